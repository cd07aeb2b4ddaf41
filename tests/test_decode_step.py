"""The one-token decode step: the model's one forward (`walk_run` over the loop plan, each attention picking the
one-query kernel) and its `torch.compile`d form.

These tests pin down that no second decode driver exists, that a decode step goes through `forward` with the one-query
kernel, that it equals a full recompute, that `compile_decode()` (and transformers' `compile_config`) compile
the same walk without graph breaks and give the same logits, and that transformers' own whole-forward compile runs
every decode step as one graph.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from packaging import version

from spike_whale import modeling_spike_whale as msw
from spike_whale.generation_utils import CACHE_FIELD, LoopSlotLayer, SpikeWhaleCache

from conftest import tiny_model

L = 8  # Memory-Cache segment length of the tiny config
TOL = 1e-5


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3)


def count_decode_steps(monkeypatch):
    """The write offsets of the forwards that ran through the compiled walk."""
    calls = []
    compiles = msw.SpikeWhaleModel._decode_step_compiles

    def counted(self, ctx, cache):
        out = compiles(self, ctx, cache)
        if out:
            calls.append(ctx.past)
        return out

    monkeypatch.setattr(msw.SpikeWhaleModel, "_decode_step_compiles", counted)
    return calls


def count_one_query_kernels(monkeypatch):
    calls = []
    kernel = msw.decode_attention

    def counted(q, k, v, mask):
        calls.append(k.shape[2])
        return kernel(q, k, v, mask)

    monkeypatch.setattr(msw, "decode_attention", counted)
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


def test_no_second_decode_driver_exists():
    for name in ("DecodeStep", "decode_run", "decode_block"):
        assert not hasattr(msw, name), name
    assert not hasattr(msw.SpikeWhaleAttention, "decode") and not hasattr(msw.MemoryCacheBranch, "decode")
    assert not hasattr(LoopSlotLayer, "mark_written")


def test_decode_step_goes_through_forward_with_the_one_query_kernel(model, monkeypatch):
    ids, mask = batch()
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
    forwards = []
    attention_forward = msw.SpikeWhaleAttention.forward

    def counted(self, u, ctx, state, depth_sources):
        forwards.append(u.shape[1])
        return attention_forward(self, u, ctx, state, depth_sources)

    monkeypatch.setattr(msw.SpikeWhaleAttention, "forward", counted)
    kernels = count_one_query_kernels(monkeypatch)
    got = decode_logits(model, ids, mask, prefill=5)
    slots = model.config.num_loop_slots
    steps = 4 * L - 5
    assert forwards == [5] * slots + [1] * (slots * steps)  # every slot's attention forward, the prefill's and each step's
    # Each step, segment openings included (row 0 at 8, 16, 24; row 1 at 11, 19, 27), reads the cache with the
    # one-query kernel, over everything cached so far.
    assert kernels == [t + 1 for t in range(5, 4 * L) for _ in range(slots)]
    assert float((got - full)[mask.bool()].abs().max()) <= TOL


@pytest.mark.parametrize("config", [dict(use_memory_cache=False), dict(use_hyper_connections=False, use_derf=True),
                                    dict(use_depth_attention=False, loop_mode="middle_split", num_hidden_layers=5)])
def test_decode_step_on_other_configs(config, monkeypatch):
    model = tiny_model(seed=4, **config)
    ids, mask = batch(seed=1)
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
    fast = decode_logits(model, ids, mask, prefill=3)
    assert float((fast - full)[mask.bool()].abs().max()) <= TOL


def test_elo_decodes_through_forward_and_refuses_compile_decode(monkeypatch):
    model = tiny_model(seed=5, use_elo=True)
    kernels = count_one_query_kernels(monkeypatch)
    ids, mask = batch(seed=2)
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
    got = decode_logits(model, ids, mask, prefill=4)
    assert kernels == []  # Elo attention is its own kernel, with the cached ratings
    assert float((got - full)[mask.bool()].abs().max()) <= TOL
    with pytest.raises(ValueError, match="Elo attention"):
        model.compile_decode()


def test_compile_decode_stores_only_float32_weights_column_major():
    """The column-major re-store is for float32 weights, where MKL reads it faster: a bf16 model keeps its weights
    row-major (column-major bf16 weights made the compiled 114M decode step on a CPU without bf16 instructions
    4.4x slower than eager bf16, 1,028 against 234 ms: there a one-row bf16 GEMM on a column-major weight is ~28x
    slower)."""
    model = tiny_model(seed=3).to(torch.bfloat16)
    gate = model.model.layers[0].ffn.gate_proj.weight
    try:
        model.compile_decode()
        assert gate.stride() == (gate.shape[1], 1)
        assert all(layer.attn.fused_input is not None for layer in model.model.layers)
    finally:
        model.compile_decode(enable=False)


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
        # The same values; a prompt of <= FEW_ROWS_MAX rows takes another kernel on the re-stored column-major weights.
        assert float((reloaded(ids).logits - model(ids).logits).abs().max()) <= TOL
        try:
            assert model.model._compiled_run is not None
            compiled = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, output_logits=True,
                                      return_dict_in_generate=True)
        finally:
            model.compile_decode(enable=False)
    assert model.model._compiled_run is None
    assert all(layer.attn.fused_input is None for layer in model.model.layers)
    assert calls == [10, 11, 12, 13, 14]  # the compiled generate's 5 decode steps, all inside segment 1
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

    ids, mask = batch(seed=3)
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
        got = decode_logits(model, ids, mask, prefill=3)
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
    assert attn._fused_projections(u) is None  # with gradients on: the fused copy does not train
    with torch.no_grad():
        assert attn._fused_projections(u) is not None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert attn._fused_projections(u) is None  # autocast would run the fp32 MC projections in bf16
    attn.fuse_input_projections(enable=False)
    assert attn.fused_input is None


def test_eager_no_grad_forwards_fuse_input_projections_and_training_does_not(monkeypatch):
    """An eager no-grad forward in eval fuses each attention's (q_a, k, v, the Memory Cache's qkv and gate) and each
    dense FFN's (gate, up) input projections, which its decode steps (few rows) then read as one GEMM, without
    changing the state dict or the function; a forward with gradients, or in train mode, does not fuse."""
    model = tiny_model(seed=6)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids, mask = batch(seed=3)
    calls = []
    call = msw.FusedLinears.__call__
    monkeypatch.setattr(msw.FusedLinears, "__call__", lambda self, x: calls.append(x.shape) or call(self, x))
    model(ids, attention_mask=mask, use_cache=False)  # gradients on
    with torch.no_grad():
        model.train()
        model(ids, attention_mask=mask, use_cache=False)
        model.eval()
        assert all(layer.attn.fused_input is None and layer.ffn.fused_input is None for layer in model.model.layers)
        full = model(ids, attention_mask=mask, use_cache=False).logits
        ffn = model.model.layers[0].ffn
        assert ffn.fused_input is not None and ffn.fused_input.linears == (ffn.gate_proj, ffn.up_proj)
        assert all(layer.attn.fused_input is not None for layer in model.model.layers)
        assert calls == []  # the whole batch is more than FEW_ROWS_MAX rows: one projection at a time
        got = decode_logits(model, ids, mask, prefill=3)
        assert calls and all(shape[0] * shape[1] <= msw.FEW_ROWS_MAX for shape in calls)
        monkeypatch.setattr(msw.SpikeWhaleModel, "_fuse_input_projections", lambda self: None)
        for layer in model.model.layers:
            layer.attn.fuse_input_projections(enable=False)
            layer.ffn.fuse_input_projections(enable=False)
        calls.clear()
        plain = decode_logits(model, ids, mask, prefill=3)
        assert calls == []
    assert float((got - full)[mask.bool()].abs().max()) <= TOL
    assert float((got - plain)[mask.bool()].abs().max()) <= TOL
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_hooked_or_wrapped_input_projections_run_one_by_one():
    """A forward hook (on the Linear or on every module), a replaced forward or a wrapper class makes the Linear's call
    more than x·Wᵀ + b, so the fused GEMM must not stand in for it."""
    model = tiny_model(seed=6)
    ids, mask = batch(seed=3)
    with torch.no_grad():
        model(ids[:, :2], attention_mask=mask[:, :2])
    attn = model.model.layers[0].attn
    assert attn.fused_input is not None and attn.fused_input.intact()
    seen = []
    handle = attn.v_proj.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    with torch.no_grad():
        decode_logits(model, ids[:, :6], mask[:, :6], prefill=3)
    runs = sum(layer_idx == 0 for layer_idx, _ in model.model.loop_plan.entries)  # layer 0 runs once per pass
    assert attn.fused_input is None and len(seen) == 4 * runs  # the prefill and 3 steps
    handle.remove()
    with torch.no_grad():
        model(ids[:, :2], attention_mask=mask[:, :2])
    assert attn.fused_input is not None
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
    try:
        assert not attn.fused_input.intact()
    finally:
        handle.remove()
    assert attn.fused_input.intact()
    attn.k_proj.forward = attn.k_proj.forward  # what accelerate's add_hook_to_module does
    assert not attn.fused_input.intact() and not msw.FusedLinears.fusable(attn.input_linears())
    del attn.k_proj.forward

    class Adapter(torch.nn.Linear):  # a PEFT-style wrapper adds its own product
        pass

    attn.q_a_proj.__class__ = Adapter
    assert not msw.FusedLinears.fusable(attn.input_linears())


def test_input_projections_of_offloaded_or_mixed_weights_are_not_fused():
    model = tiny_model(seed=6)
    ffn = model.model.layers[0].ffn
    ffn.up_proj.weight.data = ffn.up_proj.weight.data.to(torch.bfloat16)
    ffn.fuse_input_projections()
    assert ffn.fused_input is None
    meta = tiny_model(seed=6).to("meta")  # what accelerate's offload leaves between calls
    ffn = meta.model.layers[0].ffn
    ffn.fuse_input_projections()
    assert ffn.fused_input is None


def test_compile_decode_unfuses_the_ffn_that_eager_decoding_fused():
    model = tiny_model(seed=8)
    ids, mask = batch(seed=3)
    with torch.no_grad():
        model(ids, attention_mask=mask, use_cache=False)
    assert all(layer.ffn.fused_input is not None for layer in model.model.layers)
    try:
        model.compile_decode()
        assert all(layer.ffn.fused_input is None and layer.attn.fused_input is not None for layer in model.model.layers)
        with torch.no_grad():
            model(ids[:, :4], attention_mask=mask[:, :4], use_cache=False)  # an eager forward beside the compiled walk
        assert all(layer.ffn.fused_input is None for layer in model.model.layers)
    finally:
        model.compile_decode(enable=False)


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
    assert model.model._compiled_run is None
    compiled = model.generate(ids, max_new_tokens=4, do_sample=False, compile_config=CompileConfig(backend="eager"))
    assert model.model._compiled_run is not None  # compile_decode ran through get_compiled_call
    assert torch.equal(compiled, eager)
    assert msw.SpikeWhaleCache(model.config).is_compileable


def test_the_walk_compiles_without_graph_breaks():
    """`compile_decode(fullgraph=True)`: a decode step's walk of each loop-plan run is one graph (a graph break
    raises), and its logits equal the eager step's."""
    torch._dynamo.reset()
    model = tiny_model(seed=3)
    ids, mask = batch(seed=4)
    eager = decode_logits(model, ids, mask, prefill=L + 1)
    model.compile_decode(fullgraph=True, backend="eager")
    try:
        compiled = decode_logits(model, ids, mask, prefill=L + 1)
    finally:
        model.compile_decode(enable=False)
    assert float((compiled - eager)[mask.bool()].abs().max()) <= TOL


