"""Trainer benchmark: tokens per byte of a Length-MAX vocabulary from `spike-whale train-tokenizer` against
`tokenizers`' byte-level BPE trained on the same sample at the same vocabulary size, with and without the GPT-2
pre-tokenizer regex (`ByteLevel(use_regex=True)` / `use_regex=False`).

    python benchmarks/bench_trainer.py --lengthmax ~/.cache/spike-whale/tokenizer-16512  # trained on the sample
    python benchmarks/bench_trainer.py --train-bytes 3000000                             # train Length-MAX here

Train sample: the first `--train-bytes` of `--train`, cut after the last newline before the limit (what
`head`-style samples given to `train-tokenizer` hold; its sha256 is recorded so a folder can be matched to it).
Held out: `--validation`, never test.txt (docs/corpus.md keeps it for the final evaluation).
- Length-MAX: the folder's vocab, or `train_from_files` with the command's defaults on the sample; tokens are greedy
  longest match, the model's encoder.
- BPE: `tokenizers` BpeTrainer, vocab_size the same N (BPE spends every id on bytes and merges; Length-MAX keeps 388
  for specials, bytes and reserved ids), trained on the sample's documents (two blank lines apart). With the regex,
  words are GPT-2 pre-tokens; without it each document is one word, so merges cross words as Length-MAX tokens do.
  Tokens are the BPE model's own encoding of each validation document. BPE without the regex is the slow part (no
  two documents are the same word, so every merge rewrites most of the sample); set TOKENIZERS_PARALLELISM=true to
  train it on several threads.
Results: a table on stdout and JSON (default benchmarks/results/trainer.json).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

CORPUS = Path.home() / ".cache" / "spike-whale" / "corpus"
DOC_SEPARATOR = "\n\n\n"  # documents are separated by two blank lines (docs/corpus.md)


def read_sample(path: Path, limit: int | None) -> bytes:
    with open(path, "rb") as handle:
        data = handle.read(limit) if limit else handle.read()
    if limit and len(data) == limit:
        data = data[:data.rfind(b"\n") + 1] or data
    return data


def documents(text: str) -> list[str]:
    """`text` cut after each document separator; the pieces join back to `text`."""
    parts = text.split(DOC_SEPARATOR)
    return [p + DOC_SEPARATOR for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=Path, default=CORPUS / "train.txt")
    parser.add_argument("--train-bytes", type=int, default=30_000_000, help="sample size (default 30,000,000)")
    parser.add_argument("--validation", type=Path, default=CORPUS / "validation.txt")
    parser.add_argument("--lengthmax", type=Path, default=None,
                        help="a tokenizer folder trained on the sample (default: train one here, with the defaults)")
    parser.add_argument("--vocab-size", type=int, default=16512)
    parser.add_argument("--out", default="benchmarks/results/trainer.json")
    args = parser.parse_args()
    if args.validation.name == "test.txt" or args.train.name == "test.txt":
        parser.error("test.txt is held out for the final evaluation (docs/corpus.md): use validation.txt")
    for path in (args.train, args.validation):
        if not path.is_file():
            parser.error(f"{path} does not exist: build the corpus with scripts/build_corpus.py (docs/corpus.md)")

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from spike_whale.hub_export.train_tokenizer import compile_greedy_regex, train_from_files
    from spike_whale.tokenization_spike import load_vocab_file

    sample = read_sample(args.train, args.train_bytes)
    heldout = args.validation.read_bytes()
    held_text, n_held = heldout.decode("utf-8"), len(heldout)
    print(f"train sample: {len(sample):,} bytes of {args.train}; validation: {n_held:,} bytes of {args.validation}")

    rows = {}
    if args.lengthmax is not None:
        data = load_vocab_file(args.lengthmax / "spike_vocab.json")
        lm_row = {"source": str(args.lengthmax), "train_s": None, "max_rss_MB": None}
    else:
        with tempfile.TemporaryDirectory() as tmp:
            sample_file = Path(tmp) / "sample.txt"
            sample_file.write_bytes(sample)
            start = time.perf_counter()
            data = train_from_files([str(sample_file)], args.vocab_size, show_progress=False)
            lm_row = {"source": "train_from_files (defaults)", "train_s": round(time.perf_counter() - start, 1),
                      "max_rss_MB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}
    greedy = [t for t, i in data["vocab"].items() if 4 <= i < 16384 and len(t) <= data["max_token_len"]]
    n_lm = len(compile_greedy_regex(greedy).findall(heldout.decode("latin-1")))
    rows["Length-MAX (greedy)"] = {**lm_row, "token_ids": len(greedy), "tokens": n_lm}

    train_docs = documents(sample.decode("utf-8"))
    held_docs = documents(held_text)
    for name, regex in (("BPE, ByteLevel use_regex=True", True), ("BPE, ByteLevel use_regex=False", False)):
        bpe = Tokenizer(models.BPE())
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=regex)
        bpe.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=args.vocab_size, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        start = time.perf_counter()
        bpe.train_from_iterator(train_docs, trainer=trainer)
        train_s = time.perf_counter() - start
        tokens = sum(len(e.ids) for e in bpe.encode_batch(held_docs, add_special_tokens=False))
        rows[name] = {"train_s": round(train_s, 1), "token_ids": bpe.get_vocab_size(), "tokens": tokens}
        print(f"{name}: trained in {train_s:.1f} s", flush=True)

    for row in rows.values():
        row["tokens_per_byte"] = row["tokens"] / n_held
        row["bytes_per_token"] = n_held / row["tokens"]
        row["tokens_vs_lengthmax"] = row["tokens"] / n_lm - 1
    result = {
        "vocab_size": args.vocab_size, "train_file": str(args.train), "train_bytes": len(sample),
        "train_sha256": hashlib.sha256(sample).hexdigest(), "validation_file": str(args.validation),
        "validation_bytes": n_held, "rows": rows,
        "host": {"python": platform.python_version(), "cpus": os.cpu_count(), "load": os.getloadavg()},
    }
    print(f"\n{'tokenizer':32s} {'train s':>8s} {'token ids':>10s} {'tokens':>10s} {'tokens/byte':>12s} "
          f"{'bytes/token':>12s} {'vs Length-MAX':>14s}")
    for name, row in rows.items():
        train_s = "-" if row["train_s"] is None else f"{row['train_s']:.1f}"
        print(f"{name:32s} {train_s:>8s} {row['token_ids']:10,d} {row['tokens']:10,d} {row['tokens_per_byte']:12.4f} "
              f"{row['bytes_per_token']:12.3f} {100 * row['tokens_vs_lengthmax']:+13.1f}%")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out} (load average {os.getloadavg()[0]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
