"""lm-evaluation-harness (optional extra): exact continuation scoring across Length-MAX boundary tokens, and the
local tasks through lm-eval's own command line. Skipped where lm-eval is not installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from _tiny_folder import load_folder, write_tiny_folder  # noqa: E402
from spike_whale.hub_export.lm_eval_harness import register_lm_eval_model  # noqa: E402
from spike_whale.hub_export.lm_eval_tasks import write_tasks  # noqa: E402
from spike_whale.hub_export.perplexity import score_ids  # noqa: E402

TEXT = "The harbour was quiet before dawn. Fishing boats rocked against the pier, their ropes creaking."


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_folder(tmp_path_factory.mktemp("lmeval") / "tiny")


@pytest.fixture(scope="module")
def lm(folder):
    return register_lm_eval_model()(pretrained=folder, batch_size=1, device="cpu")


def spanning_split(tokenizer, text):
    """A split point of `text` that lies inside one of its tokens (greedy longest match)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pos = 0
    for i in ids:
        piece = len(tokenizer.decode([i]))
        if piece > 1:
            return pos + 1
        pos += piece
    raise AssertionError("no multi-character token in the text")


def request(kind, *args):
    from lm_eval.api.instance import Instance

    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


def test_continuation_is_scored_exactly_across_a_boundary_token(folder, lm):
    tokenizer, model = load_folder(folder)
    cut = spanning_split(tokenizer, TEXT)
    context, continuation = TEXT[:cut], TEXT[cut:]
    # What lm-eval's `hf` model would score: the tokens of the whole string after the context's own encoding.
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    ctx_ids = tokenizer(context, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(whole[len(ctx_ids):]) != continuation  # a token spans the boundary
    cont_ids = tokenizer(continuation, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([[model.config.bos_token_id] + ctx_ids + cont_ids])
    with torch.no_grad():
        logp = model(input_ids=ids, use_cache=False).logits[0].double().log_softmax(-1)
    expected = sum(logp[len(ctx_ids) + j, t].item() for j, t in enumerate(cont_ids))
    (got, _), = lm.loglikelihood([request("loglikelihood", context, continuation)], disable_tqdm=True)
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-4)


def test_rolling_loglikelihood_equals_spike_whale_eval(folder, lm):
    tokenizer, model = load_folder(folder)
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    nll = score_ids(model, ids, context=model.config.max_position_embeddings, stride=8)
    got, = lm.loglikelihood_rolling([request("loglikelihood_rolling", TEXT)], disable_tqdm=True)
    assert -got == pytest.approx(nll, rel=1e-5)


def test_local_tasks_through_the_lm_eval_command_line(folder, tmp_path):
    from spike_whale.hub_export.train_tokenizer import DEMO_CORPUS

    heldout = tmp_path / "heldout.txt"
    heldout.write_text(DEMO_CORPUS)
    write_tasks(str(heldout), str(tmp_path / "tasks"), n_docs=3, n_cloze=3)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"),
               OMP_NUM_THREADS="1")
    tasks = "spike_whale_heldout,spike_whale_cloze,spike_whale_cloze_gen"
    proc = subprocess.run([sys.executable, "-m", "spike_whale", "lm-eval", "--model", "spike_whale", "--model_args",
                           f"pretrained={folder}", "--tasks", tasks, "--include_path", str(tmp_path / "tasks"),
                           "--batch_size", "2", "--output_path", str(tmp_path / "results")],
                          capture_output=True, text=True, env=env, timeout=600, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result_file = next(p for p in (tmp_path / "results").rglob("results*.json"))
    results = json.loads(result_file.read_text())["results"]
    assert results["spike_whale_heldout"]["bits_per_byte,none"] > 0
    assert 0 <= results["spike_whale_cloze"]["acc,none"] <= 1
    assert 0 <= results["spike_whale_cloze_gen"]["exact_match,first_word"] <= 1
