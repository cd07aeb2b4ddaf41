"""Every config.py knob: it builds, trains (finite loss and gradients), changes the output the way its comment
says, stays exact under the loop-slot cache, and contradictory combinations raise at config time."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_config, tiny_model
from spike_whale import LoopPlan, SpikeWhaleCache, SpikeWhaleConfig, SpikeWhaleForCausalLM
from spike_whale.modeling_spike_whale import SpikeWhaleMoE, hash_expert_ids, rope_inv_freq

MOE = dict(use_moe=True, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, num_hash_layers=1,
           moe_layers=[0, 1, 3], moe_intermediate_size=48)

# name -> (overrides with the knob on, overrides with it off). Each pair differs only in that knob.
KNOBS = {
    "moe": (MOE, {}),
    "moe_softmax_unnormed": (dict(MOE, scoring_func="softmax", norm_topk_prob=False, routed_scaling_factor=2.0,
                                  n_shared_experts=0, num_hash_layers=0), {}),
    "derf": (dict(use_derf=True), {}),
    "elo": (dict(use_elo=True), {}),
    "middle_split": (dict(loop_mode="middle_split", loop_middle_layers=2, loop_count=3), dict(loop_count=3)),
    "loop_pass_embed_off": (dict(loop_pass_embed=False), {}),
    "loop_count_1": (dict(loop_count=1), {}),
    "engram_legacy_hash": (dict(engram_legacy_hash=True), {}),
    "engram_fusion": (dict(engram_fusion_layers=[1, 2], engram_fusion_dim=16), {}),
    "value_embed": (dict(use_value_embed=True), {}),
    "hyper_connections_off": (dict(use_hyper_connections=False), {}),
    "hc_mult_3": (dict(hc_mult=3), {}),
    "qk_norm_off": (dict(use_qk_norm=False), {}),
    "xsa_off": (dict(use_xsa=False), {}),
    "fractal_gamma_half": (dict(fractal_rope_gamma=0.5), {}),
    "hrm_3_steps": (dict(hrm_refine_steps=3), {}),
    "abstain_head": (dict(use_abstain_head=True), {}),
    "mtp_2_heads": (dict(num_nextn_predict_layers=2), {}),
}

# Zero-init parameters of the knobs themselves (beyond conftest.ZERO_INIT_GATES), opened for the tests.
KNOB_GATES = ("elo_gain", "ve_gate", "engram_fusion.o_proj")


def knob_model(seed: int = 0, **overrides) -> SpikeWhaleForCausalLM:
    model = tiny_model(seed=seed, **overrides)
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(s in name for s in KNOB_GATES):
                p.copy_(torch.randn(p.shape, generator=g) * (3.0 if "elo_gain" in name else 0.5))
    return model


def ids_batch(batch=2, seq=40, seed=3):
    return torch.randint(4, 16000, (batch, seq), generator=torch.Generator().manual_seed(seed))


def transplant(dst: torch.nn.Module, src: torch.nn.Module) -> None:
    """Copy every same-named, same-shaped tensor of src into dst (the knob's own tensors keep their values)."""
    theirs = src.state_dict()
    with torch.no_grad():
        for name, t in dst.state_dict().items():
            if name in theirs and theirs[name].shape == t.shape and ".rope." not in name:  # RoPE follows the config
                t.copy_(theirs[name])


def cached_logits(model, ids, chunks, attention_mask=None):
    cache, outs, p = SpikeWhaleCache(model.config), [], 0
    for c in chunks:
        am = None if attention_mask is None else attention_mask[:, : p + c]
        outs.append(model(ids[:, p : p + c], attention_mask=am, cache=cache, use_cache=True).logits)
        p += c
    return torch.cat(outs, 1)


# ---------------------------------------------------------------------------------------------------------------
# Per knob: finite loss and gradients, the output changes, cached chunked decode equals the full recompute.


@pytest.mark.parametrize("knob", list(KNOBS))
def test_knob_trains_with_finite_loss_and_gradients(knob):
    model = knob_model(**KNOBS[knob][0]).train()
    ids = ids_batch(seq=24)
    out = model(ids, labels=ids)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert all(g is None or torch.isfinite(g).all() for g in grads.values())
    # The knob's own parameters take part in the loss.
    own = {n for n in grads if any(s in n for s in ("experts", "ffn.gate.", "derf_", "elo_", "engram_fusion",
                                                     "ve_gate", "abstain_head", "mtp_heads.1", "hrm_refine.gate"))}
    for name in own:
        assert grads[name] is not None and grads[name].abs().sum() > 0, name


@pytest.mark.parametrize("knob", list(KNOBS))
def test_switching_the_knob_changes_the_output(knob):
    on, off = KNOBS[knob]
    m_off = knob_model(**off)
    m_on = knob_model(seed=1, **on)
    transplant(m_on, m_off)
    ids = ids_batch(seq=24)
    with torch.no_grad():
        a = m_off(ids, labels=ids)
        b = m_on(ids, labels=ids)
    if knob in ("hrm_3_steps", "abstain_head", "mtp_2_heads"):
        # Training-side knobs: the extra HRM steps change the output; the extra heads change the objective.
        changed = (a.loss - b.loss).abs() > 1e-4
        if knob == "hrm_3_steps":
            changed = changed and (a.logits - b.logits).abs().max() > 1e-4
        assert changed
    else:
        assert (a.logits - b.logits).abs().max() > 1e-4


@pytest.mark.parametrize("knob", list(KNOBS))
def test_knob_cached_chunked_decode_equals_full_recompute(knob):
    model = knob_model(**KNOBS[knob][0])
    ids = ids_batch()
    with torch.no_grad():
        full = model(ids).logits
        for chunks in ([7, 1, 1, 1, 5, 2, 8, 15], [1] * 6 + [34]):
            torch.testing.assert_close(cached_logits(model, ids, chunks), full, rtol=0, atol=2e-6)
        # Left padding: row 1 starts with 5 pads; it must equal the same row run alone.
        padded, mask = ids.clone(), torch.ones_like(ids)
        padded[1, :5], mask[1, :5] = 0, 0
        alone = model(ids[1:, 5:]).logits[0]
        torch.testing.assert_close(model(padded, attention_mask=mask).logits[1, 5:], alone, rtol=0, atol=2e-6)
        inc = cached_logits(model, padded, [13, 1, 1, 6, 19], attention_mask=mask)
        torch.testing.assert_close(inc[1, 5:], alone, rtol=0, atol=2e-6)
        torch.testing.assert_close(inc[0], full[0], rtol=0, atol=2e-6)


# ---------------------------------------------------------------------------------------------------------------
# Invalid combinations.


@pytest.mark.parametrize(
    "overrides, fields",
    [
        (dict(hc_sinkhorn_iters=10), ["hc_sinkhorn_iters", "hc_eps"]),
        (dict(hc_eps=1e-3), ["hc_sinkhorn_iters", "hc_eps"]),
        (dict(use_moe=True, n_routed_experts=2, num_experts_per_tok=3), ["num_experts_per_tok", "n_routed_experts"]),
        (dict(use_moe=True, moe_layers=[]), ["use_moe", "moe_layers"]),
        (dict(use_moe=True, moe_layers=[1, 1]), ["moe_layers"]),
        (dict(use_moe=True, n_shared_experts=-1), ["n_shared_experts"]),
        (dict(use_moe=True, num_hash_layers=-1), ["num_hash_layers"]),
        (dict(use_moe=True, routed_scaling_factor=0.0), ["routed_scaling_factor"]),
        (dict(scoring_func="sigmoid"), ["scoring_func"]),
        (dict(use_engram=False, engram_fusion_layers=[1]), ["engram_fusion_layers", "use_engram"]),
        (dict(engram_fusion_layers=[1], engram_fusion_dim=0), ["engram_fusion_dim"]),
        (dict(engram_gate_init_bias=-4.0), ["engram_gate_init_bias"]),
        (dict(use_hrm_refine=False), ["hrm_deep_supervision", "use_hrm_refine"]),
        (dict(use_abstain_head=True, abstain_threshold=1.5), ["abstain_threshold"]),
        (dict(use_abstain_head=True, abstain_pos_weight=0.0), ["abstain_pos_weight"]),
        (dict(mtp_loss_weight=-0.3), ["mtp_loss_weight"]),
        (dict(moe_aux_loss_coef=-1), ["moe_aux_loss_coef"]),
        (dict(hidden_dropout=1.0), ["hidden_dropout"]),
        (dict(fractal_rope_gamma=-0.1), ["fractal_rope_gamma"]),
        (dict(loop_mode="middle_split", loop_middle_layers=3), ["loop_middle_layers", "num_hidden_layers"]),
        (dict(num_nextn_predict_layers=-1), ["num_nextn_predict_layers"]),
    ],
)
def test_invalid_combinations_raise_at_config_time_naming_the_fields(overrides, fields):
    with pytest.raises(ValueError) as err:
        tiny_config(**overrides)
    for field in fields:
        assert field in str(err.value)


def test_valid_edge_values_are_accepted():
    tiny_config(use_hrm_refine=False, hrm_deep_supervision=False)
    tiny_config(engram_gate_init_bias=-2.5)
    tiny_config(fractal_rope_gamma=0.0)


def test_elo_takes_precedence_over_derf(caplog):
    with caplog.at_level(logging.WARNING):
        cfg = tiny_config(use_elo=True, use_derf=True)
    assert "precedence" in caplog.text
    names = [n for n, _ in SpikeWhaleForCausalLM(cfg).named_parameters()]
    assert any("elo_gain" in n for n in names) and not any("derf_" in n for n in names)


# ---------------------------------------------------------------------------------------------------------------
# MoE.


def moe_layer(**overrides) -> SpikeWhaleMoE:
    torch.manual_seed(0)
    model = SpikeWhaleForCausalLM(tiny_config(**{**MOE, **overrides}))
    return model


def test_moe_layout_hash_layers_and_parameter_count():
    model = moe_layer()
    ffn = [layer.ffn for layer in model.model.layers]
    assert [isinstance(f, SpikeWhaleMoE) for f in ffn] == [True, True, False, True]
    assert [f.hash_routing for f in ffn if isinstance(f, SpikeWhaleMoE)] == [True, False, False]
    moe = ffn[1]
    H, F_ = 64, 48
    assert len(moe.experts) == 4 and moe.gate.weight.shape == (4, H)
    assert moe.shared_experts.gate_proj.weight.shape == (F_, H)
    names = set(dict(model.named_parameters()))
    assert "model.layers.1.ffn.experts.3.down_proj.weight" in names
    assert "model.layers.1.ffn.shared_experts.up_proj.weight" in names
    assert "model.layers.2.ffn.gate_proj.weight" in names  # dense layer


def test_hash_routing_is_deterministic_per_token_id():
    ids = torch.arange(16512)
    e = hash_expert_ids(ids, 8, 2)
    assert torch.equal(e, hash_expert_ids(ids.flip(0), 8, 2).flip(0))
    assert (e[:, 0] != e[:, 1]).all() and e.min() >= 0 and e.max() < 8
    counts = torch.bincount(e[:, 0], minlength=8).float()
    assert counts.min() > 0.8 * counts.mean()  # spread over the experts
    # Inside the model: the same id gets the same experts whatever its hidden state.
    moe = moe_layer().model.layers[0].ffn
    x = torch.randn(6, 64)
    tok = torch.tensor([5, 5, 5, 900, 900, 77])
    idx, w, _ = moe.route(x, tok)
    assert torch.equal(idx[0], idx[1]) and torch.equal(idx[1], idx[2]) and torch.equal(idx[3], idx[4])
    assert torch.equal(idx, hash_expert_ids(tok, 4, 2))
    assert not torch.allclose(w[0], w[1])  # the router still weighs them
    with pytest.raises(ValueError, match="input_ids"):
        moe.route(x, None)


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "softmax"])
@pytest.mark.parametrize("hash_layers", [0, 1])
def test_topk_weights_sum_to_routed_scaling_factor(scoring, hash_layers):
    model = moe_layer(scoring_func=scoring, routed_scaling_factor=2.5, num_hash_layers=hash_layers)
    x = torch.randn(50, 64)
    tok = torch.randint(4, 16000, (50,))
    for moe in (model.model.layers[0].ffn, model.model.layers[1].ffn):
        idx, w, scores = moe.route(x, tok)
        torch.testing.assert_close(w.sum(-1), torch.full((50,), 2.5))
        if scoring == "softmax":
            torch.testing.assert_close(scores.sum(-1), torch.ones(50))
        else:
            torch.testing.assert_close(scores, F.softplus(F.linear(x, moe.gate.weight)).sqrt())
        if not moe.hash_routing:
            assert torch.equal(idx.sort(-1).values, scores.topk(2, -1).indices.sort(-1).values)
    unnormed = moe_layer(norm_topk_prob=False, routed_scaling_factor=2.5, num_hash_layers=0).model.layers[1].ffn
    idx, w, scores = unnormed.route(x, tok)
    torch.testing.assert_close(w, scores.gather(-1, idx) * 2.5)
    assert not torch.allclose(w.sum(-1), torch.full((50,), 2.5))


