import json

import pytest
import torch
from conftest import open_gates, tiny_model
from safetensors import safe_open

from spike_whale import SpikeWhaleCache, SpikeWhaleConfig, SpikeWhaleForCausalLM, SpikeWhaleLM
from spike_whale.modeling_spike_whale import HyperConnection, rope_inv_freq

# Per-layer names the blueprint marks certain (architecture.md §2.1), relative to model.layers.{i}.
CERTAIN_LAYER_KEYS = {
    "attn_norm.weight", "attn.q_a_proj.weight", "attn.q_a_norm.weight", "attn.q_b_proj.weight", "attn.k_proj.weight",
    "attn.v_proj.weight", "attn.o_a_proj.weight", "attn.o_b_proj.weight", "attn.q_norm.weight", "attn.k_norm.weight",
    "attn.rope.inv_freq", "attn.rope.cos_cache", "attn.rope.sin_cache", "ffn_norm.weight", "ffn.gate_proj.weight",
    "ffn.up_proj.weight", "ffn.down_proj.weight",
}
CERTAIN_GLOBAL_KEYS = {
    "model.embed_tokens.weight", "model.engram.compressor.proj.weight", "model.engram.lookup.tables.0.weight",
    "model.engram.lookup.tables.1.weight", "model.norm.weight", "model.hrm_refine.norm.weight",
    "model.hrm_refine.down.weight", "model.hrm_refine.up.weight", "model.hrm_refine.gate", "mtp_heads.0.proj.weight",
} | {f"model.engram.lookup.hash_proj_n{n}_p{k}" for n in (1, 2, 3) for k in range(n)}


def _meta_model(preset):
    with torch.device("meta"):
        model = SpikeWhaleForCausalLM(SpikeWhaleConfig.from_preset(preset))
    model.tie_weights()  # transformers 5.0 does not tie on the meta device (from_pretrained ties on every version)
    return model


def test_byrne_100m_preset_counts_and_names():
    model = _meta_model("byrne-100m-ultra-mc")
    assert sum(p.numel() for p in model.parameters()) == 113_916_322
    stored = [k for k in model.state_dict() if k != "lm_head.weight"]
    assert len(stored) == 502
    keys = set(stored)
    for i in range(16):
        assert {f"model.layers.{i}.{k}" for k in CERTAIN_LAYER_KEYS} <= keys
        assert (f"model.layers.{i}.attn.depth_gate" in keys) == (i > 0)
        assert len([k for k in keys if k.startswith(f"model.layers.{i}.attn.mc.")]) == 8
    assert CERTAIN_GLOBAL_KEYS <= keys
    assert model.model.layers[0].attn.rope.cos_cache.shape == (1024, 8)
    assert model.model.engram.lookup.hash_proj_n3_p2.shape[0] == 2
    assert SpikeWhaleLM is SpikeWhaleForCausalLM


def test_nomc_twin_and_sft_counts():
    assert sum(p.numel() for p in _meta_model("byrne-100m-nomc-stdrope").parameters()) == 106_032_018
    sft = _meta_model("byrne-100m-ultra-mc-sft")
    assert sum(p.numel() for p in sft.parameters()) == 113_916_322
    assert sft.model.layers[3].attn.rope.sin_cache.shape == (4096, 8)


def test_fractal_rope_schedule():
    geo = rope_inv_freq(16, 10000.0, fractal=False, gamma=1.0)
    frac = rope_inv_freq(16, 10000.0, fractal=True, gamma=1.0)
    assert abs((frac - geo).abs().max().item() - 0.2218) < 5e-4
    cantor = [0, 2, 6, 8, 18, 20, 24, 26]
    expected = torch.tensor([10000.0 ** (-7 * k / 208) for k in cantor])
    torch.testing.assert_close(frac, expected, rtol=1e-6, atol=0)
    assert torch.equal(rope_inv_freq(16, 10000.0, fractal=True, gamma=0.0), geo)
    half = rope_inv_freq(16, 10000.0, fractal=True, gamma=0.5)
    assert ((half > torch.minimum(geo, frac) - 1e-7) & (half < torch.maximum(geo, frac) + 1e-7)).all()
    model = tiny_model()
    rope = model.model.layers[0].attn.rope
    pos = torch.arange(rope.cos_cache.shape[0]).float()
    torch.testing.assert_close(rope.cos_cache, torch.cos(pos[:, None] * rope.inv_freq[None]), rtol=0, atol=1e-6)


