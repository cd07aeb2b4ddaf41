"""A/B decode speed of this checkout against an earlier revision (issue 10: "speed must not drop"), in one process.

    python benchmarks/bench_ab.py                       # against f9f76d9, every row, 3 rounds, 2 threads
    python benchmarks/bench_ab.py --rows eager_b8 --rounds 11
    python benchmarks/bench_ab.py --rows eager_b1 --interleave steps --rounds 10   # 10 × 32 alternating steps
    python benchmarks/bench_ab.py --rows eager_b1 --dtype bfloat16 --interleave steps   # bf16 weights
    python benchmarks/bench_ab.py --rows compiled_b1 --dtype bfloat16 --int8   # torchao int8 weights, bf16 rows

The base revision's package files (the repo root's *.py) are taken with `git archive REV` into a temporary folder as
a package named `spike_whale_base` (nothing is written into the checkout or .git), with its `accel/` where it has
one: with `--accel on` (the default) each side then runs under its own CPU layer; a base from before the redesign
carries its CPU code in its model files. Both models are the 114M preset
with the SAME random state dict (seed 0), in `--dtype` (float32 by default; built as `bench_speed.py` builds its
bf16 rows, through `_from_config(dtype=...)`, which keeps the float32 modules float32; with `--int8`, saved and
loaded back through transformers' `TorchAoConfig(Int8WeightOnlyConfig())` in `--dtype`, as `bench_speed.py`'s int8
rows). Rows: eager batch 1 / 8
(plain `generate`), compiled batch 1 / 8 (base: the API it had -- `model.compile_decode()` before the redesign
(f9f76d9), `compile_config` once it has `accel/` or no `compile_decode`; new:
`generate(..., compile_config=CompileConfig())`; each
compiled model is its own twin, since compiling re-stores weights, and its compile is done before timing). Greedy,
prompt 128, 32 new tokens; decode time only (prefill excluded, generate's per-step overhead included;
`_common.time_generate`). Rounds alternate which model goes first. Every row asserts the two models emit the same
ids; `--ids count` (for bf16 products that sum in another order and may round to other ids) prints and records the
share of equal ids instead. Only the ratios mean anything when other processes share the machine: each round's two
runs are back to back.

`--interleave steps` (eager rows only) alternates single decode steps instead of whole `generate` calls: each
round is a fresh prefill per model and then `--new-tokens` greedy `forward` steps, old and new one after the other
(order flipping every step), so drift on a shared VM hits both sides of every pair; the ratios are then over steps
(model forward only, generate's per-step overhead excluded).

Output: per-round ms/step, median ms/step of each side, new/old speed ratio of the medians and the median of the
per-round (or, with `--interleave steps`, per-step) paired ratios; JSON in benchmarks/results/ab.json
(`perf_tables.py` renders one or more of them as a markdown table).
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

from _common import PRESET, cpu_info, time_generate
from spike_whale import SpikeWhaleConfig, SpikeWhaleForCausalLM
from spike_whale.accel import optimize_for_cpu

ROOT = Path(__file__).resolve().parents[1]
ROWS = ("eager_b1", "eager_b8", "compiled_b1", "compiled_b8", "prefill512", "fresh_compiled_step")


def import_base(rev: str, folder: Path):
    """The revision's package as `spike_whale_base` (its top-level *.py files, from `git archive`)."""
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev], check=True,
                         capture_output=True).stdout
    package = folder / "spike_whale_base"
    package.mkdir()
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        for member in archive.getmembers():
            top = member.name.count("/") == 0 or (member.name.startswith("accel/") and member.name.count("/") == 1)
            if member.isfile() and top and member.name.endswith(".py"):
                (package / member.name).parent.mkdir(exist_ok=True)
                (package / member.name).write_bytes(archive.extractfile(member).read())
    sys.path.insert(0, str(folder))
    return importlib.import_module("spike_whale_base.modeling_spike_whale"), \
        importlib.import_module("spike_whale_base.configuration_spike_whale")


def base_accel():
    """The base revision's own CPU layer (`accel/`, since the redesign), or None where the base has none (its model
    files then carry their CPU code themselves). Its attention kernel is registered under a name of its own, so each
    side reads its own kernel."""
    try:
        accel = importlib.import_module("spike_whale_base.accel")
    except ModuleNotFoundError:
        return None
    accel.attention.NAME += "_base"
    return accel


def prompt_ids(batch: int, prompt: int) -> torch.Tensor:
    ids = torch.randint(10, 16000, (batch, prompt), generator=torch.Generator().manual_seed(batch))
    ids[:, 0] = 2
    return ids


