"""The committed default model (models/spike-whale-demo): it loads as shipped, it has learned English (held-out
bits per byte well below xz of the same text), its card matches its files, and diagnose runs on it."""

from __future__ import annotations

import hashlib
import json
import lzma
import math
import os
import zlib

import pytest
import torch

from _tiny_folder import load_folder
from spike_whale.hub_export import cli
from spike_whale.hub_export.perplexity import score_ids

FOLDER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "spike-whale-demo")
ROOT = os.path.dirname(os.path.dirname(FOLDER))


def demo_prompt() -> str:
    """The prompt scripts/demo.sh gives the model."""
    import re

    script = open(os.path.join(ROOT, "scripts", "demo.sh"), encoding="utf-8").read()
    return re.search(r'PROMPT:-([^}]*)\}', script).group(1)


DEMO_PROMPT = demo_prompt()


@pytest.fixture(scope="module")
def loaded():
    return load_folder(FOLDER)


def test_folder_is_complete_and_small():
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "spike_vocab.json",
                 "tokenizer_config.json", "chat_template.jinja", "modeling_spike_whale.py", "README.md",
                 "heldout.txt", "training_record.json"):
        assert os.path.isfile(os.path.join(FOLDER, name)), name
    assert sum(os.path.getsize(os.path.join(FOLDER, f)) for f in os.listdir(FOLDER)) <= 60 * 10**6


def test_card_states_the_held_out_hash_and_figures():
    record = json.load(open(os.path.join(FOLDER, "training_record.json")))
    held = open(os.path.join(FOLDER, "heldout.txt"), "rb").read()
    assert hashlib.sha256(held).hexdigest() == record["heldout_sha256"]
    card = open(os.path.join(FOLDER, "README.md"), encoding="utf-8").read()
    facts = [*record["corpus_sha256"].values(), record["manifest_sha256"], record["vocab_sha256"],
             record["heldout_sha256"], "bits per byte", "gzip", "xz -9e", "public domain"]
    for fact in facts:
        assert fact in card, fact
    for command in record["commands"]:
        assert command.replace("/root/.cache/spike-whale/", "~/.cache/spike-whale/") in card, command


def test_every_mechanism_is_on(loaded):
    c = loaded[1].config
    assert c.loop_count > 1 and c.use_memory_cache and c.use_engram and c.use_hyper_connections
    assert c.use_depth_attention and c.use_fractal_rope and c.use_hrm_refine and c.use_xsa and c.use_qk_norm
    assert c.num_nextn_predict_layers >= 1
    assert 5e6 < sum(p.numel() for p in loaded[1].parameters()) < 30e6


def test_held_out_bits_per_byte_well_below_xz(loaded):
    """The head of the validation split (never trained on), 8,000 characters: clearly below both compressors of the
    same text (the card: 0.84x xz -9e there)."""
    tokenizer, model = loaded
    text = open(os.path.join(FOLDER, "heldout.txt"), encoding="utf-8").read()[:8000]
    data = text.encode("utf-8")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    bpb = score_ids(model, ids, context=512, stride=256) / len(data) / math.log(2)
    gzip_bpb = len(zlib.compress(data, 9)) * 8 / len(data)
    xz_bpb = len(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)) * 8 / len(data)
    assert bpb < 0.9 * xz_bpb and bpb < 0.9 * gzip_bpb, (bpb, gzip_bpb, xz_bpb)


def test_generates_words_from_the_corpus(loaded):
    tokenizer, model = loaded
    enc = tokenizer(DEMO_PROMPT, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, do_sample=False, max_new_tokens=30)
    text = tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    words = [w.strip(".,;:()\"'") for w in text.split()]
    corpus = {w.strip(".,;:()\"'").lower() for w in open(os.path.join(FOLDER, "heldout.txt"), encoding="utf-8").read().split()}
    known = sum(1 for w in words if w and w.lower() in corpus)  # English words of the held-out text
    assert len(words) >= 4 and known >= 0.8 * len(words), text


def test_diagnose_tables_on_the_default_model(tmp_path, capsys):
    report = tmp_path / "diag.json"
    assert cli.main(["diagnose", FOLDER, "--max-tokens", "300", "--json", str(report), "--quiet"]) == 0
    out = capsys.readouterr().out
    for title in ("Memory-Cache knock-out", "RoPE swap", "Loop-pass contribution", "Context readiness"):
        assert title in out
    r = json.loads(report.read_text())
    assert len(r["mc_knockout"]) == 2 + r["loop_passes"][-1]["slots"]
    assert r["loop_passes"][-1]["perplexity"] == pytest.approx(r["mc_knockout"][0]["perplexity"])
    assert all(row["ok"] for row in r["context_readiness"])
    # The trained model uses its loop passes: the loop table moves (the Memory-Cache effect, +0.5% perplexity on
    # 2,048 tokens in the card, is within the noise of 300).
    loops = [row["perplexity"] for row in r["loop_passes"]]
    assert loops[0] > 1.01 * loops[-1], loops


