"""The fast paths of issue 12 produce the same tokens as their references (speed is measured by
benchmarks/bench_speed.py, never here): bf16 cached decode equals a bf16 full recompute, and an int8 weight-only
model loads through transformers' `TorchAoConfig` and generates, its cached decode equal to its own recompute."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from packaging import version

from spike_whale import SpikeWhaleForCausalLM

from conftest import tiny_model

L = 8  # Memory-Cache segment length of the tiny config: 21 prompt + 12 new tokens cross several segments


def prompt(batch: int = 1, length: int = 21) -> torch.Tensor:
    ids = torch.randint(10, 200, (batch, length), generator=torch.Generator().manual_seed(length))
    ids[:, 0] = 2
    return ids


def greedy(model, ids, use_cache: bool, new: int = 12) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                              do_sample=False, use_cache=use_cache, pad_token_id=0)


def stepwise_logits(model, ids: torch.Tensor, prefill: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits of a prefill then one-token cached steps over the rest of ids, logits of one full forward)."""
    with torch.no_grad():
        out = model(ids[:, :prefill], use_cache=True)
        cache, steps = out.cache, [out.logits]
        for t in range(prefill, ids.shape[1]):
            steps.append(model(ids[:, t:t + 1], cache=cache, use_cache=True).logits)
        full = model(ids, use_cache=False).logits
    return torch.cat(steps, 1), full


def bf16_twin(model: SpikeWhaleForCausalLM) -> SpikeWhaleForCausalLM:
    """The same weights loaded the way `from_pretrained(..., dtype=torch.bfloat16)` builds the model."""
    twin = SpikeWhaleForCausalLM._from_config(model.config, dtype=torch.bfloat16).eval()
    twin.load_state_dict(model.state_dict())
    return twin


def test_bf16_cached_decode_equals_bf16_recompute():
    model = bf16_twin(tiny_model(seed=4))
    assert model.model.layers[0].attn.k_proj.weight.dtype == torch.bfloat16
    ids = prompt()
    assert torch.equal(greedy(model, ids, True), greedy(model, ids, False))
    steps, full = stepwise_logits(model, greedy(model, ids, True), prefill=5)
    # bf16: a few roundings of the largest logit, as `spike-whale verify --dtype bf16` allows
    assert (steps.float() - full.float()).abs().max() <= 8 * 2**-7 * full.float().abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_decode_attention_reads_in_float32_on_cpu(dtype):
    """On CPU a bf16/float16 decode step's softmax attention is computed from its inputs in float32 and rounded
    once (oneDNN's bf16 batched GEMMs of these shapes were the slower kernel), with and without a mask; it matches
    float32 SDPA over the same rounded inputs."""
    import spike_whale.modeling_spike_whale as msw

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, s, 16, generator=g).to(dtype) for n, s in ((6, 3), (2, 37), (2, 37)))
    mask = torch.ones(2, 1, 3, 37, dtype=torch.bool).tril(34)
    mask[1, ..., :5] = False
    for m in (None, mask):
        got = msw.decode_attention(q, k, v, m)
        assert got.dtype == dtype
        assert torch.equal(got, msw.decode_attention(q.float(), k.float(), v.float(), m).to(dtype))
        ref = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(3, 1),
                                             v.float().repeat_interleave(3, 1), attn_mask=m)
        assert (got.float() - ref).abs().max() <= 2 * torch.finfo(dtype).eps * ref.abs().max()


@pytest.mark.parametrize("kind", ["mv", "transposed", "packed"])
def test_bf16_decode_through_the_few_row_products_equals_bf16_recompute(monkeypatch, kind):
    """bf16 decode steps whose products take `FEW_ROWS_KERNEL`'s W·x, (W·xᵀ)ᵀ or oneDNN's prepacked linear (forced
    for every weight, for the test; bf16 one-row products pick them by timing) keep greedy decoding's ids and equal a
    bf16 recompute (F.linear) within the same tolerance as F.linear's own steps. The float32 Memory-Cache products
    take the forced product too, except the prepacked one (bf16 only)."""
    import spike_whale.modeling_spike_whale as msw

    if kind == "packed" and not msw.cpu_has_mkldnn_bf16():
        pytest.skip("this torch has no oneDNN prepacked linear")

    monkeypatch.setattr(msw, "FEW_ROWS_MIN_WEIGHT", 0)
    monkeypatch.setattr(msw.FewRowsKernel, "forced", kind)
    ran, product = [], msw.FewRowsKernel.product
    monkeypatch.setattr(msw.FewRowsKernel, "product",
                        staticmethod(lambda x, w, b, rows, k: ran.append((w.dtype, k)) or product(x, w, b, rows, k)))
    model = bf16_twin(tiny_model(seed=4))
    ids = prompt()
    assert torch.equal(greedy(model, ids, True), greedy(model, ids, False))
    steps, full = stepwise_logits(model, greedy(model, ids, True), prefill=5)
    assert (torch.bfloat16, kind) in ran and ((torch.float32, kind) in ran) == (kind != "packed")
    assert (steps.float() - full.float()).abs().max() <= 8 * 2**-7 * full.float().abs().max()


def test_bf16_padded_batch_cached_equals_recompute():
    model = bf16_twin(tiny_model(seed=5))
    ids = prompt(batch=2)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    ids[1, :4] = 0
    with torch.no_grad():
        kw = dict(attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(ids, use_cache=True, **kw), model.generate(ids, use_cache=False, **kw))


def branch_tensors(model) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if ".attn.mc." in k}


def test_bf16_loads_keep_the_memory_cache_branch_float32(tmp_path):
    """Both low-precision routes (`_from_config(dtype=...)`, `from_pretrained(dtype=...)`) keep the branch's weights
    float32 (it computes in float32; bf16 weights were cast on every slot of every step); save_pretrained writes them
    float32 under their own names, the rest bf16, and the reload is the same model."""
    built = bf16_twin(tiny_model(seed=4))
    assert len(branch_tensors(built)) == 8 * built.config.num_hidden_layers
    assert all(t.dtype == torch.float32 for t in branch_tensors(built).values())
    built.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    stored = load_file(str(tmp_path / "model.safetensors"))
    assert stored.keys() == built.state_dict().keys() - {"lm_head.weight"}
    assert {k for k, t in stored.items() if t.dtype == torch.float32 and "rope" not in k and "hash_proj" not in k} \
        == branch_tensors(built).keys()
    loaded = SpikeWhaleForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    assert all(t.dtype == torch.float32 for t in branch_tensors(loaded).values())
    assert loaded.model.layers[0].attn.k_proj.weight.dtype == torch.bfloat16
    ids = prompt()
    assert torch.equal(greedy(loaded, ids, True), greedy(built, ids, True))
    assert torch.equal(greedy(loaded, ids, True), greedy(loaded, ids, False))