def test_moe_sorted_dispatch_equals_dense_reference_and_runs_each_expert_on_its_tokens_only():
    moe = moe_layer(num_hash_layers=0).model.layers[1].ffn
    u = torch.randn(2, 30, 64)
    rows = []
    hooks = [e.register_forward_hook(lambda m, inp, out: rows.append(inp[0].shape[0])) for e in moe.experts]
    out, aux = moe(u)
    for h in hooks:
        h.remove()
    assert sum(rows) == 60 * 2  # N·k rows in total, not N·E
    x = u.reshape(60, 64)
    idx, w, scores = moe.route(x, None)
    ref = moe.shared_experts(x)
    for j in range(2):
        ref = ref + w[:, j : j + 1] * torch.stack([moe.experts[int(e)](x[n]) for n, e in enumerate(idx[:, j])])
    torch.testing.assert_close(out.reshape(60, 64), ref, rtol=1e-5, atol=1e-6)
    # Load balance: E·Σ f_e P_e.
    f = torch.bincount(idx.flatten(), minlength=4).float() / idx.numel()
    P = (scores / scores.sum(-1, keepdim=True)).mean(0)
    torch.testing.assert_close(aux, 4 * (f * P).sum())


def test_moe_aux_loss_is_reported_weighted_and_trains_the_router():
    model = tiny_model(**dict(MOE, moe_aux_loss_coef=0.5)).train()
    ids = ids_batch(seq=24)
    out = model(ids, labels=ids)
    assert out.moe_aux_loss is not None and 1.0 <= out.moe_aux_loss < 4.0  # 1 when perfectly balanced
    model.zero_grad()
    (out.moe_aux_loss).backward()
    router = model.model.layers[1].ffn.gate.weight
    assert router.grad is not None and router.grad.abs().sum() > 0
    with torch.no_grad():  # hash layers have no balance term; learned-router layers do
        u = torch.randn(1, 5, 64)
        ctx = SimpleNamespace(valid=torch.ones(1, 5, dtype=torch.bool), token_ids=torch.arange(5)[None])
        assert model.model.layers[0].ffn(u, ctx)[1] is None and model.model.layers[1].ffn(u, ctx)[1] is not None
    assert tiny_model().eval()(ids, labels=ids).moe_aux_loss is None  # dense model


