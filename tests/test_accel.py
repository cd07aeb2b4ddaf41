"""The CPU acceleration layer (`spike_whale.accel`, issue 38), applied explicitly by `optimize_for_cpu(model)`: the Hub
model stays plain torch, and the layer's drop-ins (`FewRowsLinear` and its few-row kernel, the fused input
projections, the CPU-specialised compiled walk with its product choices and column-major weights) compute the plain
model's function. Speed is measured by benchmarks/bench_speed.py, never here. The stored walk's own tests are in
test_compile_cache.py."""

from __future__ import annotations

import ast
import json
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from packaging import version
from torch import nn

from spike_whale import modeling_spike_whale as msw
from spike_whale.accel import compile as accel_compile
from spike_whale.accel import attention, fusion, is_optimized, kernels, optimize_for_cpu
from spike_whale.accel.compile import PersistentDecodeWalk, choose_compiled_products, compiled_owners
from spike_whale.accel.fusion import fused
from spike_whale.accel.kernels import COMPILED_BATCH_ROWS, FEW_ROWS_MAX, FewRowsKernel, FewRowsLinear, compiled_kinds

from conftest import tiny_model
from test_decode_step import batch, decode_logits
from test_speed_paths import greedy, prompt, stepwise_logits

L = 8  # Memory-Cache segment length of the tiny config
TOL = 1e-5

needs_compile_config = pytest.mark.skipif(
    version.parse(transformers.__version__) < version.parse("5.24"),
    reason="transformers < 5.24 refuses assisted decoding with a compileable cache, so compile_config does not "
    "apply to the loop-slot cache there",
)


def bf16_twin(model):
    """The same weights loaded the way `from_pretrained(..., dtype=torch.bfloat16)` builds the model."""
    twin = type(model)._from_config(model.config, dtype=torch.bfloat16).eval()
    twin.load_state_dict(model.state_dict())
    return twin


def recording_backend():
    """(the graphs a compiled walk traces, a dynamo backend that records each and runs it as traced)."""
    graphs = []

    def backend(gm, example_inputs, **kwargs):
        graphs.append(gm)
        return gm.forward

    return graphs, backend


def every_weight_few_rows(monkeypatch, kind: str | None = None) -> None:
    """Every weight, however small, through the few-row kernel: its eager products (`linear_forward`) and the compiled
    walk's product choices (`choose_compiled_products`); with `kind`, that product is forced (no timing)."""
    monkeypatch.setattr(kernels, "FEW_ROWS_MIN_WEIGHT", 0)
    monkeypatch.setattr(accel_compile, "FEW_ROWS_MIN_WEIGHT", 0)
    if kind is not None:
        monkeypatch.setattr(FewRowsKernel, "forced", kind)


def use_kernel(monkeypatch, kernel: FewRowsKernel) -> FewRowsKernel:
    """`kernel` as the process's few-row kernel, for eager products and the compiled walk's choices alike."""
    monkeypatch.setattr(kernels, "FEW_ROWS_KERNEL", kernel)
    monkeypatch.setattr(accel_compile, "FEW_ROWS_KERNEL", kernel)
    return kernel


def plain_linear_forward(monkeypatch) -> None:
    """Every product of the drop-ins (`FewRowsLinear`, the fused input projections) as F.linear: the general kernels."""
    plain = lambda x, w, b=None, compiled_product="linear": F.linear(x, w, b)  # noqa: E731
    monkeypatch.setattr(kernels, "linear_forward", plain)
    monkeypatch.setattr(fusion, "linear_forward", plain)


# ---------------------------------------------------------------------------------------------------------------------
# The layer itself: applied explicitly, undone, the plain model's function


def test_the_hub_model_has_no_cpu_only_code_path():
    """The Hub model file is plain torch: no few-row kernel, oneDNN or int8-pack product, no timing, no CPU model, none
    of the imports they need, and no import of the pip-only `accel` package (a Hub folder has none)."""
    source = Path(msw.__file__).read_text()
    for name in ("FewRowsKernel", "mkldnn", "_weight_int8pack_mm", "time.perf_counter", "cpu_model"):
        assert name not in source, name
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0] if node.level == 0 else f".{node.module}")
            assert "accel" not in (node.module or "") and not any("accel" in a.name for a in node.names)
    assert not imported & {"time", "statistics", "hashlib", "uuid", "platform"}, imported


def test_the_plain_model_fuses_and_swaps_nothing_and_optimize_for_cpu_does(monkeypatch):
    """Eager no-grad decoding of the plain model leaves every Linear an `nn.Linear` with its own weight storage, no
    module with fused input projections and SDPA its attention. `optimize_for_cpu` swaps every plain Linear for a
    `FewRowsLinear` (same state dict), SDPA for the one-query kernel, and gives each attention (q_a, k, v, the Memory Cache's qkv and gate) and each dense FFN (gate, up) its input
    projections as one GEMM, which eager no-grad forwards in eval of a few rows (decode steps) take, with the plain
    model's logits and state dict; a forward with gradients, in train mode, or of more than `FEW_ROWS_MAX` rows runs
    them one by one."""
    model = tiny_model(seed=6)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids, mask = batch(seed=3)
    calls = []
    call = fusion.FusedLinears.__call__
    monkeypatch.setattr(fusion.FusedLinears, "__call__", lambda self, x: calls.append(x.shape) or call(self, x))
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
        plain = decode_logits(model, ids, mask, prefill=3)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and not any(isinstance(m, FewRowsLinear) for m in linears)
    assert not is_optimized(model) and "compile_decode" not in vars(model)
    assert model.config._attn_implementation == "sdpa"
    assert not any("input_projections" in vars(m) for m in model.modules()) and calls == []
    storages = {m.weight.untyped_storage().data_ptr() for m in linears}
    assert len(storages) == len(linears)  # no weight is a view of a fused matrix

    assert optimize_for_cpu(model) is model and is_optimized(model)
    assert model.config._attn_implementation == attention.NAME  # SDPA's decode steps: the one-query kernel
    assert all(type(m) is (msw.FrozenLinear if isinstance(m, msw.FrozenLinear) else FewRowsLinear) for m in linears)
    assert [m for m in model.modules() if isinstance(m, nn.Linear)] == linears  # swapped in place, none added
    for layer in model.model.layers:
        attn, ffn = layer.attn, layer.ffn
        assert fused(attn).linears == (attn.q_a_proj, attn.k_proj, attn.v_proj, attn.mc.qkv_proj, attn.mc.gate_proj)
        assert fused(ffn).linears == (ffn.gate_proj, ffn.up_proj)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(before[k], after[k]) for k in before)

    model(ids, attention_mask=mask, use_cache=False)  # gradients on
    with torch.no_grad():
        model.train()
        model(ids[:, :4], attention_mask=mask[:, :4], use_cache=False)
        model.eval()
        assert calls == []
        got_full = model(ids, attention_mask=mask, use_cache=False).logits
        assert calls == []  # the whole batch is more than FEW_ROWS_MAX rows: one projection at a time
        got = decode_logits(model, ids, mask, prefill=3)
    assert calls and all(shape[0] * shape[1] <= FEW_ROWS_MAX for shape in calls)
    real = mask.bool()
    assert float((got_full - full)[real].abs().max()) <= TOL
    assert float((got - plain)[real].abs().max()) <= TOL and float((got - full)[real].abs().max()) <= TOL
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_optimize_for_cpu_undone_returns_the_plain_model():
    """`optimize_for_cpu(model, enable=False)`, also after `compile_decode` (product choices, column-major weights):
    every Linear is an `nn.Linear` again, the attention SDPA, no fused projections or compiled walk remain, and the
    state dict, the weights' layout and the outputs are the plain model's."""
    plain, model = tiny_model(seed=6), tiny_model(seed=6)
    ids, mask = batch(seed=3)
    want_full = plain(ids, attention_mask=mask, use_cache=False).logits.detach()
    want = decode_logits(plain, ids, mask, prefill=3)
    optimize_for_cpu(model)
    decode_logits(model, ids, mask, prefill=3)
    model.compile_decode()
    assert not model.model.layers[0].ffn.gate_proj.weight.is_contiguous()  # float32 F.linear: column-major
    assert optimize_for_cpu(model, enable=False) is model
    assert not is_optimized(model) and "compile_decode" not in vars(model) and model.model._compiled_run is None
    assert model.config._attn_implementation == plain.config._attn_implementation == "sdpa"
    assert [type(m) for m in model.modules()] == [type(m) for m in plain.modules()]
    assert not any("input_projections" in vars(m) for m in model.modules())
    assert not any(isinstance(m, FewRowsLinear) for m in model.modules())
    got_state, want_state = model.state_dict(), plain.state_dict()
    assert got_state.keys() == want_state.keys()
    assert all(torch.equal(got_state[k], want_state[k]) and got_state[k].stride() == want_state[k].stride()
               for k in want_state)
    got_full = model(ids, attention_mask=mask, use_cache=False).logits.detach()
    got = decode_logits(model, ids, mask, prefill=3)
    assert torch.equal(got_full, want_full) and torch.equal(got, want)
    assert optimize_for_cpu(model, enable=False) is model  # undoing twice is a no-op