@pytest.mark.parametrize("block_rows", [None, 1, 5])
def test_memory_cache_read_mixes_reads_not_memories(block_rows):
    """`_read` is the card's γ-softmax mix of the segment reads (to ~1e-6 in float32, against float64 per segment),
    computed without a per-token mixed hd × hd memory (that [B, S, nh, hd, hd] tensor was 11% of a bf16 prefill), and,
    where `read_floats` holds only `block_rows` tokens' candidate-weighted query rows, a block of tokens at a time
    (1 row; 5, which leaves a shorter last block)."""
    from torch.overrides import TorchFunctionMode

    from conftest import tiny_config
    from spike_whale.modeling_spike_whale import MemoryCacheBranch

    B, S, I, nh, hd, gd = 2, 48, 3, 4, 32, 16
    mc = MemoryCacheBranch(tiny_config(mc_num_heads=nh, mc_head_dim=hd, mc_gate_dim=gd))
    g = torch.Generator().manual_seed(0)
    fq = torch.rand(B, S, nh, hd, generator=g) + 0.5
    gu, own_g, cand_g = (torch.randn(*shape, generator=g) for shape in ((B, S, gd), (B, S, gd), (B, I, gd)))
    own_num, own_den = torch.rand(B, S, nh, hd, generator=g), torch.rand(B, S, nh, generator=g) + 1
    own_n = torch.randint(1, 9, (B, S), generator=g).float()
    cand_M, cand_z = torch.rand(B, I, nh, hd, hd, generator=g), torch.rand(B, I, nh, hd, generator=g) + 1
    readable = torch.rand(B, S, I, generator=g) > 0.4
    readable[0, 0] = False  # a token that reads only its own segment

    if block_rows is not None:
        mc.read_floats = block_rows * B * nh * I * hd

    class Sizes(TorchFunctionMode):
        largest = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor):
                Sizes.largest = max(Sizes.largest, out.numel())
            return out

    with Sizes():
        y = mc._read(fq, gu, (own_num, own_den, own_g, own_n), (cand_M, cand_z, cand_g, readable))
    assert Sizes.largest < B * S * nh * hd * hd // 4
    if block_rows is not None:  # no tensor holds the whole chunk's rows, B·nh·S·I·hd floats
        assert Sizes.largest < B * nh * S * I * hd

    d = torch.float64
    logits = torch.cat([(gu[:, :, None] * cand_g[:, None]).sum(-1).masked_fill(~readable, float("-inf")),
                        (gu * own_g).sum(-1, keepdim=True) / own_n[..., None]], -1).to(d)
    gamma = torch.softmax(logits, -1)
    num = gamma[..., -1, None, None] * own_num.to(d)
    den = gamma[..., -1, None] * own_den.to(d)
    for i in range(I):
        num = num + gamma[..., i, None, None] * torch.einsum("bshd,bhde->bshe", fq.to(d), cand_M[:, i].to(d))
        den = den + gamma[..., i, None] * torch.einsum("bshd,bhd->bsh", fq.to(d), cand_z[:, i].to(d))
    want = num / (den[..., None] + mc.eps)
    assert (y.to(d) - want).abs().max() <= 1e-6 * want.abs().max()


def test_memory_cache_one_token_reads_its_own_segment_as_a_candidate():
    """A decode step's read: its own segment's running totals are one more candidate of the read's GEMM, with their
    mean gate key as ḡ (`MemoryCacheBranch._step`). That is the read with the own segment apart, to the float32
    floor, and a candidate without a mask (None) is readable by every token."""
    from conftest import tiny_config
    from spike_whale.modeling_spike_whale import MemoryCacheBranch

    B, I, nh, hd, gd = 3, 2, 4, 32, 16
    mc = MemoryCacheBranch(tiny_config(mc_num_heads=nh, mc_head_dim=hd, mc_gate_dim=gd))
    g = torch.Generator().manual_seed(1)
    fq = torch.rand(B, 1, nh, hd, generator=g) + 0.5
    gu, own_g, cand_g = (torch.randn(*shape, generator=g) for shape in ((B, 1, gd), (B, 1, gd), (B, I, gd)))
    own_M, own_z = torch.rand(B, 1, nh, hd, hd, generator=g), torch.rand(B, 1, nh, hd, generator=g) + 1
    own_n = torch.tensor([[1.0], [5.0], [200.0]])
    cand_M, cand_z = torch.rand(B, I, nh, hd, hd, generator=g), torch.rand(B, I, nh, hd, generator=g) + 1
    own = (torch.matmul(fq[..., None, :], own_M)[..., 0, :], (fq * own_z).sum(-1), own_g, own_n)
    as_candidate = (torch.cat([cand_M, own_M], 1), torch.cat([cand_z, own_z], 1),
                    torch.cat([cand_g, own_g / own_n[..., None]], 1))
    readable = torch.tensor([[[True, True]], [[False, True]], [[False, False]]])
    for mask in (readable, None):
        want = mc._read(fq, gu, own, (cand_M, cand_z, cand_g, mask))
        full = torch.cat([mask, torch.ones(B, 1, 1, dtype=torch.bool)], -1) if mask is not None else None
        got = mc._read(fq, gu, None, (*as_candidate, full))
        assert (got - want).abs().max() <= 2e-6 * want.abs().max()
    everyone = torch.ones(B, 1, I, dtype=torch.bool)
    assert torch.equal(mc._read(fq, gu, own, (cand_M, cand_z, cand_g, None)),
                       mc._read(fq, gu, own, (cand_M, cand_z, cand_g, everyone)))


def test_parameter_functions_kept_between_steps_follow_their_parameters():
    """`derived` keeps an HC softmax or a gate's tanh between no-grad forwards, and recomputes it when the parameter
    is updated in place or replaced; with gradients on it is computed afresh: the gradient reaches the parameter, and
    a frozen model's training step after an inference-mode step saves no value kept there for its backward."""
    from spike_whale.modeling_spike_whale import HyperConnection

    hc = HyperConnection(2)
    g = torch.Generator().manual_seed(0)
    X, out = torch.randn(3, 2, 4, 8, generator=g), torch.randn(3, 4, 8, generator=g)

    def fresh(X):
        return torch.lerp(X[:, 0], X[:, 1], torch.softmax(hc.pre_logits.detach(), 0)[1])

    with torch.no_grad():
        assert torch.equal(hc.pre_op(X), fresh(X))
        hc.pre_logits.add_(torch.tensor([0.0, 1.5]))
        assert torch.equal(hc.pre_op(X), fresh(X))
        hc.pre_logits = torch.nn.Parameter(torch.tensor([2.0, -1.0]))
        assert torch.equal(hc.pre_op(X), fresh(X))
        hc.post_op(X, out)
        hc.post_scale.mul_(3.0)
        assert torch.equal(hc.post_op(X, out), torch.addcmul(X, torch.full((2, 1, 1), 3.0), out[:, None]))
    hc.pre_op(X).sum().backward()
    assert hc.pre_logits.grad is not None and hc.pre_logits.grad.abs().sum() > 0

    hc.requires_grad_(False)
    hc.pre_logits.add_(0.25)  # changed: the next no-grad forward computes and keeps w again
    with torch.inference_mode():
        hc.pre_op(X)
    Xg = X.clone().requires_grad_(True)
    hc.pre_op(Xg).sum().backward()
    assert torch.allclose(Xg.grad[:, 1], torch.softmax(hc.pre_logits, 0)[1].expand_as(Xg.grad[:, 1]))