def recording_backend():
    """(the graphs a compiled walk traces, a dynamo backend that records each and runs it as traced)."""
    graphs = []

    def backend(gm, example_inputs, **kwargs):
        graphs.append(gm)
        return gm.forward

    return graphs, backend


def test_compile_decode_multiplies_by_row_blocks_where_the_few_row_kernel_takes_them(monkeypatch):
    """Where `FEW_ROWS_KERNEL` takes a one-row product as the batched GEMM over blocks of W's rows (forced here, for
    every weight), `compile_decode` gives the FFN and rank→hidden SpikeWhaleLinears that `compiled_product` and keeps
    their weights row-major, and the compiled walk multiplies by those blocks, with eager decoding's ids and logits;
    `enable=False` clears the choice."""
    monkeypatch.setattr(msw, "FEW_ROWS_MIN_WEIGHT", 0)
    monkeypatch.setattr(msw.FewRowsKernel, "forced", "blocks2")
    monkeypatch.setattr(msw.FewRowsKernel, "min_block_rows", 1)
    torch._dynamo.reset()
    model = tiny_model(seed=4)
    graphs, backend = recording_backend()

    ids = torch.randint(5, 200, (1, L + 1), generator=torch.Generator().manual_seed(5))
    kw = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True)
    attn, ffn = model.model.layers[0].attn, model.model.layers[0].ffn
    with torch.no_grad():
        eager = model.generate(ids, **kw)
        model.compile_decode(backend=backend)
        try:
            assert ffn.gate_proj.compiled_product == ffn.down_proj.compiled_product == attn.o_b_proj.compiled_product \
                == attn.mc.o_proj.compiled_product == "blocks2"
            assert ffn.gate_proj.weight.is_contiguous() and attn.o_b_proj.weight.is_contiguous()
            assert attn.mc.o_proj.weight.is_contiguous()
            compiled = model.generate(ids, **kw)
        finally:
            model.compile_decode(enable=False)
    assert ffn.gate_proj.compiled_product == "linear" and "compiled_product" not in vars(ffn.gate_proj)
    blocked = [n.args[1] for gm in graphs for n in gm.graph.nodes if n.target is torch.bmm]
    # q_b, o_a, o_b, gate, up, down, the Memory Cache's o_proj and the fused q_a/kv/Memory-Cache inputs
    assert graphs and len(blocked) >= 8 * len(model.model.layers)
    assert torch.equal(eager.sequences, compiled.sequences)
    assert max(float((a - b).abs().max()) for a, b in zip(eager.logits, compiled.logits)) <= TOL


