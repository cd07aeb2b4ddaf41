"""transformers' standard model and generation contract (issue 10 items 1-7, 9-12; issue 11 items 7 and 12)."""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch
import transformers
from packaging import version

from conftest import tiny_config, tiny_model
from spike_whale import SpikeWhaleConfig, SpikeWhaleForCausalLM
from spike_whale.generation_utils import CACHE_FIELD, SpikeWhaleCache
from spike_whale.hub_export.serving import serving_generation_config

# transformers < 5.24 warns on these calls for every model (an in-library Llama with the same generation_config too:
# sampling flags next to do_sample=False, max_new_tokens next to max_length in its own assisted loop); from 5.24 none.
QUIET_GENERATE = version.parse(transformers.__version__) >= version.parse("5.24")


def ids_of(batch=2, seq=12, seed=0, high=200):
    return torch.randint(4, high, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_hidden_states_follow_loop_slots_and_eager_attentions(caplog):
    model = tiny_model()
    slots = model.config.num_loop_slots
    ids = ids_of()
    msw_logger = transformers.utils.logging.get_logger("spike_whale.modeling_spike_whale")
    type(msw_logger).warning_once.cache_clear()  # once per process: this test's call is the first
    with torch.no_grad():
        out = model(ids, output_hidden_states=True, use_cache=False)
        assert len(out.hidden_states) == 1 + slots and out.hidden_states[0].shape == (2, 12, 64)
        # As in-library models: under sdpa the call that asks for the weights runs eager attention, with a warning.
        with caplog.at_level(logging.WARNING):
            from_sdpa = model(ids, output_attentions=True, use_cache=False)
        assert model.config._attn_implementation == "sdpa"
        assert any("run eager attention" in r.getMessage() for r in caplog.records)
        model.set_attn_implementation("eager")
        eager = model(ids, output_attentions=True, use_cache=False)
    assert len(eager.attentions) == slots and eager.attentions[0].shape == (2, 4, 12, 12)
    assert torch.allclose(eager.attentions[3].sum(-1), torch.ones(2, 4, 12), atol=1e-5)
    assert torch.allclose(eager.logits, out.logits, atol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(from_sdpa.attentions, eager.attentions))
    assert torch.equal(from_sdpa.logits, eager.logits)


def test_generate_dict_outputs_carry_hidden_states_and_attentions():
    model = tiny_model()
    model.set_attn_implementation("eager")
    out = model.generate(ids_of(1, 5), max_new_tokens=3, do_sample=False, return_dict_in_generate=True,
                         output_hidden_states=True, output_attentions=True)
    assert len(out.hidden_states) == 3 and len(out.hidden_states[0]) == 1 + model.config.num_loop_slots
    assert len(out.attentions) == 3 and out.attentions[1][0].shape[-1] == 6


def test_return_dict_false_gives_transformers_tuple_order():
    model = tiny_model()
    ids = ids_of()
    with torch.no_grad():
        loss, logits, *_ = model(ids, labels=ids, return_dict=False, use_cache=False)
        ref = model(ids, labels=ids, use_cache=False)
    assert torch.equal(loss, ref.loss) and torch.equal(logits, ref.logits)
    assert isinstance(model.model(ids, return_dict=False), tuple)


def test_shift_labels_are_honoured():
    model = tiny_model(num_nextn_predict_layers=0)
    ids = ids_of()
    shift = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    with torch.no_grad():
        ref = model(ids, labels=ids, use_cache=False)
        same = model(ids, shift_labels=shift, use_cache=False)
        other = model(ids, shift_labels=torch.roll(shift, 1, 1), use_cache=False)
    assert torch.allclose(same.loss, ref.loss, atol=1e-6)
    assert not torch.allclose(other.loss, ref.loss, atol=1e-3)


def test_use_cache_config_field_is_honoured_by_forward_and_generate():
    model = tiny_model()
    assert model.config.use_cache is True
    ids = ids_of(1, 6)
    with torch.no_grad():
        assert isinstance(model(ids).cache, SpikeWhaleCache)
        model.config.use_cache = False
        assert model(ids).cache is None
    calls = []
    hook = model.model.register_forward_pre_hook(lambda m, a, kw: calls.append(kw.get("cache")), with_kwargs=True)
    model.generate(ids, max_new_tokens=3, do_sample=False, use_cache=False)
    hook.remove()
    assert calls and all(c is None for c in calls)
    assert SpikeWhaleConfig.from_dict(dict(model.config.to_dict(), use_cache=False)).use_cache is False


def test_attention_interface_eager_sdpa_and_a_registered_function():
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    model = tiny_model()
    ids = ids_of()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        ref = model(ids, attention_mask=mask, use_cache=False).logits
        model.set_attn_implementation("eager")
        assert model.config._attn_implementation == "eager"
        eager = model(ids, attention_mask=mask, use_cache=False).logits
        seen = []

        def counting(module, q, k, v, attention_mask, **kw):
            seen.append(attention_mask.dtype)
            return sdpa_attention_forward(module, q, k, v, attention_mask, **kw)

        AttentionInterface.register("counting_sdpa", counting)
        model.set_attn_implementation("counting_sdpa")
        custom = model(ids, attention_mask=mask, use_cache=False).logits
    assert torch.allclose(eager[mask.bool()], ref[mask.bool()], atol=1e-5)
    assert torch.allclose(custom[mask.bool()], ref[mask.bool()], atol=1e-5)
    assert len(seen) == model.config.num_loop_slots


def test_attention_implementation_at_load(tmp_path):
    tiny_model().save_pretrained(tmp_path)
    model = SpikeWhaleForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert model.config._attn_implementation == "eager"


FP32_NAMES = ("rope", r"hash_proj_n\d+_p\d+", r"attn\.mc")


def _fp32_ok(model, low):
    """transformers' own `test_keep_in_fp32_modules` rule: listed dotted components float32, the rest `low`."""
    for name, t in model.state_dict().items():
        keep = any(re.search(rf"(?:^|\.){k}(?:\.|$)", name) for k in model._keep_in_fp32_modules_strict)
        assert t.dtype == (torch.float32 if keep else low), name


def test_keep_in_fp32_modules_from_config_and_from_pretrained(tmp_path):
    assert set(SpikeWhaleForCausalLM._keep_in_fp32_modules_strict) == set(FP32_NAMES)
    model = SpikeWhaleForCausalLM._from_config(tiny_config(), dtype=torch.bfloat16)
    _fp32_ok(model, torch.bfloat16)
    tiny_model().save_pretrained(tmp_path)
    _fp32_ok(SpikeWhaleForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16), torch.bfloat16)


