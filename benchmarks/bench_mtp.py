"""MTP self-speculative decoding against plain greedy decoding, batch 1, on a model folder (default: the committed
default model): draft acceptance rate, tokens/s of both, speedup, and whether the tokens are identical.

    python benchmarks/bench_mtp.py [MODEL_DIR] [--prompts 8] [--new-tokens 64] [--repeats 3] [--threads 1]

Prompts are cut from MODEL_DIR/heldout.txt (text the model never trained on), each `<bos>` + 32 tokens. Each
prompt is decoded greedily (`do_sample=False`, the folder's other generation settings) with and without
`use_mtp=True`, the two interleaved, `--repeats` times; rates are total new tokens over total time, the speedup
is the ratio of the medians over repeats. Writes benchmarks/results/mtp.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", nargs="?", default=os.path.join(HERE, "..", "models", "spike-whale-demo"))
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=os.path.join(HERE, "results", "mtp.json"))
    args = p.parse_args(argv)
    if not os.path.isfile(os.path.join(args.model_dir, "heldout.txt")):
        p.error(f"{args.model_dir} has no heldout.txt to cut prompts from")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, trust_remote_code=True, dtype=torch.float32).eval()
    with open(os.path.join(args.model_dir, "heldout.txt"), encoding="utf-8") as handle:
        paragraphs = [t for t in handle.read().split("\n\n") if len(t) > 400]
    step = max(1, len(paragraphs) // args.prompts)
    prompts = [torch.tensor([[model.config.bos_token_id] + tokenizer(paragraphs[i * step], add_special_tokens=False)
                              ["input_ids"][: args.prompt_tokens]]) for i in range(args.prompts)]
    settings = dict(do_sample=False, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens)

    def timed(ids, **extra):
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **settings, **extra)
        return out[0, ids.shape[1]:].tolist(), time.perf_counter() - start

    timed(prompts[0])  # warm-up (allocations, first-call paths)
    timed(prompts[0], use_mtp=True)
    plain_s, mtp_s, identical, drafted, accepted = [], [], 0, 0, 0
    for r in range(args.repeats):
        t_plain = t_mtp = 0.0
        for ids in prompts:
            a, dt = timed(ids)
            t_plain += dt
            b, dt = timed(ids, use_mtp=True)
            t_mtp += dt
            if r == 0:
                identical += int(a == b)
                drafted += model.last_mtp_stats.drafted
                accepted += model.last_mtp_stats.accepted
        plain_s.append(t_plain)
        mtp_s.append(t_mtp)
        print(f"round {r + 1}/{args.repeats}: plain {t_plain:.2f}s, MTP {t_mtp:.2f}s", file=sys.stderr, flush=True)
    n_tokens = args.prompts * args.new_tokens
    plain, mtp = statistics.median(plain_s), statistics.median(mtp_s)
    result = {
        "model_dir": os.path.relpath(args.model_dir), "prompts": args.prompts, "prompt_tokens": args.prompt_tokens + 1,
        "new_tokens": args.new_tokens, "repeats": args.repeats, "threads": args.threads,
        "plain_tokens_per_s": n_tokens / plain, "mtp_tokens_per_s": n_tokens / mtp, "speedup": plain / mtp,
        "acceptance_rate": accepted / drafted if drafted else 0.0, "drafted": drafted, "accepted": accepted,
        "identical_sequences": f"{identical}/{args.prompts}", "plain_seconds": plain_s, "mtp_seconds": mtp_s,
        "torch": torch.__version__,
    }
    print(f"{'':<28}{'tokens/s':>10}")
    print(f"{'plain greedy (cache)':<28}{result['plain_tokens_per_s']:>10.1f}")
    print(f"{'MTP self-speculation':<28}{result['mtp_tokens_per_s']:>10.1f}")
    print(f"speedup {result['speedup']:.2f}x (target >= 1.3x), acceptance {result['acceptance_rate']:.3f} "
          f"({accepted}/{drafted}), identical sequences {identical}/{args.prompts}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