def test_moe_with_inputs_embeds_needs_input_ids_only_for_hash_layers():
    ids = ids_batch(seq=8)
    learned = tiny_model(**dict(MOE, num_hash_layers=0))
    with torch.no_grad():
        torch.testing.assert_close(learned(inputs_embeds=learned.model.embed_tokens(ids)).logits, learned(ids).logits)
    hashed = tiny_model(**MOE)
    with pytest.raises(ValueError, match="hash routing"):
        hashed(inputs_embeds=hashed.model.embed_tokens(ids))


# ---------------------------------------------------------------------------------------------------------------
# Attention variants.


def test_derf_attention_equation():
    from spike_whale.modeling_spike_whale import derf_attention

    q, k, v = torch.randn(1, 4, 5, 16), torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    alpha, beta, gamma = torch.tensor([1.0, 0.5, 2.0, 1.0]), torch.tensor([0.0, -1.0, 0.3, 0.1]), torch.ones(4) * 3
    y, weights = derf_attention(q, k, v, None, True, 0.0, alpha, beta, gamma)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    s = q @ kk.transpose(-1, -2) / 4.0
    w = gamma[:, None, None] * (torch.erf(alpha[:, None, None] * s + beta[:, None, None]) + 1) / 2
    w = w * torch.ones(5, 5).tril()
    torch.testing.assert_close(y, (w / (w.sum(-1, keepdim=True) + 1e-8)) @ vv)
    torch.testing.assert_close(weights, w / (w.sum(-1, keepdim=True) + 1e-8))