def test_input_ids_with_inputs_embeds_route_moe_and_engram():
    model = tiny_model(use_moe=True, n_routed_experts=4, num_experts_per_tok=2, num_hash_layers=1)
    ids = ids_of()
    embeds = model.get_input_embeddings()(ids)
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits
        both = model(ids, inputs_embeds=embeds, use_cache=False).logits
        soft = embeds.clone()
        soft[:, :4] = torch.randn(2, 4, 64) * 0.02
        prompt_tuned = model(ids, inputs_embeds=soft, use_cache=False).logits
        with pytest.raises(ValueError, match="hash routing"):
            model(inputs_embeds=embeds, use_cache=False)
        with pytest.raises(ValueError, match="same"):
            model(ids[:, :5], inputs_embeds=embeds, use_cache=False)
    assert torch.equal(both, ref)
    assert not torch.allclose(prompt_tuned, ref)


def _packed(model, seqs):
    ids = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    return ids, pos


def test_padding_free_packing_equals_each_sequence_alone():
    from transformers import DataCollatorWithFlattening

    model = tiny_model()  # Memory-Cache segments of 8, Engram, depth attention, HC, HRM, MTP
    a, b = ids_of(1, 19, seed=1)[0], ids_of(1, 11, seed=2)[0]
    batch = DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": a.tolist()}, {"input_ids": b.tolist()}])
    with torch.no_grad():
        packed = model(batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"])
        alone_a = model(a[None], labels=a[None], use_cache=False)
        alone_b = model(b[None], labels=b[None], use_cache=False)
        masked_b = batch["labels"].clone()
        masked_b[:, 19:] = -100
        only_a = model(batch["input_ids"], position_ids=batch["position_ids"], labels=masked_b)
    assert torch.allclose(packed.logits[0, :19], alone_a.logits[0], atol=1e-5)
    assert torch.allclose(packed.logits[0, 19:], alone_b.logits[0], atol=1e-5)
    assert torch.allclose(only_a.loss, alone_a.loss, atol=1e-5)
    assert torch.allclose(only_a.mtp_loss, alone_a.mtp_loss, atol=1e-5)  # no MTP target crosses into b


def test_custom_4d_mask_and_packing_with_a_mask_raise_clearly():
    model = tiny_model()
    for position_ids in (None, torch.arange(6)[None]):  # the refusal comes before position_ids are read
        with pytest.raises(ValueError, match="4D masks are not supported"):
            model(ids_of(1, 6), attention_mask=torch.ones(1, 1, 6, 6, dtype=torch.bool), position_ids=position_ids)
    with pytest.raises(NotImplementedError, match="padding-free packing"):
        model(ids_of(1, 6), attention_mask=torch.ones(1, 6, dtype=torch.long), position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]))
    left_padded = torch.tensor([[0, 0, 1, 1, 1, 1]])  # generate's position_ids: pads at 1, real tokens from 0
    model(ids_of(1, 6), attention_mask=left_padded, position_ids=torch.tensor([[1, 1, 0, 1, 2, 3]]))


