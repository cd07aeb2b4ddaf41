"""The fast paths of issue 12 produce the same tokens as their references (speed is measured by
benchmarks/bench_speed.py, never here): bf16 cached decode equals a bf16 full recompute, and an int8 weight-only
model loads through transformers' `TorchAoConfig` and generates, its cached decode equal to its own recompute. The
CPU layer's products (`spike_whale.accel`, applied by `optimize_for_cpu`) are tested in test_accel.py; the tests here
that take them (short chunks, int8) apply it first."""

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


def test_memory_cache_step_read_weighs_whole_memories_as_the_chunk_read_weighs_rows():
    """A decode step's read (`MemoryCacheBranch._read_step`: the memories summed under γ first, each entry read in
    place) equals the chunk form's read (`_read`: γ-weighted query rows times the stacked memories) to the float32
    floor: with a mask, with none (every entry readable, as a mask of all True is), with the first k of more entries,
    and with no finished entry (the own segment alone, γ = 1 exactly: the same bits; with gradients, through γ)."""
    from conftest import tiny_config
    from spike_whale.generation_utils import MemoryCacheState
    from spike_whale.modeling_spike_whale import MemoryCacheBranch

    B, I, nh, hd, gd = 3, 3, 4, 32, 16
    mc = MemoryCacheBranch(tiny_config(mc_num_heads=nh, mc_head_dim=hd, mc_gate_dim=gd))
    g = torch.Generator().manual_seed(1)
    fq = torch.rand(B, 1, nh, hd, generator=g) + 0.5
    gu = torch.randn(B, 1, gd, generator=g)
    state = MemoryCacheState(
        fin_M=torch.rand(B, I + 1, nh, hd, hd, generator=g), fin_z=torch.rand(B, I + 1, nh, hd, generator=g) + 1,
        fin_g=torch.randn(B, I + 1, gd, generator=g), run_M=torch.rand(B, nh, hd, hd, generator=g),
        run_z=torch.rand(B, nh, hd, generator=g) + 1, run_g=torch.randn(B, gd, generator=g),
        run_n=torch.tensor([1.0, 5.0, 200.0]))
    own = (torch.matmul(fq[..., None, :], state.run_M[:, None])[..., 0, :], (fq * state.run_z[:, None]).sum(-1),
           state.run_g[:, None], state.run_n[:, None])
    readable = torch.tensor([[True, True, False], [False, True, True], [False, False, False]])
    for k, mask in ((I, readable), (I, None), (2, readable[:, :2]), (2, None)):
        cands = (state.fin_M[:, :k], state.fin_z[:, :k], state.fin_g[:, :k], None if mask is None else mask[:, None])
        want = mc._read(fq, gu, own, cands)
        got = mc._read_step(fq, gu, state, k, mask)
        assert got.shape == want.shape == (B, 1, nh, hd)
        assert (got - want).abs().max() <= 2e-6 * want.abs().max()
    assert torch.equal(mc._read_step(fq, gu, state, 0, None), mc._read(fq, gu, own, None))
    everyone = torch.ones(B, I, dtype=torch.bool)  # a mask of None: every entry readable
    cands = (state.fin_M[:, :I], state.fin_z[:, :I], state.fin_g[:, :I])
    assert torch.equal(mc._read(fq, gu, own, (*cands, None)), mc._read(fq, gu, own, (*cands, everyone[:, None])))
    assert torch.equal(mc._read_step(fq, gu, state, I, None), mc._read_step(fq, gu, state, I, everyone))
    gu.requires_grad_(True)
    mc._read_step(fq, gu, state, 0, None).sum().backward()
    assert gu.grad is not None  # the gate stays in the graph


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