def test_compile_decode_multiplies_a_batch_by_the_product_timed_fastest_for_several_rows(monkeypatch, tmp_path):
    """The compiled walk takes the product timed fastest for one row in its batch-1 graph and the one timed fastest
    for `COMPILED_BATCH_ROWS` rows in the graph of larger batches (here, by fake timings, blocks of W's rows and
    (W·Xᵀ)ᵀ): on the FFN and rank→hidden Linears and the fused input projections of every layer's attention, with
    eager decoding's ids and logits at batch 1 and 3; `enable=False` clears both choices."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # the fake timings' choices stay out of the user's
    monkeypatch.setattr(msw, "FEW_ROWS_MIN_WEIGHT", 0)
    monkeypatch.setattr(msw.FewRowsKernel, "min_block_rows", 1)
    kernel = msw.FewRowsKernel()
    monkeypatch.setattr(msw, "FEW_ROWS_KERNEL", kernel)
    fastest = {1: "blocks2", msw.COMPILED_BATCH_ROWS: "transposed"}
    monkeypatch.setattr(kernel, "product", lambda x, w, b, rows, kind: msw.time.sleep(
        1e-4 if kind == fastest.get(rows) else 3e-4) or torch.nn.functional.linear(x, w, b))
    torch._dynamo.reset()
    model = tiny_model(seed=4)
    graphs, backend = recording_backend()

    def calls(gms, op):
        return sum(n.target is op for gm in gms for n in gm.graph.nodes)

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(5, 200, (rows, L + 1), generator=g) for rows in (1, 3)]
    kw = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
    attn, ffn = model.model.layers[0].attn, model.model.layers[0].ffn
    # q_b, o_a, o_b, gate, up, down, the Memory Cache's o_proj and the fused q_a/kv/Memory-Cache inputs
    n_products = 8 * len(model.model.layers)
    with torch.no_grad():
        eager = [model.generate(ids, **kw) for ids in prompts]
        model.compile_decode(backend=backend)
        try:
            for owner in (ffn.gate_proj, attn.o_b_proj, attn.fused_input):
                assert (owner.compiled_product, owner.compiled_product_rows) == ("blocks2", "transposed")
            compiled, traced = [], []
            for ids in prompts:
                before = len(graphs)
                compiled.append(model.generate(ids, **kw))
                traced.append(graphs[before:])
        finally:
            model.compile_decode(enable=False)
    assert "compiled_product_rows" not in vars(ffn.gate_proj) and ffn.gate_proj.compiled_product_rows == "linear"
    one, batch3 = traced
    assert one and batch3
    assert calls(one, torch.bmm) == n_products and calls(one, torch.mm) == 0
    assert calls(batch3, torch.mm) == n_products and calls(batch3, torch.bmm) == 0
    for want, got in zip(eager, compiled):
        assert torch.equal(want.sequences, got.sequences)
        assert max(float((a - b).abs().max()) for a, b in zip(want.logits, got.logits)) <= TOL


def bf16_walk_with_forced_product(monkeypatch, kind: str):
    """(tiny_model(seed=4)'s weights in bf16, the graphs a compiled walk traces, a dynamo backend recording them and
    running them as traced), with every few-row product forced to `kind` and dynamo's caches reset."""
    monkeypatch.setattr(msw, "FEW_ROWS_MIN_WEIGHT", 0)
    monkeypatch.setattr(msw.FewRowsKernel, "forced", kind)
    torch._dynamo.reset()
    f32 = tiny_model(seed=4)
    model = type(f32)._from_config(f32.config, dtype=torch.bfloat16).eval()
    model.load_state_dict(f32.state_dict())
    return model, *recording_backend()