def test_elo_is_an_exact_no_op_at_init_and_ratings_follow_the_equation():
    base = tiny_model(seed=0)
    elo = tiny_model(seed=0, use_elo=True)
    transplant(elo, base)
    with torch.no_grad():
        for layer in elo.model.layers:
            assert torch.equal(layer.attn.elo_k, torch.full((4,), 0.5))
            layer.attn.elo_gain.zero_()  # its init value (tiny_model opens it)
    ids = ids_batch(seq=20)
    with torch.no_grad():
        torch.testing.assert_close(elo(ids).logits, base(ids).logits, rtol=0, atol=1e-6)
    from spike_whale.modeling_spike_whale import elo_attention

    q, k, v = torch.randn(1, 2, 6, 8), torch.randn(1, 1, 6, 8), torch.randn(1, 1, 6, 8)
    gain, kf = torch.tensor([0.0, 2.0]), torch.tensor([0.5, 0.5])
    y, _, ratings, _ = elo_attention(q, k, v, None, True, 0.0, gain, kf, None, torch.ones(1, 6, dtype=torch.bool))
    s = (q @ k.transpose(-1, -2)) / math.sqrt(8)
    vis = torch.ones(6, 6).tril().bool()
    p = torch.softmax(s.masked_fill(~vis, -math.inf), -1)
    delta = p - vis.float() / vis.sum(-1, keepdim=True)
    R = torch.zeros(1, 2, 6)
    expected = []
    for t in range(6):
        logits = s[:, :, t] + (gain * kf)[None, :, None] * R
        expected.append(torch.softmax(logits.masked_fill(~vis[t], -math.inf), -1) @ v[:, 0])
        R = R + delta[:, :, t]
    torch.testing.assert_close(y, torch.stack(expected, 2))
    torch.testing.assert_close(ratings, R)
    torch.testing.assert_close(ratings.sum(-1), torch.zeros(1, 2), atol=1e-5, rtol=0)  # zero-sum matches