@needs_compile_config
def test_optimized_greedy_generate_equals_the_plain_models_through_the_few_rows_kernel(monkeypatch):
    """A model whose weights are large enough for the few-row kernel (hidden 256: the FFN's [256, 256] products and the
    fused gate/up, the 16,512-row `lm_head`): the optimized model's greedy generate, eager and through
    `compile_config` (the CPU-specialised walk, its products timed on this machine; dynamo's eager backend, which
    traces the same products: an inductor walk of this model compiles ~50 s longer here), gives the plain model's ids,
    with its logits to the float32 floor."""
    from transformers import CompileConfig

    config = dict(seed=9, hidden_size=256, moe_intermediate_size=256, num_hidden_layers=2)  # 2 layers: traces faster
    plain, model = tiny_model(**config), optimize_for_cpu(tiny_model(**config))
    ffn = model.model.layers[0].ffn
    assert ffn.gate_proj.weight.numel() >= kernels.FEW_ROWS_MIN_WEIGHT
    shapes, kernel = [], kernels.FEW_ROWS_KERNEL
    monkeypatch.setattr(kernels, "FEW_ROWS_KERNEL",
                        lambda x, w, b, rows: shapes.append(tuple(w.shape)) or kernel(x, w, b, rows))
    steps, compiles = [], msw.SpikeWhaleModel._decode_step_compiles
    monkeypatch.setattr(msw.SpikeWhaleModel, "_decode_step_compiles",
                        lambda self, ctx, cache: (compiles(self, ctx, cache) and not steps.append(ctx.past)))
    asked, choose = [], accel_compile.FEW_ROWS_KERNEL.choose
    monkeypatch.setattr(accel_compile.FEW_ROWS_KERNEL, "choose",
                        lambda weights, *a, **k: asked.extend(map(id, weights)) or choose(weights, *a, **k))
    ids = prompt(length=L + 1)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6, do_sample=False,
              pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        want = plain.generate(ids, **kw)
        assert shapes == [] and steps == []
        eager = model.generate(ids, **kw)
        assert {(512, 256), (256, 256), (model.config.vocab_size, 256)} <= set(shapes)  # fused gate/up, down, lm_head
        compiled = model.generate(ids, compile_config=CompileConfig(backend="eager"), **kw)
    assert steps == list(range(L + 1, L + 6))  # every decode step through the compiled walk
    chosen = [o for o in compiled_owners(model) if o.weight.numel() >= kernels.FEW_ROWS_MIN_WEIGHT]
    assert chosen and {id(o.weight) for o in chosen} <= set(asked)  # chosen for the walk
    for got in (eager, compiled):
        assert torch.equal(got.sequences, want.sequences)
        for a, b in zip(got.logits, want.logits):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


