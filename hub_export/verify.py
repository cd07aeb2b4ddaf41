"""`spike-whale verify MODEL_DIR`: does the cached generation path compute the same function as a full recompute?

The checks are `cache_check.run_checks` (see there); this module declares the command and prints progress as each
check finishes. torch and transformers are imported only when the command runs.
"""

from __future__ import annotations

import time
from pathlib import Path

DTYPE_NAMES = ("bf16", "bfloat16", "float16", "float32", "fp16", "fp32")


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def run(args) -> int:
    if not Path(args.model_dir).is_dir():
        raise FileNotFoundError(f"{args.model_dir}: no such folder (give the folder of an exported model)")
    import torch
    from transformers import AutoModelForCausalLM

    from .cache_check import format_line, format_table, logits_scale, run_checks, slot_report, tolerance
    from .checkpoint import DTYPES
    from .serving import cache_footprint

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    t0 = time.time()
    print(f"loading {args.model_dir} ({args.dtype}) ...", flush=True)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, trust_remote_code=True, dtype=dtype)
    model = model.to(args.device).eval()
    cfg = model.config
    n_params = sum(p.numel() for p in model.parameters())
    print(f"spike-whale verify {args.model_dir}")
    print(f"model: {cfg.model_type}, {n_params:,} parameters, {args.dtype} on {args.device}")
    slots, slots_ok = slot_report(model)
    print(slots + ("" if slots_ok else "  FAIL"))

    fp = cache_footprint(cfg, 1, dtype)
    print(f"static cache per sequence at the full context ({cfg.num_loop_slots} slots x {cfg.max_position_embeddings} "
          f"tok, {args.dtype}): K/V {_size(fp['kv'])} + Memory-Cache state {_size(fp['memory_cache'])} "
          f"+ Engram codes {_size(fp['engram'])}")
    mc = f"Memory-Cache segment {cfg.mc_segment_len} tokens" if cfg.use_memory_cache else "Memory Cache off"
    print(f"{mc}; context {cfg.max_position_embeddings}; reference: use_cache=False (full recompute every step)")
    if args.tol is not None:
        tol = args.tol
        print(f"tolerance: max |Δlogit| <= {tol:.1e} (--tol)")
    else:
        scale = logits_scale(model, args.seed)
        tol = tolerance(dtype, scale)
        print(f"tolerance: max |Δlogit| <= {tol:.1e} ({args.dtype} rounding of logits up to {scale:.3g}); tokens first")
    print(flush=True)

    def progress(i, n, result, seconds):
        print(f"[{i + 1}/{n}] {format_line(result)} ({seconds:.1f}s)", flush=True)

    results = run_checks(model, new_tokens=args.new_tokens, tol=tol, seed=args.seed, on_result=progress)
    print()
    print(format_table(results))
    ran = [r for r in results if not r.skipped]
    failed = [r for r in ran if not r.ok] + ([] if slots_ok else ["slots"])
    print()
    if failed:
        print(f"FAILED: {len(failed)} of {len(ran) + 1} checks (tolerance {tol:.1e}); the cached path computes a "
              f"different function than a full recompute. ({time.time() - t0:.1f}s)")
        return 1
    print(f"all {len(ran) + 1} checks passed (tokens identical, max |Δlogit| <= {tol:.1e}; {time.time() - t0:.1f}s)")
    return 0


def register(sub) -> None:
    p = sub.add_parser(
        "verify",
        help="check that cached generation == full recompute on a checkpoint folder",
        description="Load MODEL_DIR with AutoModelForCausalLM (trust_remote_code=True) and compare greedy generation "
        "with the loop-slot cache against use_cache=False around Memory-Cache segment boundaries: prefill just "
        "under/at/just over/two segments past a boundary, decode crossing a boundary, chunked decode, a left-padded "
        "batch against its rows alone, and MTP self-speculation. Exit code 1 on any failure.",
    )
    p.add_argument("model_dir")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="float32", help="load dtype (default float32)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--new-tokens", type=int, default=6, help="greedy tokens per check (default 6)")
    p.add_argument("--tol", type=float, default=None,
                   help="max |Δlogit| allowed (default: derived from the dtype and the logits' scale, "
                        "at least 1e-4 in float32)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    p.set_defaults(func=run)