def test_elo_ratings_live_in_the_cache_and_survive_select_reorder_and_crop():
    model = knob_model(use_elo=True, use_memory_cache=False)
    ids = ids_batch(batch=3, seq=30)
    with torch.no_grad():
        full = model(ids).logits
        cache = SpikeWhaleCache(model.config)
        model(ids[:, :12], cache=cache, use_cache=True)
        assert cache.slot_state(0, "elo").shape == (3, 4, 12)
        # Select rows 2 and 0 (in that order), continue, compare with their full recompute.
        cache.batch_select_indices(torch.tensor([2, 0]))
        out = model(ids[[2, 0], 12:20], cache=cache, use_cache=True).logits
        torch.testing.assert_close(out, full[[2, 0], 12:20], rtol=0, atol=2e-6)
        cache.reorder_cache(torch.tensor([1, 0]))
        cache.activate_past_recording(recurrent_states_to_keep=4)  # the ratings at lengths 22..26 only
        model(ids[[0, 2], 20:26], cache=cache, use_cache=True)
        assert sorted({int(p) for p, _ in cache.layers[0].history["elo"]}) == [20, 22, 23, 24, 25]  # 26: live
        cache.crop(-4)  # remove the last 4: back to 22 positions
        assert cache.slot_state(0, "elo").shape[-1] == 22
        out = model(ids[[0, 2], 22:30], cache=cache, use_cache=True).logits
        torch.testing.assert_close(out, full[[0, 2], 22:30], rtol=0, atol=2e-6)
        cache.reset()
        assert cache.slot_state(0, "elo") is None


