"""The one-token decode path (`DecodeStep` / `decode_run`) and its `torch.compile`d form.

Every other generation test already decodes through `DecodeStep` where it applies; these tests pin down where
it applies, that it computes the same function as the general chunk path (and a full recompute), and that
`compile_decode()` does too.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from packaging import version

from spike_whale import modeling_spike_whale as msw

from conftest import tiny_model

L = 8  # Memory-Cache segment length of the tiny config
TOL = 1e-5


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3)


def count_decode_steps(monkeypatch):
    calls = []
    run = msw.DecodeStep.run

    def counted(self, *args, **kwargs):
        calls.append(self.start)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(msw.DecodeStep, "run", counted)
    return calls


def decode_logits(model, ids, mask, prefill: int) -> torch.Tensor:
    """Logits of a prefill of `prefill` positions followed by one-token steps over the rest of `ids`."""
    with torch.no_grad():
        out = model(ids[:, :prefill], attention_mask=mask[:, :prefill], use_cache=True)
        cache, got = out.cache, [out.logits]
        for t in range(prefill, ids.shape[1]):
            got.append(model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache, use_cache=True).logits)
    return torch.cat(got, 1)


def batch(seed: int = 0):
    """Two rows, the second left-padded by 3, 4 * L positions (so decode crosses 3 segment boundaries)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 500, (2, 4 * L), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids[1, :3] = 0
    return ids, mask


def test_decode_step_runs_where_it_applies_and_equals_the_general_path(model, monkeypatch):
    ids, mask = batch()
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
    calls = count_decode_steps(monkeypatch)
    fast = decode_logits(model, ids, mask, prefill=5)
    # Every one-token step but those whose token opens a new segment in some row (row 0 at 8, 16, 24; row 1,
    # three positions behind, at 11, 19, 27).
    opening = {8, 16, 24, 11, 19, 27}
    assert calls == [t for t in range(5, 4 * L) if t not in opening]
    monkeypatch.setattr(msw.DecodeStep, "applies", staticmethod(lambda model, ctx: False))
    general = decode_logits(model, ids, mask, prefill=5)
    real = mask.bool()
    assert float((fast - general)[real].abs().max()) <= TOL
    assert float((fast - full)[real].abs().max()) <= TOL


@pytest.mark.parametrize("config", [dict(use_memory_cache=False), dict(use_hyper_connections=False, use_derf=True),
                                    dict(use_depth_attention=False, loop_mode="middle_split", num_hidden_layers=5)])
def test_decode_step_on_other_configs(config, monkeypatch):
    model = tiny_model(seed=4, **config)
    ids, mask = batch(seed=1)
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
    calls = count_decode_steps(monkeypatch)
    fast = decode_logits(model, ids, mask, prefill=3)
    assert calls, "the one-token path never ran"
    assert float((fast - full)[mask.bool()].abs().max()) <= TOL


def test_general_path_where_decode_step_does_not_apply(monkeypatch):
    model = tiny_model(seed=5, use_elo=True)
    calls = count_decode_steps(monkeypatch)
    ids, mask = batch(seed=2)
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
    got = decode_logits(model, ids, mask, prefill=4)
    assert calls == []
    assert float((got - full)[mask.bool()].abs().max()) <= TOL
    with pytest.raises(ValueError, match="Elo attention"):
        model.compile_decode()


def test_compile_decode_equals_eager(model, monkeypatch, tmp_path):
    torch._dynamo.reset()
    calls = count_decode_steps(monkeypatch)
    ids = torch.randint(10, 500, (1, L + 2), generator=torch.Generator().manual_seed(7))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        eager = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, output_logits=True,
                               return_dict_in_generate=True)
        model.compile_decode()
        gate = model.model.layers[0].ffn.gate_proj.weight
        assert gate.stride() == (1, gate.shape[0])  # FFN weights stored column-major, same values
        o_b = model.model.layers[0].attn.o_b_proj.weight
        assert o_b.stride() == (1, o_b.shape[0])  # and the rank→hidden up-projections
        assert all(layer.attn.fused_input is not None for layer in model.model.layers)
        after = model.state_dict()
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
        model.save_pretrained(tmp_path)
        reloaded = type(model).from_pretrained(tmp_path).eval()
        assert torch.equal(reloaded(ids).logits, model(ids).logits)
        try:
            assert model.model._decode_run is not msw.decode_run
            compiled = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, output_logits=True,
                                      return_dict_in_generate=True)
        finally:
            model.compile_decode(enable=False)
    assert model.model._decode_run is msw.decode_run
    assert all(layer.attn.fused_input is None for layer in model.model.layers)
    assert len(calls) == 10  # 5 decode steps in each generate, all inside segment 1 (one compiled graph)
    assert torch.equal(eager.sequences, compiled.sequences)
    assert max(float((a - b).abs().max()) for a, b in zip(eager.logits, compiled.logits)) <= TOL


