"""`spike-whale eval`: sliding-window perplexity against a hand computation, token by token."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from _tiny_folder import load_folder, write_tiny_folder
from spike_whale.hub_export import cli
from spike_whale.hub_export.perplexity import windows

TEXT = "The harbour was quiet before dawn. Nobody noticed the whale until the tide turned.\n"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_folder(tmp_path_factory.mktemp("eval") / "tiny")


@pytest.mark.parametrize("n,context,stride", [(10, 5, 2), (10, 5, 4), (7, 20, 3), (1, 2, 1), (33, 9, 5)])
def test_windows_score_every_token_once(n, context, stride):
    scored = []
    for begin, end, first in windows(n, context, stride):
        assert end - begin <= context - 1 and begin <= first < end
        scored += range(first, end)
    assert scored == list(range(n))


def hand_nll(model, ids, context, stride):
    """Each text token i scored from its own forward of <bos> + text[begin:i], where begin is the start of the
    first window (starts 0, stride, 2·stride, ...; context - 1 text tokens each) that reaches i."""
    bos, nll = model.config.bos_token_id, 0.0
    for i, target in enumerate(ids):
        begin = next(b for b in range(0, len(ids), stride) if b + context - 1 > i)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([[bos] + ids[begin:i]]), use_cache=False).logits[0, -1]
        nll -= torch.log_softmax(logits.double(), -1)[target].item()
    return nll


@pytest.mark.parametrize("context,stride", [(9, 4), (9, 8), (200, 100)])
def test_eval_equals_hand_computed_perplexity(folder, tmp_path, capsys, context, stride):
    text_file = tmp_path / "text.txt"
    text_file.write_text(TEXT, encoding="utf-8")
    report_file = tmp_path / "report.json"
    assert cli.main(["eval", folder, str(text_file), "--context", str(context), "--stride", str(stride),
                     "--json", str(report_file), "--quiet"]) == 0
    report = json.loads(report_file.read_text())["files"][0]
    tokenizer, model = load_folder(folder)
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    if context > len(ids):  # one window: the plain cross-entropy of one forward over <bos> + text
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([[model.config.bos_token_id] + ids]), use_cache=False).logits
        expected = torch.nn.functional.cross_entropy(logits[0, :-1].double(), torch.tensor(ids),
                                                     reduction="sum").item()
    else:
        expected = hand_nll(model, ids, context, stride)
    n_bytes = len(TEXT.encode("utf-8"))
    assert report["tokens"] == len(ids) and report["bytes"] == n_bytes
    assert report["nll"] == pytest.approx(expected, rel=1e-4)
    assert report["token_perplexity"] == pytest.approx(math.exp(expected / len(ids)), rel=1e-4)
    assert report["bits_per_byte"] == pytest.approx(expected / n_bytes / math.log(2), rel=1e-4)
    assert "bits_per_byte" in capsys.readouterr().out


@pytest.mark.parametrize("args,message", [
    (["missing.txt"], "not found"),
    (["text.txt", "--context", "9", "--stride", "9"], "--stride must be in 1..8"),
    (["text.txt", "--context", "100000"], "exceeds the model's context window"),
    (["empty.txt"], "empty file"),
    (["a_folder"], "a_folder is a folder, not a text file"),
])
def test_eval_bad_input_is_one_line(folder, tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "text.txt").write_text(TEXT)
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "a_folder").mkdir()
    assert cli.main(["eval", folder, *args, "--quiet"]) == 1
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_lm_eval_task_files_are_written_from_held_out_text(tmp_path):
    from spike_whale.hub_export.lm_eval_tasks import write_tasks
    from spike_whale.hub_export.train_tokenizer import DEMO_CORPUS

    heldout = tmp_path / "heldout.txt"
    heldout.write_text(DEMO_CORPUS)
    paths = write_tasks(str(heldout), str(tmp_path / "tasks"), n_docs=4, n_cloze=5)
    assert sorted(os.path.basename(p) for p in paths) == [
        "spike_whale_cloze.yaml", "spike_whale_cloze_gen.yaml", "spike_whale_heldout.yaml"]
    items = [json.loads(line) for line in (tmp_path / "tasks" / "cloze.jsonl").read_text().splitlines()]
    assert 0 < len(items) <= 5
    for item in items:
        assert item["choices"][item["label"]] == item["answer"] and len(set(item["choices"])) == 4
        assert (item["context"] + " " + item["answer"]) in " ".join(DEMO_CORPUS.split())
    docs = (tmp_path / "tasks" / "heldout.jsonl").read_text().splitlines()
    assert len(docs) == 4 and json.loads(docs[0])["text"] in DEMO_CORPUS
    config = json.loads((tmp_path / "tasks" / "spike_whale_cloze.yaml").read_text())
    assert config["output_type"] == "multiple_choice" and os.path.isabs(config["dataset_kwargs"]["data_files"]["test"])