def test_sdpa_stays_the_default_without_derf_or_elo(monkeypatch):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    calls = []
    real = ALL_ATTENTION_FUNCTIONS["sdpa"]
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    ids = ids_batch(seq=6)
    with torch.no_grad():
        tiny_model()(ids)
        assert len(calls) == 8  # one per loop slot
        tiny_model(use_elo=True)(ids)
        tiny_model(use_derf=True)(ids)
    assert len(calls) == 8


# ---------------------------------------------------------------------------------------------------------------
# Loop, RoPE, residual knobs.


def layer_calls(model, ids):
    calls = []
    hooks = [layer.register_forward_hook(lambda m, i, o, idx=idx: calls.append(idx))
             for idx, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return calls


def test_middle_split_loops_only_the_middle_block():
    model = tiny_model(loop_mode="middle_split", loop_middle_layers=2, loop_count=3)
    assert layer_calls(model, ids_batch(seq=5)) == [0, 1, 2, 1, 2, 1, 2, 3]
    plan = LoopPlan.from_config(model.config)
    assert [i for i, s in enumerate(plan.pass_starts) if s] == [1, 3, 5]
    assert model.model.loop_pass_embed.weight.shape == (3, 64)
    # loop_count=1 is the dense stack; no pass embedding leaves no parameter behind.
    assert layer_calls(tiny_model(loop_count=1), ids_batch(seq=5)) == [0, 1, 2, 3]
    names = [n for n, _ in tiny_model(loop_pass_embed=False).named_parameters()]
    assert not any("loop_pass_embed" in n for n in names)


def test_fractal_rope_gamma_interpolates_between_geometric_and_cantor():
    geo = rope_inv_freq(16, 10000.0, False, 1.0)
    torch.testing.assert_close(rope_inv_freq(16, 10000.0, True, 0.0), geo, rtol=0, atol=0)
    cantor = rope_inv_freq(16, 10000.0, True, 1.0)
    half = rope_inv_freq(16, 10000.0, True, 0.5)
    e = lambda f: -torch.log(f.double()) / math.log(10000.0)  # noqa: E731
    torch.testing.assert_close(e(half), (e(geo) + e(cantor)) / 2)
    model = tiny_model(fractal_rope_gamma=0.5)
    torch.testing.assert_close(model.model.layers[0].attn.rope.inv_freq, rope_inv_freq(8, 10000.0, True, 0.5))


def test_plain_residual_qk_norm_and_xsa_switches_remove_their_parts():
    names = [n for n, _ in tiny_model(use_hyper_connections=False, use_qk_norm=False).named_parameters()]
    assert not any(s in n for n in names for s in ("hc_attn", "hc_ffn", "hc_out_mix", "q_norm", "k_norm"))
    # XSA makes each head's output orthogonal to the token's own value; use_xsa=False keeps that component.
    for xsa in (True, False):
        model = tiny_model(use_xsa=xsa)
        attn = model.model.layers[0].attn  # layer 0: no depth mixing, so v_self = v_proj(u)
        seen = {}
        attn.v_proj.register_forward_hook(lambda m, i, o: (seen.setdefault("v", o), None)[1])
        attn.o_a_proj.register_forward_hook(lambda m, i, o: (seen.setdefault("y", i[0]), None)[1])
        with torch.no_grad():
            model(ids_batch(seq=6))
        y = seen["y"].view(2, 6, 2, 2, 16)  # [B, S, kv heads, group, hd]
        v = seen["v"].view(2, 6, 2, 1, 16)
        along = (y * v / v.norm(dim=-1, keepdim=True)).sum(-1).abs()  # |<y, v̂>|
        assert (along.max() < 1e-6) if xsa else (along[:, 1:].min() > 1e-6 and along.mean() > 1e-3)


def test_hidden_dropout_acts_in_training_only():
    model = tiny_model(hidden_dropout=0.3)
    ids = ids_batch(seq=10)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, model(ids).logits)
        model.train()
        assert (model(ids).logits - model(ids).logits).abs().max() > 1e-4


# ---------------------------------------------------------------------------------------------------------------
# Engram.