def interleaved_steps(models: dict, ids: torch.Tensor, steps: int) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """`steps` greedy decode steps of the "old" and "new" models after a prefill of `ids` each, alternating one by one
    (order flipping every step): (the seconds of each side's steps, old's ids, new's ids)."""
    caches, tokens, seconds = {}, {}, {"old": [], "new": []}
    with torch.no_grad():
        for side, model in models.items():
            out = model(ids, use_cache=True)
            caches[side], tokens[side] = out.cache, [out.logits[:, -1:].argmax(-1)]
        for i in range(steps):
            for side in (("old", "new") if i % 2 == 0 else ("new", "old")):
                start = time.perf_counter()
                out = models[side](tokens[side][-1], cache=caches[side], use_cache=True)
                tokens[side].append(out.logits[:, -1:].argmax(-1))
                seconds[side].append(time.perf_counter() - start)
    return seconds, torch.cat(tokens["old"], 1), torch.cat(tokens["new"], 1)


def same_ids(old: torch.Tensor, new: torch.Tensor, mode: str, where: str) -> float:
    """The share of equal ids; with `mode` "equal" anything below all of them raises."""
    share = float((old == new).float().mean()) if old.shape == new.shape else 0.0
    if share < 1 and mode == "equal":
        raise AssertionError(f"{where}: the two models emitted different ids")
    if share < 1:
        print(f"  {where}: {100 * share:.1f}% of the ids equal", flush=True)
    return share


def summary(ms: dict, agreement: list) -> dict:
    old_ms, new_ms = statistics.median(ms["old"]), statistics.median(ms["new"])
    return {
        "old_ms_per_step": ms["old"], "new_ms_per_step": ms["new"],
        "old_median_ms": old_ms, "new_median_ms": new_ms, "speed_ratio_of_medians": old_ms / new_ms,
        "equal_ids_share": agreement,
        "paired_median_speed_ratio": statistics.median(o / n for o, n in zip(ms["old"], ms["new"])),
        "pairs_new_faster": sum(o > n for o, n in zip(ms["old"], ms["new"])), "pairs": len(ms["old"]),
        "same_ids": True,
    }


def prefill_rows(models: dict, rounds: int) -> dict:
    """One forward of a 512-token prompt (no cache, last logits), eager models, old and new alternating; ms per
    forward. The two must agree on the argmax of the last logits."""
    ids = prompt_ids(1, 512)
    ms, agreement = {"old": [], "new": []}, []
    with torch.no_grad():
        for side in ms:  # warm-up
            models[side]["eager"](ids, use_cache=False, logits_to_keep=1)
        for r in range(max(rounds, 3)):
            top = {}
            for side in (("old", "new") if r % 2 == 0 else ("new", "old")):
                t = time.perf_counter()
                out = models[side]["eager"](ids, use_cache=False, logits_to_keep=1)
                ms[side].append(1000 * (time.perf_counter() - t))
                top[side] = out.logits[:, -1].argmax(-1)
            agreement.append(same_ids(top["old"], top["new"], "equal", f"prefill512, round {r + 1}"))
            print(f"  prefill512 round {r + 1}: old {ms['old'][-1]:.0f} ms, new {ms['new'][-1]:.0f} ms", flush=True)
    return summary(ms, agreement)


FRESH = """
import json, sys, time
import torch
torch.set_num_threads({threads})
sys.path[:0] = [{bench!r}, {base_path!r}]
from _common import PRESET, time_generate
from transformers import CompileConfig
if {new}:
    from spike_whale import SpikeWhaleConfig, SpikeWhaleForCausalLM
else:
    from spike_whale_base.configuration_spike_whale import SpikeWhaleConfig
    from spike_whale_base.modeling_spike_whale import SpikeWhaleForCausalLM
model = SpikeWhaleForCausalLM._from_config(SpikeWhaleConfig.from_preset(PRESET), dtype=torch.{dtype}).eval()
model.load_state_dict(torch.load({state!r}))
if {accel} and {new}:
    from spike_whale.accel import optimize_for_cpu
    optimize_for_cpu(model)
elif {accel} and {base_accel}:
    from spike_whale_base.accel import optimize_for_cpu
    optimize_for_cpu(model)
ids = torch.randint(10, 16000, (1, 128), generator=torch.Generator().manual_seed(1))
ids[:, 0] = 2
old_api = not {new} and not {base_accel} and hasattr(SpikeWhaleForCausalLM, "compile_decode")
kw = {{}} if old_api else {{"compile_config": CompileConfig()}}
if old_api:
    model.compile_decode()
steps = time_generate(model, ids, 4, **kw)["step_s"]
print(json.dumps({{"first_compiled_step_s": max(steps), "ids": time_generate(model, ids, 4, **kw)["ids"].tolist()}}))
"""