@pytest.mark.parametrize("target", ["meta", torch.bfloat16], ids=["meta", "bf16"])
def test_an_optimized_compiled_model_moved_or_retyped_starts_clean(monkeypatch, tmp_path, target):
    """After `compile_decode` chose products for the walk (forced here, for every weight), moving the model to another
    device or dtype keeps none of them: the choices are keyed by problem, not held by modules, so none applies to a
    moved weight; no prepacked copy is kept, eager forwards on the new dtype are the plain model's, on `meta` the
    drop-ins run shape-only (no CPU-only product), and `compile_decode()` works again. Re-typed back from bf16 with
    "packed" chosen: no prepacked copy, and only the float32 problem's own choices apply (as a later process would
    read them from `compiled_products.json`)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    every_weight_few_rows(monkeypatch, "transposed")
    config = dict(seed=4, num_hidden_layers=2)  # 2 layers: the walk traces faster
    model = optimize_for_cpu(tiny_model(**config))
    ids, mask = batch(seed=6)
    ids, mask = ids[:, :L + 3], mask[:, :L + 3]
    model.compile_decode()
    owners = compiled_owners(model)
    assert owners and all(compiled_kinds(o)[0] == "transposed" for o in owners)

    def clean() -> bool:
        """No choice applies to a moved or re-typed weight (the Memory Cache's stay float32 on CPU: one problem)."""
        moved = [o for o in compiled_owners(model) if (o.weight.device.type, o.weight.dtype) != ("cpu", torch.float32)]
        return bool(moved) and all(compiled_kinds(o) == ("linear", "linear") for o in moved)

    def equals_plain(*dtypes) -> bool:
        """Eager forwards (the batch, and one row of a few tokens, which takes the few-row products) give the logits
        of a plain model re-typed the same way, within the last dtype's rounding (unforced products). Decode steps
        raise until `compile_decode()` is called again (the Hub model's own check)."""
        plain, dtype = tiny_model(**config), dtypes[-1]
        for d in dtypes:
            plain.to(d)
        with monkeypatch.context() as unforced, torch.no_grad():
            unforced.setattr(FewRowsKernel, "forced", None)
            for args in ((ids, mask), (ids[:1, :L + 1], mask[:1, :L + 1])):
                got, want = (m(args[0], attention_mask=args[1], use_cache=False).logits.float() for m in (model, plain))
                real = args[1].bool()
                scale = float(want[real].abs().max())
                tol = TOL * max(1.0, scale) if dtype == torch.float32 else 8 * 2**-7 * scale
                if float((got - want)[real].abs().max()) > tol:
                    return False
        return True

    if target == "meta":
        model.to("meta")
        assert clean()
        monkeypatch.setattr(FewRowsKernel, "product", lambda *a: pytest.fail("a CPU product on meta tensors"))
        with torch.no_grad():
            for module in model.modules():  # every drop-in (the Hub model's own input checks read values)
                if isinstance(module, FewRowsLinear):
                    y = module(torch.empty(1, 1, module.in_features, device="meta"))
                    assert y.is_meta and y.shape == (1, 1, module.out_features)
                if "input_projections" in vars(module):
                    width = model.config.hidden_size
                    outs = module.input_projections(torch.empty(1, 1, width, device="meta"))
                    assert all(y.is_meta for y in outs)
        model.compile_decode()
        assert model.model._compiled_for == (torch.float32, torch.device("meta")) and clean()
        return

    model.to(target)
    assert clean() and equals_plain(target)
    model.compile_decode(backend="eager")
    compiled = decode_logits(model, ids, mask, prefill=L + 1)
    assert all(compiled_kinds(o)[0] == "transposed" for o in compiled_owners(model))
    eager = decode_logits(optimize_for_cpu(tiny_model(**config).to(target)), ids, mask, prefill=L + 1)
    assert float((compiled.float() - eager.float())[mask.bool()].abs().max()) <= 2**-5 * float(eager.abs().max())
    if kernels.cpu_has_mkldnn_bf16():
        monkeypatch.setattr(FewRowsKernel, "forced", "packed")
        model.compile_decode(backend="eager")
        packed = [o.weight for o in compiled_owners(model) if compiled_kinds(o)[0] == "packed"]
        assert packed
        for weight in packed:  # the copies a compiled step would take
            FewRowsKernel.packed_weight(weight)
        model.to(torch.float32)
        assert all(compiled_kinds(o)[0] == "transposed" for o in compiled_owners(model))  # the float32 problem's
        assert not any(w in FewRowsKernel.packed for w in packed) and equals_plain(target, torch.float32)
        model.compile_decode()
        assert model.model._compiled_for == (torch.float32, torch.device("cpu"))


# ---------------------------------------------------------------------------------------------------------------------
# The one-query attention kernel


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_decode_attention_reads_in_float32_on_cpu(dtype):
    """On CPU a bf16/float16 decode step's softmax attention (`accel.attention.cpu_decode_attention`, registered with
    transformers' `AttentionInterface`) is computed from its inputs in float32 and rounded once (oneDNN's bf16 batched
    GEMMs of these shapes were the slower kernel), with and without a mask; it matches float32 SDPA over the same
    rounded inputs."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, s, 16, generator=g).to(dtype) for n, s in ((6, 3), (2, 37), (2, 37)))
    mask = torch.ones(2, 1, 3, 37, dtype=torch.bool).tril(34)
    mask[1, ..., :5] = False
    module = nn.Module().eval()
    for m in (None, mask):
        got, weights = attention.cpu_decode_attention(module, q, k, v, m, scaling=16**-0.5)
        assert got.dtype == dtype and got.shape == (2, 3, 6, 16) and weights is None
        as_float32, _ = attention.cpu_decode_attention(module, q.float(), k.float(), v.float(), m, scaling=16**-0.5)
        assert torch.equal(got, as_float32.to(dtype))
        ref = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(3, 1),
                                             v.float().repeat_interleave(3, 1), attn_mask=m).transpose(1, 2)
        assert (got.float() - ref).abs().max() <= 2 * torch.finfo(dtype).eps * ref.abs().max()


def test_decode_step_goes_through_forward_with_the_one_query_kernel(monkeypatch):
    """`optimize_for_cpu` gives a model that attends with SDPA the one-query kernel (`attention.NAME`): every decode
    step's attention, segment openings included, reads the whole cache with it, not through SDPA, and the logits are
    a full recompute's; `enable=False` returns the model to SDPA."""
    from transformers import AttentionInterface

    model = optimize_for_cpu(tiny_model(seed=3))
    assert model.config._attn_implementation == attention.NAME
    ids, mask = batch()
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
    kernel, sdpa = [], []
    attend, fallback = AttentionInterface._global_mapping[attention.NAME], attention.sdpa_attention_forward
    monkeypatch.setitem(AttentionInterface._global_mapping, attention.NAME,
                        lambda module, q, k, *a, **kw: kernel.append((q.shape[2], k.shape[2])) or attend(module, q, k,
                                                                                                          *a, **kw))
    monkeypatch.setattr(attention, "sdpa_attention_forward",
                        lambda module, q, k, *a, **kw: sdpa.append((q.shape[2], k.shape[2])) or fallback(module, q, k,
                                                                                                        *a, **kw))
    got = decode_logits(model, ids, mask, prefill=5)
    slots = model.config.num_loop_slots
    steps = [(1, t + 1) for t in range(5, 4 * L) for _ in range(slots)]
    assert kernel[slots:] == steps and not set(steps) & set(sdpa)
    assert float((got - full)[mask.bool()].abs().max()) <= TOL
    optimize_for_cpu(model, enable=False)
    assert model.config._attn_implementation == "sdpa"


# ---------------------------------------------------------------------------------------------------------------------
# The few-row kernel


def test_linear_forward_of_a_few_rows_equals_f_linear(monkeypatch):
    """`linear_forward` sends 1-16 rows with a float32, bf16 or float16 weight of 64K+ elements to `FEW_ROWS_KERNEL`;
    each of its products (x·Wᵀ, (W·xᵀ)ᵀ with one row padded to two, the batched GEMM over 2, 4 or 8 blocks of W's
    rows, also of a W that is a row slice of a wider matrix, and W·x for one row) gives F.linear's values and
    gradients; more rows, smaller weights and other dtypes keep F.linear; FewRowsLinear keeps nn.Linear's state
    dict."""
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(320, 208, generator=g, requires_grad=True), torch.randn(320, generator=g, requires_grad=True)
    wide = torch.randn(320, 416, generator=g)[:, 8:216]  # stride 416: blocks are views of W's rows, not of its storage
    assert FewRowsKernel.candidates(w, 2) == ("linear", "transposed", "blocks2", "blocks4")  # 8: 40-row blocks
    assert FewRowsKernel.candidates(w[:100], 2) == ("linear", "transposed")  # 50-row blocks are too small to pay
    assert FewRowsKernel.candidates(w[:100], 1) == ("linear", "transposed", "mv")  # W·x: one row only
    monkeypatch.setattr(FewRowsKernel, "min_block_rows", 1)
    kinds = FewRowsKernel.candidates(w, 1)
    assert kinds == ("linear", "transposed", "blocks2", "blocks4", "blocks8", "mv")
    assert FewRowsKernel.candidates(w[:300], 2) == ("linear", "transposed", "blocks2", "blocks4")  # 300: not 8
    with torch.no_grad():
        for kind in kinds[2:]:
            rows = 1 if kind == "mv" else 3
            x = torch.randn(rows, 208, generator=g)
            got = FewRowsKernel.product(x, wide, None, rows, kind)
            assert (got - F.linear(x, wide)).abs().max() <= 1e-6 * got.abs().max()
            xb, wb = x.bfloat16(), wide.bfloat16()  # low precision: float32 accumulation, one rounding, as F.linear
            got, exact = FewRowsKernel.product(xb, wb, None, rows, kind), F.linear(xb.double(), wb.double())
            assert got.dtype == torch.bfloat16 and (got.double() - exact).abs().max() <= 2 ** -8 * exact.abs().max()
    for kind in kinds:
        monkeypatch.setattr(FewRowsKernel, "forced", kind)
        for shape in ((1, 208), (2, 208), (1, 2, 208), (3, 1, 208), (1, 1, 208), (1, 4, 208), (2, 1, 8, 208), (17, 208)):
            x = torch.randn(*shape, generator=g, requires_grad=True)
            for bias in (None, b):
                got = kernels.linear_forward(x, w, bias)
                want = F.linear(x, w, bias)
                assert got.shape == want.shape and got.is_contiguous()
                r = torch.randn(want.shape, generator=g)
                grads = torch.autograd.grad((got * r).sum(), (x, w))
                for a, ref in zip((got, *grads), (want, *torch.autograd.grad((want * r).sum(), (x, w)))):
                    assert (a - ref).abs().max() <= 1e-6 * ref.abs().max()
    layer = FewRowsLinear(40, 48)
    assert list(layer.state_dict()) == ["weight", "bias"] and isinstance(layer, nn.Linear)
    routed = []
    monkeypatch.setattr(kernels, "FEW_ROWS_KERNEL",
                        lambda x, w, b, rows: routed.append((tuple(w.shape), rows)) or x @ w.t())
    with torch.no_grad():
        for rows in (1, 2, 8, 16, 17):
            kernels.linear_forward(torch.randn(rows, 1, 208), w)  # up to 16 rows: the kernel that is faster here
        kernels.linear_forward(torch.randn(2, 1, 40), layer.weight)  # a small weight: F.linear
        kernels.linear_forward(torch.randn(2, 208, dtype=torch.float64), w.detach().double())  # float64: F.linear
        kernels.linear_forward(torch.randn(2, 208, dtype=torch.bfloat16), w.detach().bfloat16())
        kernels.linear_forward(torch.randn(1, 208, dtype=torch.float16), w.detach().half())
    assert routed == [((320, 208), 1), ((320, 208), 2), ((320, 208), 8), ((320, 208), 16), ((320, 208), 2),
                      ((320, 208), 1)]


def test_packed_bf16_is_offered_only_where_the_cpu_runs_it():
    """oneDNN's prepacked bf16 linear needs AVX512 (bw/vl/dq) or AVX-NE-CONVERT: on an AVX2-only CPU its reorder
    raises, so "packed" must be on offer only where it runs (bf16 generate crashed on such CPUs)."""
    w = torch.randn(256, 512).bfloat16()
    offered = "packed" in FewRowsKernel.candidates(w, rows=1)
    assert offered == (FewRowsKernel.prepack and kernels.cpu_has_mkldnn_bf16())
    if offered:
        x = torch.randn(1, 512).bfloat16()
        assert torch.equal(kernels.packed_linear(x, w, None), F.linear(x, w))
    else:
        assert not torch.ops.mkldnn._is_mkldnn_bf16_supported() or not FewRowsKernel.prepack


def test_packed_bf16_product_follows_its_weight(monkeypatch):
    """"packed" (oneDNN's linear on a prepacked copy of a bf16 weight) is a candidate for bf16 weights only (not
    float32, float16, an inference tensor, or with `prepack = False`); it gives F.linear's values within bf16
    rounding with and without bias, packs each weight once and again after an in-place update or new storage; where
    a gradient flows it is neither timed nor run (F.linear gives the gradients); when a key's trials end on
    another product, the trials' copies are dropped; a key that took it multiplies an inference-tensor weight, or
    any weight once `prepack` is off, by F.linear."""
    if not kernels.cpu_has_mkldnn_bf16():
        pytest.skip("this torch has no oneDNN prepacked linear")
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(320, 208, generator=g).bfloat16(), torch.randn(320, generator=g).bfloat16()
    assert FewRowsKernel.candidates(w, 1)[-1] == "packed" and FewRowsKernel.candidates(w, 16)[-1] == "packed"
    assert "packed" not in FewRowsKernel.candidates(w.float(), 1) + FewRowsKernel.candidates(w.half(), 1)
    with torch.inference_mode():
        assert "packed" not in FewRowsKernel.candidates(w.clone(), 1)
    monkeypatch.setattr(FewRowsKernel, "prepack", False)
    assert "packed" not in FewRowsKernel.candidates(w, 1)
    monkeypatch.setattr(FewRowsKernel, "prepack", True)

    def close(got, x, w, b):
        exact = F.linear(x.double(), w.double(), None if b is None else b.double())
        assert got.dtype == torch.bfloat16 and got.shape == exact.shape
        assert (got.double() - exact).abs().max() <= 2**-7 * exact.abs().max()

    with torch.no_grad():
        for shape in ((1, 208), (1, 1, 208), (3, 1, 208), (16, 208)):
            x = torch.randn(*shape, generator=g).bfloat16()
            for bias in (None, b):
                close(FewRowsKernel.product(x, w, bias, x.numel() // 208, "packed"), x, w, bias)
        packed = FewRowsKernel.packed_weight(w)
        assert FewRowsKernel.packed_weight(w) is packed
        w.mul_(-2)  # in place (an optimizer step, a loaded state dict)
        assert FewRowsKernel.packed_weight(w) is not packed
        close(FewRowsKernel.product(x, w, b, 16, "packed"), x, w, b)
        param = torch.nn.Parameter(w.clone())
        packed = FewRowsKernel.packed_weight(param)
        param.data = torch.randn(320, 208, generator=g).bfloat16()  # new storage (`.to()`, assignment)
        assert FewRowsKernel.packed_weight(param) is not packed
        close(FewRowsKernel.product(x, param, None, 16, "packed"), x, param, None)

    w.requires_grad_()
    monkeypatch.setattr(FewRowsKernel, "forced", "packed")
    x = torch.randn(2, 208, generator=g).bfloat16().requires_grad_()
    got, want = kernels.linear_forward(x, w, b), F.linear(x, w, b)
    assert torch.equal(got, want)
    assert all(torch.equal(a, e) for a, e in zip(torch.autograd.grad(got.sum(), (x, w)),
                                                  torch.autograd.grad(want.sum(), (x, w))))
    monkeypatch.setattr(FewRowsKernel, "forced", None)
    kernel, ran = FewRowsKernel(), []
    product = kernel.product
    monkeypatch.setattr(kernel, "product", lambda x, w, b, rows, k: ran.append(k) or product(x, w, b, rows, k))
    for _ in range(6 * kernel.trials):  # past every other product's trials
        kernel(x, w, None, 2)
    assert ran and "packed" not in ran and kernel.key(w, 2) not in kernel.chosen  # trials wait for no-grad calls
    w2 = torch.randn(320, 208, generator=g).bfloat16()
    FewRowsKernel.packed_weight(w2)
    monkeypatch.setattr(kernel, "_fastest", lambda medians, kinds: "linear")
    with torch.no_grad():
        while kernel.key(w, 2) not in kernel.chosen:
            kernel(x.detach(), w, None, 2)
    assert "packed" in ran and w not in FewRowsKernel.packed and w2 not in FewRowsKernel.packed
    kernel.chosen[kernel.key(w, 2)] = "packed"
    with torch.inference_mode():  # a weight of the same key that counts no in-place updates: F.linear
        inference_weight = w.detach().clone()
        assert torch.equal(kernel(x.detach(), inference_weight, None, 2), F.linear(x.detach(), inference_weight))
    assert ran[-1] == "linear" and inference_weight not in FewRowsKernel.packed
    monkeypatch.setattr(FewRowsKernel, "prepack", False)  # switched off after the choice: F.linear, no copy
    with torch.no_grad():
        kernel(x.detach(), w, None, 2)
    assert ran[-1] == "linear" and w not in FewRowsKernel.packed


def test_compiled_walk_times_the_packed_product_and_keeps_only_the_copies_it_takes(monkeypatch):
    """`FewRowsKernel.choose` (a compiled walk's products) times "packed" for bf16 weights beside the traceable
    products, each weight packed before the timing; a key that takes another product leaves no copy behind, one that
    takes it keeps its weights' copies for the walk."""
    if not kernels.cpu_has_mkldnn_bf16():
        pytest.skip("this torch has no oneDNN prepacked linear")
    g = torch.Generator().manual_seed(4)
    small = [torch.randn(320, 208, generator=g).bfloat16() for _ in range(2)]
    large = [torch.randn(416, 208, generator=g).bfloat16() for _ in range(2)]
    kernel, timed = FewRowsKernel(), []

    def product(x, w, b, rows, kind):  # "packed" is the fastest for the large shape only
        timed.append((kind, w in FewRowsKernel.packed))
        time.sleep(1e-4 if kind == "packed" and w.shape[0] == 416 else 3e-4)
        return F.linear(x, w, b)

    monkeypatch.setattr(kernel, "product", product)
    monkeypatch.setattr(kernel, "compiled_reduce", lambda x, w, b, scale=None: None)  # its untimed first call compiles it
    with torch.no_grad():
        chosen = kernel.choose(small + large, 1)
    assert chosen == ["linear", "linear", "packed", "packed"]
    assert {kind for kind, _ in timed} == set(FewRowsKernel.traced_candidates(small[0], 1))
    assert all(was_packed for kind, was_packed in timed if kind == "packed")
    assert all(w not in FewRowsKernel.packed for w in small) and all(w in FewRowsKernel.packed for w in large)


def test_bf16_products_of_many_rows_run_in_float32_on_a_cpu_without_bf16_instructions(monkeypatch):
    """Without bf16 instructions (MKL's bf16 GEMM is several times slower there), a bf16 product of 8+ rows is the
    float32 product rounded to bf16 once, gradients included; one row, and any CPU with bf16 instructions, keep
    F.linear in bf16."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(96, 40, generator=g).bfloat16().requires_grad_()
    b = torch.randn(96, generator=g).bfloat16()
    native, ran, linear = [False], [], F.linear
    monkeypatch.setattr(kernels, "cpu_has_native_bf16", lambda: native[0])
    monkeypatch.setattr(F, "linear", lambda x, *a: ran.append(x.dtype) or linear(x, *a))
    for rows, lifted in ((8, True), (33, True), (1, False)):
        x = torch.randn(rows, 40, generator=g).bfloat16()
        got = kernels.linear_forward(x, w, b)
        assert ran.pop() == (torch.float32 if lifted else torch.bfloat16)
        want = linear(x.float(), w.float(), b.float()).bfloat16() if lifted else linear(x, w, b)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)
        grad, = torch.autograd.grad(got.float().sum(), w)
        assert grad.dtype == torch.bfloat16 and torch.equal(grad, x.float().sum(0).expand(96, 40).bfloat16())
    native[0] = True
    kernels.linear_forward(torch.randn(8, 40, generator=g).bfloat16(), w, b)
    assert ran == [torch.bfloat16]


def test_few_rows_kernel_times_every_product_on_first_use_and_keeps_the_fastest(monkeypatch):
    """For each (weight shape, rows, threads), the first `trials` calls of each applicable product take turns and are
    timed; the fastest is used from then on only if its median is below `margin` × F.linear's (4 rows: 5% faster is
    within the noise, F.linear stays); a new thread count is timed anew; deterministic algorithms take F.linear."""
    kernel, clock, threads = FewRowsKernel(), [0.0], [2]
    cost = {  # seconds per call, by rows and product; 320 rows make blocks of 64+ rows in 2, 4 (not 8)
        1: {"linear": 3.0, "transposed": 2.0, "blocks2": 2.5, "blocks4": 1.5, "mv": 1.8},
        8: {"linear": 1.0, "transposed": 4.0, "blocks2": 4.0, "blocks4": 4.0},
        4: {"linear": 2.0, "transposed": 1.9, "blocks2": 2.2, "blocks4": 2.1},
    }
    ran = []

    def product(x, w, b, rows, kind):
        ran.append((rows, kind))
        clock[0] += cost[rows][kind] * (10 if ran.count((rows, kind)) == 1 else 1)  # a cold first call
        return F.linear(x, w, b)

    monkeypatch.setattr(kernels, "FEW_ROWS_KERNEL", kernel)
    monkeypatch.setattr(kernel, "product", product)
    monkeypatch.setattr(kernels.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads[0])
    w, kinds = torch.randn(320, 208), ["linear", "transposed", "blocks2", "blocks4"]
    n = (len(kinds) + 1) * kernel.trials
    with torch.no_grad():
        for _ in range(n + 3):
            kernels.linear_forward(torch.randn(1, 208), w)
            kernels.linear_forward(torch.randn(8, 208), w)
            kernels.linear_forward(torch.randn(4, 208), w)
        threads[0] = 1
        kernels.linear_forward(torch.randn(1, 208), w)
        deterministic = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)
        try:
            want = F.linear(x := torch.randn(1, 208), w)
            assert torch.equal(kernels.linear_forward(x, w), want)  # no timing: F.linear itself
        finally:
            torch.use_deterministic_algorithms(deterministic)
    # After the trials a key that keeps F.linear calls it directly (not through `product`).
    assert [k for r, k in ran[:-1] if r == 1] == (kinds + ["mv"]) * kernel.trials + ["blocks4"] * 3  # the fastest
    assert [k for r, k in ran[:-1] if r == 8] == kinds * kernel.trials  # x·Wᵀ for 8
    assert [k for r, k in ran if r == 4] == kinds * kernel.trials  # within the margin
    f32 = torch.float32
    assert kernel.chosen == {(320, 208, 1, 2, f32): "blocks4", (320, 208, 8, 2, f32): "linear",
                             (320, 208, 4, 2, f32): "linear"}
    assert kernel.medians[320, 208, 4, 2, f32] == pytest.approx(cost[4]) and ran[-1] == (1, "linear")


def test_few_rows_kernel_chooses_for_compile_decode_by_timing_in_rounds(monkeypatch):
    """`FewRowsKernel.choose` (what `compile_decode` asks) times a key's traceable products (not W·x; for one row the
    float32 reduction, compiled for each shape before any timing) after one untimed F.linear per weight (a model just
    loaded from a memory-mapped file would otherwise time its page faults: the 114M FFN products all came out
    F.linear in such a process), in rounds of one product for all the key's
    weights, each key at least `trials` times per product; eager decoding's own choices are left alone, and a key
    already timed, `forced` and deterministic algorithms are answered without timing."""
    kernel, clock, seen = FewRowsKernel(), [0.0], []
    cost = {"linear": 3.0, "transposed": 2.9, "blocks2": 2.0, "blocks4": 1.0, "mv": 0.5, "reduce": 1.5}

    def product(x, w, b, rows, kind):
        seen.append((w.data_ptr(), kind))
        clock[0] += cost[kind]
        return x @ w.t()

    monkeypatch.setattr(kernel, "product", product)
    monkeypatch.setattr(kernels.time, "perf_counter", lambda: clock[0])
    compiled = []
    monkeypatch.setattr(kernel, "compiled_reduce", lambda x, w, b, scale=None: compiled.append((w.data_ptr(), clock[0])))
    weights = [torch.randn(320, 208) for _ in range(3)]
    warm, linear = [], torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear",
                        lambda x, w, *a: warm.append((w.data_ptr(), clock[0])) or linear(x, w, *a))
    assert kernel.choose(weights, 1) == ["blocks4"] * 3
    assert warm == [(w.data_ptr(), 0.0) for w in weights]  # each weight read once, before any timing
    assert compiled == warm  # and its reduction compiled
    kinds = ["linear", "transposed", "blocks2", "blocks4", "reduce"]  # 3 rounds each: 3 weights × 3 ≥ 9 trials
    assert seen == [(w.data_ptr(), kinds[r % 5]) for r in range(15) for w in weights]
    assert kernel.choose(weights, 1) == ["blocks4"] * 3 and len(seen) == 45  # already timed
    assert kernel.chosen == {} and kernel.walk_medians[(320, 208, 1, torch.get_num_threads(), torch.float32)] == {
        k: pytest.approx(cost[k]) for k in kinds}
    monkeypatch.setattr(kernel, "forced", "mv")
    assert kernel.choose(weights, 1) == ["linear"] * 3  # no traced form
    monkeypatch.setattr(kernel, "forced", "blocks8")
    assert kernel.choose(weights, 2) == ["linear"] * 3  # 40-row blocks do not apply to 320 rows
    monkeypatch.setattr(kernel, "forced", "reduce")
    assert kernel.choose(weights, 2) == ["linear"] * 3  # one row only: a batch would read W once per row
    monkeypatch.setattr(kernel, "forced", "blocks2")
    assert kernel.choose(weights, 2) == ["blocks2"] * 3 and len(seen) == 45
    monkeypatch.setattr(kernel, "forced", None)
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert kernel.choose(weights, 3) == ["linear"] * 3 and len(seen) == 45
    finally:
        torch.use_deterministic_algorithms(deterministic)


def test_few_rows_kernel_times_compiled_choices_in_walk_order(monkeypatch):
    """With a `walk` (every weight a decode step reads, in order) the rounds run over it, the other weights read
    untimed by F.linear between the timed ones, so each product finds its weight as cold as in a decode step (timed
    over one shape's weights alone, or alternating products call by call, bf16 FFN weights gave F.linear a tie with
    the product that ran the compiled step 1.12× faster). Each weight gets its own key's choice; `stored` answers
    and keeps choices by key."""
    kernel, clock, seen = FewRowsKernel(), [0.0], []
    cost = {(320, "linear"): 3.0, (320, "transposed"): 2.0, (320, "blocks2"): 2.9, (320, "blocks4"): 2.8,
            (320, "reduce"): 3.5, (208, "linear"): 1.0, (208, "transposed"): 2.0, (208, "blocks2"): 2.5,
            (208, "reduce"): 3.0}

    def product(x, w, b, rows, kind):
        seen.append((w.data_ptr(), kind))
        clock[0] += cost[w.shape[0], kind]
        return x @ w.t()

    monkeypatch.setattr(kernel, "product", product)
    monkeypatch.setattr(kernel, "compiled_reduce", lambda x, w, b, scale=None: None)
    monkeypatch.setattr(kernels.time, "perf_counter", lambda: clock[0])
    up = [torch.randn(320, 208) for _ in range(2)]
    down = [torch.randn(208, 320) for _ in range(2)]
    other = [torch.randn(64, 208), torch.randn(208, 64, dtype=torch.bfloat16)]
    walk = [up[0], other[0], down[0], up[1], other[1], down[1]]
    read, linear = [], torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear",
                        lambda x, w, *a: read.append(w.data_ptr()) or linear(x, w, *a))
    stored = {}
    assert kernel.choose([up[0], down[0], up[1], down[1]], 1, stored, walk) == [
        "transposed", "linear", "transposed", "linear"]
    assert read[:6] == [w.data_ptr() for w in walk]  # the untimed first reads
    up_kinds = ["linear", "transposed", "blocks2", "blocks4", "reduce"]
    down_kinds = ["linear", "transposed", "blocks2", "reduce"]
    # 2 weights per key: 5 rounds per product for 9 trials; the key with 5 products sets the count, 25 rounds
    order = ((up[0], up_kinds), (down[0], down_kinds), (up[1], up_kinds), (down[1], down_kinds))
    assert seen == [(w.data_ptr(), kinds[r % len(kinds)]) for r in range(25) for w, kinds in order]
    assert read.count(other[0].data_ptr()) == read.count(other[1].data_ptr()) == 1 + 25  # read every round
    assert sorted(stored.values()) == ["linear", "transposed"] and all("timed in walk rounds" in n for n in stored)
    fresh = FewRowsKernel()
    monkeypatch.setattr(fresh, "product", product)
    assert fresh.choose(down, 1, stored) == ["linear", "linear"] and len(seen) == 100  # answered by `stored`


def test_linear_forward_traces_into_one_graph_for_every_row_count():
    """Under torch.compile every row count takes F.linear inside one graph: the thread-count check of the eager few-row
    path must not be traced (dynamo cannot trace `torch.get_num_threads`; batch 8 under compile_config broke on it),
    nor the row-count rules of the eager paths."""
    torch._dynamo.reset()
    w = torch.randn(320, 208, generator=torch.Generator().manual_seed(1))
    traced = torch.compile(kernels.linear_forward, fullgraph=True, backend="eager", dynamic=False)
    for rows in (1, 4, 8, 16):
        x = torch.randn(rows, 208)
        assert torch.allclose(traced(x, w), F.linear(x, w), atol=1e-5)
    # With a dynamic row count no eager-path rule (8+ bf16 rows, up to 16 few rows) may guard the graph: 2-40 rows, one
    # graph (a compiled decode step at another batch size must not recompile).
    torch._dynamo.reset()
    graphs = []
    traced = torch.compile(kernels.linear_forward, fullgraph=True,
                           backend=lambda gm, _: graphs.append(gm) or gm.forward, dynamic=True)
    for rows in (2, 5, 8, 16, 17, 40):
        x = torch.randn(rows, 208)
        assert torch.allclose(traced(x, w), F.linear(x, w), atol=1e-5)
    assert len(graphs) == 1


@pytest.mark.parametrize("kind", ["mv", "transposed", "packed"])
def test_bf16_decode_through_the_few_row_products_equals_bf16_recompute(monkeypatch, kind):
    """bf16 decode steps whose products take `FEW_ROWS_KERNEL`'s W·x, (W·xᵀ)ᵀ or oneDNN's prepacked linear (forced
    for every weight, for the test; bf16 one-row products pick them by timing) keep greedy decoding's ids and equal a
    bf16 recompute (F.linear) within the same tolerance as F.linear's own steps. The float32 Memory-Cache products
    take the forced product too, except the prepacked one (bf16 only)."""
    if kind == "packed" and not kernels.cpu_has_mkldnn_bf16():
        pytest.skip("this torch has no oneDNN prepacked linear")

    every_weight_few_rows(monkeypatch, kind)
    ran, product = [], FewRowsKernel.product
    monkeypatch.setattr(FewRowsKernel, "product",
                        staticmethod(lambda x, w, b, rows, k: ran.append((w.dtype, k)) or product(x, w, b, rows, k)))
    model = optimize_for_cpu(bf16_twin(tiny_model(seed=4)))
    ids = prompt()
    assert torch.equal(greedy(model, ids, True), greedy(model, ids, False))
    steps, full = stepwise_logits(model, greedy(model, ids, True), prefill=5)
    assert (torch.bfloat16, kind) in ran and ((torch.float32, kind) in ran) == (kind != "packed")
    assert (steps.float() - full.float()).abs().max() <= 8 * 2**-7 * full.float().abs().max()


@pytest.mark.parametrize("kind", ["transposed", "blocks2"])
def test_one_token_decode_through_the_few_row_kernel_equals_a_full_recompute(monkeypatch, kind):
    """A batch-1 decode step's products run as (W·[x; 0]ᵀ)ᵀ, or as a batched GEMM over two blocks of W's rows (every
    weight, for the test); one-token steps across Memory-Cache segment boundaries give the logits of a full recompute,
    and greedy generate its ids."""
    every_weight_few_rows(monkeypatch, kind)
    monkeypatch.setattr(FewRowsKernel, "min_block_rows", 1)
    model = optimize_for_cpu(tiny_model(seed=7))
    ids = prompt(length=3 * L + 5)
    op = "mm" if kind == "transposed" else "bmm"
    shapes, plain = [], getattr(torch, op)
    # (W·[x; 0]ᵀ: the columns of [x; 0]ᵀ), (blocks: the blocks and rows of the broadcast x, not other bmm's)
    record = (lambda a, b: (0, b.shape[1])) if op == "mm" else (lambda a, b: a.shape[:2] if a.stride(0) == 0 else None)
    monkeypatch.setattr(torch, op, lambda a, b: shapes.append(record(a, b)) or plain(a, b))
    with torch.no_grad():
        out = model(ids[:, :5], use_cache=True)
        shapes.clear()  # the 5-token prefill takes the few-row kernel too; the decode steps are checked
        got = [out.logits]
        for t in range(5, ids.shape[1]):
            got.append(model(ids[:, t:t + 1], cache=out.cache, use_cache=True).logits)
    monkeypatch.setattr(torch, op, plain)
    if kind == "transposed":
        assert shapes and {n for _, n in shapes} == {2}  # one row padded to two, in every projection of every step
    else:
        assert shapes.count((2, 1)) > 10 * (ids.shape[1] - 5) and set(shapes) - {None} == {(2, 1)}  # 2 blocks, 1 row
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
    assert float((torch.cat(got, 1) - full).abs().max()) <= 1e-5 * float(full.abs().max())
    greedy_ids = model.generate(ids[:, :9], max_new_tokens=12, do_sample=False)
    with monkeypatch.context() as general:
        plain_linear_forward(general)
        assert torch.equal(greedy_ids, model.generate(ids[:, :9], max_new_tokens=12, do_sample=False))


# ---------------------------------------------------------------------------------------------------------------------
# Fused input projections


def test_fused_input_projections_share_storage_and_refuse_after_rebinding():
    model = optimize_for_cpu(tiny_model(seed=6))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    attn = model.model.layers[0].attn
    first = fused(attn)
    assert first.linears == (attn.q_a_proj, attn.k_proj, attn.v_proj, attn.mc.qkv_proj, attn.mc.gate_proj)
    start = first.weight.data_ptr()
    end = start + first.weight.numel() * first.weight.element_size()
    assert all(start <= lin.weight.data_ptr() < end for lin in first.linears)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)

    ids, mask = batch(seed=3)
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
        got = decode_logits(model, ids, mask, prefill=3)
        assert float((got - full)[mask.bool()].abs().max()) <= TOL
        # New storage for one weight (what .to() / .half() / assignment do): the next decode step fuses again.
        attn.k_proj.weight.data = attn.k_proj.weight.data * 1.5
        assert not first.intact()
        full = model(ids, attention_mask=mask, use_cache=False).logits
        got = decode_logits(model, ids, mask, prefill=3)
    assert fused(attn) is not first and fused(attn).intact()
    assert float((got - full)[mask.bool()].abs().max()) <= TOL


def test_fused_input_projections_keep_the_memory_cache_in_float32():
    """In a bf16 model the Memory Cache's projections (float32, as the branch computes) stay out of the fused GEMM; with
    gradients on (the fused matrix does not train) or under autocast (which would run the float32 Memory-Cache
    projections in bf16) the module's own projections run."""
    model = optimize_for_cpu(tiny_model(seed=6).to(torch.bfloat16))
    attn = model.model.layers[0].attn
    assert fused(attn).linears == (attn.q_a_proj, attn.k_proj, attn.v_proj)  # the MC branch computes in fp32
    model = optimize_for_cpu(tiny_model(seed=6))
    attn = model.model.layers[0].attn
    u = torch.randn(1, 1, model.config.hidden_size)
    assert len(attn.input_projections(u)) == 3  # with gradients on: the module's own (q_a, k, v)
    with torch.no_grad():
        assert len(attn.input_projections(u)) == 5  # the fused GEMM, the Memory Cache's two included
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert len(attn.input_projections(u)) == 3
    fusion.unfuse_input_projections(model, [attn])
    assert fused(attn) is None and "input_projections" not in vars(attn)


def test_hooked_or_wrapped_input_projections_run_one_by_one():
    """A forward hook (on the Linear or on every module), a replaced forward or a wrapper class makes the Linear's call
    more than x·Wᵀ + b, so the fused GEMM must not stand in for it."""
    model = optimize_for_cpu(tiny_model(seed=6))
    ids, mask = batch(seed=3)
    with torch.no_grad():
        model(ids[:, :2], attention_mask=mask[:, :2])
    attn = model.model.layers[0].attn
    assert fused(attn) is not None and fused(attn).intact()
    seen = []
    handle = attn.v_proj.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    with torch.no_grad():
        decode_logits(model, ids[:, :6], mask[:, :6], prefill=3)
    runs = sum(layer_idx == 0 for layer_idx, _ in model.model.loop_plan.entries)  # layer 0 runs once per pass
    assert fused(attn) is None and len(seen) == 4 * runs  # the prefill and 3 steps
    handle.remove()
    with torch.no_grad():
        model(ids[:, :2], attention_mask=mask[:, :2])  # the next eager no-grad forward fuses again
    assert fused(attn) is not None
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
    try:
        assert not attn.input_projections.fused.intact()
    finally:
        handle.remove()
    assert attn.input_projections.fused.intact()
    attn.k_proj.forward = attn.k_proj.forward  # what accelerate's add_hook_to_module does
    linears = attn.input_projections.fused.linears
    assert not attn.input_projections.fused.intact() and not fusion.FusedLinears.fusable(linears)
    del attn.k_proj.forward

    class Adapter(torch.nn.Linear):  # a PEFT-style wrapper adds its own product
        pass

    attn.q_a_proj.__class__ = Adapter
    assert not fusion.FusedLinears.fusable(linears)


def test_input_projections_of_offloaded_or_mixed_weights_are_not_fused():
    model = tiny_model(seed=6)
    ffn = model.model.layers[0].ffn
    ffn.up_proj.weight.data = ffn.up_proj.weight.data.to(torch.bfloat16)
    optimize_for_cpu(model)
    assert fused(ffn) is None and fused(model.model.layers[1].ffn) is not None
    meta = optimize_for_cpu(tiny_model(seed=6).to("meta"))  # what accelerate's offload leaves between calls
    assert all(fused(layer.ffn) is None and fused(layer.attn) is None for layer in meta.model.layers)


def test_input_projections_fused_again_inside_an_inference_mode_step_stay_trainable_parameters():
    model = optimize_for_cpu(tiny_model(seed=6))
    attn = model.model.layers[0].attn
    ids, mask = batch(seed=3)
    with torch.no_grad():
        cache = model(ids[:, :4], attention_mask=mask[:, :4], use_cache=True).cache
        attn.k_proj.weight.data = attn.k_proj.weight.data * 1.5  # new storage: the next step fuses again
        model(ids[:, 4:5], attention_mask=mask[:, :5], cache=cache, use_cache=True)
    assert fused(attn).intact()
    assert not any(p.is_inference() for p in model.parameters()) and not fused(attn).weight.is_inference()
    assert fused(attn).weight.grad_fn is None  # a copy of the weights, not a node of an autograd graph
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(ids, attention_mask=mask, labels=ids).loss.backward()
    optimizer.step()  # in place on every parameter: refused on an inference tensor


# ---------------------------------------------------------------------------------------------------------------------
# The CPU-specialised compiled walk: fusion, product choices, column-major weights, options


def test_compile_decode_stores_only_float32_weights_column_major(tmp_path):
    """The column-major re-store is for float32 weights, where MKL reads it faster: the FFN's and the rank→hidden
    up-projections of a float32 model (same values and state dict; saved and reloaded, the same logits), each
    attention's input projections fused; a bf16 model keeps its weights row-major (column-major bf16 weights made the
    compiled 114M decode step on a CPU without bf16 instructions 4.4x slower than eager bf16, 1,028 against 234 ms:
    there a one-row bf16 GEMM on a column-major weight is ~28x slower). `enable=False` stores them row-major again."""
    model = optimize_for_cpu(tiny_model(seed=3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(10, 500, (1, L + 2), generator=torch.Generator().manual_seed(7))
    gate, o_b = model.model.layers[0].ffn.gate_proj.weight, model.model.layers[0].attn.o_b_proj.weight
    try:
        model.compile_decode()
        assert gate.stride() == (1, gate.shape[0])  # FFN weights stored column-major, same values
        assert o_b.stride() == (1, o_b.shape[0])  # and the rank→hidden up-projections
        assert all(fused(layer.attn) is not None for layer in model.model.layers)
        after = model.state_dict()
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
        model.save_pretrained(tmp_path)
        reloaded = type(model).from_pretrained(tmp_path).eval()
        with torch.no_grad():
            assert float((reloaded(ids).logits - model(ids).logits).abs().max()) <= TOL
    finally:
        model.compile_decode(enable=False)
    assert gate.is_contiguous() and o_b.is_contiguous()
    model = optimize_for_cpu(tiny_model(seed=3).to(torch.bfloat16))
    gate = model.model.layers[0].ffn.gate_proj.weight
    try:
        model.compile_decode()
        assert gate.stride() == (gate.shape[1], 1)
        assert all(fused(layer.attn) is not None for layer in model.model.layers)
    finally:
        model.compile_decode(enable=False)


def test_compile_decode_unfuses_the_ffn_that_eager_decoding_fused():
    model = optimize_for_cpu(tiny_model(seed=8))
    ids, mask = batch(seed=3)
    with torch.no_grad():
        model(ids, attention_mask=mask, use_cache=False)
    assert all(fused(layer.ffn) is not None for layer in model.model.layers)
    try:
        model.compile_decode()
        assert all(fused(layer.ffn) is None and fused(layer.attn) is not None for layer in model.model.layers)
        with torch.no_grad():
            model(ids[:, :4], attention_mask=mask[:, :4], use_cache=False)  # an eager forward beside the compiled walk
        assert all(fused(layer.ffn) is None for layer in model.model.layers)
    finally:
        model.compile_decode(enable=False)


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
    optimize_for_cpu(model)
    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: seen.append(kwargs["options"]) or fn)
    model.compile_decode()
    model.compile_decode(options={"pattern_matcher": not quantized})
    model.compile_decode(enable=False)
    assert [o.get("pattern_matcher", True) for o in seen] == [quantized, not quantized]


def test_compile_decode_multiplies_by_row_blocks_where_the_few_row_kernel_takes_them(monkeypatch):
    """Where `FEW_ROWS_KERNEL` takes a one-row product as the batched GEMM over blocks of W's rows (forced here, for
    every weight), `compile_decode` chooses that product for the FFN and rank→hidden FewRowsLinears, keeps
    their weights row-major, and the compiled walk multiplies by those blocks, with eager decoding's ids and logits."""
    every_weight_few_rows(monkeypatch, "blocks2")
    monkeypatch.setattr(FewRowsKernel, "min_block_rows", 1)
    torch._dynamo.reset()
    model = optimize_for_cpu(tiny_model(seed=4))
    graphs, backend = recording_backend()

    ids = torch.randint(5, 200, (1, L + 1), generator=torch.Generator().manual_seed(5))
    kw = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True)
    attn, ffn = model.model.layers[0].attn, model.model.layers[0].ffn
    with torch.no_grad():
        eager = model.generate(ids, **kw)
        model.compile_decode(backend=backend)
        try:
            assert {compiled_kinds(m)[0] for m in (ffn.gate_proj, ffn.down_proj, attn.o_b_proj, attn.mc.o_proj)} \
                == {"blocks2"}
            assert ffn.gate_proj.weight.is_contiguous() and attn.o_b_proj.weight.is_contiguous()
            assert attn.mc.o_proj.weight.is_contiguous()
            compiled = model.generate(ids, **kw)
        finally:
            model.compile_decode(enable=False)
    blocked = [n.args[1] for gm in graphs for n in gm.graph.nodes if n.target is torch.bmm]
    # q_b, o_a, o_b, gate, up, down, the Memory Cache's o_proj and the fused q_a/kv/Memory-Cache inputs
    assert graphs and len(blocked) >= 8 * len(model.model.layers)
    assert torch.equal(eager.sequences, compiled.sequences)
    assert max(float((a - b).abs().max()) for a, b in zip(eager.logits, compiled.logits)) <= TOL


def test_compile_decode_multiplies_a_batch_by_the_product_timed_fastest_for_several_rows(monkeypatch, tmp_path):
    """The compiled walk takes the product timed fastest for one row in its batch-1 graph and the one timed fastest
    for `COMPILED_BATCH_ROWS` rows in the graph of larger batches (here, by fake timings, blocks of W's rows and
    (W·Xᵀ)ᵀ): on the FFN and rank→hidden Linears and the fused input projections of every layer's attention, with
    eager decoding's ids and logits at batch 1 and 3."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # the fake timings' choices stay out of the user's
    every_weight_few_rows(monkeypatch)
    monkeypatch.setattr(FewRowsKernel, "min_block_rows", 1)
    kernel = use_kernel(monkeypatch, FewRowsKernel())
    fastest = {1: "blocks2", COMPILED_BATCH_ROWS: "transposed"}
    monkeypatch.setattr(kernel, "product", lambda x, w, b, rows, kind: time.sleep(
        1e-4 if kind == fastest.get(rows) else 3e-4) or torch.nn.functional.linear(x, w, b))
    torch._dynamo.reset()
    model = optimize_for_cpu(tiny_model(seed=4))
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
            for owner in (ffn.gate_proj, attn.o_b_proj, fused(attn)):
                assert compiled_kinds(owner) == ("blocks2", "transposed")
            compiled, traced = [], []
            for ids in prompts:
                before = len(graphs)
                compiled.append(model.generate(ids, **kw))
                traced.append(graphs[before:])
        finally:
            model.compile_decode(enable=False)
    one, batch3 = traced
    assert one and batch3
    assert calls(one, torch.bmm) == n_products and calls(one, torch.mm) == 0
    assert calls(batch3, torch.mm) == n_products and calls(batch3, torch.bmm) == 0
    for want, got in zip(eager, compiled):
        assert torch.equal(want.sequences, got.sequences)
        assert max(float((a - b).abs().max()) for a, b in zip(want.logits, got.logits)) <= TOL


def bf16_walk_with_forced_product(monkeypatch, kind: str):
    """(tiny_model(seed=4)'s weights in bf16, optimized for CPU, the graphs a compiled walk traces, a dynamo backend
    recording them and running them as traced), with every few-row product forced to `kind` and dynamo's caches
    reset."""
    every_weight_few_rows(monkeypatch, kind)
    torch._dynamo.reset()
    return optimize_for_cpu(bf16_twin(tiny_model(seed=4))), *recording_backend()


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
        assert {compiled_kinds(m)[0] for m in (ffn.gate_proj, ffn.down_proj, attn.o_b_proj)} == {"transposed"}
        assert ffn.gate_proj.weight.is_contiguous() and attn.o_b_proj.weight.is_contiguous()
        compiled = decode_logits(model, ids, mask, prefill=L + 1).float()
    finally:
        model.compile_decode(enable=False)
    weight_first = [n for gm in graphs for n in gm.graph.nodes if n.target is torch.mm]
    assert graphs and len(weight_first) >= 5 * len(model.model.layers)  # q_b, o_b, gate, up, down in every layer
    assert compiled.dtype == eager.dtype and compiled.shape == eager.shape
    valid = mask.bool()
    assert float((compiled - eager)[valid].abs().max()) <= 2 ** -5 * float(eager[valid].abs().max())


@pytest.mark.skipif(not kernels.cpu_has_mkldnn_bf16(), reason="this torch has no oneDNN prepacked linear")
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
        fused_input = fused(model.model.layers[0].attn)  # q_a and k/v (the Memory Cache's stay float32)
        assert {compiled_kinds(m)[0] for m in (ffn.gate_proj, ffn.down_proj, fused_input)} == {"packed"}
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
    assert ffn.gate_proj.weight not in FewRowsKernel.packed  # the walk's copies go with it
    assert fused_input.weight not in FewRowsKernel.packed
    out = model(ids[:, :L + 1], attention_mask=mask[:, :L + 1], use_cache=True)
    with torch.enable_grad():
        loss = model(ids[:, L + 1:L + 2], past_key_values=out.past_key_values, **step).logits.float().square().sum()
        want = torch.autograd.grad(loss, [ffn.gate_proj.weight, ffn.down_proj.weight])
    assert all(torch.equal(g, w) for g, w in zip(grads, want))


def test_packed_linear_op_compiles_through_inductor():
    """`spike_whale::packed_linear` in an inductor graph for any number of rows (dynamic shapes): oneDNN's values on
    the weight's prepacked copy, bit for bit, with and without bias."""
    if not kernels.cpu_has_mkldnn_bf16():
        pytest.skip("this torch has no oneDNN prepacked linear")
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 64, generator=g).bfloat16(), torch.randn(96, generator=g).bfloat16()
    fn = torch.compile(lambda x, w, b: torch.ops.spike_whale.packed_linear(x, w, b) * 2, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for rows, bias in ((1, None), (3, b), (5, b)):
            x = torch.randn(rows, 1, 64, generator=g).bfloat16()
            assert torch.equal(fn(x, w, bias), FewRowsKernel.product(x, w, bias, rows, "packed") * 2)


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
            for owner in (ffn.gate_proj, ffn.down_proj, attn.o_b_proj, attn.mc.o_proj, fused(attn)):
                assert compiled_kinds(owner) == ("reduce", "linear")
            if dtype == torch.bfloat16:
                assert compiled_kinds(attn.mc.qkv_proj)[0] == compiled_kinds(attn.mc.gate_proj)[0] == "reduce"
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
    (whose winners may be "reduce"); for inductor's walk `choose_compiled_products` takes it where it is fastest."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    every_weight_few_rows(monkeypatch)
    kernel = use_kernel(monkeypatch, FewRowsKernel())
    timed = []
    monkeypatch.setattr(kernel, "product", lambda x, w, b, rows, kind: timed.append(kind) or time.sleep(
        1e-4 if kind == "reduce" else 3e-4) or torch.nn.functional.linear(x, w, b))
    monkeypatch.setattr(kernel, "compiled_reduce", lambda x, w, b, scale=None: None)
    model = optimize_for_cpu(tiny_model(seed=4))
    gate = model.model.layers[0].ffn.gate_proj
    _, backend = recording_backend()
    model.compile_decode(backend=backend)
    try:
        assert timed and "reduce" not in timed and compiled_kinds(gate)[0] == "linear"
        assert not gate.weight.is_contiguous()  # float32 F.linear: re-stored column-major
    finally:
        model.compile_decode(enable=False)
    assert gate.weight.is_contiguous()  # row-major again, for eager decoding and the next compile
    path = tmp_path / "spike_whale_decode" / "compiled_products.json"
    assert not path.exists()
    choose_compiled_products(model, persistent=True)
    assert compiled_kinds(gate)[0] == "reduce" and "reduce" in json.loads(path.read_text()).values()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reduce_product_compiles_through_inductor_and_is_timed_as_compiled(dtype):
    """The float32 reduction is F.linear's function (float32 accumulation, one rounding to x's dtype) as inductor
    compiles it in a graph of dynamic shapes, with and without bias; `FewRowsKernel.choose` times it for one row only
    (plain float weights, not a batch), on its kernel compiled once per shape (`compiled_reduce`)."""
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 64, generator=g).to(dtype), torch.randn(96, generator=g).to(dtype)
    fn = torch.compile(FewRowsKernel.reduce_product, fullgraph=True, dynamic=True)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    with torch.no_grad():
        for rows, bias in ((1, None), (1, b), (3, b)):
            x = torch.randn(rows, 1, 64, generator=g).to(dtype)
            want = torch.nn.functional.linear(x.double(), w.double(), None if bias is None else bias.double())
            for got in (fn(x, w, bias), FewRowsKernel.product(x, w, bias, rows, "reduce")):
                assert got.dtype == dtype and got.shape == want.shape
                assert float((got.double() - want).abs().max()) <= tol * float(want.abs().max())
        kernel = FewRowsKernel()
        weights = [torch.randn(256, 128, generator=g).to(dtype) for _ in range(2)]
        assert "reduce" in kernel.traced_candidates(weights[0], 1)
        assert "reduce" not in kernel.traced_candidates(weights[0], COMPILED_BATCH_ROWS)
        chosen = kernel.choose(weights, 1)
    medians = kernel.walk_medians[kernel.key(weights[0], 1)]
    assert "reduce" in medians and medians["reduce"] > 0 and chosen[0] in medians
    assert ((torch.Size([1, 128]), dtype), (weights[0].shape, dtype)) in FewRowsKernel.reduce_kernels


