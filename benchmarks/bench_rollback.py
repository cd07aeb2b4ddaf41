"""What recording for `crop` costs a prefill: the 114M preset (random weights, float32, batch 1), one forward of
`--prompt` tokens on an empty cache with recording off, on without a bound (`activate_past_recording()`, what
transformers < 5.25 asks for) and bounded (`activate_past_recording(recurrent_states_to_keep=N)`, what transformers
>= 5.25 passes in assisted decoding: the drafts its loop may crop). Prints the forward's time (median of
`--repeats`, the three interleaved) and the bytes the cache keeps for rollback (recorded states not shared with the
live ones); writes benchmarks/results/rollback.json.

    python benchmarks/bench_rollback.py [--prompt 512] [--keep 20] [--repeats 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _common import build_models  # noqa: E402

from spike_whale import SpikeWhaleCache  # noqa: E402


def _storages(obj, out: dict) -> dict:
    """{storage pointer: bytes} of every tensor in a (nested) state."""
    if isinstance(obj, torch.Tensor):
        out[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            _storages(item, out)
    elif dataclasses.is_dataclass(obj):
        _storages([getattr(obj, f.name) for f in dataclasses.fields(obj)], out)
    return out


def recorded_bytes(cache: SpikeWhaleCache) -> int:
    """Bytes held only by the rollback history (the live slot states share the finished-segment tensors)."""
    live, recorded = {}, {}
    for layer in cache.layers:
        _storages([layer.mc, layer.elo], live)
        for entries in layer.history.values():
            _storages([state for _, state in entries], recorded)
    for entries in cache._history.values():
        _storages([state for _, state in entries], recorded)
    return sum(n for ptr, n in recorded.items() if ptr not in live)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--keep", type=int, default=20, help="recurrent_states_to_keep (transformers' default drafts: 20)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, _ = build_models()
    ids = torch.randint(10, model.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    modes = {"off": False, "every length": None, f"last {args.keep}": args.keep}
    times = {m: [] for m in modes}
    held = {}
    with torch.no_grad():
        for _ in range(args.repeats):
            for mode, keep in modes.items():
                cache = SpikeWhaleCache(model.config)
                if keep is not False:
                    cache.activate_past_recording(recurrent_states_to_keep=keep)
                t = time.perf_counter()
                model(ids, cache=cache, use_cache=True, logits_to_keep=1)
                times[mode].append(time.perf_counter() - t)
                held[mode] = recorded_bytes(cache)
                del cache
    rows = [{"recording": m, "forward_s": statistics.median(times[m]), "recorded_MB": held[m] / 2**20} for m in modes]
    print(f"prefill of {args.prompt} tokens, 114M preset, float32, batch 1, {args.threads} threads")
    print(f"{'recording':>14} {'forward s':>10} {'recorded MB':>12}")
    for r in rows:
        print(f"{r['recording']:>14} {r['forward_s']:>10.3f} {r['recorded_MB']:>12.1f}")
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "rollback.json"), "w") as f:
        json.dump({"prompt": args.prompt, "keep": args.keep, "threads": args.threads, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