def _reference_memory_cache(mc, u, seg_len):
    """The card's equations, token by token and segment by segment (no vectorisation, no state)."""
    B, S, _ = u.shape
    nh, hd, gd = mc.nh, mc.hd, mc.gd
    x = u.float()
    q, k, v = torch.nn.functional.linear(x, mc.qkv_proj.weight, mc.qkv_proj.bias).view(B, S, 3, nh, hd).unbind(2)
    phi = lambda t: torch.nn.functional.elu(t * mc.feature_scale) + 1  # noqa: E731
    fq, fk = phi(q), phi(k)
    g = torch.nn.functional.linear(x, mc.gate_proj.weight)
    u_t, key = g[..., :gd] + mc.gate_bias, g[..., gd:]
    out = torch.zeros(B, S, nh * hd)
    for b in range(B):
        for t in range(S):
            s = t // seg_len
            nums, dens, logits = [], [], []
            for i in range(s + 1):
                lo, hi = i * seg_len, (t + 1 if i == s else (i + 1) * seg_len)
                M = torch.einsum("mhd,mhe->hde", fk[b, lo:hi], v[b, lo:hi])
                z = fk[b, lo:hi].sum(0)
                nums.append(torch.einsum("hd,hde->he", fq[b, t], M))
                dens.append((fq[b, t] * z).sum(-1))
                logits.append(u_t[b, t] @ key[b, lo:hi].mean(0))
            gamma = torch.softmax(torch.stack(logits), 0)
            num = sum(gm * n for gm, n in zip(gamma, nums))
            den = sum(gm * d for gm, d in zip(gamma, dens))
            out[b, t] = (num / (den[:, None] + mc.eps)).reshape(-1)
    return torch.tanh(mc.mc_gate) * torch.nn.functional.linear(out, mc.o_proj.weight, mc.o_proj.bias)


@pytest.mark.parametrize("seq_len", [5, 8, 27])
def test_memory_cache_matches_card_equations(seq_len):
    model = tiny_model()
    mc = model.model.layers[1].attn.mc
    torch.manual_seed(3)
    with torch.no_grad():
        mc.feature_scale.uniform_(0.5, 1.5)
        u = torch.randn(2, seq_len, model.config.hidden_size)
        ctx = model.model._context(2, seq_len, u.device, None, None, None, False)
        fast, _, _ = mc(u, ctx, None)  # no cache: no state before or after
        ref = _reference_memory_cache(mc, u, model.config.mc_segment_len)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-6)
    assert fast.abs().max() > 1e-3


@pytest.mark.parametrize("streams", [2, 3])
def test_hyper_connection_reads_the_softmax_weighted_sum_of_its_streams(streams):
    """pre: h = Σ_j softmax(a)_j X_j for any number of streams (two take X₀ + w₁(X₁ − X₀), one pass), gradients
    included; post: X_j + b_j · out."""
    g = torch.Generator().manual_seed(streams)
    hc = HyperConnection(streams)
    with torch.no_grad():
        hc.pre_logits.copy_(torch.randn(streams, generator=g))
        hc.post_scale.copy_(torch.randn(streams, generator=g))
    X = torch.randn(2, streams, 5, 8, generator=g, requires_grad=True)
    got = hc.pre_op(X)
    want = torch.einsum("j,bjsh->bsh", torch.softmax(hc.pre_logits, 0), X)
    assert got.shape == want.shape and (got - want).abs().max() <= 1e-6
    r = torch.randn(want.shape, generator=g)
    for a, b in zip(torch.autograd.grad((got * r).sum(), (X, hc.pre_logits)),
                    torch.autograd.grad((want * r).sum(), (X, hc.pre_logits))):
        assert (a - b).abs().max() <= 1e-6
    out = torch.randn(2, 5, 8, generator=g)
    assert torch.allclose(hc.post_op(X, out), X + hc.post_scale.view(1, -1, 1, 1) * out[:, None], atol=1e-6)