def test_linear_forward_of_a_few_rows_equals_f_linear(monkeypatch):
    """`linear_forward` sends 1-16 rows with a float32, bf16 or float16 weight of 64K+ elements to `FEW_ROWS_KERNEL`;
    each of its products (x·Wᵀ, (W·xᵀ)ᵀ with one row padded to two, the batched GEMM over 2, 4 or 8 blocks of W's
    rows, also of a W that is a row slice of a wider matrix, and W·x for one row) gives F.linear's values and
    gradients; more rows, smaller weights and other dtypes keep F.linear; SpikeWhaleLinear keeps nn.Linear's state
    dict."""
    import torch.nn.functional as F

    import spike_whale.modeling_spike_whale as msw

    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(320, 208, generator=g, requires_grad=True), torch.randn(320, generator=g, requires_grad=True)
    wide = torch.randn(320, 416, generator=g)[:, 8:216]  # stride 416: blocks are views of W's rows, not of its storage
    assert msw.FewRowsKernel.candidates(w, 2) == ("linear", "transposed", "blocks2", "blocks4")  # 8: 40-row blocks
    assert msw.FewRowsKernel.candidates(w[:100], 2) == ("linear", "transposed")  # 50-row blocks are too small to pay
    assert msw.FewRowsKernel.candidates(w[:100], 1) == ("linear", "transposed", "mv")  # W·x: one row only
    monkeypatch.setattr(msw.FewRowsKernel, "min_block_rows", 1)
    kinds = msw.FewRowsKernel.candidates(w, 1)
    assert kinds == ("linear", "transposed", "blocks2", "blocks4", "blocks8", "mv")
    assert msw.FewRowsKernel.candidates(w[:300], 2) == ("linear", "transposed", "blocks2", "blocks4")  # 300: not 8
    with torch.no_grad():
        for kind in kinds[2:]:
            rows = 1 if kind == "mv" else 3
            x = torch.randn(rows, 208, generator=g)
            got = msw.FewRowsKernel.product(x, wide, None, rows, kind)
            assert (got - F.linear(x, wide)).abs().max() <= 1e-6 * got.abs().max()
            xb, wb = x.bfloat16(), wide.bfloat16()  # low precision: float32 accumulation, one rounding, as F.linear
            got, exact = msw.FewRowsKernel.product(xb, wb, None, rows, kind), F.linear(xb.double(), wb.double())
            assert got.dtype == torch.bfloat16 and (got.double() - exact).abs().max() <= 2 ** -8 * exact.abs().max()
    for kind in kinds:
        monkeypatch.setattr(msw.FewRowsKernel, "forced", kind)
        for shape in ((1, 208), (2, 208), (1, 2, 208), (3, 1, 208), (1, 1, 208), (1, 4, 208), (2, 1, 8, 208), (17, 208)):
            x = torch.randn(*shape, generator=g, requires_grad=True)
            for bias in (None, b):
                got = msw.linear_forward(x, w, bias)
                want = F.linear(x, w, bias)
                assert got.shape == want.shape and got.is_contiguous()
                r = torch.randn(want.shape, generator=g)
                grads = torch.autograd.grad((got * r).sum(), (x, w))
                for a, ref in zip((got, *grads), (want, *torch.autograd.grad((want * r).sum(), (x, w)))):
                    assert (a - ref).abs().max() <= 1e-6 * ref.abs().max()
    layer = msw.SpikeWhaleLinear(40, 48)
    assert list(layer.state_dict()) == ["weight", "bias"]
    routed = []
    monkeypatch.setattr(msw, "FEW_ROWS_KERNEL", lambda x, w, b, rows: routed.append((tuple(w.shape), rows)) or x @ w.t())
    with torch.no_grad():
        for rows in (1, 2, 8, 16, 17):
            msw.linear_forward(torch.randn(rows, 1, 208), w)  # up to 16 rows: the kernel that is faster here
        msw.linear_forward(torch.randn(2, 1, 40), layer.weight)  # a small weight: F.linear
        msw.linear_forward(torch.randn(2, 208, dtype=torch.float64), w.detach().double())  # float64: F.linear
        msw.linear_forward(torch.randn(2, 208, dtype=torch.bfloat16), w.detach().bfloat16())
        msw.linear_forward(torch.randn(1, 208, dtype=torch.float16), w.detach().half())
    assert routed == [((320, 208), 1), ((320, 208), 2), ((320, 208), 8), ((320, 208), 16), ((320, 208), 2),
                      ((320, 208), 1)]