def test_compile_decode_multiplies_bf16_weights_first_where_the_few_row_kernel_takes_them(monkeypatch):
    """bf16 weights whose one-row product `FEW_ROWS_KERNEL` takes as (W·xᵀ)ᵀ (forced here; on a Xeon with AMX it is
    ~1.4× F.linear's speed): the compiled walk multiplies them as (W·Xᵀ)ᵀ for any number of rows, keeps them
    row-major, and decodes eager bf16's logits within bf16 rounding (the kernels sum in different orders)."""
    model, graphs, backend = bf16_walk_with_forced_product(monkeypatch, "transposed")
    ids, mask = batch(seed=6)
    eager = decode_logits(model, ids, mask, prefill=L + 1).float()
    attn, ffn = model.model.layers[0].attn, model.model.layers[0].ffn
    model.compile_decode(backend=backend)
    try:
        assert ffn.gate_proj.compiled_product == ffn.down_proj.compiled_product == attn.o_b_proj.compiled_product \
            == "transposed"
        assert ffn.gate_proj.weight.is_contiguous() and attn.o_b_proj.weight.is_contiguous()
        compiled = decode_logits(model, ids, mask, prefill=L + 1).float()
    finally:
        model.compile_decode(enable=False)
    weight_first = [n for gm in graphs for n in gm.graph.nodes if n.target is torch.mm]
    assert graphs and len(weight_first) >= 5 * len(model.model.layers)  # q_b, o_b, gate, up, down in every layer
    assert compiled.dtype == eager.dtype and compiled.shape == eager.shape
    valid = mask.bool()
    assert float((compiled - eager)[valid].abs().max()) <= 2 ** -5 * float(eager[valid].abs().max())


@pytest.mark.skipif(not msw.cpu_has_mkldnn_bf16(), reason="this torch has no oneDNN prepacked linear")
def test_compile_decode_multiplies_bf16_weights_by_their_prepacked_copies_where_the_few_row_kernel_takes_them(
        monkeypatch):
    """bf16 weights whose one-row product `FEW_ROWS_KERNEL` takes as oneDNN's linear on a prepacked copy (forced here;
    on an AVX512-BF16 EPYC it is the FFN's): the compiled walk calls the op `spike_whale::packed_linear` for them,
    with eager bf16's logits within bf16 rounding; where a gradient flows it multiplies by F.linear instead (the op
    has no derivative), with gradients equal to the eager walk's."""
    model, graphs, backend = bf16_walk_with_forced_product(monkeypatch, "packed")

    def packed_calls(gm):
        return [n for n in gm.graph.nodes if n.target in (torch.ops.spike_whale.packed_linear,
                                                            torch.ops.spike_whale.packed_linear.default)]

    ids, mask = batch(seed=6)
    eager = decode_logits(model, ids, mask, prefill=L + 1).float()
    ffn = model.model.layers[0].ffn
    model.compile_decode(backend=backend)
    try:
        fused = model.model.layers[0].attn.fused_input  # q_a and k/v (the Memory Cache's stay float32)
        assert ffn.gate_proj.compiled_product == ffn.down_proj.compiled_product == fused.compiled_product == "packed"
        compiled = decode_logits(model, ids, mask, prefill=L + 1).float()
        assert graphs and len(packed_calls(graphs[-1])) >= 5 * len(model.model.layers)  # q_b, o_b, gate, up, down
        valid = mask.bool()
        assert float((compiled - eager)[valid].abs().max()) <= 2 ** -5 * float(eager[valid].abs().max())

        out = model(ids[:, :L + 1], attention_mask=mask[:, :L + 1], use_cache=True)
        step = dict(attention_mask=mask[:, : L + 2], use_cache=True)  # a step inside the segment: compiled
        n_graphs = len(graphs)
        with torch.enable_grad():
            loss = model(ids[:, L + 1:L + 2], past_key_values=out.past_key_values, **step).logits.float().square().sum()
            grads = torch.autograd.grad(loss, [ffn.gate_proj.weight, ffn.down_proj.weight])
        assert len(graphs) == n_graphs + 1 and not packed_calls(graphs[-1])  # traced again, with F.linear
    finally:
        model.compile_decode(enable=False)
    assert ffn.gate_proj.weight not in msw.FewRowsKernel.packed  # the walk's copies go with it
    assert fused.weight not in msw.FewRowsKernel.packed
    out = model(ids[:, :L + 1], attention_mask=mask[:, :L + 1], use_cache=True)
    with torch.enable_grad():
        loss = model(ids[:, L + 1:L + 2], past_key_values=out.past_key_values, **step).logits.float().square().sum()
        want = torch.autograd.grad(loss, [ffn.gate_proj.weight, ffn.down_proj.weight])
    assert all(torch.equal(g, w) for g, w in zip(grads, want))