def test_every_gated_mechanism_changes_the_output():
    torch.manual_seed(0)
    ids = torch.randint(4, 16000, (1, 20))
    model = tiny_model()
    with torch.no_grad():
        base = model(ids).logits
        for name in ("mc.mc_gate", "attn.depth_gate", "loop_pass_embed", "hrm_refine.up", "hc_attn.pre_logits",
                     "hc_ffn.post_scale", "hc_out_mix", "engram.gate.gamma"):
            params = [p for n, p in model.named_parameters() if name in n]
            assert params, name
            saved = [p.clone() for p in params]
            for p in params:
                p.zero_()
            changed = (model(ids).logits - base).abs().max().item()
            for p, s in zip(params, saved):
                p.copy_(s)
            assert changed > 1e-4, f"zeroing {name} did not change the logits"


def test_zero_init_gates_make_the_extras_no_ops_at_init():
    """Fresh init: MC gate, depth gates, pass embeddings, HRM up and MTP proj are exactly zero."""
    model = tiny_model(gates_open=False)
    named = dict(model.named_parameters())
    for key in ("model.layers.1.attn.mc.mc_gate", "model.layers.1.attn.depth_gate", "model.loop_pass_embed.weight",
                "model.hrm_refine.up.weight", "mtp_heads.0.proj.weight"):
        assert torch.count_nonzero(named[key]) == 0, key
    assert torch.all(named["model.hrm_refine.gate"] == 1.0)
    assert not named["model.engram.compressor.proj.weight"].requires_grad