def test_packed_bf16_product_follows_its_weight(monkeypatch):
    """"packed" (oneDNN's linear on a prepacked copy of a bf16 weight) is a candidate for bf16 weights only (not
    float32, float16, an inference tensor, or with `prepack = False`); it gives F.linear's values within bf16
    rounding with and without bias, packs each weight once and again after an in-place update or new storage; where
    a gradient flows it is neither timed nor run (F.linear gives the gradients); when a key's trials end on
    another product, the trials' copies are dropped; a key that took it multiplies an inference-tensor weight, or
    any weight once `prepack` is off, by F.linear."""
    import spike_whale.modeling_spike_whale as msw

    if not msw.cpu_has_mkldnn_bf16():
        pytest.skip("this torch has no oneDNN prepacked linear")
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(320, 208, generator=g).bfloat16(), torch.randn(320, generator=g).bfloat16()
    assert msw.FewRowsKernel.candidates(w, 1)[-1] == "packed" and msw.FewRowsKernel.candidates(w, 16)[-1] == "packed"
    assert "packed" not in msw.FewRowsKernel.candidates(w.float(), 1) + msw.FewRowsKernel.candidates(w.half(), 1)
    with torch.inference_mode():
        assert "packed" not in msw.FewRowsKernel.candidates(w.clone(), 1)
    monkeypatch.setattr(msw.FewRowsKernel, "prepack", False)
    assert "packed" not in msw.FewRowsKernel.candidates(w, 1)
    monkeypatch.setattr(msw.FewRowsKernel, "prepack", True)

    def close(got, x, w, b):
        exact = F.linear(x.double(), w.double(), None if b is None else b.double())
        assert got.dtype == torch.bfloat16 and got.shape == exact.shape
        assert (got.double() - exact).abs().max() <= 2**-7 * exact.abs().max()

    with torch.no_grad():
        for shape in ((1, 208), (1, 1, 208), (3, 1, 208), (16, 208)):
            x = torch.randn(*shape, generator=g).bfloat16()
            for bias in (None, b):
                close(msw.FewRowsKernel.product(x, w, bias, x.numel() // 208, "packed"), x, w, bias)
        packed = msw.FewRowsKernel.packed_weight(w)
        assert msw.FewRowsKernel.packed_weight(w) is packed
        w.mul_(-2)  # in place (an optimizer step, a loaded state dict)
        assert msw.FewRowsKernel.packed_weight(w) is not packed
        close(msw.FewRowsKernel.product(x, w, b, 16, "packed"), x, w, b)
        param = torch.nn.Parameter(w.clone())
        packed = msw.FewRowsKernel.packed_weight(param)
        param.data = torch.randn(320, 208, generator=g).bfloat16()  # new storage (`.to()`, assignment)
        assert msw.FewRowsKernel.packed_weight(param) is not packed
        close(msw.FewRowsKernel.product(x, param, None, 16, "packed"), x, param, None)

    w.requires_grad_()
    monkeypatch.setattr(msw.FewRowsKernel, "forced", "packed")
    x = torch.randn(2, 208, generator=g).bfloat16().requires_grad_()
    got, want = msw.linear_forward(x, w, b), F.linear(x, w, b)
    assert torch.equal(got, want)
    assert all(torch.equal(a, e) for a, e in zip(torch.autograd.grad(got.sum(), (x, w)),
                                                  torch.autograd.grad(want.sum(), (x, w))))
    monkeypatch.setattr(msw.FewRowsKernel, "forced", None)
    kernel, ran = msw.FewRowsKernel(), []
    product = kernel.product
    monkeypatch.setattr(kernel, "product", lambda x, w, b, rows, k: ran.append(k) or product(x, w, b, rows, k))
    for _ in range(6 * kernel.trials):  # past every other product's trials
        kernel(x, w, None, 2)
    assert ran and "packed" not in ran and kernel.key(w, 2) not in kernel.chosen  # trials wait for no-grad calls
    w2 = torch.randn(320, 208, generator=g).bfloat16()
    msw.FewRowsKernel.packed_weight(w2)
    monkeypatch.setattr(kernel, "_fastest", lambda medians, kinds: "linear")
    with torch.no_grad():
        while kernel.key(w, 2) not in kernel.chosen:
            kernel(x.detach(), w, None, 2)
    assert "packed" in ran and w not in msw.FewRowsKernel.packed and w2 not in msw.FewRowsKernel.packed
    kernel.chosen[kernel.key(w, 2)] = "packed"
    with torch.inference_mode():  # a weight of the same key that counts no in-place updates: F.linear
        inference_weight = w.detach().clone()
        assert torch.equal(kernel(x.detach(), inference_weight, None, 2), F.linear(x.detach(), inference_weight))
    assert ran[-1] == "linear" and inference_weight not in msw.FewRowsKernel.packed
    monkeypatch.setattr(msw.FewRowsKernel, "prepack", False)  # switched off after the choice: F.linear, no copy
    with torch.no_grad():
        kernel(x.detach(), w, None, 2)
    assert ran[-1] == "linear" and w not in msw.FewRowsKernel.packed


def test_compiled_walk_times_the_packed_product_and_keeps_only_the_copies_it_takes(monkeypatch):
    """`FewRowsKernel.choose` (a compiled walk's products) times "packed" for bf16 weights beside the traceable
    products, each weight packed before the timing; a key that takes another product leaves no copy behind, one that
    takes it keeps its weights' copies for the walk."""
    import spike_whale.modeling_spike_whale as msw

    if not msw.cpu_has_mkldnn_bf16():
        pytest.skip("this torch has no oneDNN prepacked linear")
    g = torch.Generator().manual_seed(4)
    small = [torch.randn(320, 208, generator=g).bfloat16() for _ in range(2)]
    large = [torch.randn(416, 208, generator=g).bfloat16() for _ in range(2)]
    kernel, timed = msw.FewRowsKernel(), []

    def product(x, w, b, rows, kind):  # "packed" is the fastest for the large shape only
        timed.append((kind, w in msw.FewRowsKernel.packed))
        msw.time.sleep(1e-4 if kind == "packed" and w.shape[0] == 416 else 3e-4)
        return F.linear(x, w, b)

    monkeypatch.setattr(kernel, "product", product)
    monkeypatch.setattr(kernel, "compiled_reduce", lambda x, w, b, scale=None: None)  # its untimed first call compiles it
    with torch.no_grad():
        chosen = kernel.choose(small + large, 1)
    assert chosen == ["linear", "linear", "packed", "packed"]
    assert {kind for kind, _ in timed} == set(msw.FewRowsKernel.traced_candidates(small[0], 1))
    assert all(was_packed for kind, was_packed in timed if kind == "packed")
    assert all(w not in msw.FewRowsKernel.packed for w in small) and all(w in msw.FewRowsKernel.packed for w in large)


def test_bf16_products_of_many_rows_run_in_float32_on_a_cpu_without_bf16_instructions(monkeypatch):
    """Without bf16 instructions (MKL's bf16 GEMM is several times slower there), a bf16 product of 8+ rows is the
    float32 product rounded to bf16 once, gradients included; one row, and any CPU with bf16 instructions, keep
    F.linear in bf16."""
    import torch.nn.functional as F

    import spike_whale.modeling_spike_whale as msw

    g = torch.Generator().manual_seed(2)
    w = torch.randn(96, 40, generator=g).bfloat16().requires_grad_()
    b = torch.randn(96, generator=g).bfloat16()
    native, ran, linear = [False], [], F.linear
    monkeypatch.setattr(msw, "cpu_has_native_bf16", lambda: native[0])
    monkeypatch.setattr(F, "linear", lambda x, *a: ran.append(x.dtype) or linear(x, *a))
    for rows, lifted in ((8, True), (33, True), (1, False)):
        x = torch.randn(rows, 40, generator=g).bfloat16()
        got = msw.linear_forward(x, w, b)
        assert ran.pop() == (torch.float32 if lifted else torch.bfloat16)
        want = linear(x.float(), w.float(), b.float()).bfloat16() if lifted else linear(x, w, b)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)
        grad, = torch.autograd.grad(got.float().sum(), w)
        assert grad.dtype == torch.bfloat16 and torch.equal(grad, x.float().sum(0).expand(96, 40).bfloat16())
    native[0] = True
    msw.linear_forward(torch.randn(8, 40, generator=g).bfloat16(), w, b)
    assert ran == [torch.bfloat16]


def test_few_rows_kernel_times_every_product_on_first_use_and_keeps_the_fastest(monkeypatch):
    """For each (weight shape, rows, threads), the first `trials` calls of each applicable product take turns and are
    timed; the fastest is used from then on only if its median is below `margin` × F.linear's (4 rows: 5% faster is
    within the noise, F.linear stays); a new thread count is timed anew; deterministic algorithms take F.linear."""
    import torch.nn.functional as F

    import spike_whale.modeling_spike_whale as msw

    kernel, clock, threads = msw.FewRowsKernel(), [0.0], [2]
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

    monkeypatch.setattr(msw, "FEW_ROWS_KERNEL", kernel)
    monkeypatch.setattr(kernel, "product", product)
    monkeypatch.setattr(msw.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads[0])
    w, kinds = torch.randn(320, 208), ["linear", "transposed", "blocks2", "blocks4"]
    n = (len(kinds) + 1) * kernel.trials
    with torch.no_grad():
        for _ in range(n + 3):
            msw.linear_forward(torch.randn(1, 208), w)
            msw.linear_forward(torch.randn(8, 208), w)
            msw.linear_forward(torch.randn(4, 208), w)
        threads[0] = 1
        msw.linear_forward(torch.randn(1, 208), w)
        deterministic = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)
        try:
            want = F.linear(x := torch.randn(1, 208), w)
            assert torch.equal(msw.linear_forward(x, w), want)  # no timing: F.linear itself
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
    import spike_whale.modeling_spike_whale as msw

    kernel, clock, seen = msw.FewRowsKernel(), [0.0], []
    cost = {"linear": 3.0, "transposed": 2.9, "blocks2": 2.0, "blocks4": 1.0, "mv": 0.5, "reduce": 1.5}

    def product(x, w, b, rows, kind):
        seen.append((w.data_ptr(), kind))
        clock[0] += cost[kind]
        return x @ w.t()

    monkeypatch.setattr(kernel, "product", product)
    monkeypatch.setattr(msw.time, "perf_counter", lambda: clock[0])
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
    import spike_whale.modeling_spike_whale as msw

    kernel, clock, seen = msw.FewRowsKernel(), [0.0], []
    cost = {(320, "linear"): 3.0, (320, "transposed"): 2.0, (320, "blocks2"): 2.9, (320, "blocks4"): 2.8,
            (320, "reduce"): 3.5, (208, "linear"): 1.0, (208, "transposed"): 2.0, (208, "blocks2"): 2.5,
            (208, "reduce"): 3.0}

    def product(x, w, b, rows, kind):
        seen.append((w.data_ptr(), kind))
        clock[0] += cost[w.shape[0], kind]
        return x @ w.t()

    monkeypatch.setattr(kernel, "product", product)
    monkeypatch.setattr(kernel, "compiled_reduce", lambda x, w, b, scale=None: None)
    monkeypatch.setattr(msw.time, "perf_counter", lambda: clock[0])
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
    fresh = msw.FewRowsKernel()
    monkeypatch.setattr(fresh, "product", product)
    assert fresh.choose(down, 1, stored) == ["linear", "linear"] and len(seen) == 100  # answered by `stored`


