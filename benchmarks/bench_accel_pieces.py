"""What each piece of the CPU layer (`spike_whale.accel`) pays on its own (issue 38: keep a piece only if its
interleaved A/B gain is at least 5%).

    python benchmarks/bench_accel_pieces.py                      # 114M preset, eager decode, batch 1 and 8
    python benchmarks/bench_accel_pieces.py --batch 1 --rounds 3 --steps 8
    python benchmarks/bench_accel_pieces.py --compiled           # also: compile_decode, plain vs max-autotune vs accel
    python benchmarks/bench_accel_pieces.py --compiled --compiled-batch 1 8   # the compiled twins at batch 8 too

Eager rows: the same random weights (seed 0), in `--dtype` (float32 by default; built as transformers builds a
`dtype=` load, the float32 modules kept float32), a prompt of `--prompt` tokens, then one-token greedy steps on the
loop-slot cache through `forward`. Variants: the plain Hub model; the whole layer (`optimize_for_cpu`); the whole layer
less one piece: the few-row products (`FewRowsLinear` back to `nn.Linear`), the fused input projections
(`unfuse_input_projections`), the one-query attention kernel (back to SDPA). Each round runs every variant's
`--steps` steps, in a rotated order. A piece's gain is (speed with the layer) / (speed with the layer less that piece).
`--compiled` adds four compiled twins at each `--compiled-batch` (default 1): the plain model's `compile_decode()`,
the plain model's `compile_decode(mode="max-autotune")` (inductor's own CPU GEMM templates), the layer's
`compile_decode()` and the layer's less the attention kernel (the compiled walk traces SDPA instead); a compiled
piece's gain is against the layer's compiled twin.
Each variant first runs `--warmup` untimed steps (a compiled twin compiles there, the few-row products time
their candidates there). In float32 every variant must emit the same ids; in bf16 the share of equal ids is
printed. Prints a table; JSON in benchmarks/results/accel_pieces.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from _common import PRESET
from spike_whale import SpikeWhaleConfig, SpikeWhaleForCausalLM
from spike_whale.accel import FewRowsLinear, optimize_for_cpu
from spike_whale.accel.fusion import unfuse_input_projections

ROOT = Path(__file__).resolve().parents[1]


def build(config, variant: str, dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    model = SpikeWhaleForCausalLM._from_config(config, dtype=dtype).eval()
    if variant == "plain" or variant.startswith("compiled_plain"):
        if variant == "compiled_plain":
            model.compile_decode()
        elif variant == "compiled_plain_max_autotune":
            model.compile_decode(mode="max-autotune")
        return model
    optimize_for_cpu(model)
    if variant == "no_few_rows":
        for module in model.modules():
            if type(module) is FewRowsLinear:
                module.__class__ = nn.Linear
    elif variant == "no_fusion":
        unfuse_input_projections(model)
    elif variant in ("no_attention_kernel", "compiled_no_attention_kernel"):
        model.set_attn_implementation("sdpa")
    if variant.startswith("compiled"):
        model.compile_decode()
    return model


def stepper(model, prompt: torch.Tensor):
    """A generator of (seconds, tokens) for one-token greedy steps after a prefill."""
    with torch.no_grad():
        out = model(prompt, use_cache=True)
        cache, tok = out.cache, out.logits[:, -1:].argmax(-1)
        while True:
            t0 = time.perf_counter()
            tok = model(input_ids=tok, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
            yield time.perf_counter() - t0, tok[:, 0].tolist()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--steps", type=int, default=8, help="steps per variant per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=8, help="untimed steps per variant (compiles, kernel timings)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--preset", default=PRESET, help="a SpikeWhaleConfig preset (tiny: a smoke run)")
    p.add_argument("--compiled", action="store_true")
    p.add_argument("--compiled-batch", type=int, nargs="+", default=[1], help="batch sizes of the compiled twins")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "accel_pieces.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = SpikeWhaleConfig.from_preset(args.preset)
    runs = [(b, v) for b in args.batch for v in ("plain", "accel", "no_few_rows", "no_fusion", "no_attention_kernel")]
    if args.compiled:
        runs += [(b, v) for b in args.compiled_batch
                 for v in ("compiled_plain", "compiled_plain_max_autotune", "compiled_accel",
                           "compiled_no_attention_kernel")]
    steps, times, ids, first = {}, {}, {}, {}
    for batch, variant in runs:
        prompt = torch.randint(4, config.vocab_size, (batch, args.prompt), generator=torch.Generator().manual_seed(1))
        key = f"b{batch}_{variant}"
        steps[key] = stepper(build(config, variant, getattr(torch, args.dtype)), prompt)
        warm = [next(steps[key]) for _ in range(args.warmup)]  # compiles and kernel timings happen here
        first[key] = max(s for s, _ in warm)
        times[key], ids[key] = [], [tok for _, tok in warm]
        print(f"{key}: ready (slowest warm-up step {first[key]:.1f} s)", flush=True)
    keys = list(steps)
    for r in range(args.rounds):
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:
            for _ in range(args.steps):
                s, tok = next(steps[key])
                times[key].append(s)
                ids[key].append(tok)
    med = {key: 1000 * statistics.median(t) for key, t in times.items()}
    rows = []
    for batch in sorted({b for b, _ in runs}):
        ref = ids[f"b{batch}_plain"] if f"b{batch}_plain" in ids else None
        for key in (k for k in keys if k.startswith(f"b{batch}_")):
            same = sum(a == b for a, b in zip(ids[key], ref)) / len(ref) if ref is not None else 1.0
            if same < 1 and args.dtype == "float32":  # bf16 products summed in another order may round to other ids
                raise AssertionError(f"{key} emitted other ids than the plain model")
            variant = key.replace(f"b{batch}_", "")
            whole = med.get(f"b{batch}_compiled_accel" if variant.startswith("compiled") else f"b{batch}_accel")
            gain = whole and variant.replace("compiled_", "").startswith("no_") and med[key] / whole
            rows.append(dict(row=key, ms_per_step=med[key], slowest_warmup_s=first[key], piece_gain=gain or None,
                             equal_ids_share=same))
    print(f"{'variant':<34}{'ms/step':>9}{'piece gain':>12}{'equal ids':>11}")
    for row in rows:
        gain = f"{row['piece_gain']:.3f}x" if row["piece_gain"] else ""
        print(f"{row['row']:<34}{row['ms_per_step']:>9.1f}{gain:>12}{row['equal_ids_share']:>11.2f}")
    result = dict(preset=args.preset, dtype=args.dtype, prompt=args.prompt, steps=args.steps, rounds=args.rounds,
                  threads=args.threads,
                  torch=torch.__version__, rows=rows, step_s=times)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