def test_packed_linear_op_compiles_through_inductor():
    """`spike_whale::packed_linear` in an inductor graph for any number of rows (dynamic shapes): oneDNN's values on
    the weight's prepacked copy, bit for bit, with and without bias."""
    if not msw.cpu_has_mkldnn_bf16():
        pytest.skip("this torch has no oneDNN prepacked linear")
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 64, generator=g).bfloat16(), torch.randn(96, generator=g).bfloat16()
    fn = torch.compile(lambda x, w, b: torch.ops.spike_whale.packed_linear(x, w, b) * 2, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for rows, bias in ((1, None), (3, b), (5, b)):
            x = torch.randn(rows, 1, 64, generator=g).bfloat16()
            assert torch.equal(fn(x, w, bias), msw.FewRowsKernel.product(x, w, bias, rows, "packed") * 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compile_decode_multiplies_one_row_by_the_float32_reduction_where_the_few_row_kernel_takes_it(
        monkeypatch, dtype):
    """Where `FEW_ROWS_KERNEL` takes a one-row product as the float32 reduction (forced here; on an AVX512-BF16 EPYC it
    wins the bf16 FFN), the batch-1 graph sums x_k·W_nk for every chosen product instead of a GEMM, and a batch, for
    which the reduction is no candidate (it reads W once per row), keeps F.linear: eager decoding's ids and logits
    (float32: to `TOL`; bf16: within bf16 rounding, the sums run in another order)."""
    model, graphs, backend = bf16_walk_with_forced_product(monkeypatch, "reduce")
    model = model.to(dtype)
    attn, ffn = model.model.layers[0].attn, model.model.layers[0].ffn
    kw = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(5, 200, (rows, L + 1), generator=g) for rows in (1, 3)]
    with torch.no_grad():
        eager = [model.generate(ids, **kw) for ids in prompts]
        model.compile_decode(backend=backend)
        try:
            for owner in (ffn.gate_proj, ffn.down_proj, attn.o_b_proj, attn.mc.o_proj, attn.fused_input):
                assert (owner.compiled_product, owner.compiled_product_rows) == ("reduce", "linear")
            if dtype == torch.bfloat16:
                assert attn.mc.qkv_proj.compiled_product == attn.mc.gate_proj.compiled_product == "reduce"
            traced = []
            for ids in prompts:
                before = len(graphs)
                traced.append((model.generate(ids, **kw), graphs[before:]))
        finally:
            model.compile_decode(enable=False)
    sums = [sum(n.target == "sum" for gm in gms for n in gm.graph.nodes) for _, gms in traced]
    assert all(len(gms) == 1 for _, gms in traced)  # one graph per batch size
    # q_b, o_a, o_b, gate, up, down, the Memory Cache's o_proj and the fused inputs: q_a/kv and, in float32, the
    # Memory Cache's qkv and gate, which under bf16 stay float32 and are multiplied on their own
    per_layer = 8 if dtype == torch.float32 else 10
    assert sums[0] - sums[1] == per_layer * len(model.model.layers)
    for (got, _), want in zip(traced, eager):
        assert torch.equal(want.sequences, got.sequences)
        for a, b in zip(want.logits, got.logits):
            tol = TOL if dtype == torch.float32 else 2 ** -5 * float(a.abs().max())
            assert float((a.float() - b.float()).abs().max()) <= tol


def test_only_an_inductor_walk_takes_the_float32_reduction(monkeypatch, tmp_path):
    """Another backend than inductor would run the reduction unfused (each call converting its whole weight to
    float32), so `compile_decode` with one neither times nor takes it, and neither reads nor writes the stored choices
    (whose winners may be "reduce"); for inductor's walk `_choose_compiled_products` takes it where it is fastest."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(msw, "FEW_ROWS_MIN_WEIGHT", 0)
    kernel = msw.FewRowsKernel()
    monkeypatch.setattr(msw, "FEW_ROWS_KERNEL", kernel)
    timed = []
    monkeypatch.setattr(kernel, "product", lambda x, w, b, rows, kind: timed.append(kind) or msw.time.sleep(
        1e-4 if kind == "reduce" else 3e-4) or torch.nn.functional.linear(x, w, b))
    monkeypatch.setattr(kernel, "compiled_reduce", lambda x, w, b, scale=None: None)
    model = tiny_model(seed=4)
    gate = model.model.layers[0].ffn.gate_proj
    _, backend = recording_backend()
    model.compile_decode(backend=backend)
    try:
        assert timed and "reduce" not in timed and gate.compiled_product == "linear"
        assert not gate.weight.is_contiguous()  # float32 F.linear: re-stored column-major
    finally:
        model.compile_decode(enable=False)
    assert gate.weight.is_contiguous()  # row-major again, for eager decoding and the next compile
    path = tmp_path / "spike_whale_decode" / "compiled_products.json"
    assert not path.exists()
    model._choose_compiled_products(persistent=True)
    assert gate.compiled_product == "reduce" and "reduce" in json.loads(path.read_text()).values()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reduce_product_compiles_through_inductor_and_is_timed_as_compiled(dtype):
    """The float32 reduction is F.linear's function (float32 accumulation, one rounding to x's dtype) as inductor
    compiles it in a graph of dynamic shapes, with and without bias; `FewRowsKernel.choose` times it for one row only
    (plain float weights, not a batch), on its kernel compiled once per shape (`compiled_reduce`)."""
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 64, generator=g).to(dtype), torch.randn(96, generator=g).to(dtype)
    fn = torch.compile(msw.FewRowsKernel.reduce_product, fullgraph=True, dynamic=True)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    with torch.no_grad():
        for rows, bias in ((1, None), (1, b), (3, b)):
            x = torch.randn(rows, 1, 64, generator=g).to(dtype)
            want = torch.nn.functional.linear(x.double(), w.double(), None if bias is None else bias.double())
            for got in (fn(x, w, bias), msw.FewRowsKernel.product(x, w, bias, rows, "reduce")):
                assert got.dtype == dtype and got.shape == want.shape
                assert float((got.double() - want).abs().max()) <= tol * float(want.abs().max())
        kernel = msw.FewRowsKernel()
        weights = [torch.randn(256, 128, generator=g).to(dtype) for _ in range(2)]
        assert "reduce" in kernel.traced_candidates(weights[0], 1)
        assert "reduce" not in kernel.traced_candidates(weights[0], msw.COMPILED_BATCH_ROWS)
        chosen = kernel.choose(weights, 1)
    medians = kernel.walk_medians[kernel.key(weights[0], 1)]
    assert "reduce" in medians and medians["reduce"] > 0 and chosen[0] in medians
    assert ((torch.Size([1, 128]), dtype), (weights[0].shape, dtype)) in msw.FewRowsKernel.reduce_kernels


def test_compile_decode_keeps_its_row_block_choices_for_later_processes(monkeypatch, tmp_path):
    """The compiled walk's row blocks are timed once per torch, CPU model, thread count and weight shape: the first
    `compile_decode` writes them to `compiled_products.json` in torch's cache directory, and a later process (a fresh
    kernel that has timed nothing) takes them from there without timing, so its stored walk's key is the same;
    `persistent=False` neither reads nor writes it."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(msw, "FEW_ROWS_MIN_WEIGHT", 0)
    monkeypatch.setattr(msw.FewRowsKernel, "min_block_rows", 1)
    model = tiny_model(seed=4)
    first = msw.FewRowsKernel()
    monkeypatch.setattr(msw, "FEW_ROWS_KERNEL", first)
    monkeypatch.setattr(first, "product", lambda x, w, b, rows, kind: msw.time.sleep(2e-4 if kind == "blocks4" else 4e-4)
                        or torch.nn.functional.linear(x, w, b))
    gate = model.model.layers[0].ffn.gate_proj
    try:
        model.compile_decode()
        assert gate.compiled_product == "blocks4" and first.walk_medians  # timed, and blocks of 4 were the fastest
        key = msw.PersistentDecodeWalk.key(model.model, {}, {})
    finally:
        model.compile_decode(enable=False)
    path = tmp_path / "spike_whale_decode" / "compiled_products.json"
    stored = json.loads(path.read_text())
    assert set(stored.values()) == {"blocks4"} and all(msw.cpu_model() in name for name in stored)
    later = msw.FewRowsKernel()
    monkeypatch.setattr(msw, "FEW_ROWS_KERNEL", later)
    monkeypatch.setattr(later, "product", lambda *a: pytest.fail("a stored choice is timed again"))
    try:
        model.compile_decode()
        assert gate.compiled_product == "blocks4" and not later.walk_medians
        assert msw.PersistentDecodeWalk.key(model.model, {}, {}) == key
    finally:
        model.compile_decode(enable=False)
    path.unlink()
    monkeypatch.setattr(later, "product", lambda x, w, b, rows, kind: torch.nn.functional.linear(x, w, b))
    try:
        model.compile_decode(persistent=False)
        assert later.walk_medians and not path.exists()
    finally:
        model.compile_decode(enable=False)