def test_chunked_cache_equals_full_recompute_with_padding():
    model = tiny_model()
    torch.manual_seed(1)
    ids = torch.randint(4, 16000, (2, 37))
    mask = torch.ones_like(ids)
    ids[1, :6], mask[1, :6] = 0, 0
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        alone = model(ids[1:, 6:]).logits
        cache, outs, p = SpikeWhaleCache(model.config), [], 0
        for n in (9, 1, 1, 3, 8, 15):
            outs.append(model(ids[:, p:p + n], attention_mask=mask[:, :p + n], cache=cache, use_cache=True).logits)
            p += n
    inc = torch.cat(outs, 1)
    torch.testing.assert_close(inc[0], full[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(inc[1, 6:], alone[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(full[1, 6:], alone[0], rtol=0, atol=1e-5)
    assert cache.get_seq_length() == 37 and len(cache.layers) == model.config.num_loop_slots


def test_bad_inputs_raise_clear_errors():
    model = tiny_model()
    limit = model.config.max_position_embeddings
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(torch.full((1, limit + 1), 5))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model(torch.tensor([[5, model.config.vocab_size]]))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model(torch.tensor([[-1, 5]]))
    with pytest.raises(ValueError, match="inputs_embeds"):
        model(inputs_embeds=torch.zeros(1, 3, model.config.hidden_size + 1))
    with pytest.raises(ValueError, match="attention_mask"):
        model(torch.tensor([[5, 6, 7]]), attention_mask=torch.ones(1, 5))
    with pytest.raises(TypeError, match="SpikeWhaleCache"):
        from transformers import DynamicCache

        cache = DynamicCache()
        cache.update(torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16), 0)
        model(torch.tensor([[5]]), cache=cache, use_cache=True)


def test_inputs_embeds_equals_input_ids():
    model = tiny_model()
    ids = torch.randint(4, 16000, (2, 11))
    with torch.no_grad():
        a = model(ids).logits
        b = model(inputs_embeds=model.get_input_embeddings()(ids)).logits
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_labels_give_all_loss_terms_and_respect_ignore_index():
    model = tiny_model().train()
    ids = torch.randint(4, 16000, (2, 24))
    out = model(ids, labels=ids)
    for term in (out.loss, out.lm_loss, out.z_loss, out.mtp_loss):
        assert term is not None and torch.isfinite(term)
    expected = out.lm_loss + model.config.zloss_coef * out.z_loss + model.config.mtp_loss_weight * out.mtp_loss
    torch.testing.assert_close(out.loss, expected)
    out.loss.backward()
    assert model.model.embed_tokens.weight.grad is not None
    assert model.model.engram.compressor.proj.weight.grad is None
    labels = ids.clone()
    labels[:, :12] = -100
    mask = torch.ones_like(ids)
    mask[1, 20:] = 0
    with torch.no_grad():
        a = model.eval()(ids, labels=labels).lm_loss
        ref = torch.nn.functional.cross_entropy(model(ids).logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        torch.testing.assert_close(a, ref)
        masked = model(ids, labels=ids, attention_mask=mask).lm_loss
        manual = ids.clone()
        manual[1, 20:] = -100
        torch.testing.assert_close(masked, model(ids, labels=manual, attention_mask=mask).lm_loss)


def test_bfloat16_forward_keeps_memory_cache_in_float32():
    model = tiny_model().to(torch.bfloat16)
    ids = torch.randint(4, 16000, (1, 19))
    with torch.no_grad():
        out = model(ids).logits
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


@pytest.mark.parametrize("dtype, cast", [
    (torch.bfloat16, lambda m: m.to(torch.bfloat16)),
    (torch.bfloat16, lambda m: m.bfloat16()),
    (torch.float16, lambda m: m.to("cpu", torch.float16)),
    (torch.float16, lambda m: m.half()),
])
def test_a_cast_model_keeps_float32_where_a_load_in_that_dtype_does(tmp_path, dtype, cast):
    """`.to(dtype)` / `.half()` / `.bfloat16()` leave the RoPE caches, the Engram hash projections and the
    Memory-Cache branch float32 with their original values, as `from_pretrained(dtype=...)` does: the same tensors,
    dtypes and logits."""
    source = tiny_model(seed=4)
    source.save_pretrained(tmp_path)
    loaded = SpikeWhaleForCausalLM.from_pretrained(tmp_path, dtype=dtype).eval()
    model = cast(tiny_model(seed=4))
    got, want, original = model.state_dict(), loaded.state_dict(), source.state_dict()
    assert {k: v.dtype for k, v in got.items()} == {k: v.dtype for k, v in want.items()}
    kept = [k for k, v in got.items() if v.dtype == torch.float32]
    assert any(".attn.mc." in k for k in kept) and any("hash_proj" in k for k in kept)
    assert any("rope.cos_cache" in k for k in kept) and any(".lookup.tables." in k for k in got if k not in kept)
    assert all(torch.equal(got[k], original[k]) for k in kept)  # never rounded, then widened back
    assert got["model.embed_tokens.weight"].dtype == dtype
    ids = torch.randint(4, 16000, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    assert all(v.dtype == torch.float32 for v in model.float().state_dict().values())
    assert all(v.dtype == torch.float64 for v in model.double().state_dict().values() if v.is_floating_point())


def test_save_then_load_in_fresh_process(tmp_path, fresh_python):
    from spike_whale.hub_export.folder import save_hub_folder
    from spike_whale.hub_export.init_tiny import build_tiny

    model, tok = build_tiny(seed=3, **{"mc_segment_len": 8})
    open_gates(model)
    folder = tmp_path / "tiny"
    save_hub_folder(model, tok, folder)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert "model.layers.0.attn.rope.cos_cache" in names and "model.engram.lookup.hash_proj_n2_p1" in names
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_spike_whale.SpikeWhaleForCausalLM"
    for f in ("modeling_spike_whale.py", "configuration_spike_whale.py", "generation_utils.py", "tokenization_spike.py"):
        assert (folder / f).exists(), f
    ids = tok("The whale sings. Hello world, this is a longer prompt!")["input_ids"]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits
    torch.save(ref, tmp_path / "ref.pt")
    out = fresh_python(f"""
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        model, info = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True, output_loading_info=True)
        tok = AutoTokenizer.from_pretrained({str(folder)!r}, trust_remote_code=True)
        assert not any(info.values()), info
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        ids = tok("The whale sings. Hello world, this is a longer prompt!")["input_ids"]
        assert ids == {ids!r}, ids
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits
        print("MAXDIFF", (logits - torch.load({str(tmp_path / 'ref.pt')!r})).abs().max().item())
    """)
    assert float(out.split("MAXDIFF")[1]) == 0.0