def test_code_files_are_the_repository_files():
    """The folder's code files are links to the root files, so trust_remote_code runs the current code."""
    root = os.path.dirname(os.path.dirname(FOLDER))
    code = [f for f in os.listdir(FOLDER) if f.endswith(".py")]
    assert "modeling_spike_whale.py" in code and "configuration_spike_whale.py" in code
    for f in code:
        assert os.path.realpath(os.path.join(FOLDER, f)) == os.path.realpath(os.path.join(root, f)), f


def test_training_is_deterministic_and_resumable(tmp_path):
    """train_default: the same command and seed give the same weights (the schedule follows steps, never wall time),
    and a run stopped at a step continues with --resume to the end of its schedule, listing both commands."""
    from spike_whale.hub_export import train_default
    from spike_whale.hub_export.train_tokenizer import DEMO_CORPUS
    from safetensors.torch import load_file

    sentences = [s.strip() for s in " ".join(DEMO_CORPUS.split()).split(". ") if len(s.split()) >= 8]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(sentences * 3) + "\n", encoding="utf-8")
    common = ["--corpus", str(corpus), "--vocab-size", "420", "--seq-len", "16", "--batch-size", "2",
              "--max-steps", "3", "--warmup-steps", "1", "--eval-every", "2", "--log-every", "1"]
    runs = [tmp_path / "a", tmp_path / "b"]
    for out in runs:
        assert train_default.main([str(out)] + common) == 0
    a, b = (load_file(out / "model.safetensors") for out in runs)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    resumed = tmp_path / "resumed"
    assert train_default.main([str(resumed)] + common + ["--stop-at-step", "2"]) == 0
    first = json.load(open(resumed / "training_record.json"))
    assert first["steps"] == 2 and first["stopped_by"].startswith("stop_at_step")
    # --time-budget-min counts the whole run: one spent already is refused before the record lists the command.
    with pytest.raises(SystemExit, match="--time-budget-min 1e-09 is spent already"):
        train_default.main([str(resumed)] + common + ["--resume", "--time-budget-min", "1e-9"])
    assert len(json.load(open(resumed / "training" / "commands.json"))) == 1
    assert train_default.main([str(resumed)] + common + ["--resume"]) == 0
    record = json.load(open(resumed / "training_record.json"))
    assert record["steps"] == 3 and record["stopped_by"] == "max_steps" and len(record["commands"]) == 2
    log = (resumed / "training_log.txt").read_text()
    assert "held-out" in log and "resumed at step 2" in log
    assert torch.load(resumed / "training" / "checkpoint.pt", weights_only=False)["step"] == 3  # the last step's


def test_training_from_a_corpus_folder_with_a_given_vocabulary(tmp_path):
    """The default model's route: a scripts/build_corpus.py folder (train.txt trained on, the head of validation.txt
    as heldout.txt, test.txt never read), a train-tokenizer folder's vocabulary, the wsd schedule (constant until the
    last --decay-fraction of the steps, so its first steps do not depend on --max-steps); the record holds the
    splits' and the vocabulary's hashes."""
    import argparse

    from spike_whale.hub_export import train_default
    from spike_whale.hub_export.train_tokenizer import DEMO_CORPUS, build_demo_tokenizer
    from spike_whale.tokenization_spike import dump_vocab_data

    corpus, vocab = tmp_path / "corpus", tmp_path / "vocab"
    corpus.mkdir()
    vocab.mkdir()
    text = " ".join(DEMO_CORPUS.split())
    (corpus / "train.txt").write_text(text * 2, encoding="utf-8")
    (corpus / "validation.txt").write_text(text[:2000], encoding="utf-8")
    splits = {name: {"sha256": name * 4} for name in ("train", "validation", "test")}
    (corpus / "manifest.json").write_text(json.dumps({"splits": splits}))
    (vocab / "spike_vocab.json").write_text(dump_vocab_data(build_demo_tokenizer().vocab_data), encoding="utf-8")
    out = tmp_path / "run"
    argv = [str(out), "--corpus", str(corpus), "--tokenizer", str(vocab), "--seq-len", "16", "--batch-size", "2",
            "--max-steps", "2", "--warmup-steps", "1", "--schedule", "wsd", "--log-every", "1"]
    assert train_default.main(argv) == 0
    record = json.load(open(out / "training_record.json"))
    assert record["corpus_sha256"] == {k: v["sha256"] for k, v in splits.items()}
    assert record["vocab_sha256"] == hashlib.sha256((vocab / "spike_vocab.json").read_bytes()).hexdigest()
    assert (out / "heldout.txt").read_text(encoding="utf-8") == text[:2000]
    assert not (out / "training" / "spike_vocab.json").exists()  # the given vocabulary, not one trained here
    short, long = (argparse.Namespace(lr=1.0, min_lr=0.1, warmup_steps=10, schedule="wsd", decay_fraction=0.25,
                                      max_steps=n) for n in (100, 200))
    assert [train_default.lr_at(i, short) for i in range(75)] == [train_default.lr_at(i, long) for i in range(75)]
    assert train_default.lr_at(99, short) < train_default.lr_at(74, short) == 1.0
    again = argparse.Namespace(**{**vars(long), "rewarm_at": 100})  # a second stage after a 100-step run's decay
    assert [train_default.lr_at(i, again) for i in range(100)] == [train_default.lr_at(i, long) for i in range(100)]
    assert [train_default.lr_at(100 + i, again) for i in range(100)] == [train_default.lr_at(i, short) for i in range(100)]