def test_legacy_engram_hash_collapses_to_bucket_zero_and_lsh_does_not():
    """config.py: the pre-v3 hash `h.abs().long() % table_size` sent every token to bucket 0 (|h| = O(0.1))."""
    outs = {}
    for legacy in (True, False):
        cfg = tiny_config(hidden_size=256, num_attention_heads=4, engram_legacy_hash=legacy, engram_table_size=4096,
                          engram_compress_dim=32, engram_num_heads=2)
        torch.manual_seed(0)
        model = SpikeWhaleForCausalLM(cfg)
        engram = model.model.engram
        ids = ids_batch(batch=4, seq=64)
        with torch.no_grad():
            c = engram.compressor(model.model.embed_tokens(ids))
            buckets = [engram.lookup.bucket(torch.stack([c[:, k : 62 + k] for k in range(n)], 2), n)
                       for n in (1, 2, 3)]
        outs[legacy] = torch.cat([b.flatten() for b in buckets])
    assert outs[True].unique().tolist() == [0]
    assert outs[False].unique().numel() > 500
    # Bit-identical rule: trunc(|h|) mod T, with h = Σ_k <c_(t-n+1+k), P_{n,k}> per head.
    lookup = SpikeWhaleForCausalLM(tiny_config(engram_legacy_hash=True, engram_table_size=16)).model.engram.lookup
    window = torch.randn(2, 5, 2, 8) * 40
    h = window[:, :, 0] @ lookup.hash_proj_n2_p0.T + window[:, :, 1] @ lookup.hash_proj_n2_p1.T
    assert torch.equal(lookup.bucket(window, 2), torch.trunc(h.abs()).long() % 16)


def test_engram_fusion_is_a_zero_init_no_op_gated_by_agreement():
    base = tiny_model(seed=0)
    fused = tiny_model(seed=0, engram_fusion_layers=[1], engram_fusion_dim=16)
    transplant(fused, base)
    with torch.no_grad():
        fused.model.layers[1].engram_fusion.o_proj.weight.zero_()  # its init value (tiny_model opens it)
    ids = ids_batch(seq=12)
    with torch.no_grad():
        torch.testing.assert_close(fused(ids).logits, base(ids).logits, rtol=0, atol=0)
    module = fused.model.layers[1].engram_fusion
    assert fused.model.layers[0].engram_fusion is None
    assert module.q_proj.weight.shape == (16, 64) and module.o_proj.weight.shape == (64, 16)
    h, r = torch.randn(3, 64), torch.randn(3, 64)
    with torch.no_grad():
        module.o_proj.weight.normal_()
        k = module.k_proj(r)
        agree = torch.sigmoid((module.q_proj(module.norm(h)) * k).sum(-1, keepdim=True) / 4.0)
        torch.testing.assert_close(module(h, r), module.o_proj(agree * k))


def test_value_embed_is_a_zero_init_residual_on_the_attention_input():
    base = tiny_model(seed=0)
    ve = tiny_model(seed=0, use_value_embed=True)
    transplant(ve, base)
    names = dict(ve.named_parameters())
    assert names["model.layers.2.ve_gate"].shape == (1,)
    assert not any(torch.count_nonzero(p) for n, p in tiny_model(gates_open=False, use_value_embed=True)
                   .named_parameters() if "ve_gate" in n)
    ids = ids_batch(seq=12)
    with torch.no_grad():
        for n, p in names.items():
            if "ve_gate" in n:
                p.zero_()
        torch.testing.assert_close(ve(ids).logits, base(ids).logits, rtol=0, atol=0)
        names["model.layers.2.ve_gate"].fill_(0.7)
        assert (ve(ids).logits - base(ids).logits).abs().max() > 1e-4


# ---------------------------------------------------------------------------------------------------------------
# Heads.


def test_abstain_head_probability_and_threshold_are_exposed():
    model = tiny_model(use_abstain_head=True, abstain_threshold=0.55)
    ids = ids_batch(seq=10)
    with torch.no_grad():
        out = model(ids)
        h = out.last_hidden_state
        probs = torch.sigmoid(model.abstain_head(h).squeeze(-1))
        torch.testing.assert_close(out.abstain_probs, probs)
        assert torch.equal(out.abstain_mask, probs > 0.55) and out.abstain_threshold == 0.55
        last = model(ids, logits_to_keep=1)
        torch.testing.assert_close(last.abstain_probs, probs[:, -1:])
        cache = SpikeWhaleCache(model.config)
        first = model(ids[:, :4], cache=cache, use_cache=True).abstain_probs
        rest = model(ids[:, 4:], cache=cache, use_cache=True).abstain_probs
        torch.testing.assert_close(torch.cat([first, rest], 1), probs, rtol=0, atol=2e-6)
    assert tiny_model()(ids).abstain_probs is None