def test_compile_decode_keeps_its_row_block_choices_for_later_processes(monkeypatch, tmp_path):
    """The compiled walk's row blocks are timed once per torch, CPU model, thread count and weight shape: the first
    `compile_decode` writes them to `compiled_products.json` in torch's cache directory, and a later process (a fresh
    kernel that has timed nothing) takes them from there without timing, so its stored walk's key is the same;
    `persistent=False` neither reads nor writes it."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    every_weight_few_rows(monkeypatch)
    monkeypatch.setattr(FewRowsKernel, "min_block_rows", 1)
    model = optimize_for_cpu(tiny_model(seed=4))
    first = use_kernel(monkeypatch, FewRowsKernel())
    monkeypatch.setattr(first, "product", lambda x, w, b, rows, kind: time.sleep(2e-4 if kind == "blocks4" else 4e-4)
                        or torch.nn.functional.linear(x, w, b))
    gate = model.model.layers[0].ffn.gate_proj
    try:
        model.compile_decode()
        assert compiled_kinds(gate)[0] == "blocks4" and first.walk_medians  # timed, and blocks of 4 were the fastest
        key = PersistentDecodeWalk.key(model.model, {}, {})
    finally:
        model.compile_decode(enable=False)
    path = tmp_path / "spike_whale_decode" / "compiled_products.json"
    stored = json.loads(path.read_text())
    assert set(stored.values()) == {"blocks4"} and all(kernels.cpu_model() in name for name in stored)
    later = use_kernel(monkeypatch, FewRowsKernel())
    monkeypatch.setattr(later, "product", lambda *a: pytest.fail("a stored choice is timed again"))
    try:
        model.compile_decode()
        assert compiled_kinds(gate)[0] == "blocks4" and not later.walk_medians
        assert PersistentDecodeWalk.key(model.model, {}, {}) == key
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
    every_weight_few_rows(monkeypatch)
    kernel = use_kernel(monkeypatch, FewRowsKernel())
    monkeypatch.setattr(kernel, "product", lambda x, w, b, rows, kind: torch.nn.functional.linear(x, w, b))

    def full_disk(src, dst):  # the choices written to the temporary file, then the disk fills
        raise OSError("No space left on device")

    monkeypatch.setattr(accel_compile.os, "replace", full_disk)
    with pytest.raises(OSError, match="No space"):
        choose_compiled_products(optimize_for_cpu(tiny_model(seed=4)), persistent=True)
    assert list((tmp_path / "spike_whale_decode").iterdir()) == []