def fresh_process_rows(args, folder: Path, base_has_accel: bool) -> dict:
    """The first compiled decode step of a fresh process, old and new alternating, each after one process of its
    own has filled the persistent caches (seconds, reported in the ms columns as ms). Each side has an inductor cache
    folder of its own, new for the run: the base package's path is new every run, so a shared cache would hold a
    stored walk from every earlier run and the base side would load them all."""
    ms, agreement, ids = {"old": [], "new": []}, [], {}
    env = {side: {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(folder / f"inductor_{side}")} for side in ms}
    for r in range(max(args.rounds, 2) + 1):
        for side in (("old", "new") if r % 2 == 0 else ("new", "old")):
            code = FRESH.format(threads=args.threads, bench=str(Path(__file__).parent), base_path=str(folder),
                                new=side == "new", accel=args.accel == "on", base_accel=base_has_accel,
                                dtype=args.dtype,
                                state=str(folder / "state.pt"))
            proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800,
                                  env=env[side])
            if proc.returncode != 0:
                raise RuntimeError(f"fresh {side} process failed: {proc.stderr.strip()[-2000:]}")
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            ids[side] = res["ids"]
            if r == 0:  # the caches' filling run
                print(f"  fresh_compiled_step {side}: filling run {res['first_compiled_step_s']:.1f} s", flush=True)
                continue
            ms[side].append(1000 * res["first_compiled_step_s"])
        if r:
            agreement.append(same_ids(torch.tensor(ids["old"]), torch.tensor(ids["new"]), "equal",
                                      f"fresh_compiled_step, round {r}"))
            print(f"  fresh_compiled_step round {r}: old {ms['old'][-1] / 1000:.1f} s, new "
                  f"{ms['new'][-1] / 1000:.1f} s", flush=True)
    return summary(ms, agreement)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default="f9f76d9", help="git revision to compare against (default f9f76d9)")
    p.add_argument("--accel", choices=("on", "off"), default="on",
                   help="apply each side's optimize_for_cpu, where it has one (default on: the CLI's default)")
    p.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--int8", action="store_true", help="weight-only int8 weights (torchao), activations in --dtype")
    p.add_argument("--interleave", choices=("generate", "steps"), default="generate",
                   help="alternate whole generate calls (default) or single decode steps (eager rows only)")
    p.add_argument("--ids", choices=("equal", "count"), default="equal",
                   help="assert equal ids (default) or count how many are equal")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "ab.json"))
    args = p.parse_args(argv)
    if args.interleave == "steps" and any(not row.startswith("eager") for row in args.rows):
        p.error("--interleave steps times eager forwards; pass --rows eager_b1 and/or eager_b8")
    torch.set_num_threads(args.threads)
    from transformers import CompileConfig

    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True).stdout.strip())
    with tempfile.TemporaryDirectory(prefix="bench_ab_") as tmp:
        base_modeling, base_configuration = import_base(args.base, Path(tmp))
        BaseLM = base_modeling.SpikeWhaleForCausalLM
        old_accel = base_accel()
        torch.manual_seed(0)
        reference = SpikeWhaleForCausalLM(SpikeWhaleConfig.from_preset(PRESET)).eval()
        state, folder = reference.state_dict(), Path(tmp) / "saved"
        if args.int8:
            reference.save_pretrained(folder)

        def build(new: bool):
            cls, cfg = ((SpikeWhaleForCausalLM, SpikeWhaleConfig) if new
                        else (BaseLM, base_configuration.SpikeWhaleConfig))
            if args.int8:
                from torchao.quantization import Int8WeightOnlyConfig
                from transformers import TorchAoConfig

                model = cls.from_pretrained(folder, quantization_config=TorchAoConfig(Int8WeightOnlyConfig()),
                                            dtype=getattr(torch, args.dtype)).eval()
            else:
                model = cls._from_config(cfg.from_preset(PRESET), dtype=getattr(torch, args.dtype)).eval()
                model.load_state_dict(state)
            if args.accel == "on" and (new or old_accel is not None):
                (optimize_for_cpu if new else old_accel.optimize_for_cpu)(model)
            return model

        base_compiles = hasattr(BaseLM, "compile_decode") and old_accel is None  # the API before compile_config
        compiled_rows = [r for r in args.rows if r.startswith("compiled")]
        timed_rows = [r for r in args.rows if r.split("_b")[0] in ("eager", "compiled")]
        models = {"old": {"eager": build(False)}, "new": {"eager": build(True)}}
        kwargs = {"old": {"eager": {}, "compiled": {} if base_compiles else {"compile_config": CompileConfig()}},
                  "new": {"eager": {}, "compiled": {"compile_config": CompileConfig()}}}
        load_before = os.getloadavg()
        weights = " rows, int8 weights" if args.int8 else ""
        print(f"{PRESET}, {args.dtype}{weights}, {torch.get_num_threads()} threads, load average {load_before[0]:.2f}; "
              f"old = {args.base}, new = {head}{' (dirty)' if dirty else ''}; prompt {args.prompt}, "
              f"{args.new_tokens} new tokens, {args.rounds} rounds", flush=True)
        compile_s = {}
        if compiled_rows:
            models["old"]["compiled"], models["new"]["compiled"] = build(False), build(True)
            if base_compiles:
                models["old"]["compiled"].compile_decode()
            for side in ("old", "new"):
                for row in compiled_rows:
                    batch = int(row.split("_b")[1])
                    t = time.perf_counter()
                    time_generate(models[side]["compiled"], prompt_ids(batch, args.prompt), 3,
                                  **kwargs[side]["compiled"])
                    compile_s[f"{side}_{row}"] = time.perf_counter() - t
                    print(f"  {side} {row}: first 3 tokens (compile) {compile_s[f'{side}_{row}']:.0f} s", flush=True)
        for side in ("old", "new"):  # warm-up of the eager paths (allocator, first calls)
            time_generate(models[side]["eager"], prompt_ids(1, 16), 3)

        results = {}
        if "prefill512" in args.rows:
            results["prefill512"] = prefill_rows(models, args.rounds)
        if "fresh_compiled_step" in args.rows:
            base_folder = Path(tmp)
            torch.save(state, base_folder / "state.pt")
            results["fresh_compiled_step"] = fresh_process_rows(args, base_folder, old_accel is not None)
        for row in timed_rows:
            kind, batch = row.split("_b")[0], int(row.split("_b")[1])
            ids = prompt_ids(batch, args.prompt)
            ms, agreement = {"old": [], "new": []}, []
            for r in range(args.rounds if args.interleave == "steps" else 0):
                seconds, old_ids, new_ids = interleaved_steps({side: models[side][kind] for side in ms}, ids,
                                                              args.new_tokens)
                agreement.append(same_ids(old_ids, new_ids, args.ids, f"{row}, round {r + 1}"))
                for side in ms:
                    ms[side] += [1000 * t for t in seconds[side]]
                print(f"  {row} round {r + 1} ({args.new_tokens} alternating steps): old "
                      f"{1000 * statistics.median(seconds['old']):.1f} ms/step, new "
                      f"{1000 * statistics.median(seconds['new']):.1f} ms/step (medians)", flush=True)
            for r in range(args.rounds if args.interleave == "generate" else 0):
                order = ("old", "new") if r % 2 == 0 else ("new", "old")
                out = {}
                for side in order:
                    res = time_generate(models[side][kind], ids, args.new_tokens, **kwargs[side][kind])
                    ms[side].append(res["ms_per_step"])
                    out[side] = res["ids"]
                agreement.append(same_ids(out["old"], out["new"], args.ids, f"{row}, round {r + 1}"))
                print(f"  {row} round {r + 1} ({order[0]} first): old {ms['old'][-1]:.1f} ms/step, "
                      f"new {ms['new'][-1]:.1f} ms/step, new/old speed {ms['old'][-1] / ms['new'][-1]:.3f}x",
                      flush=True)
            results[row] = summary(ms, agreement)
        load_after = os.getloadavg()

    shares = [share for res in results.values() for share in res["equal_ids_share"]]
    ids_line = ("same ids in every row" if all(share == 1 for share in shares)
                else f"{100 * min(shares):.1f}% of the ids equal in the worst round")
    print(f"\n{'row':<20}{'old ms':>10}{'new ms':>10}{'new/old':>10}{'paired':>10}{'new faster':>12}")
    for row, res in results.items():
        print(f"{row:<20}{res['old_median_ms']:>10.1f}{res['new_median_ms']:>10.1f}"
              f"{res['speed_ratio_of_medians']:>9.3f}x{res['paired_median_speed_ratio']:>9.3f}x"
              f"{res['pairs_new_faster']:>6} of {res['pairs']}")
    print(f"(new/old: speed ratio, > 1 means the new code is faster; load average {load_before[0]:.2f} -> "
          f"{load_after[0]:.2f}; {ids_line})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "base": args.base, "head": head, "dirty": dirty, "preset": PRESET, "dtype": args.dtype, "int8": args.int8,
        "accel": args.accel,
        "threads": torch.get_num_threads(),
        "prompt": args.prompt, "new_tokens": args.new_tokens, "rounds": args.rounds, "interleave": args.interleave,
        "load_average": [load_before[0], load_after[0]], "compile_s": compile_s, "rows": results,
        "torch": torch.__version__, "cpu": cpu_info(),
    }, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