def test_linear_forward_traces_into_one_graph_for_every_row_count():
    """Under torch.compile every row count takes F.linear inside one graph: the thread-count check of the eager few-row
    path must not be traced (dynamo cannot trace `torch.get_num_threads`; batch 8 under compile_config broke on it),
    nor the row-count rules of the eager paths."""
    import torch.nn.functional as F

    from spike_whale.modeling_spike_whale import linear_forward

    torch._dynamo.reset()
    w = torch.randn(320, 208, generator=torch.Generator().manual_seed(1))
    traced = torch.compile(linear_forward, fullgraph=True, backend="eager", dynamic=False)
    for rows in (1, 4, 8, 16):
        x = torch.randn(rows, 208)
        assert torch.allclose(traced(x, w), F.linear(x, w), atol=1e-5)
    # With a dynamic row count no eager-path rule (8+ bf16 rows, up to 16 few rows) may guard the graph: 2-40 rows, one
    # graph (a compiled decode step at another batch size must not recompile).
    torch._dynamo.reset()
    graphs = []
    traced = torch.compile(linear_forward, fullgraph=True, backend=lambda gm, _: graphs.append(gm) or gm.forward,
                           dynamic=True)
    for rows in (2, 5, 8, 16, 17, 40):
        x = torch.randn(rows, 208)
        assert torch.allclose(traced(x, w), F.linear(x, w), atol=1e-5)
    assert len(graphs) == 1


@pytest.mark.parametrize("kind", ["transposed", "blocks4"])
def test_short_cached_chunks_take_the_short_chunk_kernels_and_equal_the_general_ones(monkeypatch, kind):
    """Verify-sized chunks (2-4 tokens on a cache, recording for `crop`, a padded row, segment boundaries inside a chunk
    and not) read attention with `decode_attention`, the Memory Cache through its step form (every token recorded)
    and the few-row products with (W·xᵀ)ᵀ or over blocks of W's rows (every weight, for the test); their logits and
    rolled-back states equal those of the general kernels, and a full recompute."""
    import torch.nn.functional as F

    import spike_whale.modeling_spike_whale as msw

    monkeypatch.setattr(msw, "FEW_ROWS_MIN_WEIGHT", 0)
    monkeypatch.setattr(msw.FewRowsKernel, "forced", kind)
    monkeypatch.setattr(msw.FewRowsKernel, "min_block_rows", 1)
    model = tiny_model(seed=6)
    ids = prompt(batch=2, length=2 * L + 9)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    chunks = [2, 3, 2, 4, 2, 3, 2]  # positions 7-25 after a 7-token prefill; some chunks cross a segment boundary

    def chunked():
        """Logits of each chunk, and after each chunk a rolled-back one-token crop and re-feed of its last token."""
        with torch.no_grad():
            out = model(ids[:, :7], attention_mask=mask[:, :7], use_cache=True)
            cache, logits, t = out.cache, [out.logits], 7
            cache.activate_past_recording()
            for n in chunks:
                logits.append(model(ids[:, t:t + n], attention_mask=mask[:, :t + n], cache=cache, use_cache=True).logits)
                cache.crop(-1)
                again = model(ids[:, t + n - 1:t + n], attention_mask=mask[:, :t + n], cache=cache, use_cache=True)
                torch.testing.assert_close(again.logits[:, -1], logits[-1][:, -1], rtol=1e-5, atol=1e-5)
                t += n
        return torch.cat(logits, 1)

    kernel_queries, stepped = [], []
    attention, step = msw.decode_attention, msw.MemoryCacheBranch._step
    monkeypatch.setattr(msw, "decode_attention", lambda q, *a: kernel_queries.append(q.shape[2]) or attention(q, *a))
    monkeypatch.setattr(msw.MemoryCacheBranch, "_step", lambda self, j, *a: stepped.append(j) or step(self, j, *a))
    fast = chunked()
    assert set(kernel_queries) == {1, *chunks} and set(stepped) == set(range(max(chunks)))  # every chunk token
    with monkeypatch.context() as general:
        general.setattr(msw.SpikeWhaleAttention, "few_queries", 1)
        general.setattr(msw, "linear_forward", lambda x, w, b=None, compiled_product="linear": F.linear(x, w, b))
        kernel_queries.clear()
        slow = chunked()
        assert set(kernel_queries) == {1}
    with torch.no_grad():
        full = model(ids[:, :sum(chunks) + 7], attention_mask=mask[:, :sum(chunks) + 7], use_cache=False).logits
    real = mask[:, :full.shape[1]].bool()
    assert float((fast - slow)[real].abs().max()) <= 1e-5 * float(slow.abs().max())
    assert float((fast - full)[real].abs().max()) <= 1e-5 * float(full.abs().max())


