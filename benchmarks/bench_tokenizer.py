"""Tokenizer benchmark: throughput of SpikeTokenizerFast vs SpikeTokenizer, and tokens per byte of the Length-MAX
trainer vs `tokenizers`' own BPE trained on the same corpus at the same vocabulary size.

    python benchmarks/bench_tokenizer.py                 # ~4 MB of local text, vocab 16512
    python benchmarks/bench_tokenizer.py --quick         # ~1 MB, vocab 8192: a few minutes on 2 shared cores

Corpus: mixed local text (no network): Python sources, Markdown/reST/text documentation and licences of the base
interpreter's standard library and /usr/share, shuffled by file with a fixed seed; the last `--heldout-bytes` are held
out. Both vocabularies are trained on the rest; tokens per byte are measured on the held-out part.
- Length-MAX: `spike_whale.hub_export.train_tokenizer.train_lengthmax_vocab`, greedy longest-match encoding.
- BPE: `tokenizers` BpeTrainer with the standard byte-level pre-tokenizer (GPT-2 regex), and, as a second
  baseline, the same without the regex split (cross-word merges, as Length-MAX tokens cross words).
  vocab_size = the same N (BPE spends all of it on merges and bytes; Length-MAX keeps 128 ids for specials).
Throughput: MB/s through transformers' `__call__` of three inputs built from the held-out text: ~2 KB documents
(batch), one 464 KB text, and 1,000 lines (batch); best of `--repeats`, every tokenizer interleaved on each input so
a shared machine's load hits all alike. Two vocabularies: the one trained here and models/spike-whale-demo's. The
fast class batches in Rust (`TOKENIZERS_PARALLELISM=true`, `RAYON_NUM_THREADS=2`); the slow one runs in one Python
thread. For the ratio, the same tokenizer.json through `tokenizers`' `encode_batch_fast` (no character offsets,
which transformers' `encode_batch` path asks for), and the fast class with its joined-rows route off (row by row).
Targets: fast >= 10 MB/s on the long text and faster than slow on every row (issue 39), Length-MAX >= 10% fewer
tokens than BPE (issue 14).
Results: a table on stdout and JSON (default benchmarks/results/tokenizer.json).
"""

from __future__ import annotations

import argparse
import copy
import glob
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
os.environ.setdefault("RAYON_NUM_THREADS", "2")


def collect_corpus(total_bytes: int, seed: int) -> list[str]:
    roots = [sys.base_prefix + "/lib", "/usr/share/doc", "/usr/share/common-licenses"]  # not the venv: it changes
    files = []
    for root in roots:
        for ext in ("py", "md", "rst", "txt"):
            files += glob.glob(f"{root}/**/*.{ext}", recursive=True)
    files = sorted(set(files))
    random.Random(seed).shuffle(files)
    docs, size = [], 0
    for path in files:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if len(text) < 200:
            continue
        docs.append(text)
        size += len(text.encode("utf-8"))
        if size >= total_bytes:
            break
    return docs


def split_docs(docs: list[str], heldout_bytes: int) -> tuple[list[str], list[str]]:
    held, size = [], 0
    while docs and size < heldout_bytes:
        held.append(docs.pop())
        size += len(held[-1].encode("utf-8"))
    return docs, held


def pieces(docs: list[str], size: int = 2048) -> list[str]:
    return [d[i:i + size] for d in docs for i in range(0, len(d), size)]


