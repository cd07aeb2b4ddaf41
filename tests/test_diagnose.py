"""`spike-whale diagnose`: each knock-out is what it claims (checked against an independently changed model)."""

from __future__ import annotations

import json

import pytest
import torch

from _tiny_folder import load_folder, write_tiny_folder
from conftest import tiny_model
from spike_whale.hub_export import cli
from spike_whale.hub_export.diagnose import (Evaluator, compare_checkpoints, loop_passes, mc_knockout, rope_frequencies,
                                             silenced_memory_cache)

TEXT = ("The harbour was quiet before dawn. Fishing boats rocked against the pier, and a single gull walked along "
        "the railing. Nobody noticed the whale until the tide turned.\n") * 2


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_folder(tmp_path_factory.mktemp("diag") / "tiny")


@pytest.fixture(scope="module")
def loaded(folder):
    return load_folder(folder)


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


IDS = torch.tensor([[2] + list(range(300, 340))])


def test_silencing_every_slot_equals_zero_mc_gates(loaded):
    _, model = loaded
    reference = tiny_model()
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if name.endswith("mc.mc_gate"):
                p.zero_()
    with silenced_memory_cache(model, None):
        assert torch.allclose(logits(model, IDS), logits(reference, IDS), atol=1e-5)
    with silenced_memory_cache(model, {1}):
        one = logits(model, IDS)
    assert not torch.allclose(one, logits(model, IDS), atol=1e-4)  # one slot matters...
    assert not torch.allclose(one, logits(reference, IDS), atol=1e-4)  # ...and is not all of them


def test_silenced_slots_are_the_loop_plan_slots_of_their_layer(loaded):
    """Silencing every pass's slot of one layer equals zeroing that layer's (shared) Memory-Cache gate."""
    _, model = loaded
    layer = 1
    slots = {s for s, (lay, _) in enumerate(model.model.loop_plan.entries) if lay == layer}
    reference = tiny_model()
    with torch.no_grad():
        reference.model.layers[layer].attn.mc.mc_gate.zero_()
    with silenced_memory_cache(model, slots):
        assert torch.allclose(logits(model, IDS), logits(reference, IDS), atol=1e-5)
    with silenced_memory_cache(model, {min(slots)}):
        assert not torch.allclose(logits(model, IDS), logits(reference, IDS), atol=1e-4)


def test_loop_passes_equal_a_model_built_with_fewer_loops(loaded):
    _, model = loaded
    fewer = tiny_model(loop_count=1)
    state = dict(model.state_dict())
    state["model.loop_pass_embed.weight"] = state["model.loop_pass_embed.weight"][:1]
    fewer.load_state_dict(state)
    with loop_passes(model, 1):
        assert torch.allclose(logits(model, IDS), logits(fewer, IDS), atol=1e-5)
    assert len(model.model.loop_plan.entries) == model.config.num_hidden_layers * model.config.loop_count


def test_rope_swap_rebuilds_from_the_checkpoints_own_frequencies(loaded):
    _, model = loaded
    rope = next(m for m in model.modules() if type(m).__name__ == "SpikeWhaleRotaryEmbedding")
    before, cos = logits(model, IDS), rope.cos_cache.clone()
    with rope_frequencies(model, rope.inv_freq.clone()):
        assert torch.equal(logits(model, IDS), before)
    geometric = 1.0 / (model.config.rope_theta ** (torch.arange(0, rope.inv_freq.numel() * 2, 2).float()
                                                    / (rope.inv_freq.numel() * 2)))
    with rope_frequencies(model, geometric):
        assert torch.allclose(rope.cos_cache[5], torch.cos(5 * geometric))
        assert not torch.allclose(logits(model, IDS), before, atol=1e-4)
    assert torch.equal(rope.cos_cache, cos)  # restored


def test_tables_and_compare(loaded):
    tokenizer, model = loaded
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    evaluate = Evaluator(model, ids, len(TEXT.encode()), 17, 8, 4)
    text, rows = mc_knockout(model, evaluate, lambda m: None)
    assert len(rows) == 2 + len(model.model.loop_plan.entries) and "Memory-Cache knock-out" in text
    assert rows[0]["perplexity"] != rows[1]["perplexity"]
    other = tiny_model()
    with torch.no_grad():
        other.model.layers[1].attn.mc.o_proj.weight.mul_(1.5)
    _, same = compare_checkpoints(model, tiny_model(), ids, lambda m: None)
    assert same["tensors_identical"] == same["tensors_compared"] and same["max_abs_dlogit"] == 0.0
    _, changed = compare_checkpoints(model, other, ids, lambda m: None)
    assert changed["largest_relative_differences"][0][0] == "model.layers.1.attn.mc.o_proj.weight"
    assert changed["largest_relative_differences"][0][1] == pytest.approx(0.5, rel=1e-5)
    assert changed["tensors_identical"] == changed["tensors_compared"] - 1 and changed["max_abs_dlogit"] > 0


def test_diagnose_command_prints_every_table(folder, tmp_path, capsys):
    text_file = tmp_path / "text.txt"
    text_file.write_text(TEXT)
    report_file = tmp_path / "diag.json"
    assert cli.main(["diagnose", folder, str(text_file), "--compare", folder, "--context", "33", "--json",
                     str(report_file), "--quiet"]) == 0
    out = capsys.readouterr().out
    for title in ("Memory-Cache knock-out", "RoPE swap", "Loop-pass contribution", "Checkpoint comparison",
                  "Context readiness"):
        assert title in out
    report = json.loads(report_file.read_text())
    assert [r["passes"] for r in report["loop_passes"]] == [1, 2]
    assert report["loop_passes"][-1]["perplexity"] == pytest.approx(report["mc_knockout"][0]["perplexity"])
    assert report["rope_swap"][0]["perplexity"] == pytest.approx(report["mc_knockout"][0]["perplexity"])
    assert all(r["ok"] for r in report["context_readiness"])


@pytest.mark.parametrize("args,message", [
    (["--only", "compare"], "--only compare needs --compare"),
    ([], "does not exist: pass a text file"),
    (["missing.txt"], "not found"),
    (["a_folder"], "a_folder is a folder, not a text file"),
])
def test_diagnose_bad_input_is_one_line(folder, tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a_folder").mkdir()
    assert cli.main(["diagnose", folder, *args]) == 1
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
