"""The one-token decode step: the model's one forward (`walk_run` over the loop plan, each attention reading the cache
through the model's attention function) and its `torch.compile`d form.

These tests pin down that no second decode driver exists, that a decode step goes through `forward` and the model's
attention function, that it equals a full recompute, that `compile_decode()` (and transformers' `compile_config`)
compile the same walk without graph breaks and give the same logits, and that transformers' own whole-forward compile
runs every decode step as one graph. They run the plain Hub model; the CPU layer's compiled walk (fused projections,
product choices, column-major weights) is tested in test_accel.py, its stored walk in test_compile_cache.py.
"""

from __future__ import annotations

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


def count_attention_calls(monkeypatch, impl: str = "sdpa"):
    """(queries, keys) of every call of the attention function registered as `impl` with transformers'
    `AttentionInterface` (the model's `config._attn_implementation`)."""
    from transformers import AttentionInterface

    calls = []
    attend = AttentionInterface._global_mapping[impl]

    def counted(module, q, k, *args, **kwargs):
        calls.append((q.shape[2], k.shape[2]))
        return attend(module, q, k, *args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, impl, counted)
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


def test_decode_step_goes_through_forward_with_the_attention_interface(model, monkeypatch):
    """A decode step is the model's one forward: every slot's attention runs, and reads the cache through the
    model's attention function (`config._attn_implementation`, transformers' `AttentionInterface`; the plain model's
    SDPA, the CPU layer's one-query kernel in test_accel.py), over everything cached so far."""
    ids, mask = batch()
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
    forwards = []
    attention_forward = msw.SpikeWhaleAttention.forward

    def counted(self, u, ctx, state, depth_sources):
        forwards.append(u.shape[1])
        return attention_forward(self, u, ctx, state, depth_sources)

    monkeypatch.setattr(msw.SpikeWhaleAttention, "forward", counted)
    assert model.config._attn_implementation == "sdpa"
    kernels = count_attention_calls(monkeypatch)
    got = decode_logits(model, ids, mask, prefill=5)
    slots = model.config.num_loop_slots
    steps = 4 * L - 5
    assert forwards == [5] * slots + [1] * (slots * steps)  # every slot's attention forward, the prefill's and each step's
    # Each step, segment openings included (row 0 at 8, 16, 24; row 1 at 11, 19, 27), reads the cache with one query,
    # over everything cached so far.
    assert kernels == [(5, 5)] * slots + [(1, t + 1) for t in range(5, 4 * L) for _ in range(slots)]
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
    kernels = count_attention_calls(monkeypatch)
    ids, mask = batch(seed=2)
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
    got = decode_logits(model, ids, mask, prefill=4)
    assert kernels == []  # Elo attention is its own kernel, with the cached ratings
    assert float((got - full)[mask.bool()].abs().max()) <= TOL
    with pytest.raises(ValueError, match="Elo attention"):
        model.compile_decode()