@pytest.mark.parametrize("kind", ["transposed", "blocks2"])
def test_one_token_decode_through_the_few_row_kernel_equals_a_full_recompute(monkeypatch, kind):
    """A batch-1 decode step's products run as (W·[x; 0]ᵀ)ᵀ, or as a batched GEMM over two blocks of W's rows (every
    weight, for the test); one-token steps across Memory-Cache segment boundaries give the logits of a full recompute,
    and greedy generate its ids."""
    import torch.nn.functional as F

    import spike_whale.modeling_spike_whale as msw

    monkeypatch.setattr(msw, "FEW_ROWS_MIN_WEIGHT", 0)
    monkeypatch.setattr(msw.FewRowsKernel, "forced", kind)
    monkeypatch.setattr(msw.FewRowsKernel, "min_block_rows", 1)
    model = tiny_model(seed=7)
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
    greedy = model.generate(ids[:, :9], max_new_tokens=12, do_sample=False)
    with monkeypatch.context() as general:
        general.setattr(msw, "linear_forward", lambda x, w, b=None, compiled_product="linear": F.linear(x, w, b))
        assert torch.equal(greedy, model.generate(ids[:, :9], max_new_tokens=12, do_sample=False))


@pytest.mark.parametrize("steps", [0, 5, 23])
def test_memory_cache_chunk_and_step_forms_match_a_per_token_reference(steps):
    """The Memory Cache's chunk form (the aligned block buffer), its step form and chunk-then-steps (`steps` tokens
    stepped, as a recording forward does) give each token the card's read, to ~1e-5 of float64 per-token sums: rows
    continuing a cache from different segment offsets (one at a segment's end, one empty), left padding, a 23-token
    chunk across three segments; the states after the chunk agree. Without padding a prompt's buffer is the chunk
    itself (`idx` None); the chunk form builds nothing of [S, S] size."""
    from torch.overrides import TorchFunctionMode

    from conftest import tiny_config
    from spike_whale import SpikeWhaleCache
    from spike_whale.modeling_spike_whale import ForwardContext, MemoryCacheBranch, SegmentLayout

    cfg = tiny_config(mc_num_heads=2, mc_head_dim=4, mc_gate_dim=3)
    torch.manual_seed(3)
    mc = MemoryCacheBranch(cfg)
    with torch.no_grad():
        for p in (mc.gate_bias, mc.feature_scale):
            p.add_(torch.randn(p.shape) * 0.5)
        mc.mc_gate.fill_(1.0)  # zero-init: the output would be 0
    n_seg = SpikeWhaleCache(cfg, max_cache_len=64).n_mc_segments
    B, past, S, H = 3, 11, 23, cfg.hidden_size
    pad = torch.tensor([0, 3, 11])  # cached rows of 11 (segment 1, offset 3), 8 (a segment's end) and 0 tokens
    chunk_pad = torch.tensor([0, 2, 0])
    valid = torch.arange(past + S)[None] >= pad[:, None]
    valid[:, past:] &= torch.arange(S)[None] >= chunk_pad[:, None]
    positions = (valid.long().cumsum(1) - 1).clamp(min=0) * valid
    x = torch.randn(B, past + S, H)

    def context(lo, hi, base, n_fin, record, n_steps):
        lay = SegmentLayout.build(positions[:, lo:hi], valid[:, lo:hi], base, L, n_fin, n_steps)
        return ForwardContext(positions[:, lo:hi], valid[:, lo:hi], None, False, lay, past=lo, max_cache_len=64,
                              n_mc_segments=n_seg, record=record)

    with torch.no_grad():
        ctx = context(0, past, torch.zeros(B, dtype=torch.long), 0, 0, 0)
        _, before, _ = mc(x[:, :past], ctx, None)
        base = ctx.segments.new_segment

        class Squares(TorchFunctionMode):
            seen = []  # shapes with two dimensions of the chunk's length

            def __torch_function__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if isinstance(out, torch.Tensor) and list(out.shape).count(S) > 1:
                    Squares.seen.append(tuple(out.shape))
                return out

        ctx = context(past, past + S, base, min(n_seg, (past + S - 1 if steps else past) // L), steps, steps)
        snapshot = before.map(torch.clone)  # fin_* are written in place
        with Squares():
            out, after, recorded = mc(x[:, past:], ctx, before)
        assert Squares.seen == []
        assert recorded is None if steps == 0 else (len(recorded) == steps and recorded[-1] is after)
        _, reference_state, _ = mc(x[:, past:], context(past, past + S, base, ctx.segments.n_fin, 0, 0),
                                   snapshot)
        fq, fk, v, gu, gk = (t.double() for t in mc._features(x))
        y = torch.zeros(B, S, cfg.mc_num_heads, cfg.mc_head_dim, dtype=torch.float64)
        for b in range(B):
            real = [t for t in range(past + S) if valid[b, t]]
            for t in range(past, past + S):
                if not valid[b, t]:
                    continue
                s = int(positions[b, t]) // L
                groups = [[m for m in real if int(positions[b, m]) // L == i] for i in range(s)]
                groups.append([m for m in real if int(positions[b, m]) // L == s and m <= t])
                scores = torch.stack([(gu[b, t] * gk[b, g].mean(0)).sum() for g in groups])
                gamma = torch.softmax(scores, 0)
                num = sum(w * torch.einsum("hd,mhd,mhe->he", fq[b, t], fk[b, g], v[b, g])
                          for w, g in zip(gamma, groups))
                den = sum(w * torch.einsum("hd,mhd->h", fq[b, t], fk[b, g]) for w, g in zip(gamma, groups))
                y[b, t - past] = num / (den[:, None] + mc.eps)
        want = mc._output(y.reshape(B, S, -1).float()) * valid[:, past:, None]
    assert want.abs().max() > 0 and (out - want).abs().max() <= 1e-5 * want.abs().max()
    assert (ctx.segments.idx is not None) == (steps < S)  # padding: the chunk part is scattered into the buffer
    unpadded = SegmentLayout.build(positions[:1, :past], valid[:1, :past], torch.zeros(1, dtype=torch.long), L, 0, 0)
    assert unpadded.idx is None and unpadded.n_rel == 2
    for name in ("run_M", "run_z", "run_g", "run_n"):
        torch.testing.assert_close(getattr(after, name), getattr(reference_state, name), rtol=1e-5, atol=1e-6)
    for b in range(B):
        done = int(ctx.segments.new_segment[b])
        for name in ("fin_M", "fin_z", "fin_g"):
            torch.testing.assert_close(getattr(after, name)[b, :done], getattr(reference_state, name)[b, :done],
                                       rtol=1e-5, atol=1e-6)


needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                   reason="torchao is not installed (the optional `int8` extra)")
needs_compile_config = pytest.mark.skipif(
    version.parse(transformers.__version__) < version.parse("5.24"),
    reason="transformers < 5.24 refuses assisted decoding with a compileable cache, so compile_config does not "
    "apply to the loop-slot cache there",
)


@needs_torchao
def test_int8_weight_only_loads_through_torchao_config_and_generates(tmp_path):
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import TorchAoConfig

    reference = tiny_model(seed=7)
    reference.save_pretrained(tmp_path)
    model = SpikeWhaleForCausalLM.from_pretrained(
        tmp_path, quantization_config=TorchAoConfig(Int8WeightOnlyConfig())
    ).eval()
    ffn = model.model.layers[0].ffn.gate_proj.weight
    assert getattr(ffn, "qdata", ffn).dtype == torch.int8, type(ffn)
    lookup = model.model.engram.lookup
    assert all(buf.dtype == torch.float32 for _, _, buf in lookup.projections())
    ids = prompt()
    cached = greedy(model, ids, True)
    assert torch.equal(cached, greedy(model, ids, False))
    steps, full = stepwise_logits(model, cached, prefill=5)
    assert (steps - full).abs().max() <= 1e-4 * full.abs().max()
    with torch.no_grad():
        ref, q = reference(ids, use_cache=False).logits, model(ids, use_cache=False).logits
    assert (ref - q).abs().max() <= 0.1 * ref.abs().max()  # weight-only int8, per-row scales: close to float32


@needs_torchao
def test_int8_weight_only_with_bf16_activations_keeps_float32_parts_and_decodes_exactly(tmp_path):
    """int8 weights with `dtype=torch.bfloat16`: the route on which inductor lowers int8 weight-only matmuls to
    `_weight_int8pack_mm` (bf16 activations and scales only; benchmarks/bench_speed.py's int8_compiled row). The
    Memory-Cache branch and hash projections stay float32, cached decode equals its own recompute."""
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import TorchAoConfig

    tiny_model(seed=7).save_pretrained(tmp_path)
    model = SpikeWhaleForCausalLM.from_pretrained(
        tmp_path, quantization_config=TorchAoConfig(Int8WeightOnlyConfig()), dtype=torch.bfloat16
    ).eval()
    ffn = model.model.layers[0].ffn.gate_proj.weight
    assert ffn.qdata.dtype == torch.int8 and ffn.dtype == torch.bfloat16  # dequantizes to bf16
    assert model.model.layers[0].attn.k_proj.weight.dtype == torch.bfloat16
    assert model.model.layers[0].attn.mc.mc_gate.dtype == torch.float32
    assert all(buf.dtype == torch.float32 for _, _, buf in model.model.engram.lookup.projections())
    ids = prompt()
    cached = greedy(model, ids, True)
    assert torch.equal(cached, greedy(model, ids, False))
    steps, full = stepwise_logits(model, cached, prefill=5)
    assert (steps.float() - full.float()).abs().max() <= 8 * 2**-7 * full.float().abs().max()


@needs_torchao
def test_int8_quantizes_the_memory_cache_projections_unless_told_not_to(tmp_path):
    """transformers' torchao route skips `_keep_in_fp32_modules` only, so an int8 load quantizes the Memory Cache's
    projections too (dequantized to float32); `modules_to_not_convert=[r".*attn\\.mc"]`, as MemoryCacheBranch's
    docstring says, keeps them plain float32 while the other Linears are int8, and cached decode stays exact."""
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import TorchAoConfig

    import spike_whale.modeling_spike_whale as msw

    tiny_model(seed=7).save_pretrained(tmp_path)
    ids = prompt()
    for skip, mc_int8 in ((None, True), ([r".*attn\.mc"], False)):
        quant = TorchAoConfig(Int8WeightOnlyConfig(), **({} if skip is None else {"modules_to_not_convert": skip}))
        model = SpikeWhaleForCausalLM.from_pretrained(tmp_path, quantization_config=quant, dtype=torch.bfloat16).eval()
        mc = model.model.layers[0].attn.mc
        for linear in (mc.qkv_proj, mc.o_proj, mc.gate_proj):
            assert linear.weight.dtype == torch.float32
            assert msw.weight_only_int8(linear.weight) == mc_int8
            assert (type(linear.weight) is torch.nn.Parameter) != mc_int8
        assert msw.weight_only_int8(model.model.layers[0].ffn.gate_proj.weight)
        cached = greedy(model, ids, True)
        assert torch.equal(cached, greedy(model, ids, False))


@needs_torchao
def test_int8_few_row_product_is_torchaos_product_and_decodes_exactly(tmp_path, monkeypatch):
    """Eager bf16 rows by a weight-only int8 weight: `FEW_ROWS_KERNEL`'s candidates are F.linear (torchao's own
    product) and `_weight_int8pack_mm`, which computes the same y = (x·qᵀ)·s up to bf16 rounding; forced for every
    weight, decode keeps greedy ids and equals its int8 recompute within bf16's tolerance. Plain weights are not
    int8, and their keys stay apart from an int8 weight's of the same shape."""
    import spike_whale.modeling_spike_whale as msw
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import TorchAoConfig

    tiny_model(seed=7).save_pretrained(tmp_path)
    model = SpikeWhaleForCausalLM.from_pretrained(
        tmp_path, quantization_config=TorchAoConfig(Int8WeightOnlyConfig()), dtype=torch.bfloat16
    ).eval()
    linear = model.model.layers[0].ffn.gate_proj
    w = linear.weight
    plain = torch.randn(w.shape, dtype=torch.bfloat16)
    assert msw.weight_only_int8(w) and not msw.weight_only_int8(plain)
    assert msw.FewRowsKernel.candidates(w, 1) == ("linear", "int8pack")
    assert msw.FewRowsKernel.key(w, 1) != msw.FewRowsKernel.key(plain, 1)
    for rows in (1, 3):
        x = torch.randn(rows, 1, w.shape[1], dtype=torch.bfloat16)
        with torch.no_grad():
            ref = F.linear(x, w).float()
            got = msw.FewRowsKernel.product(x, w, None, rows, "int8pack")
        assert got.dtype == torch.bfloat16 and got.shape == ref.shape
        assert (got.float() - ref).abs().max() <= 4 * 2**-8 * ref.abs().max()

    monkeypatch.setattr(msw, "FEW_ROWS_MIN_WEIGHT", 0)
    monkeypatch.setattr(msw.FewRowsKernel, "forced", "int8pack")
    ran, product = [], msw.FewRowsKernel.product
    monkeypatch.setattr(msw.FewRowsKernel, "product",
                        staticmethod(lambda x, w, b, rows, k: ran.append(k) or product(x, w, b, rows, k)))
    x = torch.randn(1, 1, w.shape[1], dtype=torch.bfloat16, requires_grad=True)
    linear(x).float().sum().backward()  # `_weight_int8pack_mm` has no derivative: a gradient takes torchao's F.linear
    assert x.grad is not None and ran == []
    ids = prompt()
    cached = greedy(model, ids, True)
    assert "int8pack" in ran
    assert torch.equal(cached, greedy(model, ids, False))
    steps, full = stepwise_logits(model, cached, prefill=5)
    assert (steps.float() - full.float()).abs().max() <= 8 * 2**-7 * full.float().abs().max()


@needs_torchao
@needs_compile_config
def test_int8_weight_only_decodes_through_compile_config(tmp_path, monkeypatch):
    """compile_config with a torchao int8 model: compile_decode leaves the quantized weights' layout alone (re-storing
    them column-major raised NotImplementedError for `aten.t`) and the compiled step gives the eager int8 ids. The
    graph's guards check each quantized parameter's type but not its metadata (a Python `__tensor_flatten__` per
    weight per call)."""
    import spike_whale.modeling_spike_whale as msw
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import CompileConfig, TorchAoConfig

    kept, keep = [], msw.compiled_decode_guards
    monkeypatch.setattr(msw, "compiled_decode_guards",
                        lambda entries: [kept.append(e) or k if k else k for e, k in zip(entries, keep(entries))])
    tiny_model(seed=7).save_pretrained(tmp_path)
    model = SpikeWhaleForCausalLM.from_pretrained(
        tmp_path, quantization_config=TorchAoConfig(Int8WeightOnlyConfig())
    ).eval()
    ids = prompt()
    eager = greedy(model, ids, True, new=6)
    with torch.no_grad():
        compiled = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6,
                                  do_sample=False, pad_token_id=0, compile_config=CompileConfig(backend="eager"))
    assert model.model._compiled_run is not None
    assert torch.equal(compiled, eager)
    on_weights = {e.guard_type for e in kept if "._parameters['weight']" in e.name}
    assert "TYPE_MATCH" in on_weights and kept
    assert not on_weights & {"TENSOR_MATCH", "TENSOR_SUBCLASS_METADATA_MATCH", "EQUALS_MATCH"}, on_weights


@needs_torchao
@needs_compile_config
def test_int8_compiled_walk_multiplies_by_its_own_int8_products_without_the_pattern_matcher(tmp_path, monkeypatch):
    """An inductor walk of int8 weights with bf16 rows: every int8 weight of the layers takes an explicit int8 product
    ("int8pack" for rows, "int8reduce" forced here for one row), so inductor's pattern matcher stays off and its
    rewrite of the one-query attention into CPU SDPA does not happen; the reduction computes int8pack's function
    (bf16 tolerance) and the compiled step gives the eager int8 step's logits within bf16's."""
    import spike_whale.modeling_spike_whale as msw
    from torch._inductor.utils import run_and_get_code
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import CompileConfig, TorchAoConfig

    tiny_model(seed=7).save_pretrained(tmp_path)
    model = SpikeWhaleForCausalLM.from_pretrained(
        tmp_path, quantization_config=TorchAoConfig(Int8WeightOnlyConfig()), dtype=torch.bfloat16
    ).eval()
    w = model.model.layers[0].ffn.gate_proj.weight
    assert msw.FewRowsKernel.traced_candidates(w, 1) == ("int8pack", "int8reduce")
    assert msw.FewRowsKernel.traced_candidates(w, 1, reduce=False) == msw.FewRowsKernel.traced_candidates(w, 8) \
        == ("int8pack",)
    bias = torch.randn(w.shape[0])
    for x in (torch.randn(1, 1, w.shape[1], dtype=torch.bfloat16), torch.randn(1, w.shape[1])):  # bf16, MC float32
        with torch.no_grad():
            ref = msw.FewRowsKernel.product(x, w, bias, 1, "int8pack").float()
            got = msw.FewRowsKernel.product(x, w, bias, 1, "int8reduce")
        assert got.dtype == x.dtype and got.shape == ref.shape
        assert (got.float() - ref).abs().max() <= 2 * 2**-8 * ref.abs().max()

    monkeypatch.setattr(msw, "FEW_ROWS_MIN_WEIGHT", 0)
    monkeypatch.setattr(msw.FewRowsKernel, "forced", "int8reduce")
    ids = prompt()

    def first_step_logits(**kwargs):
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, min_new_tokens=3,
                                 do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                                 **kwargs)
        return out.sequences, out.logits

    eager_ids, eager_logits = first_step_logits()
    (compiled_ids, compiled_logits), code = run_and_get_code(first_step_logits, compile_config=CompileConfig())
    code = "".join(code)
    owners = model._compiled_owners()
    assert owners and {(o.compiled_product, o.compiled_product_rows) for o in owners} == {("int8reduce", "int8pack")}
    assert "scaled_dot_product" not in code  # the pattern matcher was off
    assert torch.equal(compiled_ids[:, : ids.shape[1] + 1], eager_ids[:, : ids.shape[1] + 1])
    for step in (1, 2):  # decode steps (step 0 is the eager prefill); the same prefix of ids so far
        if torch.equal(compiled_ids[:, : ids.shape[1] + step], eager_ids[:, : ids.shape[1] + step]):
            full = eager_logits[step].float()
            assert (compiled_logits[step].float() - full).abs().max() <= 8 * 2**-7 * full.abs().max()


def test_bench_speed_prefill_breakdown_splits_a_forward_by_module_kind(monkeypatch):
    """benchmarks/bench_speed.py's `prefill_breakdown`: each module's own time by kind, as fractions of the forward
    that add up to it; the Memory Cache in its own row (the issue's share) and none for the Llama anchor; no hook
    left on the model."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    bench = importlib.import_module("bench_speed")
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2)).eval()
    for model, has_mc in ((tiny_model(), True), (llama, False)):
        shares = bench.prefill_breakdown(model, prompt(1, 40))
        assert list(shares) == [*dict.fromkeys(bench.BREAKDOWN_KINDS.values()), "rest"]
        assert sum(shares.values()) == pytest.approx(1.0)
        assert min(shares.values()) >= 0
        assert shares["products"] > 0 and shares["norms"] > 0 and shares["attention, other"] > 0
        assert (shares["memory cache"] > 0) == has_mc
        assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_packed_bf16_is_offered_only_where_the_cpu_runs_it():
    """oneDNN's prepacked bf16 linear needs AVX512 (bw/vl/dq) or AVX-NE-CONVERT: on an AVX2-only CPU its reorder
    raises, so "packed" must be on offer only where it runs (bf16 generate crashed on such CPUs)."""
    import spike_whale.modeling_spike_whale as msw

    w = torch.randn(256, 512).bfloat16()
    offered = "packed" in msw.FewRowsKernel.candidates(w, rows=1)
    assert offered == (msw.FewRowsKernel.prepack and msw.cpu_has_mkldnn_bf16())
    if offered:
        x = torch.randn(1, 512).bfloat16()
        assert torch.equal(msw.packed_linear(x, w, None), F.linear(x, w))
    else:
        assert not torch.ops.mkldnn._is_mkldnn_bf16_supported() or not msw.FewRowsKernel.prepack
