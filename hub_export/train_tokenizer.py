"""`spike-whale train-tokenizer CORPUS... OUT_DIR --vocab-size N`: train a Length-MAX vocabulary.

Length-MAX (Dong & Su, arXiv 2511.20849) chooses tokens that maximise frequency × length, i.e. the tokens
that remove the most tokens from the corpus, solved greedily with a scoreboard.  Here the objective is
measured against the encoder the model actually uses, greedy longest match: every round segments the
corpus with the current vocabulary, scores each run of n = 2..`max_ngram` consecutive tokens (at most
`max_token_len` bytes) by the tokens it would save, ``score(s) = Σ (n − 1)`` over its occurrences (the
authors' trainer scores the same (n − 1)·freq), and adds the best new strings.  Re-scoring against the new
segmentation after each batch of additions is the scoreboard: candidates that a new token already covers
lose their score.  Tokens picked in one batch can overlap, so `refine_rounds` more passes swap the least used
tokens for candidates worth more than twice their use.  Multi-byte ids follow the order of selection.

* Streaming: files and globs are read in chunks of `chunk_bytes` (any size of corpus), each round counts them in
  numpy (`CandidateTable`: strings are 64-bit hashes, no Python object per occurrence) and reads the chunks again
  for the bytes of its winners.  Memory is bounded by the candidate table, pruned to its best half whenever it
  exceeds `max_candidates` entries (about 250 bytes each at the peak of a merge); a round whose picks may have
  lost to a pruned string warns.
* Deterministic: same corpus, options and seed give the same vocabulary (ties are broken by the token bytes;
  the seed only chooses which chunks a round reads when `sample_bytes` limits it: chunks are then at most
  `sample_bytes`, and a round whose draw skipped every chunk reads one).
* No token is part of one character and another (b"d \xe2\x80"), nor text spelled like another token's byte-level
  key ("Ġthe", "Ã©"): either would put the fast tokenizer on its slower piece pipeline (`needs_the_pieces`).
* A vocab that falls short of `vocab_size` (too little text read) warns, naming the count and the round that ran dry;
  so does a candidate table too small for the corpus, and a refinement that ends early says so (`notify`).
* Layout (the released one): ids 0..3 ``<pad> <unk> <bos> <eos>``, byte b at b + 4, multi-byte tokens from
  260 in order of selection, the 17 chat/tool/FIM specials at 16384..16400 and 111 reserved ids up to 16511.
  ``vocab_size`` counts all of them, as the model's ``config.vocab_size`` does: the released 16,512 gives
  16,124 multi-byte tokens.  A smaller size learns ``vocab_size − 388`` multi-byte tokens (ids 260 ..
  vocab_size − 129) and leaves the rest of 260..16383 unused; the specials and reserved ids never move, so
  every trained vocabulary fits a model with ``vocab_size = 16512``.  Larger sizes are refused.
"""

from __future__ import annotations

import glob
import math
import os
import random
import re
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

DEFAULT_VOCAB_SIZE = 16512
NUM_FIXED_IDS = 4 + 256 + 128  # base specials, bytes, chat/tool/FIM specials + reserved ids
MIN_VOCAB_SIZE = NUM_FIXED_IDS

def _layout():
    from ..tokenization_spike import (
        ALGORITHM, BASE_SPECIAL_TOKENS, BYTE_OFFSET, FIRST_MULTIBYTE_ID, RESERVED_START_ID, RESERVED_TOKENS,
        SPECIAL_START_ID, SPECIAL_TOKEN_IDS, SPECIAL_TOKENS, VOCAB_SIZE,
    )
    return locals()


def _check_options(vocab_size, max_token_len, rounds, max_ngram, min_freq, max_candidates):
    from ..tokenization_spike import MAX_TOKEN_LEN_LIMIT

    if not isinstance(vocab_size, int) or not MIN_VOCAB_SIZE <= vocab_size <= DEFAULT_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size must be an integer in {MIN_VOCAB_SIZE}..{DEFAULT_VOCAB_SIZE} (it counts the 4 base "
            f"specials, 256 bytes and 128 chat/reserved ids of the released layout), got {vocab_size!r}"
        )
    if not isinstance(max_token_len, int) or not 2 <= max_token_len <= MAX_TOKEN_LEN_LIMIT:
        raise ValueError(f"max_token_len must be an integer in 2..{MAX_TOKEN_LEN_LIMIT}, got {max_token_len!r}")
    if rounds < 1 or max_ngram < 2 or min_freq < 1 or max_candidates < 1000:
        raise ValueError("rounds >= 1, max_ngram >= 2, min_freq >= 1 and max_candidates >= 1000 are required")


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


