"""Samples from a model folder at its serving defaults (generation_config.json), for its card: five fixed prompts
chosen before the model was trained, one sample each with seed 0, nothing picked or dropped.

    python benchmarks/samples.py [MODEL_DIR] [--max-new-tokens 60] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPTS = (
    "The old man looked at the sea and said",
    "To open a file in Python, you",
    "And the LORD spake unto Moses, saying,",
    "The database stores each row",
    "O gentle night,",
)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", nargs="?", default=os.path.join(HERE, "..", "models", "spike-whale-demo"))
    p.add_argument("--max-new-tokens", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model_dir, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, trust_remote_code=True, dtype=torch.float32).eval()
    rows = []
    for prompt in PROMPTS:
        torch.manual_seed(args.seed)
        enc = tok(prompt, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=args.max_new_tokens)
        text = tok.decode(out[0], skip_special_tokens=True)
        rows.append({"prompt": prompt, "seed": args.seed, "text": text})
        print(f"--- {prompt!r} (seed {args.seed})\n{text}\n", flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"model": args.model_dir, "max_new_tokens": args.max_new_tokens, "samples": rows}, handle,
                      indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
