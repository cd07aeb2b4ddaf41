"""Issue 39, model side: every parameter in the graph at any length (DDP), static caches for inputs_embeds, configs
far larger than their weights refused before building, precision lists and load reports that follow the config."""

from __future__ import annotations

import json
import time

import pytest
import torch
from conftest import tiny_config, tiny_model

from spike_whale import SpikeWhaleForCausalLM, SpikeWhaleModel
from spike_whale.generation_utils import CACHE_FIELD


@pytest.mark.parametrize("seq_len", [8, 5, 1])  # one whole Memory-Cache segment (mc_segment_len = 8), and less
def test_every_parameter_takes_part_while_a_row_holds_one_segment(seq_len):
    """DDP needs a gradient for every parameter whatever the length: with no finished segment to read, the gate
    still takes part (with an exact zero contribution), so no output value changes."""
    model = tiny_model()
    ids = torch.randint(10, 500, (4, seq_len), generator=torch.Generator().manual_seed(3))
    out = model(ids, labels=ids, use_cache=False)
    out.loss.backward()
    mtp_reads_a_later_token = seq_len > 2  # the MTP head predicts two tokens ahead: no target in a shorter row
    unused = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None
              and (mtp_reads_a_later_token or not n.startswith("mtp_heads."))]
    assert not unused
    for p in model.parameters():
        p.requires_grad_(False)  # the read without the gate's graph
    assert torch.equal(model(ids, use_cache=False).logits, out.logits.detach())


def test_a_static_cache_holds_the_inputs_embeds_prompt():
    model = tiny_model()
    ids = torch.randint(10, 500, (1, 6), generator=torch.Generator().manual_seed(1))
    embeds = model.get_input_embeddings()(ids)
    kw = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    static = model.generate(inputs_embeds=embeds, cache_implementation="static", return_dict_in_generate=True, **kw)
    assert getattr(static, CACHE_FIELD).max_cache_len == 6 + 5
    assert torch.equal(static.sequences, model.generate(inputs_embeds=embeds, **kw))
    assert torch.equal(static.sequences[0], model.generate(ids, **kw)[0, 6:])


def _folder_with(tmp_path, **fields):
    tiny_model().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **fields}))
    return tmp_path


def test_a_config_far_larger_than_its_weights_is_refused_before_building(tmp_path):
    folder = _folder_with(tmp_path, num_hidden_layers=1_000_000, vocab_size=10**8)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"num_hidden_layers=1000000 \(the weights hold 4\), vocab_size=100000000"):
        SpikeWhaleForCausalLM.from_pretrained(folder)
    assert time.perf_counter() - start < 30  # a meta-device build of the layers alone takes ~9 ms each
    # A config passed in (AutoModel's route) and config fields passed as keyword arguments are checked too.
    with pytest.raises(ValueError, match="n_routed_experts=4096 \\(the weights hold 0\\)"):
        SpikeWhaleModel.from_pretrained(folder, config=tiny_config(use_moe=True, n_routed_experts=4096))
    with pytest.raises(ValueError, match="num_hidden_layers=64 \\(the weights hold 4\\)"):
        SpikeWhaleModel.from_pretrained(_folder_with(tmp_path / "other"), num_hidden_layers=64)


def test_a_config_near_its_weights_still_loads(tmp_path):
    folder = _folder_with(tmp_path, num_hidden_layers=6)  # two new layers to train: missing keys, not refused
    model, info = SpikeWhaleForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert len(model.model.layers) == 6 and any(k.startswith("model.layers.5.") for k in info["missing_keys"])


def test_keep_in_fp32_follows_the_config():
    assert not any("mc" in m for m in tiny_model(use_memory_cache=False)._keep_in_fp32_modules_strict)
    assert r"attn\.mc" in tiny_model()._keep_in_fp32_modules_strict
    assert not any("hash_proj" in m for m in tiny_model(use_engram=False)._keep_in_fp32_modules_strict)


def test_the_backbone_passes_over_the_causal_lm_heads_silently(tmp_path):
    tiny_model(use_abstain_head=True, num_nextn_predict_layers=2, tie_word_embeddings=False).save_pretrained(tmp_path)
    _, info = SpikeWhaleModel.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["unexpected_keys"] and not info["missing_keys"]
    # The causal LM still reports a head tensor it has no place for.
    _, info = SpikeWhaleForCausalLM.from_pretrained(tmp_path, num_nextn_predict_layers=1, output_loading_info=True)
    assert info["unexpected_keys"] == {"mtp_heads.1.proj.weight"}