def test_row_block_choices_leave_no_partial_file_when_writing_fails(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(msw, "FEW_ROWS_MIN_WEIGHT", 0)
    kernel = msw.FewRowsKernel()
    monkeypatch.setattr(msw, "FEW_ROWS_KERNEL", kernel)
    monkeypatch.setattr(kernel, "product", lambda x, w, b, rows, kind: torch.nn.functional.linear(x, w, b))

    def full_disk(src, dst):  # the choices written to the temporary file, then the disk fills
        raise OSError("No space left on device")

    monkeypatch.setattr(msw.os, "replace", full_disk)
    with pytest.raises(OSError, match="No space"):
        tiny_model(seed=4)._choose_compiled_products(persistent=True)
    assert list((tmp_path / "spike_whale_decode").iterdir()) == []


def test_compile_decode_turns_a_mode_into_options(monkeypatch):
    """torch.compile takes `mode` or `options`, not both, and the walk needs options: `compile_decode(mode=...)` hands
    torch the mode's inductor options (on CPU without CUDA graphs) under the caller's own, and decodes eager's ids."""
    seen, compile_ = [], torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(kw) or compile_(fn, **kw))
    model = tiny_model(seed=3)
    ids = torch.randint(5, 200, (1, 9), generator=torch.Generator().manual_seed(3))
    eager = model.generate(ids, max_new_tokens=4, do_sample=False)
    model.compile_decode(mode="max-autotune-no-cudagraphs", backend="eager", options={"max_autotune": False})
    try:
        assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), eager)
        model.compile_decode(mode="reduce-overhead", backend="eager")
        assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), eager)
    finally:
        model.compile_decode(enable=False)
    assert all("mode" not in kw for kw in seen) and len(seen) == 2
    assert seen[0]["options"]["coordinate_descent_tuning"] is True and seen[0]["options"]["max_autotune"] is False
    assert "triton.cudagraphs" not in seen[1]["options"]