def test_compile_decode_equals_eager(model, monkeypatch):
    """The plain model's `compile_decode()` (inductor, one graph per loop pass) decodes eager's ids and logits, and
    leaves the weights as they were: same storage, layout and state dict, no module swapped or fused (the CPU layer,
    `spike_whale.accel`, does that; test_accel.py)."""
    torch._dynamo.reset()
    calls = count_decode_steps(monkeypatch)
    ids = torch.randint(10, 500, (1, L + 2), generator=torch.Generator().manual_seed(7))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    layout = {name: (p.data_ptr(), p.stride()) for name, p in model.named_parameters()}
    modules = [(name, type(m)) for name, m in model.named_modules()]
    with torch.no_grad():
        eager = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, output_logits=True,
                               return_dict_in_generate=True)
        model.compile_decode()
        try:
            assert model.model._compiled_run is not None
            compiled = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, output_logits=True,
                                      return_dict_in_generate=True)
            assert {name: (p.data_ptr(), p.stride()) for name, p in model.named_parameters()} == layout
            assert [(name, type(m)) for name, m in model.named_modules()] == modules
            assert not any("input_projections" in vars(m) for m in model.modules())
            after = model.state_dict()
            assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
        finally:
            model.compile_decode(enable=False)
    assert model.model._compiled_run is None
    assert calls == [10, 11, 12, 13, 14]  # the compiled generate's 5 decode steps, all inside segment 1
    assert torch.equal(eager.sequences, compiled.sequences)
    assert max(float((a - b).abs().max()) for a, b in zip(eager.logits, compiled.logits)) <= TOL


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
        assert [p for p, _ in layer.history["mc"]] == [6, 7, 8]  # the recorded chunk's start and each position (9: live)
        assert cache.slot(cache.layers.index(layer)).mc is layer.mc
    cache.crop(-3)
    assert all(layer.mc is state for layer, state in zip(cache.layers, before))  # restored into the same buffers
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
    """Eager code reads the host copy of `SpikeWhaleCache.length`, the one length of every slot (kept with the tensor
    by every update, crop, reset and reorder), so an eager generate never syncs on it: greedy on a
    left-padded batch across three Memory-Cache segment boundaries, beam search (reorder), assisted decoding (crop
    every step, both models' caches) and a reset. The ids still equal a recompute without cache."""
    cache_init = SpikeWhaleCache.__init__

    def cache_counted(self, *args, **kwargs):
        cache_init(self, *args, **kwargs)
        self.length = self.length.as_subclass(HostReadCounter)

    monkeypatch.setattr(SpikeWhaleCache, "__init__", cache_counted)
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
    """Inference-mode steps copy the slots' recurrent states into the cache's buffers, which stay normal tensors, so a
    forward with gradients may follow them; a crop restores recorded states (made in inference mode) into them."""
    ids, mask = batch(seed=8)
    with torch.no_grad():
        cache = model(ids[:, :6], attention_mask=mask[:, :6], use_cache=True).cache
        cache.activate_past_recording()
        for t in range(6, 9):
            model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache, use_cache=True)
    buffers = [t for layer in cache.layers for t in layer.mc.tensors()]
    assert not any(t.is_inference() for t in buffers)
    cache.crop(-1)
    model.zero_grad()
    out = model(ids[:, 8:10], attention_mask=mask[:, :10], cache=cache, use_cache=True)
    out.logits.sum().backward()
    assert model.model.layers[0].attn.mc.qkv_proj.weight.grad.abs().sum() > 0
    assert all(a is b for a, b in zip((t for layer in cache.layers for t in layer.mc.tensors()), buffers))
    full = model(ids[:, :10], attention_mask=mask[:, :10], use_cache=False).logits
    assert float((out.logits - full[:, 8:10])[mask[:, 8:10].bool()].abs().max()) <= TOL
    model.zero_grad()




class HostSyncCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops that read a tensor's value on the host (on an accelerator each waits for the queued kernels)."""

    SYNCS = {"_local_scalar_dense", "nonzero", "equal", "is_nonzero", "unique"}

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.SYNCS:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


