"""`spike-whale eval MODEL_DIR TEXT_FILE...`: sliding-window perplexity, token- and byte-level, and bits per byte.

Each file is encoded without specials and scored in windows of `--context` positions that
start `--stride` tokens apart; every window is `<bos>` followed by its slice of the text (the model was trained
with `<bos>` before every sequence), and only the tokens no earlier window scored count in it, so each token of
the text is predicted exactly once, and after the first window with at least `context - 1 - stride` tokens of
text before it. Windows of equal length go through the model as one batch, and only the scored positions pass the
LM head (`logits_to_keep`).

token perplexity = exp(NLL / tokens), byte perplexity = exp(NLL / bytes), bits_per_byte = NLL / (bytes · ln 2),
with bytes the UTF-8 size of the text: bits per byte does not depend on the tokenizer, so it compares with
another vocabulary or with a compressor (gzip -9 and xz -9e of the same text are reported next to it).
"""

from __future__ import annotations

import json
import lzma
import math
import os
import zlib
from dataclasses import asdict, dataclass


@dataclass
class TextScore:
    """Summed negative log-likelihood (nats) of a text and its size in tokens and bytes."""

    name: str
    nll: float
    tokens: int
    bytes: int

    @property
    def token_perplexity(self) -> float:
        return math.exp(self.nll / self.tokens)

    @property
    def byte_perplexity(self) -> float:
        return math.exp(self.nll / self.bytes)

    @property
    def bits_per_byte(self) -> float:
        return self.nll / (self.bytes * math.log(2))

    def report(self) -> dict:
        return dict(asdict(self), token_perplexity=self.token_perplexity, byte_perplexity=self.byte_perplexity,
                    bits_per_byte=self.bits_per_byte)


def compressor_bits_per_byte(data: bytes) -> dict:
    """gzip -9 (zlib, deflate) and xz -9e (lzma preset 9 | extreme) of `data`, in bits per byte."""
    n = 8.0 / len(data)
    return {"gzip_bits_per_byte": len(zlib.compress(data, 9)) * n,
            "xz_bits_per_byte": len(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)) * n}