_HASH_BASE = 0x100000001B3  # odd, so it is invertible modulo 2**64
_BYTE_CODES = [_splitmix64(b) for b in range(256)]  # fixed: numpy's generators may change their streams
WINDOW_TOKENS = 1 << 18  # tokens counted at once: bounds the temporary arrays whatever the size of a chunk


class _Powers:
    """``base**i`` and ``base**-i`` modulo 2**64 for i = 0..n, grown on demand."""

    def __init__(self):
        self.up = self.down = None

    def get(self, n: int):
        import numpy as np

        if self.up is None or len(self.up) <= n:
            size = max(n + 1, 1 << 16, 0 if self.up is None else 2 * len(self.up))
            self.up, self.down = (np.full(size, b, dtype=np.uint64) for b in (_HASH_BASE, pow(_HASH_BASE, -1, 1 << 64)))
            self.up[0] = self.down[0] = 1
            np.cumprod(self.up, out=self.up)  # integer products wrap: arithmetic modulo 2**64
            np.cumprod(self.down, out=self.down)
        return self.up, self.down


_POWERS = _Powers()


def _group(keys, *columns, sums: int):
    """Sort by `keys` and merge equal keys: the first `sums` columns are added, the others keep a first value."""
    import numpy as np

    order = np.argsort(keys)  # equal keys are equal strings: which occurrence represents them does not matter
    keys = keys[order]
    first = np.flatnonzero(np.concatenate(([True], keys[1:] != keys[:-1]))) if len(keys) else np.empty(0, np.intp)
    out = [keys[first]]
    for i, col in enumerate(columns):
        col = col[order]
        out.append(np.add.reduceat(col, first) if i < sums and len(first) else col[first])
    return out


def compile_greedy_regex(tokens: Iterable[str]) -> re.Pattern:
    """`greedy_trie_pattern` compiled with Python's ``re``: its matches are the greedy segmentation (the slow
    tokenizer's matcher)."""
    from ..tokenization_spike import greedy_trie_pattern

    return re.compile(greedy_trie_pattern(tokens))


def needs_the_pieces(token: str) -> bool:
    """A token that can put its vocab on the pieces alone (`build_backend`), which the trainer never takes: one across
    a character boundary, or one whose text is spelled in the byte alphabet like other bytes a token may hold ("Ã©"
    is the byte-level key of "é", "Ġthe" the key of " the")."""
    from ..tokenization_spike_fast import _BYTE_LEVEL_TO_LATIN1, _decodes_as_itself, _text, crosses_a_character

    if crosses_a_character(token):
        return True
    text = _text(token)
    if text is None or len(text) < 2 or _decodes_as_itself(text):
        return False
    return not crosses_a_character("".join(map(_BYTE_LEVEL_TO_LATIN1.get, text)))