def test_abstain_loss_is_weighted_bce_toward_argmax_is_wrong():
    model = tiny_model(use_abstain_head=True, abstain_pos_weight=3.0).train()
    ids = ids_batch(seq=16)
    labels = ids.clone()
    labels[0, :6] = -100
    out = model(ids, labels=labels)
    with torch.no_grad():
        logit = model.abstain_head(out.last_hidden_state[:, :-1]).squeeze(-1)
        target = labels[:, 1:]
        wrong = (out.logits[:, :-1].argmax(-1) != target).float()
        keep = target != -100
        manual = F.binary_cross_entropy_with_logits(logit[keep], wrong[keep], pos_weight=torch.tensor(3.0))
    torch.testing.assert_close(out.abstain_loss, manual)


def test_several_mtp_heads_each_predict_further_ahead():
    model = tiny_model(num_nextn_predict_layers=3)
    ids = ids_batch(seq=16)
    with torch.no_grad():
        out = model(ids, labels=ids)
        h = out.last_hidden_state
        terms = [F.cross_entropy(model.lm_head(model.mtp_heads[k - 1](h[:, : -(k + 1)])).flatten(0, 1),
                                 ids[:, k + 1 :].flatten()) for k in (1, 2, 3)]
    torch.testing.assert_close(out.mtp_loss, torch.stack(terms).mean())
    assert len(model.mtp_heads) == 3


def test_hrm_deep_supervision_sums_the_ce_of_every_earlier_step():
    model = tiny_model(hrm_refine_steps=3)
    ids = ids_batch(seq=16)
    with torch.no_grad():
        out = model.model(ids)
        assert len(out.refinement_states) == 3
        lm = model(ids, labels=ids)
        ce = [F.cross_entropy(model.lm_head(s[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
              for s in out.refinement_states]
    torch.testing.assert_close(lm.hrm_loss, ce[0] + ce[1])
    torch.testing.assert_close(lm.lm_loss, ce[2])
    off = tiny_model(hrm_refine_steps=3, hrm_deep_supervision=False)
    with torch.no_grad():
        assert off(ids, labels=ids).hrm_loss is None


# ---------------------------------------------------------------------------------------------------------------
# The 15M sibling.


def test_byrne_15m_looped_preset_builds_and_trains():
    cfg = SpikeWhaleConfig.from_preset("byrne-15m-looped")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.loop_count, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim, cfg.qk_rope_head_dim) == (384, 10, 3, 8, 1, 64, 32)
    moe = (cfg.n_routed_experts, cfg.n_shared_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size)
    assert moe == (4, 1, 2, 160)
    assert cfg.use_elo and cfg.use_abstain_head and cfg.hrm_refine_steps == 3 and cfg.hrm_deep_supervision
    assert cfg.engram_table_size == 1024 and cfg.use_xsa and cfg.use_hyper_connections and not cfg.use_memory_cache
    assert cfg.num_loop_slots == 30
    torch.manual_seed(0)
    model = SpikeWhaleForCausalLM(cfg).train()
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert abs(total - 18.9e6) < 0.3e6 and abs(total - routed / 2 - 15.2e6) < 0.3e6  # the card: ~18.9M / ~15.2M
    ids = ids_batch(seq=16)
    out = model(ids, labels=ids)
    for term in (out.lm_loss, out.z_loss, out.mtp_loss, out.hrm_loss, out.abstain_loss, out.moe_aux_loss):
        assert term is not None and torch.isfinite(term)
    out.loss.backward()
    named = dict(model.named_parameters())
    for key in ("model.layers.5.ffn.experts.0.up_proj.weight", "model.layers.5.ffn.gate.weight",
                "model.layers.3.attn.elo_gain", "abstain_head.weight", "model.hrm_refine.up.weight"):
        assert named[key].grad is not None and named[key].grad.abs().sum() > 0, key
