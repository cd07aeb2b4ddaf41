"""Render benchmark JSON as the markdown tables of docs/performance.md.

    python benchmarks/perf_tables.py benchmarks/results/speed.json > table.md
    python benchmarks/perf_tables.py ab_b1.json ab_rest.json ab_int8.json      # bench_ab.py results, one table

A `bench_speed.py` result: a line naming the run (CPU flags, threads, settings, load), one table row per entry of the
JSON's `table` (spike_whale, anchor, ratio, target; ratios that meet their target in bold), then the rows bench_speed
keeps in its `notes`: the Memory-Cache share of the longest prefill, the first compiled step in a fresh process and
the roofline fractions. One or more `bench_ab.py` results: a line per run (CPU, threads, settings, load), then one
table with a row per measured row of every run (ratios at or above `--target`, 0.95 by default, in bold). Reads only
the JSON; runs nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

UNITS = {"decode tok/s": "tok/s", "tok/s": "tok/s"}


def fmt(value, digits: int = 2) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def meets(ratio, target) -> bool:
    return ratio is not None and target is not None and ratio >= target


def run_line(result: dict) -> str:
    machine, settings = result.get("machine", {}), result.get("settings", {})
    cpu = machine.get("cpu", {})
    load = machine.get("loadavg_before"), machine.get("loadavg_after")
    parts = [
        f"CPU: avx512_bf16 {cpu.get('avx512_bf16')}, amx_bf16 {cpu.get('amx_bf16')}, L3 {cpu.get('l3')}",
        f"{machine.get('torch_threads')} threads",
        f"torch {machine.get('torch')}, transformers {machine.get('transformers')}",
        f"prompt {settings.get('prompt')}, {settings.get('new_tokens')} new tokens, "
        f"{settings.get('repeats')} interleaved round(s)",
    ]
    if all(load):
        parts.append(f"load {load[0][0]:.2f} → {load[1][0]:.2f}")
    if machine.get("copy_bandwidth_bytes_s"):
        parts.append(f"copy {machine['copy_bandwidth_bytes_s'] / 1e9:.1f} GB/s")
    return "; ".join(parts)


def table(result: dict) -> list[str]:
    rows = result.get("table") if isinstance(result, dict) else None
    if not isinstance(rows, list):
        raise ValueError("the JSON has no 'table' list: pass the file bench_speed.py writes (benchmarks/results/speed.json)")
    lines = ["| path | spike_whale | anchor | ratio | target |", "|---|---|---|---|---|"]
    for row in rows:
        unit = UNITS.get(row.get("measure"), row.get("measure") or "")
        anchor = f"{fmt(row.get('anchor'))} {unit}"
        if row.get("anchor_name") not in (None, "Llama"):
            anchor += f" ({row['anchor_name']})"
        ratio = f"{fmt(row.get('ratio'))}×" if row.get("ratio") is not None else "–"
        if meets(row.get("ratio"), row.get("target")):
            ratio = f"**{ratio}**"
        target = f"≥ {row['target']:g}×" if row.get("target") is not None else ""
        lines.append(f"| {row['path']} | {fmt(row.get('spike_whale'))} {unit} | {anchor} | {ratio} | {target} |")
    notes, targets = result.get("notes", {}), result.get("targets", {})
    for key in sorted(k for k in notes if k.startswith("mc_share_prefill")):
        share, limit = notes[key], targets.get("mc_share")
        cell = f"{100 * share:.1f}%"
        if limit is not None and share <= limit:
            cell = f"**{cell}**"
        length, _, dtype = key.removeprefix("mc_share_prefill").partition("_")
        lines.append(f"| Memory-Cache share of prefill {length}, {dtype} | {cell} | | | "
                     + (f"≤ {100 * limit:g}% |" if limit is not None else "|"))
    fresh = notes.get("compile_cost_fresh_process", {})
    if "first_compiled_step_s" in fresh:
        limit = targets.get("compile_cost_s")
        cell = f"{fresh['first_compiled_step_s']:.1f} s"
        if limit is not None and fresh["first_compiled_step_s"] <= limit:
            cell = f"**{cell}**"
        after = fresh.get("steps_second_generate_s")
        if after:
            cell += f" (a compiled step after it: {1000 * min(after):.0f} ms)"
        lines.append(f"| first compiled step in a fresh process | {cell} | | | "
                     + (f"≤ {limit:g} s |" if limit is not None else "|"))
    roofline = {k.removeprefix("roofline_"): v for k, v in notes.items() if k.startswith("roofline_")}
    paths = [k.removesuffix("_spike_whale") for k in roofline if k.endswith("_spike_whale")]
    if paths:
        def cell(model: str) -> str:
            return " / ".join(f"{100 * roofline[f'{p}_{model}']['fraction']:.0f}%" if f"{p}_{model}" in roofline
                              else "–" for p in paths)
        lines.append(f"| roofline ({' / '.join(paths)}) | {cell('spike_whale')} | {cell('llama')} | | stated |")
    return lines


def is_ab(result) -> bool:
    return isinstance(result, dict) and "base" in result and isinstance(result.get("rows"), dict)


def ab_run_line(name: str, result: dict) -> str:
    cpu = result.get("cpu") or {}
    flags = ", ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if cpu.get(f)) or "flags not recorded"
    load = result.get("load_average") or [None, None]
    load_text = f"load {load[0]:.2f} → {load[1]:.2f}" if None not in load else "load not recorded"
    return (f"{name}: {cpu.get('model', 'CPU not recorded')} ({flags}), {result['threads']} threads, torch "
            f"{result.get('torch')}; prompt {result['prompt']}, {result['new_tokens']} new tokens, "
            f"{result['rounds']} rounds ({result['interleave']}); {load_text}")


def ab_table(results: list[dict], target: float) -> list[str]:
    """One row per measured row of every `bench_ab.py` result: speeds as new/old (> 1: the new code is faster)."""
    lines = ["| row | old → new | weights | CPU layer | old | new | new/old | paired | new faster | ids |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for result in results:
        head = result["head"] + (" (dirty)" if result.get("dirty") else "")
        weights = result["dtype"] + (", int8" if result.get("int8") else "")
        for row, r in result["rows"].items():
            if row == "fresh_compiled_step":  # recorded in ms, measured in seconds
                old, new = f"{r['old_median_ms'] / 1000:.2f} s", f"{r['new_median_ms'] / 1000:.2f} s"
            else:
                unit = " ms" if row.startswith("prefill") else " ms/step"
                old, new = f"{r['old_median_ms']:.1f}{unit}", f"{r['new_median_ms']:.1f}{unit}"
            ratio = f"{r['speed_ratio_of_medians']:.3f}×"
            if r["speed_ratio_of_medians"] >= target:
                ratio = f"**{ratio}**"
            shares = r.get("equal_ids_share") or []
            ids = "same" if shares and min(shares) == 1 else (f"{100 * min(shares):.1f}% equal" if shares else "–")
            lines.append(f"| {row} | {result['base']} → {head} | {weights} | {result['accel']} | {old} | {new} | "
                         f"{ratio} | {r['paired_median_speed_ratio']:.3f}× | {r['pairs_new_faster']} of {r['pairs']} "
                         f"| {ids} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", nargs="+",
                        help="a bench_speed.py result (benchmarks/results/speed.json), or bench_ab.py results")
    parser.add_argument("--target", type=float, default=0.95, help="bench_ab rows: the new/old ratio set in bold")
    args = parser.parse_args(argv)
    results = {}
    for name in args.json:
        path = Path(name)
        try:
            results[name] = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            print(f"perf_tables: {path}: {e}", file=sys.stderr)
            return 1
    kinds = {is_ab(result) for result in results.values()}
    if kinds == {True}:
        try:
            lines = [ab_run_line(name, result) for name, result in results.items()] + [""]
            lines += ab_table(list(results.values()), args.target)
        except (KeyError, TypeError, ValueError) as e:
            print(f"perf_tables: not a bench_ab.py result ({type(e).__name__}: {e})", file=sys.stderr)
            return 1
        print("\n".join(lines))
        return 0
    if len(results) > 1:
        print("perf_tables: pass one bench_speed.py result, or only bench_ab.py results", file=sys.stderr)
        return 1
    (path, result), = results.items()
    try:
        lines = table(result)
    except (ValueError, KeyError, TypeError) as e:
        print(f"perf_tables: {path}: {e}", file=sys.stderr)
        return 1
    print(run_line(result))
    print()
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
