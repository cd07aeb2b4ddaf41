"""scripts/build_corpus.py's pure steps (dedup, split, held-out refusal, manifest) on a tiny fake source tree."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "build_corpus.py"


@pytest.fixture(scope="module")
def bc():
    spec = importlib.util.spec_from_file_location("build_corpus", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["build_corpus"] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("build_corpus", None)


def prose(seed: int, n_words: int = 120) -> str:
    """Deterministic English-looking text, different for every seed."""
    vocab = ("the river ran under old stone bridges while lanterns burned in narrow windows and merchants "
             "argued about grain wool salt iron timber ships weather tides letters debts marriages").split()
    words = []
    h = seed
    for i in range(n_words):
        h = int.from_bytes(hashlib.sha256(f"{h}:{i}".encode()).digest()[:8], "big")
        words.append(vocab[h % len(vocab)])
    return " ".join(words) + "."


def fake_tree(root: Path) -> None:
    """Two packages' worth of text files: 'alpha' and 'beta', where beta repeats some of alpha."""
    (root / "alpha").mkdir(parents=True)
    (root / "beta").mkdir(parents=True)
    for i in range(40):
        (root / "alpha" / f"doc{i:02d}.txt").write_text(f"{prose(i)}\n\n{prose(1000 + i)}\n", encoding="utf-8")
    # beta: an exact copy, a reformatted copy (case, punctuation, line breaks), a near copy with one changed
    # word, a document sharing one paragraph with alpha, and fresh ones.
    (root / "beta" / "copy.txt").write_text((root / "alpha" / "doc03.txt").read_text(), encoding="utf-8")
    reformatted = (root / "alpha" / "doc04.txt").read_text().upper().replace(" ", "\n").replace(".", "!")
    (root / "beta" / "reformatted.txt").write_text(reformatted, encoding="utf-8")
    near = prose(5).replace("river", "stream", 1) + "\n\n" + prose(1005)
    (root / "beta" / "near.txt").write_text(near, encoding="utf-8")
    (root / "beta" / "shared_par.txt").write_text(f"{prose(6)}\n\n{prose(77777)}\n", encoding="utf-8")
    for i in range(20):
        (root / "beta" / f"fresh{i:02d}.txt").write_text(prose(5000 + i), encoding="utf-8")


def dir_extractor(bc, folder: Path):
    def extract(src, cache):
        for p in sorted(folder.glob("*.txt")):
            yield bc.Document(src.name, p.name, bc.clean_text(p.read_text(encoding="utf-8")))
    return extract


def fake_sources(bc, root: Path):
    return [bc.Source(name, "deb", "1.0", "public-domain", "", "", dir_extractor(bc, root / name))
            for name in ("alpha", "beta")]


def run_build(bc, tmp_path: Path, out_name: str = "out", held_out: dict | None = None):
    root = tmp_path / "tree"
    if not root.exists():
        fake_tree(root)
    sources = fake_sources(bc, root)
    held = held_out if held_out is not None else {"gpl": prose(424242, 300)}
    docs = bc.all_documents(sources, tmp_path)
    return bc.build(docs, sources, held, tmp_path / out_name, compress=False), tmp_path / out_name


def test_dedup_drops_exact_reformatted_and_near_copies(bc, tmp_path):
    manifest, out = run_build(bc, tmp_path)
    alpha, beta = manifest["sources"]
    assert alpha["documents_out"] == 40 and alpha["exact_duplicate_documents"] == 0
    # copy.txt and reformatted.txt normalise to an alpha document; near.txt shares almost all its shingles.
    assert beta["exact_duplicate_documents"] == 2
    assert beta["near_duplicate_documents"] == 1
    assert beta["duplicate_paragraphs"] == 1  # shared_par.txt keeps only its own paragraph
    assert beta["documents_out"] == 21
    index = (out / "documents.tsv").read_text().splitlines()[1:]
    kept = {tuple(r.split("\t")[:2]) for r in index}
    assert ("beta", "copy.txt") not in kept and ("beta", "near.txt") not in kept and ("beta", "shared_par.txt") in kept
    corpus = "".join((out / f"{s}.txt").read_text() for s in bc.SPLITS)
    assert corpus.count(prose(6)) == 1 and prose(77777) in corpus
    assert beta["bytes_out"] < beta["bytes_in"]


def test_splits_are_disjoint_by_document_and_deterministic(bc, tmp_path):
    manifest, out = run_build(bc, tmp_path, "a")
    again, out2 = run_build(bc, tmp_path, "b")
    rows = [r.split("\t") for r in (out / "documents.tsv").read_text().splitlines()[1:]]
    splits_of = {}
    for source, doc, group, split, n in rows:
        splits_of.setdefault((source, doc), set()).add(split)
        assert split == bc.split_of(group)
    assert all(len(s) == 1 for s in splits_of.values())
    # every kept document's text lies whole in exactly its own split's file
    texts = {s: (out / f"{s}.txt").read_text() for s in bc.SPLITS}
    for p in sorted((tmp_path / "tree" / "beta").glob("fresh*.txt")):
        body = p.read_text()
        assert [s for s in bc.SPLITS if body in texts[s]] == list(splits_of[("beta", p.name)])
    for s in bc.SPLITS:
        assert manifest["splits"][s]["sha256"] == again["splits"][s]["sha256"]
        assert manifest["splits"][s]["sha256"] == hashlib.sha256((out2 / f"{s}.txt").read_bytes()).hexdigest()
    assert sum(manifest["splits"][s]["documents"] for s in bc.SPLITS) == 61
    assert manifest["total_bytes"] == sum(manifest["splits"][s]["bytes"] for s in bc.SPLITS)


