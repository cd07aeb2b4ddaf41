"""Which compiled decode step to keep (issue 38: "the per-pass compiled walk stays only if it measures faster"):
transformers' own whole-forward compile (`PreTrainedModel.get_compiled_call`: `torch.compile(model.__call__)`, every
slot of every loop pass in one graph) against the model's per-pass walk (`compile_decode`: one graph of one loop pass,
reused by every pass), on the plain Hub model (no CPU layer).

    python benchmarks/bench_compile_forms.py                 # 114M preset, batch 1, 3 rounds of 16 steps each
    python benchmarks/bench_compile_forms.py --steps 8 --rounds 2

Both models hold the same random weights (seed 0), float32, prompt `--prompt` tokens (one eager prefill each), then
one-token greedy steps on the loop-slot cache; transformers' default `CompileConfig()` for both. Rounds alternate
which form goes first, so drift hits both. Prints the slowest of the first 3 steps (trace + compile), the median ms/step of
each form and their ratio; asserts both emit the same ids. JSON: benchmarks/results/compile_forms.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import CompileConfig, PreTrainedModel

from _common import PRESET
from spike_whale import SpikeWhaleConfig, SpikeWhaleForCausalLM

ROOT = Path(__file__).resolve().parents[1]


def decoder(model, call, prompt: torch.Tensor):
    """A generator of (seconds, token) for one-token greedy steps through `call` after an eager prefill."""
    with torch.no_grad():
        out = model(prompt, use_cache=True)
        cache, tok = out.cache, out.logits[:, -1:].argmax(-1)
        while True:
            t0 = time.perf_counter()
            logits = call(input_ids=tok, cache=cache, use_cache=True).logits
            tok = logits[:, -1:].argmax(-1)
            yield time.perf_counter() - t0, int(tok)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--steps", type=int, default=16, help="steps per form per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--preset", default=PRESET, help="a SpikeWhaleConfig preset (tiny: a smoke run)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "compile_forms.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = SpikeWhaleConfig.from_preset(args.preset)
    models = {}
    for form in ("per_pass", "whole_forward"):
        torch.manual_seed(0)
        models[form] = SpikeWhaleForCausalLM(config).eval()
    models["per_pass"].compile_decode()
    calls = {"per_pass": models["per_pass"],
             "whole_forward": PreTrainedModel.get_compiled_call(models["whole_forward"], CompileConfig())}
    prompt = torch.randint(4, config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    steps = {form: decoder(models[form], calls[form], prompt) for form in calls}
    first, times, ids = {}, {form: [] for form in calls}, {form: [] for form in calls}
    for form in calls:  # the first steps trace and compile (a step that opens a segment may run eagerly)
        warm = [next(steps[form]) for _ in range(3)]
        first[form] = max(s for s, _ in warm)
        ids[form] += [tok for _, tok in warm]
        print(f"{form}: slowest of the first 3 steps {first[form]:.1f} s", flush=True)
    for r in range(args.rounds):
        for form in (list(calls) if r % 2 == 0 else list(calls)[::-1]):
            for _ in range(args.steps):
                s, tok = next(steps[form])
                times[form].append(s)
                ids[form].append(tok)
    assert ids["per_pass"] == ids["whole_forward"], "the two compiled forms emitted different ids"
    med = {form: 1000 * statistics.median(t) for form, t in times.items()}
    ratio = med["whole_forward"] / med["per_pass"]
    print(f"{'form':<15}{'compile s':>14}{'ms/step':>10}")
    for form in calls:
        print(f"{form:<15}{first[form]:>14.1f}{med[form]:>10.1f}")
    print(f"per-pass speed / whole-forward speed: {ratio:.3f}x  (same ids over {len(ids['per_pass'])} steps)")
    result = {"preset": args.preset, "prompt": args.prompt, "steps": args.steps, "rounds": args.rounds,
              "threads": args.threads, "torch": torch.__version__, "first_step_s": first, "median_ms": med,
              "per_pass_over_whole": ratio, "step_s": times}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
