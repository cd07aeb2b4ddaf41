"""`spike-whale generate MODEL_DIR -p PROMPT`: load through the Auto classes and stream a completion."""

from __future__ import annotations

import json
import os

DTYPE_NAMES = ("fp32", "bf16", "fp16")


def positive_int(text: str) -> int:
    import argparse

    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_sampling_arguments(p) -> None:
    """The sampling switches shared by `generate` and `chat`; unset ones keep the folder's generation_config."""
    p.add_argument("--temperature", type=float, help="sampling temperature > 0 (folder default: 0.7)")
    p.add_argument("--top-k", type=int, help="keep the k most likely tokens, 0 = off (folder default: 40)")
    p.add_argument("--top-p", type=float, help="nucleus sampling: keep the smallest set with mass >= p, in (0, 1]")
    p.add_argument("--repetition-penalty", type=float, help="> 0, 1.0 = off (folder default: 1.3)")
    p.add_argument("--greedy", action="store_true", help="greedy decoding (deterministic)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--max-new-tokens", type=positive_int, default=160)
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="fp32", help="weights dtype (default fp32)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--no-cpu-accel", dest="cpu_accel", action="store_false",
                   help="run the plain Hub model on CPU (by default spike_whale.accel.optimize_for_cpu is applied)")


def sampling_kwargs(args) -> dict:
    """`generate` keyword arguments for the switches given; a bad value raises ValueError naming the switch."""
    if args.temperature is not None and not args.temperature > 0:
        raise ValueError(f"--temperature must be > 0, got {args.temperature} (use --greedy for deterministic output)")
    if args.top_k is not None and args.top_k < 0:
        raise ValueError(f"--top-k must be >= 0 (0 = off), got {args.top_k}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.repetition_penalty is not None and not args.repetition_penalty > 0:
        raise ValueError(f"--repetition-penalty must be > 0 (1.0 = off), got {args.repetition_penalty}")
    out = {"max_new_tokens": args.max_new_tokens}
    if args.greedy:
        given = [n for n in ("temperature", "top_k", "top_p") if getattr(args, n) is not None]
        if given:
            raise ValueError(f"--greedy ignores sampling; drop --{given[0].replace('_', '-')} or --greedy")
        out["do_sample"] = False
    for name in ("temperature", "top_k", "top_p", "repetition_penalty"):
        if getattr(args, name) is not None:
            out[name] = getattr(args, name)
    return out


DAMAGED = "is damaged or truncated ({}); re-download it or re-convert the folder with `spike-whale convert`"


def check_model_dir(path: str) -> None:
    """A missing folder, one without config.json, or a damaged config.json or weights file is reported as such (not
    as a bad Hub repo id, nor as a traceback from inside the loader). Only the safetensors headers are read: they
    record each file's length, so a truncated file is caught without reading the weights."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: no such folder")
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        raise FileNotFoundError(f"{path} is not a model folder (no config.json); pass a folder written by "
                                "`spike-whale init-tiny`/`convert`, e.g. models/spike-whale-demo")
    try:
        with open(config, encoding="utf-8") as f:
            json.load(f)
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{config} {DAMAGED.format(f'not valid JSON: {err}')}") from err
    from safetensors import SafetensorError, safe_open

    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            try:
                with safe_open(os.path.join(path, name), framework="pt"):
                    pass
            except SafetensorError as err:
                raise ValueError(f"{os.path.join(path, name)} {DAMAGED.format(err)}") from err


def load(args):
    """Tokenizer and model of `args.model_dir` (Auto classes, trust_remote_code), in `args.dtype`, threads set."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_model_dir(args.model_dir)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, trust_remote_code=True, dtype=dtype).eval()
    if getattr(args, "cpu_accel", True) and model.device.type == "cpu":
        from ..accel import optimize_for_cpu

        optimize_for_cpu(model)
    return tokenizer, model


def run(args) -> int:
    import torch
    from transformers import TextStreamer

    kwargs = sampling_kwargs(args)
    tokenizer, model = load(args)
    if args.chat:
        messages = [{"role": "user", "content": args.prompt}]
        enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    else:
        enc = tokenizer(args.prompt, return_tensors="pt")
    if args.seed is not None:
        torch.manual_seed(args.seed)
    if args.token_healing and not args.chat:
        # Healing rewrites the prompt's last token, so the streamer prints the (healed) prompt itself.
        kwargs.update(token_healing=True, tokenizer=tokenizer)
        streamer = TextStreamer(tokenizer, skip_prompt=False, skip_special_tokens=True)
    else:
        streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        print(args.prompt if not args.chat else "", end="", flush=True)
    with torch.no_grad():
        model.generate(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], streamer=streamer, **kwargs)
    return 0


def register(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text from a model folder (Auto classes, trust_remote_code)",
        description="Load MODEL_DIR with AutoModelForCausalLM/AutoTokenizer (trust_remote_code=True) and stream a "
        "completion. Sampling uses the folder's generation_config.json (serving defaults: temperature 0.7, "
        "top_k 40, repetition_penalty 1.3) unless a switch overrides it.",
    )
    p.add_argument("model_dir")
    p.add_argument("-p", "--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the ChatML chat template")
    p.add_argument("--no-token-healing", dest="token_healing", action="store_false",
                   help="keep the prompt's last token as encoded (by default the first new token may re-choose it, "
                   "so a prompt cut inside a word continues that word)")
    add_sampling_arguments(p)
    p.set_defaults(func=run)
