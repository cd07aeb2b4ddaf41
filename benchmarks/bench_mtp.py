"""MTP self-speculative decoding against plain greedy decoding, batch 1, on a model folder (default: the committed
default model): draft acceptance rate, tokens/s of both, speedup, and whether the tokens are identical.

    python benchmarks/bench_mtp.py [MODEL_DIR] [--prompts 8] [--new-tokens 64] [--repeats 3] [--threads 1]
                                   [--thresholds 0,0.3,0.5,0.7] [--draft-tokens 1,2]

Prompts are cut from MODEL_DIR/heldout.txt (text the model never trained on), each `<bos>` + 32 tokens. Each
prompt is decoded greedily (`do_sample=False`, the folder's other generation settings) without and with
`use_mtp=True`, once per confidence gate in `--thresholds` (`assistant_confidence_threshold`; "model" = the
folder's generation_config.json value) and drafts per step in `--draft-tokens` (`mtp_draft_tokens`; "model" = the
folder's `num_assistant_tokens`, else one per MTP head; more than the heads chain the first head), all interleaved,
`--repeats` times; rates are total new tokens over total time; "speedup" is the ratio of the medians over repeats of
the total times, "paired" the median over prompts and repeats of plain/MTP time measured back to back (the order
rotates; steadier under load), "cpu" the ratio of the total process CPU times (with one thread, the figure that
other processes on the machine disturb least). "drafting steps" is the share of decode steps that fed a draft.
Writes benchmarks/results/mtp.json.
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
    p.add_argument("--thresholds", default="model",
                   help="comma-separated assistant_confidence_threshold values in [0, 1], or 'model' (default)")
    p.add_argument("--draft-tokens", default="model",
                   help="comma-separated mtp_draft_tokens values (ints >= 1), or 'model' (default)")
    p.add_argument("--out", default=os.path.join(HERE, "results", "mtp.json"))
    args = p.parse_args(argv)
    draft_counts = [t.strip() for t in args.draft_tokens.split(",") if t.strip()]
    if not draft_counts or not all(t == "model" or (t.isdigit() and int(t) >= 1) for t in draft_counts):
        p.error("--draft-tokens: give 'model' or ints >= 1, comma-separated")
    thresholds = [t.strip() for t in args.thresholds.split(",") if t.strip()]
    for t in thresholds:
        if t != "model":
            try:
                ok = 0.0 <= float(t) <= 1.0
            except ValueError:
                ok = False
            if not ok:
                p.error(f"--thresholds: {t!r} is not 'model' or a number in [0, 1]")
    if not thresholds:
        p.error("--thresholds: give at least one value ('model' or a number in [0, 1])")
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
        start, cpu = time.perf_counter(), time.process_time()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **settings, **extra)
        return out[0, ids.shape[1]:].tolist(), time.perf_counter() - start, time.process_time() - cpu

    gates = {}
    for t in thresholds:
        for k in draft_counts:
            name = t if len(draft_counts) == 1 else f"{t}/k={k}"
            gates[name] = {**({} if t == "model" else {"assistant_confidence_threshold": float(t)}),
                           **({} if k == "model" else {"mtp_draft_tokens": int(k)}), "_threshold": t, "_k": k}
    timed(prompts[0])  # warm-up (allocations, first-call paths)
    timed(prompts[0], use_mtp=True)
    plain_s, plain_cpu = [], 0.0
    runs = {name: {"seconds": [], "ratios": [], "cpu": 0.0, "identical": 0, "drafted": 0, "accepted": 0,
                   "drafting_steps": 0, "steps": 0} for name in gates}
    order = [None, *gates]  # None: plain greedy
    for r in range(args.repeats):
        t_plain, t_mtp = 0.0, dict.fromkeys(gates, 0.0)
        for n, ids in enumerate(prompts):
            times, texts, cpu = {}, {}, {}
            shift = (r * len(prompts) + n) % len(order)  # rotate, so no configuration always runs first or last
            for name in order[shift:] + order[:shift]:
                extra = {} if name is None else {"use_mtp": True, **{k: v for k, v in gates[name].items()
                                                                     if not k.startswith("_")}}
                texts[name], times[name], cpu[name] = timed(ids, **extra)
                if name is not None and r == 0:
                    stats, run = model.last_mtp_stats, runs[name]
                    run["drafted"] += stats.drafted
                    run["accepted"] += stats.accepted
                    run["drafting_steps"] += stats.verify_steps
                    run["steps"] += stats.forwards - 1
            t_plain += times[None]
            plain_cpu += cpu[None]
            for name, run in runs.items():
                t_mtp[name] += times[name]
                run["cpu"] += cpu[name]
                run["ratios"].append(times[None] / times[name])
                run["identical"] += int(r == 0 and texts[name] == texts[None])
        plain_s.append(t_plain)
        for name in gates:
            runs[name]["seconds"].append(t_mtp[name])
        print(f"round {r + 1}/{args.repeats}: plain {t_plain:.2f}s, MTP "
              + ", ".join(f"{name} {t:.2f}s" for name, t in t_mtp.items()), file=sys.stderr, flush=True)
    n_tokens = args.prompts * args.new_tokens
    plain = statistics.median(plain_s)
    rows = []
    for name, run in runs.items():
        mtp = statistics.median(run["seconds"])
        t, k = gates[name]["_threshold"], gates[name]["_k"]
        rows.append({
            "assistant_confidence_threshold": t if t == "model" else float(t),
            "model_threshold": model.generation_config.assistant_confidence_threshold if t == "model" else None,
            "mtp_draft_tokens": k if k == "model" else int(k),
            "model_draft_tokens": model.generation_config.num_assistant_tokens if k == "model" else None,
            "mtp_tokens_per_s": n_tokens / mtp, "speedup": plain / mtp,
            "speedup_paired_median": statistics.median(run["ratios"]), "speedup_cpu": plain_cpu / run["cpu"],
            "acceptance_rate": run["accepted"] / run["drafted"] if run["drafted"] else 0.0,
            "drafted": run["drafted"], "accepted": run["accepted"],
            "drafting_steps": run["drafting_steps"], "decode_steps": run["steps"],
            "identical_sequences": f"{run['identical']}/{args.prompts}", "mtp_seconds": run["seconds"],
        })
    result = {
        "model_dir": os.path.relpath(args.model_dir), "prompts": args.prompts, "prompt_tokens": args.prompt_tokens + 1,
        "new_tokens": args.new_tokens, "repeats": args.repeats, "threads": args.threads,
        "plain_tokens_per_s": n_tokens / plain, "plain_seconds": plain_s, "mtp": rows, "torch": torch.__version__,
    }
    print(f"plain greedy (cache): {result['plain_tokens_per_s']:.1f} tokens/s; MTP self-speculation (target >= 1.3x):")
    print(f"{'threshold':>11}{'drafts':>11}{'tokens/s':>10}{'speedup':>9}{'paired':>8}{'cpu':>7}{'acceptance':>17}"
          f"{'drafting steps':>17}{'identical':>11}")
    for row in rows:
        name, k = row["assistant_confidence_threshold"], row["mtp_draft_tokens"]
        label = f"model={row['model_threshold']}" if name == "model" else f"{name:g}"
        k_label = f"model={row['model_draft_tokens']}" if k == "model" else str(k)
        print(f"{label:>11}{k_label:>11}{row['mtp_tokens_per_s']:>10.1f}{row['speedup']:>8.2f}x"
              f"{row['speedup_paired_median']:>7.2f}x{row['speedup_cpu']:>6.2f}x"
              f"{row['acceptance_rate']:>7.3f} ({row['accepted']:>3}/{row['drafted']:>3})"
              f"{row['drafting_steps']:>7}/{row['decode_steps']:<4} ({row['drafting_steps'] / max(row['decode_steps'], 1):.2f})"
              f"{row['identical_sequences']:>9}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