def windows(n: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored) text-token spans: the window feeds `<bos>` + text[begin:end] and scores text
    tokens first..end-1; consecutive windows start `stride` apart, and together they score each token once."""
    if context < 2:
        raise ValueError(f"--context must be >= 2 (<bos> plus one text token), got {context}")
    if not 1 <= stride <= context - 1:
        raise ValueError(f"--stride must be in 1..{context - 1} (context - 1), got {stride}")
    spans, scored, begin = [], 0, 0
    while scored < n:
        end = min(begin + context - 1, n)
        spans.append((begin, end, scored))
        scored = end
        begin += stride
    return spans


def score_ids(model, ids: list[int], context: int, stride: int, batch_size: int = 8, progress=None) -> float:
    """Summed NLL (nats) of `ids` (text tokens, no `<bos>`) under `model`, by the windows of `windows`."""
    import torch

    bos = model.config.bos_token_id
    groups: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for begin, end, first in windows(len(ids), context, stride):
        groups.setdefault((end - begin, end - first), []).append((begin, end, first))
    nll = 0.0
    with torch.no_grad():
        for (width, keep), spans in groups.items():
            for i in range(0, len(spans), batch_size):
                chunk = spans[i:i + batch_size]
                x = torch.tensor([[bos] + ids[b:e] for b, e, _ in chunk], device=model.device)
                # Position p predicts text token begin + p; the scored ones are the last `keep`.
                logits = model(input_ids=x, use_cache=False, logits_to_keep=keep + 1).logits[:, :-1].float()
                targets = torch.tensor([ids[f:e] for _, e, f in chunk], device=logits.device)
                logp = torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
                nll -= logp.sum().item()
                if progress is not None:
                    progress.update(len(chunk))
    return nll


def score_text(model, tokenizer, text: str, name: str, context: int, stride: int, batch_size: int = 8,
               progress=None) -> TextScore:
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    if not ids:
        raise ValueError(f"{name}: no text to score (empty file)")
    nll = score_ids(model, ids, context, stride, batch_size, progress)
    return TextScore(name=name, nll=nll, tokens=len(ids), bytes=len(text.encode("utf-8")))


def check_text_file(path: str, what: str = "TEXT_FILE") -> None:
    """A folder or a missing path given as a text file is reported as what it is."""
    if os.path.isdir(path):
        raise ValueError(f"{path} is a folder, not a text file: {what} must be a UTF-8 text file")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"text file {path!r} not found")


def check_json_output(args, sources) -> None:
    """Refuse, before any work, a `--json` path that is one of the inputs or an existing file (without
    `--overwrite`)."""
    from .output_paths import check_destination

    if args.json:
        check_destination(args.json, sources, overwrite=args.overwrite, kind="file", flag="--json path")


def write_json(path: str, report: dict) -> None:
    """Write the report whole or not at all (a staging file renamed over `path`), as the other writers do."""
    from .output_paths import remove_stale_temps, resolved, write_file

    remove_stale_temps(resolved(path).parent)
    write_file(path, json.dumps(report, indent=2))
    print(f"wrote {path}")


def read_texts(paths: list[str]) -> list[tuple[str, str]]:
    out = []
    for path in paths:
        check_text_file(path)
        with open(path, "rb") as handle:
            data = handle.read()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        if not text:
            raise ValueError(f"{path}: empty file, nothing to score")
        out.append((path, text))
    return out


def window_arguments(args) -> tuple[int, int]:
    """(context, stride) of the command line, checked against the folder's config.json before any loading."""
    from .generate_text import check_model_dir

    check_model_dir(args.model_dir)
    with open(os.path.join(args.model_dir, "config.json")) as handle:
        limit = json.load(handle)["max_position_embeddings"]
    context = args.context or limit
    if context > limit:
        raise ValueError(f"--context {context} exceeds the model's context window ({limit}); use at most {limit}")
    stride = args.stride or max(1, (context - 1) // 2)
    windows(0, context, stride)
    return context, stride


def run(args) -> int:
    from tqdm import tqdm

    from .generate_text import load

    texts = read_texts(args.text_files)
    context, stride = window_arguments(args)
    check_json_output(args, [args.model_dir, *args.text_files])
    tokenizer, model = load(args)
    encoded = [(name, text, tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
               for name, text in texts]
    total_windows = sum(len(windows(len(ids), context, stride)) for _, _, ids in encoded)
    scores = []
    with tqdm(total=total_windows, unit="window", desc="eval", disable=args.quiet) as bar:
        for name, text, ids in encoded:
            nll = score_ids(model, ids, context, stride, args.batch_size, bar)
            scores.append(TextScore(name=name, nll=nll, tokens=len(ids), bytes=len(text.encode("utf-8"))))
    total = TextScore(name="total", nll=sum(s.nll for s in scores), tokens=sum(s.tokens for s in scores),
                      bytes=sum(s.bytes for s in scores))
    compressors = compressor_bits_per_byte(b"".join(t.encode("utf-8") for _, t in texts))
    print(f"{'file':<40} {'tokens':>9} {'bytes':>10} {'token ppl':>10} {'byte ppl':>9} {'bits_per_byte':>13}")
    for s in scores + ([total] if len(scores) > 1 else []):
        print(f"{s.name[-40:]:<40} {s.tokens:>9,} {s.bytes:>10,} {s.token_perplexity:>10.3f} "
              f"{s.byte_perplexity:>9.4f} {s.bits_per_byte:>13.4f}")
    print(f"same text: gzip -9 {compressors['gzip_bits_per_byte']:.4f} bits/byte, "
          f"xz -9e {compressors['xz_bits_per_byte']:.4f} bits/byte (context {context}, stride {stride})")
    if args.json:
        report = {"model": args.model_dir, "context": context, "stride": stride, "dtype": args.dtype,
                  "files": [s.report() for s in scores], "total": total.report(), **compressors}
        write_json(args.json, report)
    return 0


def register(sub) -> None:
    from .generate_text import DTYPE_NAMES, positive_int

    p = sub.add_parser(
        "eval",
        help="perplexity and bits per byte of text files (sliding window)",
        description=__doc__.split("\n\n", 1)[1].strip(),
    )
    p.add_argument("model_dir")
    p.add_argument("text_files", nargs="+", metavar="TEXT_FILE", help="UTF-8 text files")
    p.add_argument("--context", type=positive_int, default=None,
                   help="window length in positions, <bos> included (default: the model's context window)")
    p.add_argument("--stride", type=positive_int, default=None,
                   help="tokens between window starts (default: half the window)")
    p.add_argument("--batch-size", type=positive_int, default=8, help="windows per forward")
    p.add_argument("--json", help="write the report (per file and total) to this JSON file")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --json file")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="fp32")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