class CandidateTable:
    """The scoreboard of one round: every run of n = 2..max_ngram consecutive tokens (at most max_token_len bytes)
    with ``score(s) = Σ (n − 1)`` over its occurrences (the tokens `s` would save) and ``freq(s)`` (occurrences).

    Counting is numpy over whole chunks, never a Python object per occurrence: a string is its 64-bit polynomial
    hash, computed for every run at once from the chunk's prefix hashes, and one occurrence (its offset in the
    round's stream) stands for its bytes until the round's winners are read back (`read_back`).  Two strings whose
    hashes collide would share one count: about one chance in 10^4 for a round of 50 million distinct strings.

    Memory is bounded: beyond `max_candidates` entries the table keeps the best half by the upper bound
    ``score + err`` (lossy counting: `err` is what an entry may have lost before it was (re)inserted) and `floor`
    remembers the highest bound dropped.  A string missing from the table scores at most `floor`; a kept one
    scores between `score` and ``score + err``.
    """

    def __init__(self, max_candidates: int, max_ngram: int, max_token_len: int):
        import numpy as np

        self.max_candidates, self.max_ngram, self.max_token_len = max_candidates, max_ngram, max_token_len
        empty = np.empty(0, np.int64)
        self.keys, self.length = np.empty(0, np.uint64), np.empty(0, np.uint16)
        self.score, self.freq, self.err, self.pos = (empty,) * 4
        self.floor = 0
        self.n_read = 0  # bytes of the round's stream before the next chunk
        self.pending: list = []
        self.n_pending = 0

    def __len__(self) -> int:
        return len(self.keys)

    def add_chunk(self, chunk: str, seg: list[str]) -> None:
        """Count the runs of `seg`, the greedy segmentation of `chunk` (a latin-1 string)."""
        import numpy as np

        data = np.frombuffer(chunk.encode("latin-1"), dtype=np.uint8)
        starts = np.zeros(len(seg) + 1, dtype=np.int64)
        np.cumsum(np.fromiter(map(len, seg), dtype=np.int64, count=len(seg)), out=starts[1:])
        for t0 in range(0, len(seg), WINDOW_TOKENS):
            self._add_window(data, starts, t0, min(t0 + WINDOW_TOKENS, len(seg)))
        self.n_read += len(chunk)

    def _add_window(self, data, starts, t0: int, t1: int) -> None:
        """The runs starting at tokens t0..t1 - 1 (they may end after t1)."""
        import numpy as np

        n_tokens = len(starts) - 1
        b0, b1 = int(starts[t0]), int(starts[min(n_tokens, t1 + self.max_ngram - 1)])
        up, down = _POWERS.get(b1 - b0)
        codes = np.array(_BYTE_CODES, dtype=np.uint64)[data[b0:b1]]
        prefix = np.zeros(b1 - b0 + 1, dtype=np.uint64)  # prefix[j] = Σ_{i<j} code_i · base^(j-1-i)
        np.cumsum(codes * down[1:b1 - b0 + 1], out=prefix[1:])
        prefix *= up[:b1 - b0 + 1]
        keys, weights, where, lengths = [], [], [], []
        runs = np.arange(t0, t1)  # first token of each run that still fits; a longer run from there is longer
        for n in range(2, self.max_ngram + 1):
            runs = runs[runs + n <= n_tokens]
            size = starts[runs + n] - starts[runs]
            fits = size <= self.max_token_len
            runs, size = runs[fits], size[fits]
            if not len(runs):
                break
            begin = starts[runs] - b0
            keys.append(prefix[begin + size] - prefix[begin] * up[size])
            weights.append(np.full(len(runs), n - 1, dtype=np.int64))
            where.append(begin + (b0 + self.n_read))
            lengths.append(size.astype(np.uint16))
        if not keys:
            return
        cat = np.concatenate
        keys, score, freq, pos, length = _group(cat(keys), cat(weights), np.ones(sum(map(len, where)), np.int64),
                                                cat(where), cat(lengths), sums=2)
        self.pending.append((keys, score, freq, pos, length))
        self.n_pending += len(keys)
        if self.n_pending >= self.max_candidates // 2:
            self.flush()

    def flush(self, last: bool = False) -> None:
        """Merge the pending counts into the table, then prune it if it is over the bound: to its best half, room for
        more counts, or with `last` (the round's counting is over) to `max_candidates`."""
        import numpy as np

        if not self.pending:
            return
        columns = [np.concatenate(c) for c in zip(*self.pending)]
        self.pending, self.n_pending = [], 0
        keys, score, freq, pos, length = _group(*columns, sums=2)
        del columns
        at = np.searchsorted(self.keys, keys)
        seen = at < len(self.keys)
        seen[seen] = self.keys[at[seen]] == keys[seen]
        self.score[at[seen]] += score[seen]  # `keys` are distinct, so each table entry is hit at most once
        self.freq[at[seen]] += freq[seen]
        new, at = ~seen, at[~seen]
        for name, values in (("keys", keys), ("score", score), ("freq", freq), ("pos", pos), ("length", length)):
            setattr(self, name, np.insert(getattr(self, name), at, values[new]))
        self.err = np.insert(self.err, at, self.floor)
        if len(self.keys) > self.max_candidates:
            bound = self.score + self.err
            n_drop = len(bound) - (self.max_candidates if last else self.max_candidates // 2)
            order = np.argpartition(bound, n_drop)
            self.floor = max(self.floor, int(bound[order[:n_drop]].max()))
            keep = np.sort(order[n_drop:])
            del order, bound
            for name in ("keys", "score", "freq", "err", "pos", "length"):
                setattr(self, name, getattr(self, name)[keep])

    def ranked(self, min_freq: int):
        """Indices of the entries occurring at least `min_freq` times, best score first (ties by hash)."""
        import numpy as np

        self.flush(last=True)
        eligible = np.flatnonzero(self.freq >= min_freq)
        return eligible[np.argsort(-self.score[eligible], kind="stable")]

    def best(self, count: int, exclude: set[str], min_freq: int, read_back: Callable) -> list[tuple[str, int]]:
        """The `count` best (string, score) pairs not in `exclude`, best first (ties by the bytes).

        A string inside one already chosen from this table is taken only if it occurs at least twice as often
        (otherwise most of its score comes from inside the longer token, which greedy matching will prefer).
        `read_back(positions, lengths)` returns the strings at those offsets of the round's stream.
        """
        import numpy as np

        order = self.ranked(min_freq)
        chosen: list[tuple[str, int]] = []
        cover: dict[str, int] = {}  # substring of a chosen string -> the highest freq of a chosen string holding it
        rising = -self.score[order]
        lo, size = 0, 3 * count + 64
        while lo < len(order):  # each batch reads the chunks again: batches double, so a round reads them few times
            hi = min(len(order), lo + size)
            hi = int(np.searchsorted(rising, rising[hi - 1], side="right"))  # a batch ends after a whole tie
            idx, lo, size = order[lo:hi], hi, 2 * size
            found = zip(read_back(self.pos[idx], self.length[idx]), self.score[idx].tolist(), self.freq[idx].tolist())
            for piece, value, freq in sorted(found, key=lambda item: (-item[1], item[0])):
                if piece in exclude or freq < 2 * cover.get(piece, 0):
                    continue
                # Never a token that would put the fast tokenizer on its pieces alone: one across a character
                # boundary (b"d \xe2\x80"), or text spelled like another token's byte-level key ("Ġthe").
                if not piece.isascii() and needs_the_pieces(piece):
                    continue
                chosen.append((piece, value))
                if len(chosen) == count:
                    return chosen
                for i in range(len(piece) - 1):
                    for j in range(i + 2, len(piece) + 1 - (i == 0)):
                        sub = piece[i:j]
                        if cover.get(sub, 0) < freq:
                            cover[sub] = freq
        return chosen


def read_back(chunks: Iterable[str], positions, lengths) -> list[str]:
    """The strings of `lengths` at `positions`, offsets into the stream of `chunks` (no run crosses a chunk)."""
    out = [""] * len(positions)
    wanted = sorted(zip(positions.tolist(), lengths.tolist(), range(len(positions))))
    offset, k = 0, 0
    for chunk in chunks:
        end = offset + len(chunk)
        while k < len(wanted) and wanted[k][0] < end:
            pos, length, i = wanted[k]
            out[i] = chunk[pos - offset:pos - offset + length]
            k += 1
        if k == len(wanted):
            break
        offset = end
    return out


def train_lengthmax_vocab(
    chunks: Callable[[int], Iterable[str]],
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    *,
    max_token_len: int = 24,
    rounds: int = 10,
    max_ngram: int = 8,
    min_freq: int = 2,
    max_candidates: int = 4_000_000,
    refine_rounds: int = 4,
    progress: Callable[[int], object] | None = None,
    notify: Callable[[str], object] | None = None,
) -> dict:
    """Train a vocab in the released file format.

    `chunks(round)` returns an iterable of corpus chunks as latin-1 strings (one character per byte); it is
    called once per round to count and again to read back the round's winners, and must give the same chunks each
    time, so the corpus is streamed, never held.  `progress(round)` may return a context manager with an
    ``update(n_chars)`` method (a tqdm bar); `notify(message)` hears of a refinement that ends before
    `refine_rounds` (nothing was worth a swap).  What went wrong (a short vocab, a table too small) warns.
    """
    _check_options(vocab_size, max_token_len, rounds, max_ngram, min_freq, max_candidates)
    if refine_rounds < 0:
        raise ValueError(f"refine_rounds must be >= 0, got {refine_rounds}")
    lay = _layout()
    capacity = vocab_size - NUM_FIXED_IDS
    forbidden = set(lay["BASE_SPECIAL_TOKENS"]) | set(lay["SPECIAL_TOKENS"]) | set(lay["RESERVED_TOKENS"])
    known = {chr(b) for b in range(256)}
    selected: list[str] = []
    pruned_rounds: list[str] = []

    def scan(round_idx: int, count_usage: bool = False) -> tuple[CandidateTable, Counter]:
        """Segment the corpus with the current vocab: the candidate table and how often each token is used."""
        findall = compile_greedy_regex(known).findall
        table, usage = CandidateTable(max_candidates, max_ngram, max_token_len), Counter()
        bar = progress(round_idx) if progress else None
        for chunk in chunks(round_idx):
            seg = findall(chunk)
            table.add_chunk(chunk, seg)
            if count_usage:
                usage.update(seg)
            if bar is not None:
                bar.update(len(chunk))
        if bar is not None:
            bar.close()
        return table, usage

    def best(table: CandidateTable, round_idx: int, count: int) -> list[tuple[str, int]]:
        def strings(pos, length):
            return read_back(chunks(round_idx), pos, length)

        return table.best(count, known | forbidden, min_freq, strings)

    def check_floor(table: CandidateTable, round_idx: int, taken: list[tuple[str, int]]) -> None:
        """A string dropped from the table could have scored up to its floor: note a round that took one below."""
        if taken and table.floor >= taken[-1][1]:
            pruned_rounds.append(f"round {round_idx + 1} dropped strings scoring up to {table.floor:,} and picked "
                                 f"one scoring {taken[-1][1]:,}")

    shortfall = None
    for round_idx in range(rounds):
        remaining = capacity - len(selected)
        if remaining <= 0:
            break
        table, _ = scan(round_idx)
        take = math.ceil(remaining / (rounds - round_idx))
        picks = best(table, round_idx, take)
        check_floor(table, round_idx, picks)
        ranked = [piece for piece, _ in picks]
        if len(ranked) < take:
            shortfall = (f"round {round_idx + 1} of {rounds} read {table.n_read:,} bytes and found {len(ranked):,} "
                         f"new strings occurring at least min_freq={min_freq} times where it needed {take:,} (a small "
                         "corpus, or --sample-bytes reading too little)")
        if not ranked:
            break
        selected += ranked
        known.update(ranked)
    if len(selected) < capacity:
        warnings.warn(f"trained {len(selected):,} of the {capacity:,} multi-byte tokens vocab_size={vocab_size:,} "
                      f"asks for: {shortfall}; the other ids stay unused", stacklevel=2)

    # Refinement: tokens picked in the same batch overlap, so some end up rarely used. Each refine round swaps the
    # least used tokens (removing one costs at least one token per use) for new candidates worth clearly more.
    for refine_idx in range(refine_rounds):
        round_idx = rounds + refine_idx
        table, usage = scan(round_idx, count_usage=True)
        weakest = sorted(selected, key=lambda t: (usage[t], t))[: max(1, len(selected) // 10)]
        fresh = best(table, round_idx, len(weakest))
        swaps = 0
        while swaps < min(len(weakest), len(fresh)) and fresh[swaps][1] > 2 * usage[weakest[swaps]]:
            swaps += 1
        check_floor(table, round_idx, fresh[:swaps])
        if swaps == 0:
            if notify is not None:
                notify(f"refinement stopped at round {refine_idx + 1} of {refine_rounds}: no new string scores more "
                       "than twice the use of the token it would replace")
            break
        dropped = set(weakest[:swaps])
        selected = [t for t in selected if t not in dropped] + [piece for piece, _ in fresh[:swaps]]
        known = (known - dropped) | {piece for piece, _ in fresh[:swaps]}
    if pruned_rounds:
        warnings.warn(f"the candidate table (max_candidates={max_candidates:,}) was too small for this corpus: "
                      f"{'; '.join(pruned_rounds)}, so better strings may have been missed; raise --max-candidates "
                      "(memory) or lower --sample-bytes", stacklevel=2)

    vocab = {tok: i for i, tok in enumerate(lay["BASE_SPECIAL_TOKENS"])}
    vocab.update({chr(b): b + lay["BYTE_OFFSET"] for b in range(256)})
    vocab.update({tok: lay["FIRST_MULTIBYTE_ID"] + i for i, tok in enumerate(selected)})
    vocab.update(lay["SPECIAL_TOKEN_IDS"])
    vocab.update({tok: lay["RESERVED_START_ID"] + i for i, tok in enumerate(lay["RESERVED_TOKENS"])})
    return {
        "vocab": vocab,
        "max_token_len": max_token_len,
        "vocab_size": lay["VOCAB_SIZE"],
        "algorithm": lay["ALGORITHM"],
        "special_tokens": list(lay["SPECIAL_TOKENS"]),
    }


def build_lengthmax_vocab(texts: str | Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE, **options) -> dict:
    """`train_lengthmax_vocab` over in-memory texts (a bare string is one text)."""
    if isinstance(texts, str):
        texts = [texts]
    docs = [t.encode("utf-8").decode("latin-1") for t in texts if t]
    return train_lengthmax_vocab(lambda _round: docs, vocab_size, **options)


def expand_corpus(patterns: Iterable[str]) -> list[Path]:
    """Files named by `patterns` (paths or globs, sorted within a glob), each once, in order."""
    files: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise FileNotFoundError(f"corpus pattern {pattern!r} matches no file")
        for match in matches:
            path = Path(match)
            if path.is_dir():
                raise ValueError(f"corpus entry {match!r} is a folder: pass files or a glob such as '{match}/**/*.txt'")
            if not path.is_file():
                raise FileNotFoundError(f"corpus file {match!r} does not exist")
            if path.resolve() not in {f.resolve() for f in files}:
                files.append(path)
    return files


def read_chunks(files: list[Path], chunk_bytes: int = 1 << 20) -> Iterator[str]:
    """The files' bytes as latin-1 strings of about `chunk_bytes`, cut after a newline where there is one."""
    for path in files:
        carry = b""
        with open(path, "rb") as handle:
            while True:
                block = handle.read(chunk_bytes)
                if not block:
                    break
                data = carry + block
                cut = data.rfind(b"\n") + 1 or len(data)
                carry = data[cut:]
                yield data[:cut].decode("latin-1")
        if carry:
            yield carry.decode("latin-1")


def train_from_files(patterns: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE, *, seed: int = 0,
                     sample_bytes: int | None = None, chunk_bytes: int = 1 << 20, show_progress: bool = True,
                     **options) -> dict:
    """Stream the files (or globs) `patterns` through `train_lengthmax_vocab` with a tqdm bar per round."""
    from tqdm import tqdm

    files = expand_corpus(patterns)
    total = sum(f.stat().st_size for f in files)
    if total == 0:
        raise ValueError("the corpus is empty")
    if sample_bytes is not None and sample_bytes < 1:
        raise ValueError(f"sample_bytes must be a positive number of bytes, got {sample_bytes}")
    fraction = 1.0 if not sample_bytes or sample_bytes >= total else sample_bytes / total
    if fraction < 1.0:  # chunks larger than the sample would be skipped in most rounds, and a round would read nothing
        chunk_bytes = min(chunk_bytes, sample_bytes)

    def chunks(round_idx: int) -> Iterator[str]:
        if fraction >= 1.0:
            yield from read_chunks(files, chunk_bytes)
            return
        rng = random.Random(f"{seed}:{round_idx}")
        taken, spare = False, None
        for i, chunk in enumerate(read_chunks(files, chunk_bytes), 1):
            if rng.random() < fraction:
                taken = True
                yield chunk
            elif not taken and rng.random() * i < 1:  # one skipped chunk, uniformly (reservoir), for a round that
                spare = chunk                          # would otherwise read nothing
        if not taken and spare is not None:
            yield spare

    rounds = options.get("rounds", 10) + options.get("refine_rounds", 4)

    def progress(round_idx: int):
        return tqdm(total=int(total * fraction), unit="B", unit_scale=True, desc=f"round {round_idx + 1}/{rounds}",
                    disable=not show_progress)

    return train_lengthmax_vocab(chunks, vocab_size, progress=progress, notify=tqdm.write if show_progress else None,
                                 **options)


def save_tokenizer_folder(data: dict, out_dir: str | os.PathLike, **tokenizer_kwargs) -> str:
    """Write `data` as a folder AutoTokenizer loads (fast by default): tokenizer.json, spike_vocab.json, config,
    chat template and both tokenizer code files."""
    from ..tokenization_spike_fast import SpikeTokenizerFast

    SpikeTokenizerFast(data, **tokenizer_kwargs).save_pretrained(str(out_dir))
    return str(out_dir)


def build_demo_tokenizer(vocab_size: int = 2176, fast: bool = True, **tokenizer_kwargs):
    """A tokenizer over a vocab trained on the built-in `DEMO_CORPUS` (no files or network needed).

    The demo vocab has under 2,000 multi-byte tokens; every other multi-byte id is an unused slot.  The id
    layout (bytes, specials, reserved ids, 16,512 ids in total) is the real one.
    """
    from ..tokenization_spike import SpikeTokenizer
    from ..tokenization_spike_fast import SpikeTokenizerFast

    cls = SpikeTokenizerFast if fast else SpikeTokenizer
    with warnings.catch_warnings():  # the short vocab is the documented point of the demo, not a surprise
        warnings.filterwarnings("ignore", "trained .* multi-byte tokens", UserWarning)
        data = build_lengthmax_vocab([DEMO_CORPUS], vocab_size=vocab_size)
    return cls(data, **tokenizer_kwargs)


# A folder holding any of these holds a model: its tokenizer must stay the one whose ids it was trained on.
MODEL_FILE_NAMES = frozenset({"config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json"})
MODEL_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def _check_out_dir(out_dir: Path, corpus: list[Path], overwrite: bool) -> None:
    from .output_paths import check_destination, check_not_source

    check_not_source(out_dir, corpus, "OUT_DIR")
    if out_dir.is_dir():
        model = sorted(p.name for p in out_dir.iterdir()
                       if p.name in MODEL_FILE_NAMES or p.name.endswith(MODEL_WEIGHT_SUFFIXES))
        if model:
            raise ValueError(f"{out_dir} holds a model ({', '.join(model)}): a new tokenizer there would change the "
                             "token ids it was trained on; refusing even with --overwrite: choose a new OUT_DIR")
    check_destination(out_dir, corpus, overwrite=overwrite)


def run(args) -> int:
    import time

    corpus = expand_corpus(args.corpus)
    out_dir = Path(args.out_dir)
    _check_out_dir(out_dir, corpus, args.overwrite)
    start = time.perf_counter()
    data = train_from_files(args.corpus, args.vocab_size, seed=args.seed, sample_bytes=args.sample_bytes,
                            max_token_len=args.max_token_len, rounds=args.rounds, refine_rounds=args.refine_rounds,
                            max_ngram=args.max_ngram,
                            min_freq=args.min_freq, max_candidates=args.max_candidates)
    elapsed = time.perf_counter() - start
    n_multi = sum(1 for i in data["vocab"].values() if 260 <= i < 16384)
    save_tokenizer_folder(data, out_dir)
    print(f"wrote {out_dir}: {n_multi:,} multi-byte tokens (vocab_size {args.vocab_size:,}, max_token_len "
          f"{args.max_token_len}) from {sum(f.stat().st_size for f in corpus):,} bytes in {elapsed:.1f} s")
    return 0


def register(sub) -> None:
    p = sub.add_parser(
        "train-tokenizer",
        help="train a Length-MAX vocabulary on text files -> tokenizer folder",
        description="Train a Length-MAX vocabulary (tokens maximising frequency x length under greedy longest "
        "match) on CORPUS files or globs, streamed, and write OUT_DIR: a tokenizer folder that "
        "AutoTokenizer.from_pretrained(OUT_DIR, trust_remote_code=True) loads, with the released id layout.",
    )
    p.add_argument("corpus", nargs="+", metavar="CORPUS", help="text files or globs (quote globs: 'data/**/*.txt')")
    p.add_argument("out_dir", metavar="OUT_DIR", help="folder to write (new or empty)")
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE,
                   help=f"total ids as in config.vocab_size, {MIN_VOCAB_SIZE}..{DEFAULT_VOCAB_SIZE} (default: "
                   f"{DEFAULT_VOCAB_SIZE}, the released size); the specials keep their released ids")
    p.add_argument("--max-token-len", type=int, default=24, help="longest token in bytes (default 24)")
    p.add_argument("--rounds", type=int, default=10, help="scoreboard rounds (default 10)")
    p.add_argument("--refine-rounds", type=int, default=4,
                   help="rounds that swap rarely used tokens for better candidates (default 4)")
    p.add_argument("--max-ngram", type=int, default=8, help="longest run of current tokens scored (default 8)")
    p.add_argument("--min-freq", type=int, default=2, help="minimum occurrences of a new token (default 2)")
    p.add_argument("--max-candidates", type=int, default=4_000_000,
                   help="candidate table bound (memory: about 250 bytes an entry at its peak); pruned to its best "
                   "half beyond it, and a warning says when that may have cost better tokens (default 4,000,000)")
    p.add_argument("--sample-bytes", type=int, default=None,
                   help="read about this many bytes per round, chunks chosen by --seed (default: all)")
    p.add_argument("--seed", type=int, default=0, help="seed for --sample-bytes (default 0)")
    p.add_argument("--overwrite", action="store_true", help="allow a non-empty OUT_DIR")
    p.set_defaults(func=run)


DEMO_CORPUS = r'''
The harbour was quiet before dawn. Fishing boats rocked against the pier, their ropes creaking in
the cold wind, and a single gull walked along the railing as if it owned the whole town. By six
o'clock the first trucks arrived, the market opened its shutters, and the smell of coffee and
diesel filled the narrow streets. Nobody noticed the whale until the tide turned.

It surfaced twice near the breakwater, a long grey back and a spout of mist that hung in the air
for a moment before the wind took it. Children ran to the end of the pier. Their parents followed,
phones raised, arguing about whether it was a humpback or a minke. The harbour master, who had seen
both, said it was neither: it was a young fin whale, lost and hungry, following the herring that
had crowded into the bay that week.

"Keep the boats in," she said. "Give it room. It will find its way out when the water rises."

## Notes on the model

The spike_whale models are small decoder-only language models. They read text as bytes, group
the bytes with a Length-MAX vocabulary, and run the same stack of layers several times (a looped
decoder). A longer token means fewer steps per sentence, so the vocabulary favours long, frequent
strings such as " the ", "tion", "    return ", or "self.".

- Tokens are chosen to maximise frequency times length.
- Encoding is greedy: at each position take the longest token that matches.
- Every byte has its own token, so any input can be encoded and decoded exactly.

def greedy_segment(text, vocab, max_len=24):
    """Split text into the longest vocabulary tokens, left to right."""
    tokens = []
    i = 0
    while i < len(text):
        for length in range(min(max_len, len(text) - i), 0, -1):
            piece = text[i:i + length]
            if piece in vocab:
                tokens.append(piece)
                i += length
                break
    return tokens


class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, key, value=1):
        self.counts[key] = self.counts.get(key, 0) + value
        return self.counts[key]

    def most_common(self, n=10):
        return sorted(self.counts.items(), key=lambda kv: -kv[1])[:n]


for step in range(3):
    loss = train_one_epoch(model, loader, optimizer)
    print(f"epoch {step}: loss={loss:.4f}")
    if loss < best_loss:
        best_loss = loss
        torch.save(model.state_dict(), "best.pt")

{"role": "user", "content": "What is the capital of France?"}
{"role": "assistant", "content": "The capital of France is Paris."}
{"role": "user", "content": "And of Japan?"}
{"role": "assistant", "content": "The capital of Japan is Tokyo."}

SELECT name, count(*) AS n FROM boats WHERE harbour = 'north' GROUP BY name ORDER BY n DESC;

Weather report: winds from the north-west at 20 knots, gusting 35. Sea state moderate to rough.
Visibility good, occasionally poor in showers. Water temperature 11 degrees. High tide at 14:32,
low tide at 20:47. Small craft should remain in harbour until the wind eases in the evening.

Le port était calme avant l'aube. Les bateaux de pêche se balançaient contre la jetée.
Der Hafen war ruhig vor der Dämmerung, und die Möwen schliefen noch auf dem Dach der Halle.
El puerto estaba tranquilo antes del amanecer; nadie había visto la ballena todavía.
港は夜明け前は静かだった。クジラが湾に入ってきた。
鲸鱼在港口附近浮出水面两次，孩子们跑到码头尽头去看。
Кит всплыл дважды у волнолома. 🐋🌊 Emoji are bytes too: 👍🏽 ❤️ 🇫🇷

The whale stayed for three days. On the fourth morning the tide came in high and fast, the
herring moved out past the point, and the whale went with them. The children waited on the pier
until noon, and then they went home for lunch, and the harbour was quiet again.
'''