def test_mtp_self_distillation_trains_only_the_mtp_heads(tmp_path, capsys):
    """--mtp-distill-from DIR --mtp-distill-steps N: a folder whose tensors are DIR's except the MTP heads', trained
    on the model's greedy continuations; the record keeps DIR's commands and LM figures and adds this stage's."""
    from spike_whale.hub_export import train_default
    from spike_whale.hub_export.train_tokenizer import DEMO_CORPUS
    from safetensors.torch import load_file

    sentences = [s.strip() for s in " ".join(DEMO_CORPUS.split()).split(". ") if len(s.split()) >= 8]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(sentences * 3) + "\n", encoding="utf-8")
    common = ["--corpus", str(corpus), "--seq-len", "16", "--batch-size", "2", "--log-every", "1"]
    lm, mtp = tmp_path / "lm", tmp_path / "mtp"
    assert train_default.main([str(lm), "--vocab-size", "420", "--max-steps", "2", "--warmup-steps", "1"] + common) == 0
    distill = [str(mtp), "--mtp-distill-from", str(lm), "--mtp-distill-steps", "3", "--mtp-distill-prompts", "4"]
    assert train_default.main(distill + common) == 0
    a, b = load_file(lm / "model.safetensors"), load_file(mtp / "model.safetensors")
    assert a.keys() == b.keys()
    changed = {k for k in a if not torch.equal(a[k], b[k])}
    assert changed == {k for k in a if k.startswith("mtp_heads.")} and changed, changed
    first, record = (json.load(open(d / "training_record.json")) for d in (lm, mtp))
    assert record["commands"][:-1] == first["commands"] and "--mtp-distill-from" in record["commands"][-1]
    assert record["final_held_out_loss"] == first["final_held_out_loss"] and record["steps"] == 2
    assert record["mtp_self_distillation"]["steps"] == 3
    assert "MTP self-distillation" in (mtp / "training_log.txt").read_text()
    with pytest.raises(SystemExit):
        train_default.main([str(tmp_path / "x"), "--mtp-distill-from", str(lm)] + common)
    assert "--mtp-distill-from needs --mtp-distill-steps" in capsys.readouterr().err


def test_train_default_never_writes_over_a_users_files(tmp_path, capsys):
    """train_default refuses, before any work, an OUT_DIR holding the corpus, an earlier run's folder without
    --overwrite or --resume, and a folder with files it does not write even with --overwrite."""
    from spike_whale.hub_export import train_default

    corpus = tmp_path / "mine" / "corpus.txt"
    corpus.parent.mkdir()
    corpus.write_text("some text\n", encoding="utf-8")
    earlier = tmp_path / "run"
    (earlier / "training").mkdir(parents=True)
    (earlier / "training_log.txt").write_text("step 1\n")
    cases = [
        ([str(corpus.parent)], "source"),
        ([str(earlier)], "--overwrite"),
        ([str(corpus.parent), "--overwrite"], "source"),
    ]
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me\n")
    cases.append(([str(tmp_path / "notes"), "--overwrite"], "todo.txt"))
    for argv, says in cases:
        with pytest.raises(SystemExit):
            train_default.main(argv + ["--corpus", str(corpus)])
        assert says in capsys.readouterr().err
    assert corpus.read_text() == "some text\n" and (tmp_path / "notes" / "todo.txt").read_text() == "keep me\n"
    assert (earlier / "training_log.txt").read_text() == "step 1\n"