def test_fused_input_projections_share_storage_and_refuse_after_rebinding(monkeypatch):
    model = tiny_model(seed=6)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for layer in model.model.layers:
        layer.attn.fuse_input_projections()
    attn = model.model.layers[0].attn
    fused = attn.fused_input
    assert fused.linears == (attn.q_a_proj, attn.k_proj, attn.v_proj, attn.mc.qkv_proj, attn.mc.gate_proj)
    start = fused.weight.data_ptr()
    end = start + fused.weight.numel() * fused.weight.element_size()
    assert all(start <= lin.weight.data_ptr() < end for lin in fused.linears)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)

    calls = count_decode_steps(monkeypatch)
    ids, mask = batch(seed=3)
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
        got = decode_logits(model, ids, mask, prefill=3)
        assert calls
        assert float((got - full)[mask.bool()].abs().max()) <= TOL
        # New storage for one weight (what .to() / .half() / assignment do): the next decode step fuses again.
        attn.k_proj.weight.data = attn.k_proj.weight.data * 1.5
        assert not fused.intact()
        full = model(ids, attention_mask=mask, use_cache=False).logits
        got = decode_logits(model, ids, mask, prefill=3)
    assert attn.fused_input is not fused and attn.fused_input.intact()
    assert float((got - full)[mask.bool()].abs().max()) <= TOL


def test_fused_input_projections_keep_the_memory_cache_in_float32():
    model = tiny_model(seed=6).to(torch.bfloat16)
    attn = model.model.layers[0].attn
    attn.fuse_input_projections()
    assert attn.fused_input.linears == (attn.q_a_proj, attn.k_proj, attn.v_proj)  # the MC branch computes in fp32
    model = tiny_model(seed=6)
    attn = model.model.layers[0].attn
    attn.fuse_input_projections()
    u = torch.randn(1, 1, model.config.hidden_size)
    assert attn._fused_projections(u) is not None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert attn._fused_projections(u) is None  # autocast would run the fp32 MC projections in bf16
    attn.fuse_input_projections(enable=False)
    assert attn.fused_input is None


def test_compile_decode_refuses_a_moved_or_retyped_model():
    model = tiny_model(seed=8)
    model.compile_decode()
    model.to(torch.float64)
    ids = torch.randint(10, 500, (1, 6))
    with torch.no_grad():
        cache = model(ids, use_cache=True).cache  # prefill takes the general path
        with pytest.raises(ValueError, match="call model.compile_decode\\(\\) again"):
            model(ids[:, :1], cache=cache, use_cache=True)
    model.compile_decode(enable=False)
    with torch.no_grad():
        assert model(ids[:, :1], cache=cache, use_cache=True).logits.dtype == torch.float64


def test_compile_decode_with_the_cpp_wrapper_equals_eager():
    model = tiny_model(seed=3)
    ids = torch.randint(10, 500, (1, L + 2), generator=torch.Generator().manual_seed(9))
    kw = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        eager = model.generate(ids, **kw)
        model.compile_decode(options={"cpp_wrapper": True})
        compiled = model.generate(ids, **kw)
    assert torch.equal(eager.sequences, compiled.sequences)
    assert max(float((a - b).abs().max()) for a, b in zip(eager.logits, compiled.logits)) <= TOL


@pytest.mark.skipif(
    version.parse(transformers.__version__) < version.parse("5.24"),
    reason="transformers < 5.24 refuses assisted decoding with a compileable cache, so the loop-slot cache declares "
    "itself not compileable there and compile_config does not apply; model.compile_decode() compiles the same step",
)
def test_generate_compile_config_compiles_the_decode_step_through_the_standard_switch(monkeypatch):
    """transformers' own switch, `generate(..., compile_config=CompileConfig(...))`, compiles the one-token decode step
    (no model-specific call) and gives the eager ids; prefill stays eager."""
    from transformers import CompileConfig

    model = tiny_model(seed=3)
    ids = torch.randint(5, 200, (2, 9), generator=torch.Generator().manual_seed(3))
    eager = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert model.model._decode_run is msw.decode_run
    compiled = model.generate(ids, max_new_tokens=4, do_sample=False, compile_config=CompileConfig(backend="eager"))
    assert model.model._decode_run is not msw.decode_run  # compile_decode ran through get_compiled_call
    assert torch.equal(compiled, eager)
    assert msw.SpikeWhaleCache(model.config).is_compileable