@pytest.mark.parametrize("kind", ["transposed", "blocks4"])
def test_short_cached_chunks_take_the_short_chunk_kernels_and_equal_the_general_ones(monkeypatch, kind):
    """Verify-sized chunks (2-4 tokens on a cache, recording for `crop`, a padded row, segment boundaries inside a chunk
    and not) read the Memory Cache through its step form (every chunk token recorded) and, optimized for CPU
    (`optimize_for_cpu`), attention through the one-query kernel and the few-row products with (W·xᵀ)ᵀ or over blocks
    of W's rows (every weight, for the test); their logits and rolled-back states equal those of the general kernels
    (the plain model's SDPA and products), and a full recompute."""
    from collections import Counter

    from transformers import AttentionInterface

    import spike_whale.modeling_spike_whale as msw
    from spike_whale.accel import attention, kernels, optimize_for_cpu

    monkeypatch.setattr(kernels, "FEW_ROWS_MIN_WEIGHT", 0)
    monkeypatch.setattr(kernels.FewRowsKernel, "forced", kind)
    monkeypatch.setattr(kernels.FewRowsKernel, "min_block_rows", 1)
    model = optimize_for_cpu(tiny_model(seed=6))
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

    queries, sdpa, stepped = [], [], []
    step = msw.MemoryCacheBranch._step
    attend, fallback = AttentionInterface._global_mapping[attention.NAME], attention.sdpa_attention_forward
    monkeypatch.setitem(AttentionInterface._global_mapping, attention.NAME,
                        lambda module, q, *a, **kw: queries.append(q.shape[2]) or attend(module, q, *a, **kw))
    monkeypatch.setattr(attention, "sdpa_attention_forward",
                        lambda module, q, *a, **kw: sdpa.append(q.shape[2]) or fallback(module, q, *a, **kw))
    monkeypatch.setattr(msw.MemoryCacheBranch, "_step", lambda self, j, *a: stepped.append(j) or step(self, j, *a))
    products, product = [], kernels.FewRowsKernel.product
    monkeypatch.setattr(kernels.FewRowsKernel, "product",
                        staticmethod(lambda x, w, b, rows, k: products.append(k) or product(x, w, b, rows, k)))
    fast = chunked()
    one_query_kernel = Counter(queries) - Counter(sdpa)  # the calls the kernel did not hand to SDPA
    assert {1, *chunks} <= set(one_query_kernel) and set(stepped) == set(range(max(chunks)))  # every chunk token
    assert set(products) == {kind}
    optimize_for_cpu(model, enable=False)  # SDPA, F.linear, one projection at a time
    queries.clear(), products.clear()
    slow = chunked()
    assert queries == [] and products == []
    with torch.no_grad():
        full = model(ids[:, :sum(chunks) + 7], attention_mask=mask[:, :sum(chunks) + 7], use_cache=False).logits
    real = mask[:, :full.shape[1]].bool()
    assert float((fast - slow)[real].abs().max()) <= 1e-5 * float(slow.abs().max())
    assert float((fast - full)[real].abs().max()) <= 1e-5 * float(full.abs().max())


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
        lay = SegmentLayout.build(positions[:, lo:hi], valid[:, lo:hi], base, L, n_fin, n_steps, False)
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
    unpadded = SegmentLayout.build(positions[:1, :past], valid[:1, :past], torch.zeros(1, dtype=torch.long), L, 0, 0, False)
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

    from spike_whale.accel.kernels import weight_only_int8

    tiny_model(seed=7).save_pretrained(tmp_path)
    ids = prompt()
    for skip, mc_int8 in ((None, True), ([r".*attn\.mc"], False)):
        quant = TorchAoConfig(Int8WeightOnlyConfig(), **({} if skip is None else {"modules_to_not_convert": skip}))
        model = SpikeWhaleForCausalLM.from_pretrained(tmp_path, quantization_config=quant, dtype=torch.bfloat16).eval()
        mc = model.model.layers[0].attn.mc
        for linear in (mc.qkv_proj, mc.o_proj, mc.gate_proj):
            assert linear.weight.dtype == torch.float32
            assert weight_only_int8(linear.weight) == mc_int8
            assert (type(linear.weight) is torch.nn.Parameter) != mc_int8
        assert weight_only_int8(model.model.layers[0].ffn.gate_proj.weight)
        cached = greedy(model, ids, True)
        assert torch.equal(cached, greedy(model, ids, False))


