"""Render a `bench_speed.py` result (benchmarks/results/speed.json) as the markdown table of docs/performance.md.

    python benchmarks/perf_tables.py benchmarks/results/speed.json > table.md

Prints a line naming the run (CPU flags, threads, settings, load), one table row per entry of the JSON's `table`
(spike_whale, anchor, ratio, target; ratios that meet their target in bold), then the rows bench_speed keeps in its
`notes`: the Memory-Cache share of the longest prefill, the first compiled step in a fresh process and the roofline
fractions. Reads only the JSON; runs nothing.
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", help="a bench_speed.py result, e.g. benchmarks/results/speed.json")
    args = parser.parse_args(argv)
    path = Path(args.json)
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
        lines = table(result)
    except (OSError, json.JSONDecodeError, ValueError, KeyError, TypeError) as e:
        print(f"perf_tables: {path}: {e}", file=sys.stderr)
        return 1
    print(run_line(result))
    print()
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