def test_negative_position_ids_raise():
    model = tiny_model()
    with pytest.raises(ValueError, match="must be >= 0"):
        model(ids_of(1, 6), position_ids=torch.tensor([[-5, -4, -3, -2, -1, 0]]))


def test_static_cache_implementation_and_caller_length_wins(caplog):
    model = tiny_model()
    model.generation_config = serving_generation_config(model.config)
    ids = ids_of(1, 6)
    with caplog.at_level(logging.WARNING):
        out = model.generate(ids, max_length=10, return_dict_in_generate=True)
        assert out.sequences.shape[1] == 10
        static = model.generate(ids, cache_implementation="static", max_new_tokens=4, do_sample=False,
                                return_dict_in_generate=True)
        cache = getattr(static, CACHE_FIELD)
        assert isinstance(cache, SpikeWhaleCache) and cache.max_cache_len == 10
        plain = model.generate(ids, max_new_tokens=4, do_sample=False)
        assert torch.equal(static.sequences, plain)
        model.generate(ids, max_new_tokens=3)  # the serving default stays when the caller sets nothing else
    if QUIET_GENERATE:
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING], [r.getMessage() for r in caplog.records]
    with pytest.raises(NotImplementedError, match="offloaded"):
        model.generate(ids, cache_implementation="offloaded", max_new_tokens=2)


def test_assisted_decoding_with_serving_defaults_does_not_warn(caplog):
    model, draft = tiny_model(), tiny_model(seed=1)
    for m in (model, draft):
        m.generation_config = serving_generation_config(m.config)
    ids = ids_of(1, 6)
    with caplog.at_level(logging.WARNING):
        assisted = model.generate(ids, assistant_model=draft, max_new_tokens=5, do_sample=False)
    if QUIET_GENERATE:
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING], [r.getMessage() for r in caplog.records]
    assert torch.equal(assisted, model.generate(ids, max_new_tokens=5, do_sample=False))


def test_generate_refuses_empty_ids_and_misshapen_masks():
    model = tiny_model()
    with pytest.raises(ValueError, match="input_ids is empty"):
        model.generate(torch.zeros(1, 0, dtype=torch.long), max_new_tokens=2)
    with pytest.raises(ValueError, match="attention_mask has shape"):
        model.generate(ids_of(1, 6), attention_mask=torch.ones(1, 5, dtype=torch.long), max_new_tokens=2)
    with pytest.raises(ValueError, match="alone does not fit") as err:
        model.generate(ids_of(1, 6), max_new_tokens=model.config.max_position_embeddings + 10)
    assert "-" not in re.sub(r"[a-z]-[a-z]|max_new_tokens|max_position_embeddings", "", str(err.value).split(":")[-1])


def test_auto_model_loads_the_backbone(tmp_path, fresh_python):
    model = tiny_model()
    type(model).register_for_auto_class("AutoModelForCausalLM")
    type(model.config).register_for_auto_class("AutoConfig")
    model.save_pretrained(tmp_path / "m")
    auto_map = json.loads((tmp_path / "m" / "config.json").read_text())["auto_map"]
    assert auto_map["AutoModel"] == "modeling_spike_whale.SpikeWhaleModel"
    out = fresh_python(f"""
        from transformers import AutoModel
        m = AutoModel.from_pretrained({str(tmp_path / "m")!r}, trust_remote_code=True)
        print(type(m).__name__)
    """)
    assert out.strip().endswith("SpikeWhaleModel")


def test_input_checks_do_not_break_a_compiled_graph():
    model = tiny_model()
    cfg = model.config
    checks = torch.compile(lambda ids, pos: (model.model._check_range(ids, cfg.vocab_size, True, "token ids"),
                                            model.model._check_range(pos, cfg.max_position_embeddings, True,
                                                                     "positions")),
                           fullgraph=True, backend="eager")
    checks(ids_of(1, 6), torch.arange(6)[None])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.model._check_range(torch.tensor([[1, cfg.vocab_size]]), cfg.vocab_size, False, "token ids")
    with pytest.raises(ValueError, match="past the context window"):
        model.model._check_range(torch.tensor([[1, cfg.max_position_embeddings]]), cfg.max_position_embeddings, False,
                                 "positions")