@needs_torchao
def test_int8_few_row_product_is_torchaos_product_and_decodes_exactly(tmp_path, monkeypatch):
    """Eager bf16 rows by a weight-only int8 weight: `FEW_ROWS_KERNEL`'s candidates are F.linear (torchao's own
    product) and `_weight_int8pack_mm`, which computes the same y = (x·qᵀ)·s up to bf16 rounding; forced for every
    weight (`optimize_for_cpu`), decode keeps greedy ids and equals its int8 recompute within bf16's tolerance. Plain
    weights are not int8, and their keys stay apart from an int8 weight's of the same shape."""
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import TorchAoConfig

    from spike_whale.accel import kernels, optimize_for_cpu
    from spike_whale.accel.kernels import FewRowsKernel, FewRowsLinear, weight_only_int8

    tiny_model(seed=7).save_pretrained(tmp_path)
    model = optimize_for_cpu(SpikeWhaleForCausalLM.from_pretrained(
        tmp_path, quantization_config=TorchAoConfig(Int8WeightOnlyConfig()), dtype=torch.bfloat16
    ).eval())
    linear = model.model.layers[0].ffn.gate_proj
    w = linear.weight
    assert type(linear) is FewRowsLinear
    plain = torch.randn(w.shape, dtype=torch.bfloat16)
    assert weight_only_int8(w) and not weight_only_int8(plain)
    assert FewRowsKernel.candidates(w, 1) == ("linear", "int8pack")
    assert FewRowsKernel.key(w, 1) != FewRowsKernel.key(plain, 1)
    for rows in (1, 3):
        x = torch.randn(rows, 1, w.shape[1], dtype=torch.bfloat16)
        with torch.no_grad():
            ref = F.linear(x, w).float()
            got = FewRowsKernel.product(x, w, None, rows, "int8pack")
        assert got.dtype == torch.bfloat16 and got.shape == ref.shape
        assert (got.float() - ref).abs().max() <= 4 * 2**-8 * ref.abs().max()

    monkeypatch.setattr(kernels, "FEW_ROWS_MIN_WEIGHT", 0)
    monkeypatch.setattr(FewRowsKernel, "forced", "int8pack")
    ran, product = [], FewRowsKernel.product
    monkeypatch.setattr(FewRowsKernel, "product",
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
    """compile_config with a torchao int8 model optimized for CPU: its compile_decode leaves the quantized weights'
    layout alone (re-storing them column-major raised NotImplementedError for `aten.t`) and the compiled step gives the
    eager int8 ids. The graph's guards (the Hub model's `compiled_decode_guards`) check each quantized parameter's type
    but not its metadata (a Python `__tensor_flatten__` per weight per call)."""
    import spike_whale.generation_utils as gu
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import CompileConfig, TorchAoConfig

    from spike_whale.accel import optimize_for_cpu

    kept, keep = [], gu.compiled_decode_guards
    monkeypatch.setattr(gu, "compiled_decode_guards",
                        lambda entries: [kept.append(e) or k if k else k for e, k in zip(entries, keep(entries))])
    tiny_model(seed=7).save_pretrained(tmp_path)
    model = optimize_for_cpu(SpikeWhaleForCausalLM.from_pretrained(
        tmp_path, quantization_config=TorchAoConfig(Int8WeightOnlyConfig())
    ).eval())
    layout = {name: (type(p), p.stride()) for name, p in model.named_parameters()}
    ids = prompt()
    eager = greedy(model, ids, True, new=6)
    with torch.no_grad():
        compiled = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6,
                                  do_sample=False, pad_token_id=0, compile_config=CompileConfig(backend="eager"))
    assert model.model._compiled_run is not None
    assert {name: (type(p), p.stride()) for name, p in model.named_parameters()} == layout
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
    from torch._inductor.utils import run_and_get_code
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import CompileConfig, TorchAoConfig

    from spike_whale.accel import compile as accel_compile
    from spike_whale.accel import kernels, optimize_for_cpu
    from spike_whale.accel.kernels import FewRowsKernel

    tiny_model(seed=7).save_pretrained(tmp_path)
    model = optimize_for_cpu(SpikeWhaleForCausalLM.from_pretrained(
        tmp_path, quantization_config=TorchAoConfig(Int8WeightOnlyConfig()), dtype=torch.bfloat16
    ).eval())
    w = model.model.layers[0].ffn.gate_proj.weight
    assert FewRowsKernel.traced_candidates(w, 1) == ("int8pack", "int8reduce")
    assert FewRowsKernel.traced_candidates(w, 1, reduce=False) == FewRowsKernel.traced_candidates(w, 8) \
        == ("int8pack",)
    bias = torch.randn(w.shape[0])
    for x in (torch.randn(1, 1, w.shape[1], dtype=torch.bfloat16), torch.randn(1, w.shape[1])):  # bf16, MC float32
        with torch.no_grad():
            ref = FewRowsKernel.product(x, w, bias, 1, "int8pack").float()
            got = FewRowsKernel.product(x, w, bias, 1, "int8reduce")
        assert got.dtype == x.dtype and got.shape == ref.shape
        assert (got.float() - ref).abs().max() <= 2 * 2**-8 * ref.abs().max()

    monkeypatch.setattr(kernels, "FEW_ROWS_MIN_WEIGHT", 0)
    monkeypatch.setattr(accel_compile, "FEW_ROWS_MIN_WEIGHT", 0)
    monkeypatch.setattr(FewRowsKernel, "forced", "int8reduce")
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
    owners = accel_compile.compiled_owners(model)
    assert owners and {kernels.compiled_kinds(o) for o in owners} == {("int8reduce", "int8pack")}
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


