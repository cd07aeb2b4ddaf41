"""Decode speed of spike_whale (114M Byrne preset, random weights) with and without the loop-slot cache, next to
an in-library `LlamaForCausalLM` with the same per-token shape, measured in the same process, interleaved.

    python benchmarks/bench_decode.py            # prompt 256, 128 new tokens, batch 1 and 8, float32
    python benchmarks/bench_decode.py --quick    # prompt 128, 32 new tokens: a few minutes on 2 CPU cores

Decode tokens/s = generated tokens (all rows) / time between the first and the last decode step of
`model.generate` (greedy, exactly N new tokens; timed by a pass-through logits processor, so the prefill is
excluded and generate's per-step overhead included). Without the cache every step recomputes the whole
sequence, so that row decodes only `--nocache-new-tokens` tokens (its per-step cost only grows after that).
The "512 context" ratio compares one cached decode step at 512 tokens of context with the forward that a
no-cache decoder needs for the same token (512 tokens, use_cache=False), medians of `--repeats` runs.

spike_whale is timed eager and compiled through transformers' standard switch, `generate(...,
compile_config=CompileConfig())` (the one-token step through torch.compile, `compile_decode` underneath; its one-off
compile time per batch size is reported separately and excluded); `--cpp-wrapper` adds, at batch 1, a third twin
compiled with `CompileConfig(options={"cpp_wrapper": True})` (inductor's C++ wrapper: less per-kernel dispatch,
slower compile).
The Llama anchor runs the way transformers runs it by default (eager, DynamicCache).

Issue targets: spike_whale cached decode >= 1.15x the Llama anchor, and >= 18x faster than no cache at 512.
Results: a table on stdout and JSON (default benchmarks/results/decode.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from _common import build_models, median_rows, n_params, time_generate
from spike_whale import SpikeWhaleForCausalLM

ROOT = Path(__file__).resolve().parents[1]


def time_step_at_context(model, ctx: int, batch: int, use_cache: bool, steps: int = 5, width: int = 1) -> float:
    """Seconds for one decode step at `ctx` tokens of context: a cached step feeding `width` tokens (1, or 1 + the
    MTP drafts of a verification step), or the full forward a no-cache decoder needs."""
    ids = torch.randint(10, 16000, (batch, ctx), generator=torch.Generator().manual_seed(ctx))
    times = []
    with torch.no_grad():
        if use_cache:
            start = ctx - steps * width
            out = model(ids[:, :start], use_cache=True, logits_to_keep=1)
            cache = out.cache
            for i in range(start, ctx, width):
                t = time.perf_counter()
                model(ids[:, i:i + width], cache=cache, use_cache=True, logits_to_keep=width)
                times.append(time.perf_counter() - t)
        else:
            for _ in range(max(1, steps - 1)):
                t = time.perf_counter()
                model(ids, use_cache=False, logits_to_keep=1)
                times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="prompt 128, 32 new tokens, 2 no-cache tokens")
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 256; quick 128)")
    p.add_argument("--new-tokens", type=int, default=None, help="new tokens with the cache (default 128; quick 32)")
    p.add_argument("--nocache-new-tokens", type=int, default=None, help="new tokens without the cache (default 4; quick 3)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--ratio-context", type=int, default=512, help="context of the cache-vs-no-cache ratio")
    p.add_argument("--repeats", type=int, default=None, help="interleaved rounds, medians reported (default 2; quick 1)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    p.add_argument("--no-llama", action="store_true", help="skip the Llama anchor")
    p.add_argument("--mtp", action="store_true", help="also time use_mtp=True (random weights: drafts mostly rejected)")
    p.add_argument("--no-compile", action="store_true", help="skip the compiled rows")
    p.add_argument("--cpp-wrapper", action="store_true",
                   help="also time CompileConfig(options={'cpp_wrapper': True}) at batch 1 (minutes more to compile)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "decode.json"))
    args = p.parse_args(argv)
    prompt = args.prompt or (128 if args.quick else 256)
    new = args.new_tokens or (32 if args.quick else 128)
    new_nc = args.nocache_new_tokens or (3 if args.quick else 4)
    repeats = args.repeats or (1 if args.quick else 2)
    if args.threads:
        torch.set_num_threads(args.threads)

    spike, llama = build_models()
    models = [("spike_whale", spike)] + ([] if args.no_llama else [("llama", llama)])
    load_before = os.getloadavg()
    print(f"spike_whale byrne-100m-ultra-mc: {n_params(spike):,} parameters, {spike.config.num_loop_slots} loop slots; "
          f"llama anchor: {n_params(llama):,} parameters, 48 layers")
    print(f"float32, {torch.get_num_threads()} torch threads, {os.cpu_count()} CPUs, load average {load_before[0]:.2f}; "
          f"prompt {prompt}, {new} new tokens ({new_nc} without cache), {repeats} interleaved round(s)", flush=True)

    # warm-up (allocator, first-call paths)
    for _, m in models:
        time_generate(m, torch.randint(10, 16000, (1, 16)), 3, use_cache=True)

    def prompt_ids(batch: int) -> torch.Tensor:
        ids = torch.randint(10, 16000, (batch, prompt), generator=torch.Generator().manual_seed(batch))
        ids[:, 0] = 2
        return ids

    def compiled_twin(batch_sizes: list[int], **options) -> tuple[SpikeWhaleForCausalLM, dict, dict]:
        """A second model with the same weights, decoding through transformers' standard switch
        (`generate(..., compile_config=CompileConfig(...))`), compiled for `batch_sizes` (one graph per batch size;
        batch 1 is specialised). Returns (twin, its generate kwargs, the one-off compile times, not timed as decode)."""
        from transformers import CompileConfig

        twin = SpikeWhaleForCausalLM(spike.config).eval()
        twin.load_state_dict(spike.state_dict())
        kw = {"compile_config": CompileConfig(options=options or None)}
        seconds = {}
        for batch in batch_sizes:
            t = time.perf_counter()
            time_generate(twin, prompt_ids(batch), 3, use_cache=True, **kw)
            seconds[batch] = time.perf_counter() - t
            print(f"compile_config({'cpp_wrapper' if options else ''}): first decode steps at batch {batch} took "
                  f"{seconds[batch]:.0f} s (tracing and compiling, once)", flush=True)
        return twin, kw, seconds

    compile_s, compiled, compiled_cpp, compiled_kw, compiled_cpp_kw = {}, None, None, {}, {}
    if not args.no_compile:
        compiled, compiled_kw, compile_s["python_wrapper"] = compiled_twin(args.batch_sizes)
        if args.cpp_wrapper and 1 in args.batch_sizes:
            compiled_cpp, compiled_cpp_kw, compile_s["cpp_wrapper"] = compiled_twin([1], cpp_wrapper=True)

    runs: dict[tuple, list[dict]] = {}
    for r in range(repeats):
        for batch in args.batch_sizes:
            ids = prompt_ids(batch)
            plan = [("spike_whale", spike, True, {}), ("spike_whale", spike, False, {})]
            if not args.no_llama:
                plan.insert(1, ("llama", llama, True, {}))
            if compiled is not None:
                plan.insert(1, ("spike_whale+compile", compiled, True, compiled_kw))
            if compiled_cpp is not None and batch == 1:
                plan.insert(2, ("spike_whale+compile_cpp", compiled_cpp, True, compiled_cpp_kw))
            if args.mtp and batch == 1:
                plan.append(("spike_whale+mtp", spike, True, {"use_mtp": True}))
            for name, m, use_cache, kw in plan:
                n = new if use_cache else new_nc
                row = time_generate(m, ids, n, use_cache, **kw)
                row.update(model=name, batch=batch, cache=use_cache, prompt=prompt, new_tokens=n)
                if kw.get("use_mtp"):
                    row["mtp_acceptance_rate"] = spike.last_mtp_stats.acceptance_rate
                runs.setdefault((name, batch, use_cache), []).append(row)
                print(f"  round {r + 1}: {name:16s} batch {batch} {'cache' if use_cache else 'no cache':8s} "
                      f"{row['decode_tok_s']:8.2f} tok/s ({row['ms_per_step']:.0f} ms/step, prefill {row['prefill_s']:.1f}s)",
                      flush=True)

    ratio_runs = {"cached": [], "cached_compiled": [], "nocache": [], "verify_2_tokens": []}
    for r in range(repeats):
        ratio_runs["cached"].append(time_step_at_context(spike, args.ratio_context, 1, use_cache=True))
        if compiled is not None:
            ratio_runs["cached_compiled"].append(time_step_at_context(compiled, args.ratio_context, 1, use_cache=True))
        ratio_runs["verify_2_tokens"].append(time_step_at_context(spike, args.ratio_context, 1, use_cache=True, width=2))
        ratio_runs["nocache"].append(time_step_at_context(spike, args.ratio_context, 1, use_cache=False))
    cached_s, nocache_s = statistics.median(ratio_runs["cached"]), statistics.median(ratio_runs["nocache"])
    compiled_s = statistics.median(ratio_runs["cached_compiled"]) if compiled is not None else None
    verify_s = statistics.median(ratio_runs["verify_2_tokens"])
    load_after = os.getloadavg()

    rows = [median_rows(v) for v in runs.values()]
    by = {(r["model"], r["batch"], r["cache"]): r for r in rows}
    print()
    print(f"{'model':<48}{'batch':>6}{'prefill s':>11}{'decode tok/s':>14}{'ms/step':>10}")
    for r in rows:
        label = {"spike_whale": "spike_whale 114M", "llama": "Llama 48L anchor", "spike_whale+mtp": "spike_whale 114M, MTP",
                 "spike_whale+compile": "spike_whale 114M compiled",
                 "spike_whale+compile_cpp": "spike_whale 114M compiled, C++ wrapper"}[r["model"]]
        label += ", cache" if r["cache"] else ", no cache"
        print(f"{label:<48}{r['batch']:>6}{r['prefill_s']:>11.2f}{r['decode_tok_s']:>14.2f}{r['ms_per_step']:>10.1f}")
    summary = {}
    print()
    for batch in args.batch_sizes:
        sw, nc, ll = by.get(("spike_whale", batch, True)), by.get(("spike_whale", batch, False)), by.get(("llama", batch, True))
        if ll:
            x = sw["decode_tok_s"] / ll["decode_tok_s"]
            summary[f"spike_vs_llama_b{batch}"] = x
            print(f"batch {batch}: spike_whale / Llama decode speed {x:.2f}x eager", end="")
            for model, key, how in (("spike_whale+compile", "compiled", "compile_config"),
                                    ("spike_whale+compile_cpp", "compiled_cpp", "the C++ wrapper")):
                row = by.get((model, batch, True))
                if row:
                    x = row["decode_tok_s"] / ll["decode_tok_s"]
                    summary[f"spike_{key}_vs_llama_b{batch}"] = x
                    print(f", {x:.2f}x with {how}", end="")
            print(" (target >= 1.15x)")
        x = sw["decode_tok_s"] / nc["decode_tok_s"]
        summary[f"cache_vs_nocache_b{batch}_prompt{prompt}"] = x
        print(f"batch {batch}: cache / no cache decode speed at ~{prompt} tokens of context {x:.1f}x")
    summary[f"cache_vs_nocache_ctx{args.ratio_context}"] = nocache_s / cached_s
    print(f"{args.ratio_context} tokens of context, batch 1: cached step {1000 * cached_s:.0f} ms vs no-cache forward "
          f"{1000 * nocache_s:.0f} ms -> {nocache_s / cached_s:.1f}x eager", end="")
    if compiled_s is not None:
        summary[f"cache_compiled_vs_nocache_ctx{args.ratio_context}"] = nocache_s / compiled_s
        print(f", {nocache_s / compiled_s:.1f}x with compile_config ({1000 * compiled_s:.0f} ms)", end="")
    print(" (target >= 18x)")
    summary["mtp_verify_step_cost"] = verify_s / cached_s
    print(f"MTP: a 2-token verification step costs {verify_s / cached_s:.2f}x a 1-token step at {args.ratio_context} "
          f"context, so self-speculation pays off above {100 * (verify_s / cached_s - 1):.0f}% draft acceptance "
          f"(decode speed-up (1 + a) / {verify_s / cached_s:.2f} at acceptance a; random weights draft ~0%)")
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} (other processes on this machine "
          "skew absolute numbers; rows are interleaved so ratios are fairer)")

    result = {
        "benchmark": "decode tokens/s, float32, greedy, random weights",
        "machine": {
            "platform": platform.platform(), "processor": platform.processor(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "python": sys.version.split()[0], "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
            "loadavg_before": load_before, "loadavg_after": load_after,
        },
        "settings": {"prompt": prompt, "new_tokens": new, "nocache_new_tokens": new_nc, "batch_sizes": args.batch_sizes,
                     "repeats": repeats, "quick": args.quick, "ratio_context": args.ratio_context},
        "params": {"spike_whale": n_params(spike), "llama": n_params(llama)},
        "rows": rows,
        "ratio_context": {"context": args.ratio_context, "cached_step_s": cached_s, "cached_compiled_step_s": compiled_s,
                          "nocache_forward_s": nocache_s, "mtp_verify_2_tokens_s": verify_s, "runs": ratio_runs},
        "compile_s": compile_s,
        "summary": summary,
        "targets": {"spike_vs_llama": 1.15, "cache_vs_nocache_ctx512": 18.0},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
