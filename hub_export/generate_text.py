"""`spike-whale generate MODEL_DIR -p PROMPT`: load through the Auto classes and stream a completion."""

from __future__ import annotations

import torch


def run(args) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, trust_remote_code=True, dtype=torch.float32).eval()
    if args.chat:
        messages = [{"role": "user", "content": args.prompt}]
        enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    else:
        enc = tokenizer(args.prompt, return_tensors="pt")
    if args.seed is not None:
        torch.manual_seed(args.seed)
    sampling = {"do_sample": False} if args.greedy else {}
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    print(args.prompt if not args.chat else "", end="", flush=True)
    with torch.no_grad():
        model.generate(
            input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
            max_new_tokens=args.max_new_tokens, streamer=streamer, **sampling,
        )
    return 0


def register(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text from a model folder (Auto classes, trust_remote_code)",
        description="Load MODEL_DIR with AutoModelForCausalLM/AutoTokenizer (trust_remote_code=True) and stream a "
        "completion. Sampling uses the folder's generation_config.json (serving defaults: temperature 0.7, "
        "top_k 40, repetition_penalty 1.3); --greedy is for tests.",
    )
    p.add_argument("model_dir")
    p.add_argument("-p", "--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the ChatML chat template")
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--greedy", action="store_true", help="greedy decoding (deterministic; for tests)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.set_defaults(func=run)