def test_groups_share_a_split(bc):
    groups = [bc.chapter_group(book, 3) for book in ("I Samuel", "1 Samuel", "1Samuel")]
    assert len(set(groups)) == 1
    for i in range(200):
        a = bc.Document("kjv", f"Genesis {i}", "x", bc.chapter_group("Genesis", i))
        b = bc.Document("web", f"Genesis {i}", "y", bc.chapter_group("Genesis", i))
        assert bc.split_of(a.group) == bc.split_of(b.group)
    counts = {s: 0 for s in bc.SPLITS}
    for i in range(4000):
        counts[bc.split_of(f"g{i}")] += 1
    assert 120 < counts["validation"] < 290 and 120 < counts["test"] < 290


def test_held_out_sources_and_copies_are_refused(bc, tmp_path):
    sources = fake_sources(bc, tmp_path)
    with pytest.raises(ValueError, match="held out"):
        bc.check_not_held_out(sources, [bc.HeldOut("beta", "deb", "1", "GPL-3", lambda cache: "")])
    # the shipped configuration itself keeps its held-out texts out of its sources
    bc.check_not_held_out(bc.SOURCES, bc.HELD_OUT)
    assert {"gpl-3", "dict-gcide"} <= {h.name for h in bc.HELD_OUT}
    # a package that ships a copy of a held-out text, or one of its paragraphs, contributes neither
    fake_tree(tmp_path / "tree")
    held_text = (tmp_path / "tree" / "alpha" / "doc07.txt").read_text()
    held_par = prose(90002)
    long_doc = "\n\n".join(prose(i) for i in (90001, 90002, 90003))
    (tmp_path / "tree" / "alpha" / "long.txt").write_text(long_doc, encoding="utf-8")
    manifest, out = run_build(bc, tmp_path, held_out={"licence": held_text, "dictionary": held_par})
    alpha = manifest["sources"][0]
    assert alpha["held_out_copies"] == 1 and alpha["duplicate_paragraphs"] == 1
    corpus = "".join((out / f"{s}.txt").read_text() for s in bc.SPLITS)
    assert held_par not in corpus and prose(7) not in corpus and prose(90001) in corpus
    assert (out / "heldout" / "licence.txt").read_text() == held_text
    assert set(manifest["held_out"]) == {"licence", "dictionary"}


def test_manifest_lists_sources_and_bits_per_byte(bc, tmp_path):
    root = tmp_path / "tree"
    fake_tree(root)
    sources = fake_sources(bc, root)
    manifest = bc.build(bc.all_documents(sources, tmp_path), sources, {"gpl": prose(9, 400)}, tmp_path / "o",
                        {"gpl": {"licence": "GPL-3"}}, compress=True,
                        source_meta={"alpha": {"licence_file": "alpha/copyright"}})
    on_disk = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert on_disk == manifest
    assert [s["name"] for s in manifest["sources"]] == ["alpha", "beta"]
    for s in manifest["sources"]:
        assert s["version"] == "1.0" and s["licence"] == "public-domain"
        assert sum(s["split_bytes"].values()) == s["bytes_out"]
    for entry in [manifest["splits"]["validation"], manifest["splits"]["test"], manifest["held_out"]["gpl"]]:
        if entry["bytes"]:
            assert set(entry["bits_per_byte"]) == {"xz -9e", "bzip2 -9", "gzip -9"}
            assert all(0 < v < 8 for v in entry["bits_per_byte"].values())
    assert "bits_per_byte" not in manifest["splits"]["train"]
    assert manifest["held_out"]["gpl"]["licence"] == "GPL-3"
    assert manifest["sources"][0]["licence_file"] == "alpha/copyright" and "licence_file" not in manifest["sources"][1]
    table = bc.format_table(manifest)
    assert "alpha" in table and "total" in table


def test_text_readers(bc):
    page = ("<html><head><title>T</title><script>x()</script></head><body><div class='sphinxsidebar'>Nav</div>"
            "<h1>Title<a class='headerlink'>¶</a></h1><p>One &amp; two<br>three</p><pre>  a = 1\n  b = 2</pre>"
            "<img src=x><p>End</p></body></html>")
    assert bc.html_to_text(page) == "Title\n\nOne & two\nthree\n\n  a = 1\n  b = 2\n\nEnd"
    osis = ('<w lemma="strong:H0430">In</w> <w>the</w> beginning, God<note placement="foot">A note.</note>'
            '<w>created</w> the heavens<note>n</note>.')
    assert bc.osis_to_text(osis) == "In the beginning, God created the heavens."
    dump = ("$$$[ Module Heading ]\n\n$$$Genesis 0:0\n<title>The First Book of Moses</title>\n$$$Genesis 1:1\n"
            "In the beginning.\n$$$Genesis 1:2\nVoid.\n$$$Genesis 2:1\nDone.")
    docs = list(bc.sword_chapters("web", dump, heading=True))
    assert [(d.doc_id, d.group, d.text) for d in docs] == [
        ("Genesis 1", "bible:genesis:1", "The First Book of Moses\nGenesis 1\n\nIn the beginning.\nVoid."),
        ("Genesis 2", "bible:genesis:2", "Genesis 2\n\nDone."),
    ]
    index = "00-database-info\tA\tF\nzebra\tF\tF\napple\tK\tF\n"
    data = b"12345zebraapple"
    assert list(bc.dictd_entries(index, data)) == [("zebra", "zebra"), ("apple", "apple")]
    assert [d.doc_id for d in bc.by_initial("d", bc.dictd_entries(index, data))] == ["entries a", "entries z"]