@pytest.mark.skipif(
    version.parse(transformers.__version__) < version.parse("5.24"),
    reason="transformers < 5.24 refuses assisted decoding with a compileable cache, so the loop-slot cache declares "
    "itself not compileable there and generate does not compile the whole forward",
)
def test_transformers_own_compiled_call_runs_the_whole_decode_step_as_one_graph(monkeypatch):
    """transformers' own `get_compiled_call` (`torch.compile(model.__call__)`; ours overrides it with the faster
    per-pass walk, see its docstring), fullgraph and static shapes, on a static cache: batch 2 with left padding,
    3 * L steps crossing three Memory-Cache segment boundaries per row. Every decode step runs the one compiled graph
    (traced once, never recompiled: the cache's length, K/V writes and segment state are tensors), and the ids and
    logits equal eager decoding's."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig, PreTrainedModel

    monkeypatch.setattr(msw.SpikeWhaleForCausalLM, "get_compiled_call", PreTrainedModel.get_compiled_call)
    torch._dynamo.reset()
    counters.clear()
    model = tiny_model(seed=3)
    ids, mask = batch(seed=7)
    ids, mask = ids[:, :L + 3], mask[:, :L + 3]
    kw = dict(attention_mask=mask, max_new_tokens=3 * L, min_new_tokens=3 * L, do_sample=False, output_logits=True,
              return_dict_in_generate=True, pad_token_id=0,
              cache_implementation="static")
    eager = model.generate(ids, **kw)
    eager_forwards = []
    context = msw.SpikeWhaleModel._context

    def counted(self, *args):
        if not torch.compiler.is_compiling():
            eager_forwards.append(args[1])
        return context(self, *args)

    monkeypatch.setattr(msw.SpikeWhaleModel, "_context", counted)
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = model.generate(ids, compile_config=CompileConfig(backend="eager", fullgraph=True, dynamic=False),
                                  **kw)
    assert eager_forwards == [L + 3]  # only the prefill ran eagerly
    assert counters["stats"]["unique_graphs"] == 1
    assert model._compiled_call is not None
    assert torch.equal(eager.sequences, compiled.sequences)
    assert max(float((a - b).abs().max()) for a, b in zip(eager.logits, compiled.logits)) <= TOL
    # The compiled steps advanced the length tensor only; the host copy is re-read from it, not left stale.
    assert getattr(compiled, CACHE_FIELD).get_seq_length() == ids.shape[1] + 3 * L - 1


def test_each_slot_owns_its_state_and_rollback_history(model):
    """K/V, Memory-Cache state and its rollback history live on the slot's cache layer (`LoopSlotLayer`); the cache
    keeps only what all slots share; `crop` restores every slot from its own history."""
    ids, mask = batch(seed=5)
    with torch.no_grad():
        cache = model(ids[:, :6], attention_mask=mask[:, :6], use_cache=True).cache
        before = [layer.mc for layer in cache.layers]
        cache.activate_past_recording()
        model(ids[:, 6:9], attention_mask=mask[:, :9], cache=cache, use_cache=True)
    assert set(cache._history) == {"segment"}
    for layer, state in zip(cache.layers, before):
        assert isinstance(layer, LoopSlotLayer) and layer.is_initialized
        assert [p for p, _ in layer.history["mc"]] == [0, 6, 7, 8, 9]  # the chunk starts, then every recorded position
        assert cache.slot(cache.layers.index(layer)).mc is layer.mc
    cache.crop(-3)
    assert all(layer.mc is state for layer, state in zip(cache.layers, before))
    assert all([p for p, _ in layer.history["mc"]] == [6] for layer in cache.layers)


@pytest.mark.parametrize("holes", [(4, 8), (9, 12)])
def test_crop_to_a_padding_position_restores_the_state_of_the_last_real_token(model, holes):
    """A recorded chunk with padding after a row's real tokens (holes in its attention mask), long enough and crossing a
    Memory-Cache boundary so that it records through the general per-position path: cropping to any position of it,
    the padding ones included, then feeding the rest again gives the logits of a full recompute. The state at a padding
    position is that after the row's last real token (its running sums, the cache's carried ones included, and its
    segment), not the sums of relative segment 0 without the carried ones."""
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(10, 500, (2, 23), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 5 + holes[0]:5 + holes[1]] = 0  # row 1: chunk tokens 0-3 in segment 0/1, then padding
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
        for crop_to in range(6, 18):
            cache = model(ids[:, :5], attention_mask=mask[:, :5], use_cache=True).cache
            cache.activate_past_recording()
            model(ids[:, 5:17], attention_mask=mask[:, :17], cache=cache, use_cache=True)
            cache.crop(crop_to)
            got = model(ids[:, crop_to:], attention_mask=mask, cache=cache, use_cache=True).logits
            real = mask[:, crop_to:].bool()
            err = float((got - full[:, crop_to:])[real].abs().max())
            assert err <= TOL * float(full.abs().max()), (crop_to, err)


def test_the_whole_forward_compiles_without_graph_breaks():
    """`torch.compile(model.forward, fullgraph=True)` holds (no host syncs under compile, hence
    `_can_compile_fullgraph`): one-token steps on the model's own cache with left padding, one of them opening a
    Memory-Cache segment (row 1 at t = 11), equal the eager full recompute. One graph: n_fin stays 1."""
    torch._dynamo.reset()
    model = tiny_model(seed=3)
    ids, mask = batch(seed=6)
    assert type(model)._can_compile_fullgraph
    forward = torch.compile(model.forward, fullgraph=True, backend="eager", dynamic=True)
    end = L + 6
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
        out = model(ids[:, :L + 1], attention_mask=mask[:, :L + 1], use_cache=True)
        cache, got = out.cache, [out.logits]
        for t in range(L + 1, end):
            got.append(forward(input_ids=ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache,
                               use_cache=True).logits)
    got = torch.cat(got, 1)
    real = mask[:, :end].bool()
    assert float((got - full[:, :end])[real].abs().max()) <= TOL


def test_memory_cache_turns_autocast_off_only_where_it_is_on(monkeypatch):
    """Without autocast the Memory-Cache branch enters no autocast context (whose nodes in a compiled graph keep
    AOTAutograd from caching it on disk); under autocast it still computes in float32."""
    model = tiny_model(seed=3)
    ids = torch.randint(10, 500, (1, 6))
    entered, autocast = [], torch.autocast

    def counted(*args, **kwargs):
        entered.append(kwargs)
        return autocast(*args, **kwargs)

    monkeypatch.setattr(torch, "autocast", counted)
    with torch.no_grad():
        model(ids)
        assert entered == []
        with autocast("cpu", dtype=torch.bfloat16):
            model(ids)
    assert entered and all(kw.get("enabled") is False for kw in entered)


class HostReadCounter(torch.Tensor):
    """A cache length tensor that records every host read (`int()`, `bool()`, `.item()`, ...) of itself or of any
    tensor computed from it: on CUDA each is a device-to-host sync."""

    HOST_READS = {"__int__", "__index__", "__bool__", "__float__", "__format__", "item", "tolist"}
    reads: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in cls.HOST_READS:
            cls.reads.append(func.__name__)
        return super().__torch_function__(func, types, args, kwargs or {})


def test_eager_decoding_never_reads_the_cache_length_tensors_on_the_host(model, monkeypatch):
    """Eager code reads the host copies of `SpikeWhaleCache.length` and each slot's `cumulative_length` (kept with the
    tensors by every update, crop, reset and reorder), so an eager generate never syncs on them: greedy on a
    left-padded batch across three Memory-Cache segment boundaries, beam search (reorder), assisted decoding (crop
    every step, both models' caches) and a reset. The ids still equal a recompute without cache."""
    cache_init, layer_init = SpikeWhaleCache.__init__, LoopSlotLayer.__init__

    def cache_counted(self, *args, **kwargs):
        cache_init(self, *args, **kwargs)
        self.length = self.length.as_subclass(HostReadCounter)

    def layer_counted(self, *args, **kwargs):
        layer_init(self, *args, **kwargs)
        self.cumulative_length = self.cumulative_length.as_subclass(HostReadCounter)

    monkeypatch.setattr(SpikeWhaleCache, "__init__", cache_counted)
    monkeypatch.setattr(LoopSlotLayer, "__init__", layer_counted)
    monkeypatch.setattr(HostReadCounter, "reads", [])
    ids, mask = batch(seed=11)
    ids, mask = ids[:, :L + 3], mask[:, :L + 3]
    kw = dict(attention_mask=mask, max_new_tokens=3 * L, min_new_tokens=3 * L, pad_token_id=0)
    with torch.no_grad():
        greedy = model.generate(ids, do_sample=False, **kw)
        beams = model.generate(ids, do_sample=False, num_beams=2, **kw)
        assisted = model.generate(ids[:1], do_sample=False, assistant_model=model, max_new_tokens=L, pad_token_id=0)
        cache = model(ids, attention_mask=mask, use_cache=True).cache
        cache.reset()
        assert cache.get_seq_length() == 0 and all(layer.get_seq_length() == 0 for layer in cache.layers)
    assert HostReadCounter.reads == []
    assert isinstance(cache.length, HostReadCounter)  # the counted tensors were the ones in use
    monkeypatch.undo()
    with torch.no_grad():
        assert torch.equal(greedy, model.generate(ids, do_sample=False, use_cache=False, **kw))
        assert torch.equal(beams, model.generate(ids, do_sample=False, num_beams=2, use_cache=False, **kw))
        assert torch.equal(assisted, model.generate(ids[:1], do_sample=False, max_new_tokens=L, pad_token_id=0))


class MarkedWeight(torch.Tensor):
    """A weight of another tensor type, as torchao's quantized weights are (`AffineQuantizedTensor`, ...)."""


@pytest.mark.parametrize("quantized", [False, True])
def test_compile_decode_keeps_the_pattern_matcher_for_quantized_weights_on_cpu(monkeypatch, quantized):
    """On CPU compile_decode turns inductor's pattern matcher off (its one-query attention rewrite is slower), except
    when a weight is a tensor subclass (torchao int8): inductor's int8 weight-only lowering is a pattern there, so
    the standard `compile_config` reaches it with no option of the user's. Checked on the options handed to
    torch.compile (nothing is compiled); a caller's explicit option still wins."""
    model = tiny_model(seed=3)
    if quantized:
        ffn = next(m for m in model.modules() if isinstance(m, msw.SpikeWhaleMLP)).up_proj
        ffn.weight = torch.nn.Parameter(ffn.weight.detach().as_subclass(MarkedWeight), requires_grad=False)
    seen = []
    monkeypatch.setattr(msw.torch, "compile", lambda fn, **kwargs: seen.append(kwargs["options"]) or fn)
    model.compile_decode()
    model.compile_decode(options={"pattern_matcher": not quantized})
    model.compile_decode(enable=False)
    assert [o.get("pattern_matcher", True) for o in seen] == [quantized, not quantized]


def test_no_grad_chunks_on_a_warm_cache_walk_in_inference_mode_and_return_normal_tensors(model, monkeypatch):
    """The walk of a no-grad chunk on a warm cache runs in inference mode (faster eager decode); a prefill, a step
    with gradients on or one asked for per-slot outputs does not, and no output is ever an inference tensor."""
    modes = []
    attention_forward = msw.SpikeWhaleAttention.forward

    def recorded(self, u, ctx, state, depth_sources):
        modes.append(torch.is_inference_mode_enabled())
        return attention_forward(self, u, ctx, state, depth_sources)

    monkeypatch.setattr(msw.SpikeWhaleAttention, "forward", recorded)
    ids, mask = batch(seed=7)
    slots = model.config.num_loop_slots
    with torch.no_grad():
        out = model(ids[:, :5], attention_mask=mask[:, :5], use_cache=True)
        cache = out.cache
        steps = [model(ids[:, 5:6], attention_mask=mask[:, :6], cache=cache, use_cache=True),
                 model(ids[:, 6:9], attention_mask=mask[:, :9], cache=cache, use_cache=True),
                 model(ids[:, 9:10], attention_mask=mask[:, :10], cache=cache, use_cache=True,
                       output_hidden_states=True)]
    assert modes == [False] * slots + [True] * (2 * slots) + [False] * slots
    for o in [out, *steps]:
        tensors = [o.logits, *(o.hidden_states or ())]
        assert not any(t.is_inference() for t in tensors)
    full = model(ids[:, :10], attention_mask=mask[:, :10], use_cache=False).logits.detach()
    got = torch.cat([out.logits, *(o.logits for o in steps)], 1)
    assert float((got - full)[mask[:, :10].bool()].abs().max()) <= TOL


def test_a_cache_left_by_inference_mode_steps_serves_forwards_with_gradients(model):
    """What inference-mode steps leave in the cache (the slots' recurrent states and their rollback history) becomes
    normal tensors before a forward with gradients saves it for backward; a crop still restores recorded states."""
    ids, mask = batch(seed=8)
    with torch.no_grad():
        cache = model(ids[:, :6], attention_mask=mask[:, :6], use_cache=True).cache
        cache.activate_past_recording()
        for t in range(6, 9):
            model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache, use_cache=True)
    assert cache.holds_inference_states and cache.layers[0].mc.run_M.is_inference()
    cache.crop(-1)
    model.zero_grad()
    out = model(ids[:, 8:10], attention_mask=mask[:, :10], cache=cache, use_cache=True)
    out.logits.sum().backward()
    assert model.model.layers[0].attn.mc.qkv_proj.weight.grad.abs().sum() > 0
    states = [t for layer in cache.layers for _, s in layer.history["mc"] for t in vars(s).values()] + [
        t for layer in cache.layers for t in vars(layer.mc).values()]
    assert not cache.holds_inference_states and not any(t.is_inference() for t in states)
    full = model(ids[:, :10], attention_mask=mask[:, :10], use_cache=False).logits
    assert float((out.logits - full[:, 8:10])[mask[:, 8:10].bool()].abs().max()) <= TOL
    model.zero_grad()


def test_input_projections_fused_again_inside_an_inference_mode_step_stay_trainable_parameters():
    model = tiny_model(seed=6)
    for layer in model.model.layers:
        layer.attn.fuse_input_projections()
    attn = model.model.layers[0].attn
    ids, mask = batch(seed=3)
    with torch.no_grad():
        cache = model(ids[:, :4], attention_mask=mask[:, :4], use_cache=True).cache
        attn.k_proj.weight.data = attn.k_proj.weight.data * 1.5  # new storage: the next step fuses again
        model(ids[:, 4:5], attention_mask=mask[:, :5], cache=cache, use_cache=True)
    assert attn.fused_input.intact()
    assert not any(p.is_inference() for p in model.parameters()) and not attn.fused_input.weight.is_inference()
    assert attn.fused_input.weight.grad_fn is None  # a copy of the weights, not a node of an autograd graph
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(ids, attention_mask=mask, labels=ids).loss.backward()
    optimizer.step()  # in place on every parameter: refused on an inference tensor