def test_decode_steps_off_the_cpu_read_no_value_on_the_host_and_compute_the_same(model, monkeypatch):
    """Where reading a value waits for the device (`reads_values_free` False: every device but the CPU), a decode step
    builds its masks and Memory-Cache layout from device tensors and checks its inputs on the device: no op reads a
    value on the host, in greedy steps of a left-padded batch across three segment boundaries and in MTP verify chunks
    with rollback. The logits equal those of the CPU's host-read path. (Prefills may read values: once per call.)"""
    ids, mask = batch(seed=21)
    kw = dict(attention_mask=mask[:, :L + 2], max_new_tokens=3 * L, min_new_tokens=3 * L, pad_token_id=0,
              do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        host = model.generate(ids[:, :L + 2], **kw)
        host_mtp = model.generate(ids[:1, :L + 2], **{**kw, "attention_mask": None}, use_mtp=True)
    monkeypatch.setattr(msw, "reads_values_free", lambda device: False)
    counter, forward = HostSyncCounter(), msw.SpikeWhaleModel.forward
    steps = []

    def counted(self, *args, cache=None, **kwargs):
        if cache is None or cache.get_seq_length() == 0:
            return forward(self, *args, cache=cache, **kwargs)
        steps.append(cache.get_seq_length())
        with counter:
            return forward(self, *args, cache=cache, **kwargs)

    monkeypatch.setattr(msw.SpikeWhaleModel, "forward", counted)
    with torch.no_grad():
        device = model.generate(ids[:, :L + 2], **kw)
        device_mtp = model.generate(ids[:1, :L + 2], **{**kw, "attention_mask": None}, use_mtp=True)
    assert len(steps) > 3 * L and counter.reads == []
    for a, b in ((host, device), (host_mtp, device_mtp)):
        assert torch.equal(a.sequences, b.sequences)
        torch.testing.assert_close(torch.stack(a.logits), torch.stack(b.logits), rtol=0, atol=TOL)


def test_the_cache_keeps_one_length_and_static_buffers_updated_in_place(model):
    """Every slot reads the cache's one length; K/V, the Memory-Cache state and the shared buffers are allocated once,
    marked static for torch.compile (CUDA graphs replay on them), and keep their addresses through decode steps across
    segment boundaries, a beam reorder, a recorded crop and a reset."""
    ids, mask = batch(seed=22)
    with torch.no_grad():
        cache = model(ids[:, :5], attention_mask=mask[:, :5], use_cache=True).cache

        def buffers():
            out = [t for layer in cache.layers for t in (layer.keys, layer.values, *layer.mc.tensors())]
            return out + [getattr(cache, name) for name in cache.SHARED] + [cache.length]

        before = buffers()
        assert all(getattr(t, "_dynamo_static_input_type", None) == "unguarded" for t in before)
        pointers = [t.data_ptr() for t in before]
        cache.activate_past_recording()
        for t in range(5, 3 * L):
            model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache, use_cache=True)
        cache.crop(-2)
        cache.reorder_cache(torch.tensor([1, 0]))
        assert all(layer.get_seq_length() == cache.get_seq_length() == 3 * L - 2 for layer in cache.layers)
        assert not any(hasattr(layer, "cumulative_length") for layer in cache.layers)
        assert all(a is b for a, b in zip(buffers(), before)) and [t.data_ptr() for t in buffers()] == pointers
        cache.reset()
        assert [t.data_ptr() for t in buffers()] == pointers and cache.get_seq_length() == 0
        assert not any(t.any() for t in buffers())


@pytest.mark.parametrize("on_cpu", [True, False])
def test_compile_decode_compiles_every_step_segment_openings_included(model, monkeypatch, on_cpu):
    """A step the compiled walk may take, on the CPU or off it (`reads_values_free` False, as on an accelerator), has a
    layout of static sizes (two blocks, padding and unread entries assumed), so the compiled walk takes every step,
    those that open a Memory-Cache segment too, in one graph that serves every pass and is traced once (every
    finished-segment entry is read, those not finished yet masked); a left-padded batch across two boundaries decodes
    the ids and logits of the CPU's eager path."""
    ids, mask = batch(seed=23)
    kw = dict(attention_mask=mask[:, :L - 2], max_new_tokens=2 * L, min_new_tokens=2 * L, pad_token_id=0,
              do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        eager = model.generate(ids[:, :L - 2], **kw)
    if not on_cpu:
        monkeypatch.setattr(msw, "reads_values_free", lambda device: False)
    torch._dynamo.reset()
    calls = count_decode_steps(monkeypatch)
    torch._dynamo.utils.counters.clear()
    model.compile_decode(backend="eager")
    try:
        with torch.no_grad():
            compiled = model.generate(ids[:, :L - 2], **kw)
    finally:
        model.compile_decode(enable=False)
    assert calls == list(range(L - 2, L - 2 + 2 * L - 1))  # every decode step, both segment openings included
    assert torch.equal(eager.sequences, compiled.sequences)
    assert max(float((a - b).abs().max()) for a, b in zip(eager.logits, compiled.logits)) <= TOL
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # traced once: no recompile as segments finish
