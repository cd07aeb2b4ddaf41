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

* Streaming: files and globs are read in chunks of `chunk_bytes` (any size of corpus); memory is bounded by
  the candidate table, which is pruned to its best half whenever it exceeds `max_candidates` entries.
* Deterministic: same corpus, options and seed give the same vocabulary (ties are broken by the token bytes;
  the seed only chooses which chunks a round reads when `sample_bytes` limits it: chunks are then at most
  `sample_bytes`, and a round whose draw skipped every chunk reads one).
* No token is part of one character and another (b"d \xe2\x80"): the fast tokenizer's added-token matcher cannot
  find such a token, so one would put the whole vocab on its slower piece pipeline.
* A vocab that falls short of `vocab_size` (too little text read) warns, naming the count and the round that ran dry.
* Layout (the released one): ids 0..3 ``<pad> <unk> <bos> <eos>``, byte b at b + 4, multi-byte tokens from
  260 in order of selection, the 17 chat/tool/FIM specials at 16384..16400 and 111 reserved ids up to 16511.
  ``vocab_size`` counts all of them, as the model's ``config.vocab_size`` does: the released 16,512 gives
  16,124 multi-byte tokens.  A smaller size learns ``vocab_size − 388`` multi-byte tokens (ids 260 ..
  vocab_size − 129) and leaves the rest of 260..16383 unused; the specials and reserved ids never move, so
  every trained vocabulary fits a model with ``vocab_size = 16512``.  Larger sizes are refused.
"""

from __future__ import annotations

import glob
import heapq
import math
import os
import random
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from itertools import compress
from operator import add
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


class CandidateTable:
    """The scoreboard of one round: for each run length n, byte string -> occurrences; bounded in entries.

    ``score(s) = Σ_n (n − 1) · count_n(s)`` (the tokens `s` would save), ``freq(s) = Σ_n count_n(s)``.
    """

    def __init__(self, max_candidates: int):
        self.max_candidates = max_candidates
        self.counts: dict[int, Counter] = {}

    def add_segmentation(self, seg: list[str], max_ngram: int, max_token_len: int) -> None:
        """Count every run of n = 2..max_ngram consecutive tokens of `seg` that fits in max_token_len bytes."""
        fits = max_token_len.__ge__
        runs = seg
        for n in range(2, max_ngram + 1):
            runs = list(map(add, runs[:-1], seg[n - 1:]))
            fitting = list(compress(runs, map(fits, map(len, runs))))  # all in C: this loop is the hot path
            if not fitting:
                break
            self.counts.setdefault(n, Counter()).update(fitting)
        if sum(map(len, self.counts.values())) > self.max_candidates:
            self.prune()

    def scores(self) -> tuple[Counter, Counter]:
        score, freq = Counter(), Counter()
        for n, counts in self.counts.items():
            freq.update(counts)
            if n == 2:
                score.update(counts)
            else:
                for piece, c in counts.items():
                    score[piece] += (n - 1) * c
        return score, freq

    def prune(self) -> None:
        """Keep the best-scoring half of `max_candidates` strings (deterministic: ties by the bytes)."""
        score, _ = self.scores()
        keep = {p for p, _ in heapq.nsmallest(self.max_candidates // 2, score.items(), key=_rank)}
        self.counts = {n: Counter({p: c for p, c in counts.items() if p in keep}) for n, counts in self.counts.items()}

    def best(self, count: int, exclude: set[str], min_freq: int) -> list[tuple[str, int]]:
        """The `count` best (string, score) pairs not in `exclude`, best first.

        A string inside one already chosen from this table is taken only if it occurs at least twice as often
        (otherwise most of its score comes from inside the longer token, which greedy matching will prefer).
        """
        # Never a token across a character boundary (b"d \xe2\x80"): the fast tokenizer's added-token matcher, what
        # makes it fast, can only find tokens that are text or lie inside one character.
        from ..tokenization_spike_fast import crossing_tokens

        score, freq = self.scores()
        eligible = ((p, s) for p, s in score.items()
                    if freq[p] >= min_freq and p not in exclude and (p.isascii() or not crossing_tokens([p])))
        chosen: list[tuple[str, int]] = []
        for piece, value in heapq.nsmallest(3 * count, eligible, key=_rank):
            if any(piece in longer and freq[piece] < 2 * freq[longer] for longer, _ in chosen):
                continue
            chosen.append((piece, value))
            if len(chosen) == count:
                break
        return chosen


def _rank(item: tuple[str, int]) -> tuple[int, str]:
    return -item[1], item[0]



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
) -> dict:
    """Train a vocab in the released file format.

    `chunks(round)` returns an iterable of corpus chunks as latin-1 strings (one character per byte); it is
    called once per round, so the corpus is streamed, never held.  `progress(round)` may return a context
    manager with an ``update(n_chars)`` method (a tqdm bar).
    """
    from ..tokenization_spike import compile_greedy_regex

    _check_options(vocab_size, max_token_len, rounds, max_ngram, min_freq, max_candidates)
    if refine_rounds < 0:
        raise ValueError(f"refine_rounds must be >= 0, got {refine_rounds}")
    lay = _layout()
    capacity = vocab_size - NUM_FIXED_IDS
    forbidden = set(lay["BASE_SPECIAL_TOKENS"]) | set(lay["SPECIAL_TOKENS"]) | set(lay["RESERVED_TOKENS"])
    known = {chr(b) for b in range(256)}
    selected: list[str] = []

    def scan(round_idx: int) -> tuple[CandidateTable, Counter, int]:
        """Segment the corpus with the current vocab: the candidate table, how often each token is used and the
        number of bytes read."""
        findall = compile_greedy_regex(known).findall
        table, usage, n_read = CandidateTable(max_candidates), Counter(), 0
        bar = progress(round_idx) if progress else None
        for chunk in chunks(round_idx):
            seg = findall(chunk)
            table.add_segmentation(seg, max_ngram, max_token_len)
            usage.update(seg)
            n_read += len(chunk)
            if bar is not None:
                bar.update(len(chunk))
        if bar is not None:
            bar.close()
        return table, usage, n_read

    shortfall = None
    for round_idx in range(rounds):
        remaining = capacity - len(selected)
        if remaining <= 0:
            break
        table, _, n_read = scan(round_idx)
        take = math.ceil(remaining / (rounds - round_idx))
        ranked = [piece for piece, _ in table.best(take, known | forbidden, min_freq)]
        if len(ranked) < take:
            shortfall = (f"round {round_idx + 1} of {rounds} read {n_read:,} bytes and found {len(ranked):,} new "
                         f"strings occurring at least min_freq={min_freq} times where it needed {take:,} (a small "
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
        table, usage, _ = scan(rounds + refine_idx)
        weakest = sorted(selected, key=lambda t: (usage[t], t))[: max(1, len(selected) // 10)]
        fresh = table.best(len(weakest), known | forbidden, min_freq)
        swaps = 0
        while swaps < min(len(weakest), len(fresh)) and fresh[swaps][1] > 2 * usage[weakest[swaps]]:
            swaps += 1
        if swaps == 0:
            break
        dropped = set(weakest[:swaps])
        selected = [t for t in selected if t not in dropped] + [piece for piece, _ in fresh[:swaps]]
        known = (known - dropped) | {piece for piece, _ in fresh[:swaps]}

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

    return train_lengthmax_vocab(chunks, vocab_size, progress=progress, **options)


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
                   help="candidate table bound (memory); pruned to its best half beyond it (default 4,000,000)")
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