def best_rates(fns: dict, n_bytes: int, repeats: int) -> dict[str, float]:
    """MB/s of each function, best of `repeats`, the functions interleaved so a shared machine's load hits all alike."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: n_bytes / seconds / 1e6 for name, seconds in best.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--vocab-size", type=int, default=None)
    parser.add_argument("--train-bytes", type=int, default=None)
    parser.add_argument("--heldout-bytes", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--refine-rounds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-bpe", action="store_true", help="skip the BPE baselines (throughput only)")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/tokenizer[_quick].json)")
    args = parser.parse_args()
    args.out = args.out or f"benchmarks/results/tokenizer{'_quick' if args.quick else ''}.json"
    vocab_size = args.vocab_size or (8192 if args.quick else 16512)
    train_bytes = args.train_bytes or ((1 << 20) if args.quick else (3 << 20))
    heldout_bytes = args.heldout_bytes or ((256 << 10) if args.quick else (1 << 20))

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from spike_whale.hub_export.train_tokenizer import train_lengthmax_vocab
    from spike_whale.tokenization_spike import SpikeTokenizer
    from spike_whale.tokenization_spike_fast import SpikeTokenizerFast

    load_before = os.getloadavg()
    train_docs, held = split_docs(collect_corpus(train_bytes + heldout_bytes, args.seed), heldout_bytes)
    n_train = sum(len(d.encode()) for d in train_docs)
    n_held = sum(len(d.encode()) for d in held)
    print(f"corpus: {len(train_docs)} train docs ({n_train / 1e6:.2f} MB), {len(held)} held-out ({n_held / 1e6:.2f} MB)")

    latin = [d.encode("utf-8").decode("latin-1") for d in train_docs]
    start = time.perf_counter()
    data = train_lengthmax_vocab(lambda _r: latin, vocab_size, rounds=args.rounds, refine_rounds=args.refine_rounds)
    lm_time = time.perf_counter() - start
    fast, slow = SpikeTokenizerFast(data), SpikeTokenizer(data)
    lm_tokens = sum(len(ids) for ids in fast(held, add_special_tokens=False)["input_ids"])

    bpe_rows = {}
    for name, regex in () if args.no_bpe else (("bpe_bytelevel_regex", True), ("bpe_bytelevel_noregex", False)):
        bpe = Tokenizer(models.BPE())
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=regex)
        bpe.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
        start = time.perf_counter()
        bpe.train_from_iterator(pieces(train_docs, 1 << 16) if not regex else train_docs, trainer=trainer)
        bpe_time = time.perf_counter() - start
        tokens = sum(len(e.ids) for e in bpe.encode_batch(held))
        bpe_rows[name] = {"train_s": round(bpe_time, 1), "tokens": tokens, "tokens_per_byte": tokens / n_held,
                          "vocab": bpe.get_vocab_size()}

    docs = pieces(held)
    long_text = "".join(held)[:464_000]
    lines = [line for line in "".join(held).splitlines(keepends=True) if line.strip()][:1000]
    inputs = {"docs": docs, "long_text": long_text, "lines": lines}
    sizes = {name: sum(len(t.encode()) for t in ([x] if isinstance(x, str) else x)) for name, x in inputs.items()}
    demo_dir = Path(__file__).resolve().parent.parent / "models" / "spike-whale-demo"
    demo, demo_slow = SpikeTokenizerFast.from_pretrained(demo_dir), SpikeTokenizer.from_pretrained(demo_dir)
    pairs = {"trained": (fast, slow), "demo": (demo, demo_slow)}
    for tok in (fast, slow, demo, demo_slow):
        tok.model_max_length = 1 << 30  # no too-long warnings for the long text
        tok(docs[:10])
    # The fast class without its joined-rows route (`_encode_joined`), to show what the route gives
    row_by_row = {vocab: copy.deepcopy(f) for vocab, (f, _) in pairs.items()}
    for f in row_by_row.values():
        f._encode_joined = lambda *args: None
    rates = {}
    for name, x in inputs.items():
        batch = [x] if isinstance(x, str) else x
        fns = {}
        for vocab, (f, s) in pairs.items():
            fns[f"{vocab}_fast"] = lambda f=f, x=x: f(x)["input_ids"]
            fns[f"{vocab}_fast_row_by_row"] = lambda f=row_by_row[vocab], x=x: f(x)["input_ids"]
            fns[f"{vocab}_slow"] = lambda s=s, x=x: s(x)["input_ids"]
            fns[f"{vocab}_tokenizers_no_offsets"] = lambda f=f, b=batch: f.backend_tokenizer.encode_batch_fast(b)
        rates[name] = best_rates(fns, sizes[name], args.repeats)
    load = os.getloadavg()
    identical = {vocab: all(f(x)["input_ids"] == s(x)["input_ids"] == row_by_row[vocab](x)["input_ids"]
                            for x in inputs.values()) for vocab, (f, s) in pairs.items()}
    matched = {vocab: any(not t.special for t in f.backend_tokenizer.get_added_tokens_decoder().values())
               for vocab, (f, _) in pairs.items()}
    result = {
        "vocab_size": vocab_size, "train_bytes": n_train, "heldout_bytes": n_held, "rounds": args.rounds,
        "refine_rounds": args.refine_rounds,
        "lengthmax": {"train_s": round(lm_time, 1), "tokens": lm_tokens, "tokens_per_byte": lm_tokens / n_held},
        **bpe_rows,
        **{f"fewer_tokens_than_{name}": 1 - lm_tokens / row["tokens"] for name, row in bpe_rows.items()},
        "throughput_MB_s": rates, "throughput_bytes": sizes,
        "fast_over_slow": {name: {vocab: row[f"{vocab}_fast"] / row[f"{vocab}_slow"] for vocab in pairs}
                           for name, row in rates.items()},
        "joined_over_row_by_row": {name: {vocab: row[f"{vocab}_fast"] / row[f"{vocab}_fast_row_by_row"]
                                          for vocab in pairs} for name, row in rates.items()},
        "fast_equals_slow": identical, "greedy_tokens_matched_as_added_tokens": matched,
        "host": {"python": platform.python_version(), "cpus": os.cpu_count(), "load_before": load_before,
                 "load_after": load},
    }
    print(f"{'':28s} {'train s':>8s} {'tokens/byte':>12s}")
    print(f"{'Length-MAX (greedy)':28s} {lm_time:8.1f} {lm_tokens / n_held:12.4f}")
    for name, row in bpe_rows.items():
        print(f"{name:28s} {row['train_s']:8.1f} {row['tokens_per_byte']:12.4f}")
    for name, value in result.items():
        if name.startswith("fewer_tokens_than_"):
            print(f"Length-MAX uses {100 * value:.1f}% fewer tokens than {name[len('fewer_tokens_than_'):]}")
    print(f"throughput MB/s (identical ids: {identical}; greedy tokens matched as added tokens: {matched}; load "
          f"average {load_before[0]:.1f} before, {load[0]:.1f} after)")
    print(f"{'MB/s':32s}" + "".join(f"{name:>12s}" for name in rates))
    for key in next(iter(rates.values())):
        print(f"{key:32s}" + "".join(f"{row[key]:12.2f}" for row in rates.values()))
    for label in ("fast_over_slow", "joined_over_row_by_row"):
        for vocab in pairs:
            print(f"{label + ' ' + vocab:32s}" + "".join(f"{result[label][n][vocab]:12.2f}" for n in rates))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