def test_engram_compressor_stays_frozen_after_from_pretrained(tmp_path):
    tiny_model().save_pretrained(tmp_path)
    loaded = SpikeWhaleForCausalLM.from_pretrained(tmp_path)
    assert not loaded.model.engram.compressor.proj.weight.requires_grad
    assert sum(p.numel() for p in loaded.parameters()) == sum(p.numel() for p in tiny_model().parameters())


def test_from_pretrained_applies_checkpoint_renames(tmp_path, monkeypatch):
    """A released file whose names differ: CHECKPOINT_KEY_RENAMES maps them at load; without a rename transformers
    reports the names (`spike-whale convert` gives the guessed keys and same-shape candidates, issue 11)."""
    from safetensors.torch import load_file, save_file

    import spike_whale.modeling_spike_whale as msw

    model = tiny_model()
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights["model.mix.logits"] = weights.pop("model.hc_out_mix.mix_logits")  # a "released" name
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    _, info = SpikeWhaleForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert set(info["missing_keys"]) == {"model.hc_out_mix.mix_logits"}
    assert set(info["unexpected_keys"]) == {"model.mix.logits"}
    monkeypatch.setitem(msw.CHECKPOINT_KEY_RENAMES, r"^model\.mix\.logits$", "model.hc_out_mix.mix_logits")
    loaded = SpikeWhaleForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(loaded.model.hc_out_mix.mix_logits, model.model.hc_out_mix.mix_logits)


def _flash_stand_in(seen):
    """A CPU stand-in for flash_attention_2 that checks flash's mask contract (a [B, keys] padding mask or None, and
    is_causal with causality aligned bottom-right) and computes exactly what flash would from it."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def flash(module, q, k, v, attention_mask, is_causal=None, **kw):
        B, _, S, _ = q.shape
        N = k.shape[2]
        assert is_causal is True
        assert attention_mask is None or (attention_mask.dtype == torch.bool and attention_mask.shape == (B, N))
        seen.append(None if attention_mask is None else tuple(attention_mask.shape))
        keys = torch.ones(B, N, dtype=torch.bool) if attention_mask is None else attention_mask
        causal = torch.arange(N)[None, :] <= (N - S + torch.arange(S))[:, None]
        vis = (causal[None] & keys[:, None, :]) | ~keys[:, None, N - S:].transpose(1, 2)  # padded queries: anything
        return sdpa_attention_forward(module, q, k, v, vis[:, None], is_causal=False, **kw)

    return flash


@pytest.mark.parametrize("impl", ["flash_attention_2", "flex_attention"])
def test_each_attention_kernel_gets_the_mask_it_expects(impl, monkeypatch):
    """flash gets the [B, keys] padding mask (or None) with is_causal, flex a BlockMask (torch's CPU flex kernel does
    not survive the dense float mask), and both give the sdpa model's logits on a left-padded batch and its tokens in
    cached greedy decoding across Memory-Cache segments (prefill, a multi-token chunk, decode steps)."""
    from torch.nn.attention.flex_attention import BlockMask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    seen = []
    if impl == "flash_attention_2":
        monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, impl, _flash_stand_in(seen))
    else:
        real = ALL_ATTENTION_FUNCTIONS[impl]

        def flex(module, q, k, v, attention_mask, **kw):
            assert isinstance(attention_mask, BlockMask) and not kw.get("is_causal")
            seen.append(attention_mask.shape)
            return real(module, q, k, v, attention_mask, **kw)

        monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, impl, flex)
    model = tiny_model()
    L = model.config.mc_segment_len
    ids = ids_of(2, L + 5, high=300)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    with torch.no_grad():
        ref = model(ids, attention_mask=mask, use_cache=False).logits
        want = model.generate(ids, attention_mask=mask, max_new_tokens=L, do_sample=False, repetition_penalty=1.0)
        model.config._attn_implementation = impl
        got = model(ids, attention_mask=mask, use_cache=False).logits
        assert torch.allclose(got[mask.bool()], ref[mask.bool()], atol=1e-5)
        calls = len(seen)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=L, do_sample=False, repetition_penalty=1.0)
    assert torch.equal(out, want)
    assert calls >= model.config.num_loop_slots and len(seen) > calls
