"""SpikeWhale v2 / Byrne: a looped MLA decoder with depth attention, Hyper-Connections, Engram and a Memory Cache.

Every forward works on a chunk of positions with state carried in a `SpikeWhaleCache`, so a full recompute, a prefill
and any mix of multi-token decode steps compute the same function."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field, fields, replace

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.masking_utils import (ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask, flex_attention_mask,
                                       sdpa_mask)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import logging
from transformers.utils.generic import can_return_tuple

from .configuration_spike_whale import LoopPlan, SpikeWhaleConfig, refuse_oversized_config
from .generation_utils import (CACHE_FIELD, MemoryCacheState, SegmentLayout, SlotState, SlotUpdate, SpikeWhaleCache,
                               SpikeWhaleGenerationMixin, write_kv)

logger = logging.get_logger(__name__)

CHECKPOINT_KEY_RENAMES: dict[str, str] = {}  # released name (regex) -> ours at load; empty until a Byrne header is read


def reads_values_free(device: torch.device) -> bool:
    """Whether eager code may read tensor values on the host for free (off the CPU a read waits for queued kernels)."""
    return device.type == "cpu"


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t.to(dtype)` without the dispatch when it already has that dtype."""
    return t if t.dtype == dtype else t.to(dtype)


def derived(module: nn.Module, key, fn, *params: torch.Tensor) -> torch.Tensor:
    """fn() of `params` (an HC softmax, a gate's tanh), kept on `module` while `params` are unchanged, so a decode
    step does not redo it in every slot; recomputed with gradients on, compiling, or for inference tensors."""
    if torch.is_grad_enabled() or torch.compiler.is_compiling() or any(p.is_inference() for p in params):
        return fn()
    tag = tuple((id(p), p._version, p.data_ptr()) for p in params)
    cache = module.__dict__.setdefault("_derived", {})
    hit = cache.get(key)
    if hit is None or hit[0] != tag:  # the entry holds `params` too: no other tensor takes their ids while it lives
        hit = cache[key] = (tag, fn(), params)
    return hit[1]


def _cat(parts, dim: int) -> torch.Tensor:
    """torch.cat without the copy of a single part."""
    return torch.cat(parts, dim) if len(parts) > 1 else parts[0]


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t.to(device)` without the dispatch when it is already there."""
    return t if t.device == device else t.to(device)


class KeepsFloat32(nn.Module):
    """Stays float32 under `.to(bf16)`/`.half()`, as `from_pretrained(dtype=...)` keeps it (fp32-strict modules)."""

    float32_children = True  # False: its submodules follow the model

    def _apply(self, fn, recurse=True):
        if recurse and not self.float32_children:
            for child in self.children():
                child._apply(fn)
            recurse = False

        def keep(t: torch.Tensor) -> torch.Tensor:  # a float32 tensor fn would lower to bf16/fp16 is only moved
            out = fn(t)
            lowered = t.dtype == torch.float32 and out.dtype in (torch.bfloat16, torch.float16)
            return t.to(out.device) if lowered else out

        return super()._apply(keep, recurse)


class SpikeWhaleRMSNorm(nn.RMSNorm):
    """y = x · rsqrt(mean(x²) + ε) · w (ε inside the root; bit-identical to the reference's formula in float32)."""


def rope_inv_freq(rope_dim: int, theta: float, fractal: bool, gamma: float) -> torch.Tensor:
    """Inverse frequencies θ^(−e_j): geometric e_j = 2j/rd, or exponents on the middle-thirds Cantor set:
    band j's ternary digits are twice its binary digits (k_j ∈ {0, 2, 6, 8, 18, ...}), rescaled so the
    first exponent is 0 and the last equals the geometric endpoint (rd−2)/rd; γ interpolates linearly."""
    n = rope_dim // 2
    if not fractal or gamma == 0:
        return 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.int64).float() / rope_dim))
    level = max(1, math.ceil(math.log2(n)))
    k = [sum(2 * 3**i * ((j >> i) & 1) for i in range(level)) for j in range(n)]
    top = (rope_dim - 2) / rope_dim
    exps = [(1 - gamma) * (2 * j / rope_dim) + gamma * (k[j] / max(k[-1], 1)) * top for j in range(n)]
    return (theta ** -torch.tensor(exps, dtype=torch.float64)).float()


class SpikeWhaleRotaryEmbedding(KeepsFloat32):
    """Partial rotate-half RoPE on the last `qk_rope_head_dim` dims; the caches are persistent (in the files)."""

    def __init__(self, config: SpikeWhaleConfig):
        super().__init__()
        self.config = config
        half, P = config.qk_rope_head_dim // 2, config.max_position_embeddings
        f32 = torch.float32  # whatever the default dtype (`_from_config(dtype=...)`)
        for name, shape in (("inv_freq", (half,)), ("cos_cache", (P, half)), ("sin_cache", (P, half))):
            self.register_buffer(name, torch.empty(shape, dtype=f32), persistent=True)
        self.reset_caches()

    def compute(self, inv_freq: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.config
        if inv_freq is None:
            inv_freq = rope_inv_freq(c.qk_rope_head_dim, c.rope_theta, c.use_fractal_rope, c.fractal_rope_gamma)
        freqs = torch.outer(torch.arange(c.max_position_embeddings, dtype=torch.float32), inv_freq.float().cpu())
        return inv_freq, freqs.cos(), freqs.sin()

    def reset_caches(self) -> None:
        if self.inv_freq.is_meta:
            return
        for buf, value in zip((self.inv_freq, self.cos_cache, self.sin_cache), self.compute()):
            init.copy_(buf, value)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for [B, S] positions, shaped [B, 1, S, rd/2] to broadcast over heads."""
        return self.cos_cache[positions].unsqueeze(1), self.sin_cache[positions].unsqueeze(1)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """[nope | r1 r2] → [nope | r1·cos − r2·sin, r1·sin + r2·cos] (rotate-half on the trailing rope slice)."""
    half = cos.shape[-1]
    nope, r1, r2 = x[..., : -2 * half], x[..., -2 * half : -half], x[..., -half:]
    cos, sin = _as(cos, x.dtype), _as(sin, x.dtype)
    return torch.cat([nope, r1 * cos - r2 * sin, r1 * sin + r2 * cos], dim=-1)


@dataclass
class ForwardContext:
    """Per-forward inputs shared by every block and slot; each slot's state travels apart (`SlotState`/`SlotUpdate`)."""

    positions: torch.Tensor
    valid: torch.Tensor
    attn_mask: torch.Tensor | None
    is_causal: bool
    segments: SegmentLayout | None
    key_valid: torch.Tensor | None = None  # [B, keys]: the real keys behind attn_mask (flash's 2D padding mask)
    token_ids: torch.Tensor | None = None  # [B, S] input ids (hash routing of the MoE); None with inputs_embeds
    past: int | torch.Tensor = 0  # positions cached before this chunk (a 0-d tensor under torch.compile)
    max_cache_len: int = 0  # positions each slot's K/V buffers hold (0: no cache)
    n_mc_segments: int = 0  # finished-segment entries of a Memory-Cache state
    record: int = 0  # recurrent states are kept after each of the last `record` tokens (for crop); at most S
    need_weights: bool = False  # output_attentions: every slot returns its attention map
    attn_implementation: str | None = None  # config._attn_implementation, read once per forward
    keep_streams: bool = False  # output_hidden_states: every slot returns its residual streams
    static: bool = False  # no value is read on the host (`reads_values_free`): masks and layout assume the worst
    memo: dict = field(default_factory=dict, repr=False, compare=False)  # see `rope_tables`

    def once(self, key, fn):
        """fn(), computed once per forward (every time under torch.compile, which keeps no memo)."""
        if torch.compiler.is_compiling():
            return fn()
        if key not in self.memo:
            self.memo[key] = fn()
        return self.memo[key]

    def segments_on(self, device: torch.device) -> SegmentLayout:
        """The segment layout on `device`, copied once per forward per device of a device map."""
        lay = self.segments
        if lay.rel.device == device:
            return lay
        return self.once(("segments", device), lambda: replace(lay, **{
            f.name: t.to(device) for f in fields(lay) if isinstance(t := getattr(lay, f.name), torch.Tensor)}))

    def rope_tables(self, rope: "SpikeWhaleRotaryEmbedding", device: torch.device, dtype: torch.dtype) -> tuple:
        """rope's (cos, sin) at the chunk's positions in `dtype`, once per forward per layer (every pass reads them)."""
        return self.once((id(rope), device, dtype),
                         lambda: tuple(_as(t, dtype) for t in rope(_on(self.positions, device))))


class MemoryCacheBranch(KeepsFloat32):
    """Memory Caching (arXiv 2602.24281) beside MLA:  out = tanh(mc_gate) · o_proj(y), with, for token t in segment s,

        φ(x) = elu(x ⊙ feature_scale) + 1,   M⁽ⁱ⁾ = Σ_{m∈i} φ(k_m) v_mᵀ,   z⁽ⁱ⁾ = Σ_{m∈i} φ(k_m)
        (i = s: the causal running sums over m ≤ t only)
        γ_{t,i} = softmax_{i≤s} ⟨u_t, ḡ⁽ⁱ⁾⟩,   u_t = W_u x_t + b,   ḡ⁽ⁱ⁾ = mean_{m∈i} W_k x_m (running mean for i = s)
        y_t = Σ_i γ_{t,i} φ(q_t)ᵀM⁽ⁱ⁾ / (Σ_i γ_{t,i} φ(q_t)·z⁽ⁱ⁾ + ε)        (one global normaliser)
    in a chunk form (`_chunk`: any length, segment boundaries and padding inside) and a one-token step form
    (`_step`); segments start at positions 0, L, 2L, ... Float32 with autocast off, under any load dtype."""

    eps = 1e-6
    read_floats = 1 << 18  # the most floats of weighted query rows `_read` builds at once

    def __init__(self, config: SpikeWhaleConfig):
        super().__init__()
        H, nh, hd, gd = config.hidden_size, config.mc_num_heads, config.mc_head_dim, config.mc_gate_dim
        self.nh, self.hd, self.gd = nh, hd, gd
        f32 = torch.float32
        self.qkv_proj = nn.Linear(H, 3 * nh * hd, bias=True, dtype=f32)
        self.o_proj = nn.Linear(nh * hd, H, bias=True, dtype=f32)
        self.gate_proj = nn.Linear(H, 2 * gd, bias=False, dtype=f32)
        self.gate_bias = nn.Parameter(torch.zeros(gd, dtype=f32))
        self.feature_scale = nn.Parameter(torch.ones(hd, dtype=f32))
        self.mc_gate = nn.Parameter(torch.zeros(1, dtype=f32))

    def forward(self, u: torch.Tensor, ctx: ForwardContext, state: MemoryCacheState | None, proj: tuple | None = None):
        """(output [B, S, H], state after the chunk, states after each recorded token; None without a cache) from the
        state before it (None: empty): the chunk form on the first `lay.split` tokens, the step form on the rest."""
        lay = ctx.segments_on(u.device)
        B, S, _ = u.shape
        on = torch.is_autocast_enabled(u.device.type)  # autocast nodes keep AOTAutograd from caching a graph
        with torch.autocast(device_type=u.device.type, enabled=False) if on else contextlib.nullcontext():
            feats = self._features(_as(u, torch.float32), proj)
            if lay.padded:  # padding adds nothing
                fq, fk, v, gu, gk = feats
                vf = lay.valid_f
                feats = fq, fk * vf[..., None, None], v * vf[..., None, None], gu, gk * vf[..., None]
            ys, steps = [], []
            if lay.split:
                chunk = feats if lay.split == S else [t[:, : lay.split] for t in feats]
                y, state = self._chunk(*chunk, lay, state, ctx)
                ys.append(y)
            if lay.split < S and state is None:
                state = MemoryCacheState.empty(B, ctx.n_mc_segments, self.nh, self.hd, self.gd, u.device)
            for j in range(lay.split, S):
                y, state = self._step(j, *(feats if S == 1 else (t[:, j : j + 1] for t in feats)), lay, state)
                ys.append(y)
                steps.append(state)
            out = self._output(_cat(ys, 1).reshape(B, S, self.nh * self.hd))
            if lay.padded:
                out = out * lay.valid_f[..., None]
        return _as(out, u.dtype), state, (steps if ctx.record else None)

    def _features(self, x: torch.Tensor, proj: tuple | None = None):
        """φ(q), φ(k), v [B, S, nh, hd] and the gate query u / key W_k x [B, S, gd]; proj: `input_projections(x)`."""
        qkv, g = proj if proj is not None else self.input_projections(x)
        qkv = qkv.view(*x.shape[:2], 3, self.nh, self.hd)
        fq, fk = (F.elu(qkv[:, :, :2] * _as(self.feature_scale, torch.float32)) + 1.0).unbind(2)  # φ: q, k in one call
        gu, gk = g[..., : self.gd] + _as(self.gate_bias, torch.float32), g[..., self.gd :]
        return fq, fk, qkv[:, :, 2], gu, gk

    def input_projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(qkv_proj(x), gate_proj(x)) of float32 x, in float32 (weights cast to float64 compute in float64)."""
        dtype = self.qkv_proj.weight.dtype
        return _as(self.qkv_proj(_as(x, dtype)), torch.float32), _as(self.gate_proj(_as(x, dtype)), torch.float32)

    def _output(self, y: torch.Tensor) -> torch.Tensor:
        """tanh(mc_gate) · o_proj(y), float32."""
        out = _as(self.o_proj(_as(y, self.o_proj.weight.dtype)), torch.float32)
        return derived(self, "gate", lambda: torch.tanh(_as(self.mc_gate, torch.float32)), self.mc_gate) * out

    def _read(self, fq, gu, own: tuple, cands: tuple | None) -> torch.Tensor:
        """The chunk form's read: y_t [B, S, nh, hd], γ = softmax over the candidates' ⟨u_t, ḡ⁽ⁱ⁾⟩ and the own
        segment's ⟨u_t, own_g⟩/own_n. own: (φ(q_t)ᵀM_t, φ(q_t)·z_t, Σ W_k x, count) of the token's own segment so far.
        cands: (M [B, I, nh, hd, hd], z [B, I, nh, hd], ḡ [B, I, gd], readable [B, S, I]|None), or None."""
        own_num, own_den, own_g, own_n = own
        if cands is None:
            num, den = own_num, own_den[..., None]
            if gu.requires_grad:  # γ = 1 exactly, keeping the gate in the graph: DDP needs every parameter
                g_own = torch.softmax((gu * own_g).sum(-1, keepdim=True) / own_n.clamp(min=1)[..., None], -1)
                num, den = g_own[..., None] * num, g_own[..., None] * den
            return num / (den + self.eps)
        cand_M, cand_z, cand_g, cand_mask = cands
        B, S, nh, hd = fq.shape
        I = cand_M.shape[1]
        scores = torch.matmul(gu, cand_g.transpose(1, 2))
        if cand_mask is not None:
            scores = scores.masked_fill(~cand_mask, float("-inf"))
        own_score = (gu * own_g).sum(-1, keepdim=True) / own_n.clamp(min=1)[..., None]
        gamma = torch.softmax(torch.cat([scores, own_score], -1), dim=-1)
        # Σ_i γ_{t,i} φ(q_t)ᵀ[M⁽ⁱ⁾ | z⁽ⁱ⁾] as one GEMM per head (rows γ_{t,i}φ(q_t) times the stacked [M⁽ⁱ⁾ | z⁽ⁱ⁾]):
        # no token builds its own hd × hd memory; `read_floats` at a time, or a long prefill's rows take tens of MiB.
        g_cand = gamma[..., :I]
        fq_heads = fq.transpose(1, 2).contiguous()
        Mz = torch.cat([cand_M, cand_z[..., None]], -1).transpose(1, 2).reshape(B, nh, I * hd, hd + 1)
        rows = S if torch.compiler.is_compiling() else max(1, self.read_floats // (B * nh * I * hd))
        blocks = ([(fq_heads, g_cand)] if rows >= S  # one block unsliced: no slice calls
                  else [(fq_heads[:, :, a : a + rows], g_cand[:, a : a + rows]) for a in range(0, S, rows)])
        read = _cat([torch.matmul((f[:, :, :, None] * g[:, None, :, :, None]).reshape(B, nh, -1, I * hd), Mz)
                     for f, g in blocks], 2).transpose(1, 2)
        g_own = gamma[..., I:]
        num, den = read[..., :hd] + g_own[..., None] * own_num, read[..., hd:] + g_own[..., None] * own_den[..., None]
        return num / (den + self.eps)

    def _read_step(self, fq, gu, state: MemoryCacheState, k: int, readable: torch.Tensor | None) -> torch.Tensor:
        """The step form's read, for one token: y [B, 1, nh, hd] = φ(q)ᵀM̄ / (φ(q)·z̄ + ε) with M̄ = Σ_i γ_i M⁽ⁱ⁾ and
        z̄ = Σ_i γ_i z⁽ⁱ⁾ over the first k finished entries (readable [B, k], None: all) and the running segment:
        one token's γ weighs whole memories, so each entry is read once, in place, and none is copied."""
        if not k and not gu.requires_grad:  # the own segment alone: γ = 1 exactly
            M, z = state.run_M, state.run_z
        else:  # (with no finished entry γ = 1 stays in the graph for the gate's gradient: DDP needs every parameter)
            fin_M, fin_z, fin_g = state.fin_M[:, :k], state.fin_z[:, :k], state.fin_g[:, :k]
            if torch.is_grad_enabled():  # backward reads them, and a later step may write an entry in place
                fin_M, fin_z, fin_g = fin_M.clone(), fin_z.clone(), fin_g.clone()
            scores = torch.matmul(fin_g, gu[:, 0, :, None])[..., 0]
            if readable is not None:
                scores = scores.masked_fill(~readable, float("-inf"))
            own = (gu[:, 0] * state.run_g).sum(-1, keepdim=True) / state.run_n.clamp(min=1)[:, None]
            gamma = torch.softmax(torch.cat([scores, own], -1), -1)
            g_own = gamma[:, k:]
            M = torch.einsum("bi,bihde->bhde", gamma[:, :k], fin_M) + g_own[..., None, None] * state.run_M
            z = torch.einsum("bi,bihd->bhd", gamma[:, :k], fin_z) + g_own[..., None] * state.run_z
        num = torch.matmul(fq[:, 0, :, None, :], M)[..., 0, :]
        return (num / ((fq[:, 0] * z).sum(-1, keepdim=True) + self.eps))[:, None]

    def _chunk(self, fq, fk, v, gu, gk, lay: SegmentLayout, state: MemoryCacheState | None, ctx: ForwardContext):
        """The chunk form on the first n = `lay.split` tokens: y [B, n, nh, hd] and the state after them (None without
        a cache). Per block of the buffer (`SegmentLayout`), in O(n·W), the causal sums Σ_{m≤t} (φq_t·φk_m) v_m,
        φq_t·φk_m, W_k x_m, 1 and the block totals (the cache's running sums join block 0)."""
        B, n = fq.shape[:2]
        R, W = lay.n_rel, lay.width
        rel, vf = lay.rel[:, :n], lay.valid_f[:, :n]

        def to_blocks(t):
            if lay.idx is None:  # no scatter: the chunk is the buffer's first n rows
                buf = t if R * W == n else torch.cat([t, t.new_zeros(B, R * W - n, *t.shape[2:])], 1)
            else:
                idx = lay.idx.view(B, n, *[1] * (t.dim() - 2)).expand_as(t)
                buf = t.new_zeros(B, R * W + 1, *t.shape[2:]).scatter_(1, idx, t)[:, : R * W]
            return buf.reshape(B, R, W, *t.shape[2:])

        def from_blocks(t):
            flat = t.reshape(B, R * W, *t.shape[3:])
            if lay.idx is None:
                return flat[:, :n]
            flat = torch.cat([flat, flat.new_zeros(B, 1, *flat.shape[2:])], 1)  # the sink row reads zeros
            return flat.gather(1, lay.idx.view(B, n, *[1] * (flat.dim() - 2)).expand(B, n, *flat.shape[2:]))

        tri = torch.ones(W, W, device=fq.device).tril()
        fqb, fkb, vb, gkb, nb = (to_blocks(t) for t in (fq, fk, v, gk, vf[..., None]))
        A = torch.einsum("brlhd,brmhd->brhlm", fqb, fkb).mul_(tri)  # in place: A is [B, n_rel, nh, W, W]
        own_num = from_blocks(torch.einsum("brhlm,brmhe->brlhe", A, vb))
        own_den = from_blocks(A.sum(-1).transpose(2, 3))
        own_g, own_n = from_blocks(gkb.cumsum(2)), from_blocks(nb.cumsum(2)).squeeze(-1)
        seg_M = torch.matmul(fkb.permute(0, 1, 3, 4, 2), vb.transpose(2, 3))
        seg_z, seg_g, seg_n = fkb.sum(2), gkb.sum(2), nb.sum(2)[..., 0]
        if state is not None:  # the cache's running segment is block 0
            first = (rel == 0).float() * vf
            own_num = own_num + first[..., None, None] * torch.einsum("bshd,bhde->bshe", fq, state.run_M)
            own_den = own_den + first[..., None] * torch.einsum("bshd,bhd->bsh", fq, state.run_z)
            own_g, own_n = own_g + first[..., None] * state.run_g[:, None], own_n + first * state.run_n[:, None]
            for total, run in zip((seg_M, seg_z, seg_g, seg_n), (state.run_M, state.run_z, state.run_g, state.run_n)):
                total[:, 0] += run
        seg_gmean = seg_g / seg_n.clamp(min=1)[..., None] if R > 1 else None
        cands = []  # the cache's finished segments (i < base), then the chunk's (r < rel)
        if state is not None and lay.n_fin > 0:
            k = lay.n_fin
            mask = None if lay.fin_readable and R == 1 else (  # no mask where no candidate needs one
                torch.arange(k, device=fq.device)[None, :] < lay.base[:, None])[:, None].expand(B, n, k)
            cands.append((state.fin_M[:, :k], state.fin_z[:, :k], state.fin_g[:, :k], mask))
        if R > 1:
            cands.append((seg_M, seg_z, seg_gmean, torch.arange(R, device=fq.device)[None, None, :] < rel[..., None]))
        cand = None
        if cands:
            M, z, g, masks = zip(*cands)
            cand = (_cat(M, 1), _cat(z, 1), _cat(g, 1), None if masks[0] is None else _cat(masks, -1))
        y = self._read(fq, gu, (own_num, own_den, own_g, own_n), cand)
        if not ctx.max_cache_len:  # no cache
            return y, None
        if state is None:
            state = MemoryCacheState.empty(B, ctx.n_mc_segments, self.nh, self.hd, self.gd, fq.device)
        last, rows = rel[:, -1], torch.arange(B, device=fq.device)
        running = dict(run_M=seg_M[rows, last], run_z=seg_z[rows, last], run_g=seg_g[rows, last],
                       run_n=seg_n[rows, last])
        if R > 1:
            # fin_* are written in place and shared with recorded states: a row reads only entries below its segment
            # and an entry is written once finished (others go to the sink row), so a rollback masks later entries.
            r = torch.arange(R, device=fq.device)[None, :]
            at = torch.where(r < last[:, None], lay.base[:, None] + r, torch.full_like(r, state.fin_M.shape[1] - 1))
            at_rows = rows[:, None].expand_as(at)
            for buf, total in ((state.fin_M, seg_M), (state.fin_z, seg_z), (state.fin_g, seg_gmean)):
                buf[at_rows, at] = total
        return y, replace(state, **running)

    def _step(self, j: int, fq, fk, v, gu, gk, lay: SegmentLayout, state: MemoryCacheState):
        """The step form on chunk token j: y [B, 1, nh, hd] and the state after it (a token that starts a segment first
        files the running sums as finished entry `base + rel`); it reads the entries below its segment and its own."""
        B = fq.shape[0]
        run_M, run_z, run_g, run_n = state.run_M, state.run_z, state.run_g, state.run_n
        if lay.n_rel > 1:  # a token of the chunk starts a segment (fin_* in place: see `_chunk`)
            before = lay.rel[:, j - 1] if j else torch.zeros_like(lay.base)
            new = lay.rel[:, j] > before
            at = torch.where(new, lay.base + before, torch.full_like(before, state.fin_M.shape[1] - 1))
            rows = torch.arange(B, device=fq.device)
            state.fin_M[rows, at] = run_M
            state.fin_z[rows, at] = run_z
            state.fin_g[rows, at] = run_g / run_n.clamp(min=1)[..., None]
            keep = (~new).float()
            run_M, run_z = run_M * keep[:, None, None, None], run_z * keep[:, None, None]
            run_g, run_n = run_g * keep[:, None], run_n * keep
        state = replace(state, run_M=run_M + fk[:, 0, :, :, None] * v[:, 0, :, None, :], run_z=run_z + fk[:, 0],
                        run_g=run_g + gk[:, 0], run_n=run_n + lay.valid_f[:, j])
        k, readable = lay.n_fin, None
        if k and not lay.fin_readable:
            readable = torch.arange(k, device=fq.device) < (lay.base + lay.rel[:, j])[:, None]
        return self._read_step(fq, gu, state, k, readable), state


class FrozenLinear(nn.Linear):
    """nn.Linear whose parameters never train, also those a loader swaps in (`from_pretrained` makes new ones)."""

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None:
        if param is not None:
            param.requires_grad_(False)
        super().register_parameter(name, param)


class TokenCompressor(nn.Module):
    """c = W_c x: the frozen low-dimensional code the n-gram hash reads."""

    def __init__(self, config: SpikeWhaleConfig):
        super().__init__()
        self.proj = FrozenLinear(config.hidden_size, config.engram_compress_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class MultiHeadHashLookup(KeepsFloat32):
    """r_t = mean over available n ≤ N and heads j of table_j[idx_{n,j}(t)], where h = Σ_k P_{n,k} c_{t−n+1+k}.
    Sign-bit LSH: idx = Σ_b [h_b > 0]·2^b over ⌈log2 T⌉ projections per head; legacy: idx = trunc(|h|) mod T.
    The projections are random float32 buffers saved with the weights (loaded, never regenerated)."""

    float32_children = False

    def __init__(self, config: SpikeWhaleConfig):
        super().__init__()
        self.max_ngram, self.table_size = config.engram_max_ngram, config.engram_table_size
        self.legacy, self.n_bits = config.engram_legacy_hash, max(1, math.ceil(math.log2(self.table_size)))
        eh, cd = config.engram_num_heads, config.engram_compress_dim
        self.tables = nn.ModuleList(nn.Embedding(self.table_size, config.hidden_size) for _ in range(eh))
        for table in self.tables:
            table._spike_init_std = 0.01
        shape = (eh, cd) if self.legacy else (eh, self.n_bits, cd)
        for n in range(1, self.max_ngram + 1):
            for k in range(n):
                self.register_buffer(f"hash_proj_n{n}_p{k}", torch.empty(shape, dtype=torch.float32), persistent=True)

    def projections(self):
        return [(n, k, getattr(self, f"hash_proj_n{n}_p{k}")) for n in range(1, self.max_ngram + 1) for k in range(n)]

    def bucket(self, window: torch.Tensor, n: int) -> torch.Tensor:
        """window [B, S, n, cd] (oldest first) → bucket ids [B, S, heads]."""
        if self.legacy:
            h = sum(window[:, :, k].float() @ getattr(self, f"hash_proj_n{n}_p{k}").float().T for k in range(n))
            return h.abs().long() % self.table_size
        h = sum(torch.einsum("bsc,jnc->bsjn", window[:, :, k].float(), getattr(self, f"hash_proj_n{n}_p{k}").float())
                for k in range(n))
        weights = 2 ** torch.arange(self.n_bits, device=h.device)
        return ((h > 0).long() * weights).sum(-1) % self.table_size

    def forward(self, c: torch.Tensor, prefix: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """c [B, S, cd] for the chunk, prefix [B, N−1, cd] (the cached codes before it, None: zeros), positions."""
        S, pad = c.shape[1], self.max_ngram - 1
        ext = F.pad(c, (0, 0, pad, 0)) if prefix is None else torch.cat([prefix.to(c.dtype), c], 1)
        out, count = 0.0, 0.0
        for n in range(1, self.max_ngram + 1):
            window = torch.stack([ext[:, pad - n + 1 + k : pad - n + 1 + k + S] for k in range(n)], 2)
            idx = self.bucket(window, n)
            avail = (positions >= n - 1).to(self.tables[0].weight.dtype)[..., None]
            rows = sum(table(idx[..., j]) for j, table in enumerate(self.tables))
            out, count = out + rows * avail, count + avail * len(self.tables)
        return out / count.clamp(min=1)


class DERFContextGate(nn.Module):
    """out = γ ⊙ (erf(α ⊙ z + β) + 1)/2 ⊙ r,  z = W[r; x] + b   (β ≳ −2.5, or erf saturates to a dead gate)."""

    def __init__(self, config: SpikeWhaleConfig):
        super().__init__()
        H = config.hidden_size
        self.proj = nn.Linear(2 * H, H, bias=True)
        self.alpha = nn.Parameter(torch.ones(H))
        self.beta = nn.Parameter(torch.full((H,), config.engram_gate_init_bias))
        self.gamma = nn.Parameter(torch.ones(H))

    def forward(self, retrieved: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        z = self.proj(torch.cat([retrieved, x], -1))
        return self.gamma * (torch.erf(self.alpha * z + self.beta) + 1) / 2 * retrieved


class EngramMemory(nn.Module):
    """x ← x + gate(lookup(hash of the compressed n-gram ending at t), x): hashed n-gram memory on the embeddings."""

    def __init__(self, config: SpikeWhaleConfig):
        super().__init__()
        self.compressor = TokenCompressor(config)
        self.lookup = MultiHeadHashLookup(config)
        self.gate = DERFContextGate(config)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, prefix: torch.Tensor | None,
                hash_source: torch.Tensor | None = None):
        """(engram output, the chunk's codes for the cache, the lookup r for fusion); hash_source: the token
        embeddings the hash reads when x is something else (soft prompts)."""
        c = self.compressor(x if hash_source is None else hash_source)
        r = self.lookup(c, prefix, positions).to(x.dtype)
        return self.gate(r, x), c, r


class HyperConnection(nn.Module):
    """pre: h = Σ_j softmax(a)_j X_j;  post: X_j ← X_j + b_j · out   (static m-stream residual routing)."""

    def __init__(self, hc_mult: int):
        super().__init__()
        self.pre_logits = nn.Parameter(torch.zeros(hc_mult))
        self.post_scale = nn.Parameter(torch.ones(hc_mult))

    def forward(self, X: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """pre_op(X), or post_op(X, out) given `out`: called as a module, so accelerate's hooks place its weights."""
        return self.pre_op(X) if out is None else self.post_op(X, out)

    def pre_op(self, X: torch.Tensor) -> torch.Tensor:
        two = X.shape[1] == 2
        w = derived(self, ("pre", X.dtype, two), lambda: self._pre_weights(X.dtype, two), self.pre_logits)
        if two:  # X₀ + w₁(X₁ − X₀): one pass instead of a K=2 GEMM
            return torch.lerp(X[:, 0], X[:, 1], w)
        return torch.matmul(w, X.flatten(2)).view(X.shape[0], *X.shape[2:])

    def _pre_weights(self, dtype: torch.dtype, two: bool) -> torch.Tensor:
        w = _as(torch.softmax(self.pre_logits, 0, dtype=torch.float32), dtype)
        return w[1] if two else w

    def post_op(self, X: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        b = derived(self, ("post", X.dtype), lambda: _as(self.post_scale, X.dtype).view(-1, 1, 1), self.post_scale)
        return torch.addcmul(X, b, out[:, None])


class HCOutputMix(nn.Module):
    """x = Σ_j softmax(w)_j X_j, w = 0 at init (the plain mean of the streams)."""

    def __init__(self, hc_mult: int):
        super().__init__()
        self.mix_logits = nn.Parameter(torch.zeros(hc_mult))

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        w = _as(torch.softmax(self.mix_logits, 0, dtype=torch.float32), X.dtype)
        return torch.matmul(w, X.flatten(2)).view(X.shape[0], *X.shape[2:])


class DepthAttention:
    """ṽ_t = Σ_d softmax_d(⟨q̄_t, k_d(t)⟩/√hd) v_d(t);  v ← v + tanh(g)·(ṽ − v)   (across layers, per position).
    q̄: a KV group's mean query; d: this layer and the pass's earlier checkpoints (each `depth_attention_stride`-th)."""

    @staticmethod
    def mix(q, k, v, sources, tanh_gate) -> torch.Tensor:
        """ṽ mixed into v by tanh(g) (`tanh_gate`, in v's dtype)."""
        B, nh, S, hd = q.shape
        qbar = q.view(B, k.shape[1], nh // k.shape[1], S, hd).mean(2)  # each KV group's mean query head
        keys = torch.stack([_on(src[0], k.device) for src in sources] + [k])
        values = torch.stack([_on(src[1], v.device) for src in sources] + [v])
        w = _as(torch.softmax((qbar * keys).sum(-1) / math.sqrt(hd), dim=0, dtype=torch.float32), v.dtype)
        return torch.lerp(v, (w[..., None] * values).sum(0), tanh_gate)


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, kvh, N, hd] -> [B, kvh·groups, N, hd]: each KV head repeated for its query group."""
    return x if groups == 1 else x.repeat_interleave(groups, 1)


def eager_attention_forward(module, query, key, value, attention_mask, scaling: float, dropout: float = 0.0, **kwargs):
    """softmax(q·kᵀ·scaling + mask)·v, softmax in float32; transformers' convention: additive mask, [B, S, nh, hd]."""
    key, value = repeat_kv(key, module.num_key_value_groups), repeat_kv(value, module.num_key_value_groups)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = F.dropout(torch.softmax(weights, -1, dtype=torch.float32).to(query.dtype), dropout, module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def kernel_mask(impl: str, mask, is_causal: bool, key_valid, q, k, memo: dict) -> tuple:
    """(mask, is_causal) in the form `impl`'s registered mask function implies, from the boolean [B|1, 1, S, N] mask
    (None: `is_causal` alone): sdpa that mask; flash the [B, N] padding mask of real keys, causal (it aligns
    bottom-right); flex a `BlockMask`; anything else the additive float mask, built once per forward (`memo`)."""
    form = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(impl)
    if form is sdpa_mask or (mask is None and not is_causal):
        return mask, is_causal
    if form is flash_attention_mask:
        return key_valid, True
    flex = form is flex_attention_mask
    key = ("flex", q.device) if flex else ("additive", q.device, q.dtype)
    if key not in memo:
        vis = _visible(mask, is_causal, q.shape[2], k.shape[2], q.device)
        if flex:
            from torch.nn.attention.flex_attention import create_block_mask
            rows = vis.shape[0]
            memo[key] = create_block_mask(lambda b, h, qi, ki: vis[b if rows > 1 else 0, 0, qi, ki], rows, None,
                                          vis.shape[2], vis.shape[3], device=q.device)
        else:
            memo[key] = torch.zeros_like(vis, dtype=q.dtype).masked_fill(~vis, torch.finfo(q.dtype).min)
    return memo[key], False


def _visible(mask, is_causal, S: int, N: int, device) -> torch.Tensor:
    """The boolean [B|1, 1, S, N] "query may read key" matrix behind (mask, is_causal)."""
    if mask is not None:
        return mask
    if is_causal:
        return torch.ones(S, N, dtype=torch.bool, device=device).tril(N - S)[None, None]
    return torch.ones(1, 1, S, N, dtype=torch.bool, device=device)


def _scores(q, k, mask, is_causal) -> tuple[torch.Tensor, torch.Tensor]:
    """(s = q·kᵀ/√hd in float32 with the KV heads expanded to their GQA groups [B, nh, S, N], its visible keys)."""
    s = q.float() @ repeat_kv(k, q.shape[1] // k.shape[1]).float().transpose(-1, -2) / math.sqrt(q.shape[-1])
    return s, _visible(mask, is_causal, s.shape[2], s.shape[3], s.device)


def derf_attention(q, k, v, mask, is_causal, dropout, alpha, beta, gamma):
    """DERF: w = γ_h·(erf(α_h·s + β_h) + 1)/2 on the visible scores (0 elsewhere), renormalised by (Σ w + 1e-8).
    γ_h cancels except through the 1e-8 floor; it is kept for checkpoint compatibility."""
    s, vis = _scores(q, k, mask, is_causal)
    a, b, g = (t.float()[None, :, None, None] for t in (alpha, beta, gamma))
    w = g * (torch.erf(a * s + b) + 1) / 2 * vis
    w = w / (w.sum(-1, keepdim=True) + 1e-8)
    return F.dropout(w, dropout).to(v.dtype) @ repeat_kv(v, w.shape[1] // v.shape[1]), w


def elo_attention(q, k, v, mask, is_causal, dropout, gain, k_factor, past_ratings, query_valid):
    """Elo attention, float32: attn_t = softmax_j(s_tj + gain_h·K_h·R_tj), R_tj = Σ_{t'<t} Δ_t'j, Δ_tj = a key's
    attention share minus the uniform one (none from padding), so the cache carries Σ Δ per key. Returns (output,
    weights, ratings after the chunk [B, nh, P+S], after each query [B, nh, S, P+S])."""
    s, vis = _scores(q, k, mask, is_causal)
    B, nh, S, N = s.shape
    masked = s.masked_fill(~vis, float("-inf"))
    p, visf = torch.softmax(masked, -1), vis.float()
    delta = (p - visf / visf.sum(-1, keepdim=True)) * query_valid.float()[:, None, :, None]
    past = s.new_zeros(B, nh, N)
    if past_ratings is not None and past_ratings.shape[-1]:
        past[..., : past_ratings.shape[-1]] = past_ratings.to(past.device)
    after = past[:, :, None] + delta.cumsum(2)  # ratings after query t (inclusive)
    before = torch.cat([past[:, :, None], after[:, :, :-1]], 2)  # ratings seen by query t (earlier queries)
    bias = (gain.float() * k_factor.float())[None, :, None, None] * before
    w = torch.softmax(masked + bias, -1)
    return F.dropout(w, dropout).to(v.dtype) @ repeat_kv(v, w.shape[1] // v.shape[1]), w, after[:, :, -1], after


class SpikeWhaleAttention(nn.Module):
    """MLA: low-rank Q, GQA K/V, QK-norm, partial RoPE, depth mixing of V, XSA, low-rank output, Memory Cache branch."""

    def __init__(self, config: SpikeWhaleConfig, layer_idx: int):
        super().__init__()
        H, nh, kvh, hd = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.config, self.hd, self.layer_idx, self.is_causal = config, hd, layer_idx, True
        self.num_key_value_groups, self.scaling = nh // kvh, hd**-0.5
        self.q_a_proj = nn.Linear(H, config.q_lora_rank, bias=False)
        self.q_a_norm = SpikeWhaleRMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, nh * hd, bias=False)
        self.k_proj = nn.Linear(H, kvh * hd, bias=False)
        self.v_proj = nn.Linear(H, kvh * hd, bias=False)
        self.o_a_proj = nn.Linear(nh * hd, config.o_lora_rank, bias=False)
        self.o_b_proj = nn.Linear(config.o_lora_rank, H, bias=False)
        self.use_qk_norm, self.use_xsa = config.use_qk_norm, config.use_xsa
        if config.use_qk_norm:
            self.q_norm = SpikeWhaleRMSNorm(hd, config.rms_norm_eps)
            self.k_norm = SpikeWhaleRMSNorm(hd, config.rms_norm_eps)
        self.rope = SpikeWhaleRotaryEmbedding(config)
        self.is_depth_checkpoint = config.use_depth_attention and layer_idx % config.depth_attention_stride == 0
        self.depth_gate = nn.Parameter(torch.zeros(1)) if config.use_depth_attention and layer_idx > 0 else None
        self.mc = MemoryCacheBranch(config) if config.use_memory_cache else None
        self.attn_kind = "elo" if config.use_elo else ("derf" if config.use_derf else "softmax")
        if self.attn_kind == "derf":
            self.derf_alpha = nn.Parameter(torch.ones(nh))
            self.derf_bias = nn.Parameter(torch.zeros(nh))
            self.derf_gamma = nn.Parameter(torch.ones(nh))
        if self.attn_kind == "elo":
            self.elo_gain = nn.Parameter(torch.zeros(nh))
            self.elo_k = nn.Parameter(torch.full((nh,), float(config.elo_k_init)))

    def input_projections(self, u: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(q_a_proj(u), k_proj(u), v_proj(u)); a drop-in may append the Memory Cache's two (`MemoryCacheBranch`)."""
        return self.q_a_proj(u), self.k_proj(u), self.v_proj(u)

    def _attend(self, q, k, v, ctx: ForwardContext, ratings: torch.Tensor | None):
        """(output [B, S, nh, hd], weights or None, Elo ratings after the chunk and after each recorded token, or None)
        of Elo, DERF, or softmax attention through `ALL_ATTENTION_FUNCTIONS` (mask from `kernel_mask`)."""
        mask = _on(ctx.attn_mask, q.device) if ctx.attn_mask is not None else None
        dropout = self.config.attention_dropout if self.training else 0.0
        if self.attn_kind == "derf":
            y, weights = derf_attention(q, k, v, mask, ctx.is_causal, dropout, self.derf_alpha, self.derf_bias,
                                        self.derf_gamma)
            return y.transpose(1, 2), weights, None, None
        if self.attn_kind == "elo":
            y, weights, ratings, per_query = elo_attention(q, k, v, mask, ctx.is_causal, dropout, self.elo_gain,
                                                           self.elo_k, ratings, ctx.valid.to(q.device))
            S = q.shape[2]
            steps = [per_query[:, :, j, : ctx.past + j + 1] for j in range(S - ctx.record, S)] if ctx.record else None
            return y.to(q.dtype).transpose(1, 2), weights, ratings, steps
        impl = ctx.attn_implementation or "sdpa"
        if "flash" in impl and isinstance(ctx.past, torch.Tensor):
            impl = "sdpa"  # a compiled step reads whole static buffers, which flash's 2D padding mask cannot describe
        if hasattr(ALL_ATTENTION_FUNCTIONS, "get_interface"):
            attend = ALL_ATTENTION_FUNCTIONS.get_interface(impl, eager_attention_forward)
        elif impl == "eager":  # transformers < 5.24
            attend = eager_attention_forward
        elif impl == self.config._attn_implementation:  # the in-library idiom its set_attn_implementation looks for
            attend = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
        else:
            attend = ALL_ATTENTION_FUNCTIONS[impl]
        key_valid = _on(ctx.key_valid, q.device) if ctx.key_valid is not None else None
        mask, is_causal = kernel_mask(impl, mask, ctx.is_causal, key_valid, q, k, ctx.memo)
        y, weights = attend(self, q, k, v, mask, dropout=dropout, scaling=self.scaling, is_causal=is_causal)
        return y, weights, None, None

    def forward(self, u: torch.Tensor, ctx: ForwardContext, state: SlotState | None, depth_sources: tuple):
        """(output [B, S, H], depth (k, v), weights, the slot's `SlotUpdate`), each but the output possibly None; the
        slot's K/V buffers (`state`) are written in place at `ctx.past`."""
        B, S, _ = u.shape
        proj = self.input_projections(u)
        q_lat, k, v = proj[:3]
        q = self.q_b_proj(self.q_a_norm(q_lat)).view(B, S, -1, self.hd)  # -1: a tensor-parallel rank's heads
        k = k.view(B, S, -1, self.hd)
        if self.use_qk_norm:  # before the transpose: the same values, on a contiguous layout
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.view(B, S, -1, self.hd).transpose(1, 2)
        cos, sin = ctx.rope_tables(self.rope, u.device, q.dtype)
        q, k = apply_partial_rope(torch.cat([q, k], 1), cos, sin).split([q.shape[1], k.shape[1]], 1)
        depth_entry = (k, v) if self.is_depth_checkpoint else (None, None)
        if self.depth_gate is not None and depth_sources:
            gate = self.depth_gate
            tanh_gate = derived(self, ("depth", v.dtype), lambda: _as(torch.tanh(gate), v.dtype), gate)
            v = DepthAttention.mix(q, k, v, depth_sources, tanh_gate)
        v_self, new_kv = v, None
        if state is not None:
            keys, values = state.keys, state.values
            if keys is None:
                keys = k.new_zeros(*k.shape[:2], ctx.max_cache_len, k.shape[-1])
                values = v.new_zeros(*v.shape[:2], ctx.max_cache_len, v.shape[-1])
                new_kv = (keys, values)
            k, v = write_kv(keys, values, k, v, ctx.past)
        y, weights, elo, elo_steps = self._attend(q, k, v, ctx, state.elo if state is not None else None)
        if self.use_xsa:
            y = self.remove_self_echo(y, v_self)
        out = self.o_b_proj(self.o_a_proj(y.reshape(B, S, -1)))
        mc = mc_steps = None
        if self.mc is not None:
            mc_out, mc, mc_steps = self.mc(u, ctx, state.mc if state is not None else None, proj[3:] or None)
            out = out + mc_out
        update = SlotUpdate(new_kv, mc, mc_steps, elo, elo_steps) if state is not None else None
        return out, depth_entry, weights, update

    @staticmethod
    def remove_self_echo(y: torch.Tensor, v_self: torch.Tensor) -> torch.Tensor:
        """XSA on y [B, S, nh, hd]: y ← y − ⟨y, v̂⟩v̂, v̂ = v_t/(‖v_t‖ + 1e-8) the token's own (GQA-shared) value."""
        B, S, nh, hd = y.shape
        vhat = (v_self / (v_self.norm(dim=-1, keepdim=True) + 1e-8)).transpose(1, 2)[:, :, :, None]
        yg = y.view(B, S, v_self.shape[1], -1, hd)  # this rank's KV heads (tensor parallel)
        return torch.addcmul(yg, (yg * vhat).sum(-1, keepdim=True), vhat, value=-1).view(B, S, nh, hd)


class SpikeWhaleMLP(nn.Module):
    """Dense SwiGLU: down(silu(gate(u)) ⊙ up(u)); also one MoE expert (and the fused shared experts)."""

    def __init__(self, config: SpikeWhaleConfig, width: int | None = None):
        super().__init__()
        H, F_ = config.hidden_size, width or config.moe_intermediate_size
        self.gate_proj = nn.Linear(H, F_, bias=False)
        self.up_proj = nn.Linear(H, F_, bias=False)
        self.down_proj = nn.Linear(F_, H, bias=False)

    def input_projections(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate_proj(u), self.up_proj(u)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        inplace = not torch.is_grad_enabled()  # a long prefill's [S, F] temporaries cost about as much as the ops
        gate, up = self.input_projections(u)
        h = F.silu(gate, inplace=inplace)
        return self.down_proj(h.mul_(up) if inplace else h * up)


def hash_expert_ids(token_ids: torch.Tensor, n_experts: int, top_k: int) -> torch.Tensor:
    """Hash routing [N] → [N, top_k]: e₀ = mix(id) mod E (Knuth multiplicative hash, xor fold), e_j = (e₀ + j) mod E."""
    h = (token_ids.long() * 2654435761 + 0x9E3779B9) % (1 << 32)
    first = (h ^ (h >> 16)) % n_experts
    return (first[:, None] + torch.arange(top_k, device=token_ids.device)) % n_experts


class SpikeWhaleMoE(nn.Module):
    """MoE FFN: shared experts (one fused SwiGLU) plus the top-k of `n_routed_experts` SwiGLU experts:

        s = sqrt(softplus(W_g u)) or softmax(W_g u);  I = top-k(s), or hash(token id) in hash layers
        w_i = s_i / Σ_{j∈I} s_j (`norm_topk_prob`) · `routed_scaling_factor`;  y = shared(u) + Σ_{i∈I} w_i expert_i(u)
    Padding is not routed (output 0). Load balance (learned routers): aux = E · Σ_e f_e P_e, f_e the share of routed
    slots sent to e, P_e its mean normalised score."""

    def __init__(self, config: SpikeWhaleConfig, hash_routing: bool):
        super().__init__()
        self.n_experts, self.top_k = config.n_routed_experts, config.num_experts_per_tok
        self.hash_routing = hash_routing
        self.scoring_func, self.norm_topk_prob = config.scoring_func, config.norm_topk_prob
        self.routed_scaling_factor = float(config.routed_scaling_factor)
        self.gate = nn.Linear(config.hidden_size, self.n_experts, bias=False)
        self.experts = nn.ModuleList(SpikeWhaleMLP(config) for _ in range(self.n_experts))
        n_shared = config.n_shared_experts
        self.shared_experts = SpikeWhaleMLP(config, n_shared * config.moe_intermediate_size) if n_shared else None

    def route(self, x: torch.Tensor, token_ids: torch.Tensor | None):
        """x [N, H] → (expert ids [N, k], weights [N, k] (float32), scores [N, E] (float32))."""
        logits = F.linear(x.float(), self.gate.weight.float())
        scores = F.softplus(logits).sqrt() if self.scoring_func == "sqrtsoftplus" else torch.softmax(logits, -1)
        if self.hash_routing:
            if token_ids is None:
                raise ValueError("This MoE layer uses hash routing (num_hash_layers > 0), which picks experts from the "
                                 "token ids; call the model with input_ids, not inputs_embeds.")
            idx = hash_expert_ids(token_ids, self.n_experts, self.top_k)
        else:
            idx = scores.topk(self.top_k, dim=-1).indices
        w = scores.gather(-1, idx)
        if self.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True).clamp(min=1e-20)
        return idx, w * self.routed_scaling_factor, scores

    def forward(self, u: torch.Tensor, ctx: ForwardContext | None = None):
        """u [B, S, H] → (output [B, S, H], load-balance loss or None); each expert runs once, on all its tokens."""
        B, S, H = u.shape
        flat = u.reshape(B * S, H)
        real = (ctx.valid.to(u.device).reshape(-1).nonzero().squeeze(1) if ctx is not None
                else torch.arange(B * S, device=u.device))
        ids = ctx.token_ids if ctx is not None else None
        token_ids = ids.to(u.device).reshape(-1)[real] if ids is not None else None
        x = flat[real]
        idx, w, scores = self.route(x, token_ids)
        order = idx.flatten().argsort(stable=True)
        tok = order // self.top_k
        counts = torch.bincount(idx.flatten(), minlength=self.n_experts)  # routed slots per expert
        y = torch.cat([expert(g) for expert, g in zip(self.experts, x[tok].split(counts.tolist()))])
        y = torch.zeros_like(x).index_add_(0, tok, y * w.flatten()[order].to(y.dtype)[:, None])
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        out = torch.zeros_like(flat).index_copy(0, real, y).view(B, S, H)
        aux = None
        if not self.hash_routing and x.shape[0]:
            P = (scores / scores.sum(-1, keepdim=True)).mean(0)
            aux = self.n_experts * (counts.float() / idx.numel() * P).sum()
        return out, aux


class EngramFusion(nn.Module):
    """Mid-stack Engram re-injection: out_t = W_o(σ(⟨q, k⟩/√D) · k), k = W_k r_t, q = W_q RMSNorm(h_t), with r the
    n-gram lookup and h the streams' mean; W_o zero-init (a no-op at init); out is added to every stream."""

    def __init__(self, config: SpikeWhaleConfig):
        super().__init__()
        H, D = config.hidden_size, config.engram_fusion_dim
        self.norm = SpikeWhaleRMSNorm(H, config.rms_norm_eps)
        self.q_proj = nn.Linear(H, D, bias=False)
        self.k_proj = nn.Linear(H, D, bias=False)
        self.o_proj = nn.Linear(D, H, bias=False)
        self.o_proj._spike_zero_init = True

    def forward(self, h: torch.Tensor, retrieved: torch.Tensor) -> torch.Tensor:
        k = self.k_proj(retrieved.to(h.device, h.dtype))
        q = self.q_proj(self.norm(h))
        agree = torch.sigmoid((q * k).sum(-1, keepdim=True) / math.sqrt(k.shape[-1]))
        return self.o_proj(agree * k)


class SpikeWhaleDecoderLayer(GradientCheckpointingLayer):
    """Attention then FFN (or MoE), each pre-normed through Hyper-Connections (or a plain residual); optionally
    Engram fusion at the input and the value embedding h += tanh(ve_gate)·token_embed on the attention input."""

    def __init__(self, config: SpikeWhaleConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = SpikeWhaleRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = SpikeWhaleAttention(config, layer_idx)
        self.ffn_norm = SpikeWhaleRMSNorm(config.hidden_size, config.rms_norm_eps)
        moe_layers = sorted(config.moe_layers) if config.use_moe else []
        hash_routing = layer_idx in moe_layers[: config.num_hash_layers]  # the first MoE layers route by token id
        self.ffn = SpikeWhaleMoE(config, hash_routing) if layer_idx in moe_layers else SpikeWhaleMLP(config)
        self.use_hc = config.use_hyper_connections
        self.hc_attn = HyperConnection(config.hc_mult) if self.use_hc else None
        self.hc_ffn = HyperConnection(config.hc_mult) if self.use_hc else None
        self.ve_gate = nn.Parameter(torch.zeros(1)) if config.use_value_embed else None
        self.engram_fusion = EngramFusion(config) if layer_idx in config.engram_fusion_layers else None
        self.hidden_dropout = config.hidden_dropout

    def forward(self, X: torch.Tensor, token_embed=None, engram_r=None, *depth_flat, ctx: ForwardContext = None,
                state: SlotState | None = None):
        """depth_flat: k₀, v₀, k₁, v₁, ... of this pass's depth checkpoints (positional, as all tensors needing
        gradients, for re-entrant checkpointing). Returns (X, MoE loss, depth k, depth v, weights, `SlotUpdate`)."""
        if self.engram_fusion is not None:
            fused = self.engram_fusion(X.mean(1) if self.use_hc else X, engram_r)
            X = X + (fused[:, None] if self.use_hc else fused)
        h = self.hc_attn(X) if self.use_hc else X
        if self.ve_gate is not None:
            h = h + torch.tanh(self.ve_gate).to(h.dtype) * token_embed.to(h.device, h.dtype)
        depth_sources = tuple(zip(depth_flat[0::2], depth_flat[1::2]))
        a, (dk, dv), weights, update = self.attn(self.attn_norm(h), ctx, state, depth_sources)
        if self.training and self.hidden_dropout:
            a = F.dropout(a, self.hidden_dropout, True)
        X = self.hc_attn(X, a) if self.use_hc else X + a
        h = self.hc_ffn(X) if self.use_hc else X
        moe = isinstance(self.ffn, SpikeWhaleMoE)
        f, aux = self.ffn(self.ffn_norm(h), ctx) if moe else (self.ffn(self.ffn_norm(h)), None)
        if self.training and self.hidden_dropout:
            f = F.dropout(f, self.hidden_dropout, True)
        X = self.hc_ffn(X, f) if self.use_hc else X + f
        return X, aux, dk, dv, weights, update


def walk_run(layers: tuple, X, pass_embed, token_embed, engram_r, ctx: ForwardContext, states: tuple):
    """One run of the loop plan (a pass, or the layers before the loop), compiled for decode steps (it touches no
    cache object). Returns (X, per slot: (streams or None, MoE loss, attention weights, `SlotUpdate`))."""
    if pass_embed is not None:
        X = X + pass_embed
    depth, outs = [], []
    for layer, state in zip(layers, states):
        X, aux, dk, dv, weights, update = layer(X, token_embed, engram_r, *depth, ctx=ctx, state=state)
        if dk is not None:
            depth += [dk, dv]
        outs.append((X if ctx.keep_streams else None, aux, weights, update))
    return X, tuple(outs)


class HRMRefinement(nn.Module):
    """h_{t+1} = h_t + tanh(g_t) · up(silu(down([norm(h_t); x])))  for t < steps (up zero-init, g non-zero)."""

    def __init__(self, config: SpikeWhaleConfig):
        super().__init__()
        H, D = config.hidden_size, config.hrm_refine_dim
        self.norm = SpikeWhaleRMSNorm(H, config.rms_norm_eps)
        self.down = nn.Linear(2 * H, D, bias=False)
        self.up = nn.Linear(D, H, bias=False)
        self.up._spike_zero_init = True
        self.gate = nn.Parameter(torch.full((config.hrm_refine_steps,), float(config.hrm_gate_init)))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every step's output; the last is the model's, the others feed deep supervision."""
        h, steps = x, []
        for t in range(self.gate.shape[0]):
            h = h + torch.tanh(self.gate[t]).to(x.dtype) * self.up(F.silu(self.down(torch.cat([self.norm(h), x], -1))))
            steps.append(h)
        return steps


class MTPHead(nn.Module):
    """y = h + proj(h) (proj zero-init); head k predicts the token k+1 steps past the next one via lm_head."""

    def __init__(self, config: SpikeWhaleConfig):
        super().__init__()
        self.proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.proj._spike_zero_init = True

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.proj(h)


class SpikeWhalePreTrainedModel(PreTrainedModel):
    config_class = SpikeWhaleConfig
    config: SpikeWhaleConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["SpikeWhaleDecoderLayer", "MTPHead"]
    _skip_keys_device_placement = ["cache", "past_key_values"]
    _supports_sdpa = True
    _supports_flash_attn = True  # each kernel gets its own mask form (`kernel_mask`)
    _supports_flex_attn = True
    _supports_attention_backend = True  # softmax attention goes through ALL_ATTENTION_FUNCTIONS
    _can_compile_fullgraph = True  # except MoE configs, whose dispatch groups tokens on the host
    _is_stateful = False  # `crop` restores the Memory-Cache state exactly: assisted decoding allowed (< 5.25 checks)
    # Float32 under a bf16/fp16 load: rounded hash projections would move n-grams between buckets.
    _keep_in_fp32_modules_strict = ["rope", r"hash_proj_n\d+_p\d+", r"attn\.mc"]

    def post_init(self):
        # Only the optional modules this config builds, as in-library models set the list per instance.
        built = {r"hash_proj_n\d+_p\d+": self.config.use_engram, r"attn\.mc": self.config.use_memory_cache}
        self._keep_in_fp32_modules_strict = [m for m in type(self)._keep_in_fp32_modules_strict if built.get(m, True)]
        super().post_init()
        if not isinstance(self, SpikeWhaleModel):  # the causal LM reports missing heads
            ignored = set(self._keys_to_ignore_on_load_unexpected or ())  # None before transformers 5.9
            self._keys_to_ignore_on_load_unexpected = ignored - set(SpikeWhaleModel._keys_to_ignore_on_load_unexpected)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """`CHECKPOINT_KEY_RENAMES` as `key_mapping` (a caller's own wins); an oversized config is refused first."""
        if CHECKPOINT_KEY_RENAMES and kwargs.get("key_mapping") is None:
            kwargs["key_mapping"] = dict(CHECKPOINT_KEY_RENAMES)
        refuse_oversized_config(args, kwargs)
        return super().from_pretrained(*args, **kwargs)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """transformers' init for Linear/Embedding/norms, except `_spike_zero_init` modules and `_spike_init_std`
        tables; every other parameter gets its constructor's value."""
        cfg = self.config
        if getattr(module, "_spike_zero_init", False):
            init.zeros_(module.weight)
        elif isinstance(module, nn.Embedding) and hasattr(module, "_spike_init_std"):
            init.normal_(module.weight, mean=0.0, std=module._spike_init_std)
        elif isinstance(module, SpikeWhaleRotaryEmbedding):
            module.reset_caches()
        elif isinstance(module, MultiHeadHashLookup):
            for _, _, buf in module.projections():
                w = torch.randn(buf.shape, dtype=torch.float32)
                init.copy_(buf, w / w.norm(dim=-1, keepdim=True))
        elif isinstance(module, (nn.Linear, nn.Embedding, SpikeWhaleRMSNorm)):
            super()._init_weights(module)
        fills = dict(alpha=1, beta=cfg.engram_gate_init_bias, gamma=1, pre_logits=0, post_scale=1, mix_logits=0,
                     gate=cfg.hrm_gate_init, depth_gate=0, derf_alpha=1, derf_bias=0, derf_gamma=1, elo_gain=0,
                     elo_k=cfg.elo_k_init, ve_gate=0, gate_bias=0, feature_scale=1, mc_gate=0)
        for name, param in module.named_parameters(recurse=False):
            if name in fills:
                init.constant_(param, float(fills[name]))


@dataclass
class SpikeWhaleModelOutput(BaseModelOutputWithPast):
    """Backbone output; `refinement_states`: the normed HRM step outputs (the last is `last_hidden_state`)."""

    refinement_states: tuple[torch.Tensor, ...] | None = None
    moe_aux_loss: torch.FloatTensor | None = None


class SpikeWhaleModel(SpikeWhalePreTrainedModel):
    """Embeddings + Engram, the looped block stack walked by the loop plan, HC output mix, HRM and final norm."""

    _keys_to_ignore_on_load_unexpected = [r"^(lm_head|mtp_heads|abstain_head)\."]
    walk_run = staticmethod(walk_run)  # what `compile_decode` compiles

    def __init__(self, config: SpikeWhaleConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.engram = EngramMemory(config) if config.use_engram else None
        self.layers = nn.ModuleList(SpikeWhaleDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.loop_plan: LoopPlan = config.loop_plan
        self.loop_pass_embed = nn.Embedding(config.loop_count, config.hidden_size) if config.loop_pass_embed else None
        self.hc_out_mix = HCOutputMix(config.hc_mult) if config.use_hyper_connections else None
        self.hrm_refine = HRMRefinement(config) if config.use_hrm_refine else None
        self.norm = SpikeWhaleRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gradient_checkpointing = False
        self._compiled_run = None  # `walk_run` compiled for decode steps, set by compile_decode()
        self._compiled_for: tuple[torch.dtype, torch.device] | None = None
        if self.loop_pass_embed is not None:
            self.loop_pass_embed._spike_zero_init = True
        self.post_init()

    def _check_inputs(self, input_ids, inputs_embeds, static: bool):
        if input_ids is None and inputs_embeds is None:
            raise ValueError("Pass `input_ids`, `inputs_embeds`, or both (the ids then only route the MoE and Engram).")
        if input_ids is not None:
            if input_ids.dim() != 2:
                raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}.")
            self._check_range(input_ids, self.config.vocab_size, static, "token ids")
        if inputs_embeds is not None:
            if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != self.config.hidden_size:
                raise ValueError(f"inputs_embeds must be [batch, seq, {self.config.hidden_size}], "
                                 f"got {tuple(inputs_embeds.shape)}.")
            if input_ids is not None and tuple(input_ids.shape) != tuple(inputs_embeds.shape[:2]):
                raise ValueError(f"input_ids {tuple(input_ids.shape)} and inputs_embeds {tuple(inputs_embeds.shape)} "
                                 "must describe the same [batch, seq] tokens when passed together.")

    def _check_range(self, values: torch.Tensor, limit: int, static: bool, what: str) -> None:
        """Token ids or positions (`what`) outside [0, limit) raise; a device-side assert when `static`."""
        inside = (values >= 0) & (values < limit)
        if static:
            torch._assert_async(inside.all(), f"{what} outside [0, {limit})")
        elif values.numel() and not bool(inside.all()):
            if what == "token ids":
                raise ValueError(f"Token ids {values[~inside].unique()[:5].tolist()} are outside the vocabulary "
                                 f"[0, {limit}); check that the tokenizer matches this model.")
            if int(values.min()) < 0:
                raise ValueError(f"position_ids contain {int(values.min())}: positions must be >= 0 (a negative "
                                 "position would index the RoPE caches from the end). Pass position_ids counting "
                                 "from 0.")
            self._raise_past_context(int(values.max()))

    def _raise_past_context(self, position: int) -> None:
        raise ValueError(f"Position {position} is past the context window (max_position_embeddings="
                         f"{self.config.max_position_embeddings}); this model raises instead of wrapping. Shorten the "
                         "input or widen the RoPE caches (`spike-whale widen`).")

    @staticmethod
    def _check_attention_mask(attention_mask, B: int, S: int, cache: SpikeWhaleCache | None) -> None:
        """The mask must be a 2D padding mask over the cache's and the chunk's tokens."""
        if attention_mask is None:
            return
        compiling = torch.compiler.is_compiling()
        past = (cache.length if compiling else cache.seq_len) if cache is not None else 0
        if attention_mask.dim() != 2 or attention_mask.shape[0] != B or not (  # compiled: reads the last S columns
                attention_mask.shape[1] >= S if compiling else attention_mask.shape[1] in (S, past + S)):
            raise ValueError(f"attention_mask must be a 2D [batch, past + seq] = [{B}, {past + S}] padding mask (1 = "
                             f"real token), got shape {tuple(attention_mask.shape)}. Custom 4D masks are not "
                             "supported: the Memory Cache and Engram need each token's sequence, not only which keys "
                             "it sees; to pack several sequences in one row, pass position_ids restarting at 0 for "
                             "each (padding-free packing).")

    def _context(self, B, S, device, attention_mask, position_ids, cache, static: bool) -> ForwardContext:
        compiling = torch.compiler.is_compiling()
        past = (cache.length.to(device) if compiling else cache.seq_len) if cache is not None else 0
        valid = (attention_mask[:, -S:].to(device=device, dtype=torch.bool) if attention_mask is not None
                 else torch.ones(B, S, dtype=torch.bool, device=device))
        if cache is not None:
            cache.begin(valid)
        given = position_ids is not None
        if not given:  # at most past + S - 1: checked on the host here
            num_real = cache.num_real.to(device)[:, None] if cache is not None else 0
            position_ids = num_real + valid.long().cumsum(-1) - 1
            if not compiling and past + S > self.config.max_position_embeddings:
                self._raise_past_context(past + S - 1)
        elif position_ids.dim() != 2 or position_ids.shape[1] != S or position_ids.shape[0] not in (1, B):
            raise ValueError(f"position_ids must be [batch, seq] = [{B}, {S}], got {tuple(position_ids.shape)}.")
        positions = torch.where(valid, position_ids.to(device).long(), torch.zeros_like(position_ids, device=device))
        if compiling or given:
            self._check_range(positions, self.config.max_position_embeddings, static, "positions")
        if cache is not None and compiling:
            torch._assert_async(past + S <= cache.max_cache_len, "the chunk does not fit the cache; use a larger cache")
        elif cache is not None and past + S > cache.max_cache_len:
            raise ValueError(f"The cache holds {cache.max_cache_len} positions but {past + S} are needed; "
                             "use a larger cache.")
        # Static: a mask whenever one may be needed; else for padding, a chunk after the cache, or padding cached.
        needs_mask = (cache is not None or attention_mask is not None) if static else (
            not bool(valid.all()) or (past > 0 and (S > 1 or not bool(cache.key_valid[:, :past].all()))))
        attn_mask, is_causal, key_valid = None, False, None
        if needs_mask:
            q_idx = (past + torch.arange(S, device=device))[:, None]
            if compiling and cache is not None:  # the whole static buffers (`write_kv`): unwritten keys are masked
                key_valid = cache.key_valid.to(device).index_copy(1, q_idx[:, 0], valid)
            elif cache is None or past == 0:
                key_valid = valid
            else:
                key_valid = torch.cat([cache.key_valid[:, :past].to(device), valid], 1)
            k_idx = torch.arange(key_valid.shape[1], device=device)[None, :]
            attn_mask = (((k_idx <= q_idx)[None] & key_valid[:, None, :]) | (k_idx == q_idx)[None])[:, None]
        elif past == 0:
            is_causal = True

        record = min(S, cache.get_recurrent_states_to_keep() + 1) if cache is not None and cache.record_past else 0
        segments = None
        if self.config.use_memory_cache:
            L = self.config.mc_segment_len
            steps = 0 if cache is None else (1 if S == 1 else record)
            if cache is not None and cache.mc_segment is not None:
                n_fin = cache.n_mc_segments if static else min(cache.n_mc_segments,
                                                               (past + S - 1 if steps else past) // L)
                base = cache.mc_segment.to(device)
            else:
                base, n_fin = torch.zeros(B, dtype=torch.long, device=device), 0
            segments = SegmentLayout.build(positions, valid, base, L, n_fin, steps, static)
        sizes = dict(max_cache_len=cache.max_cache_len, n_mc_segments=cache.n_mc_segments) if cache is not None else {}
        return ForwardContext(positions, valid, attn_mask, is_causal, segments, key_valid, past=past, record=record,
                              attn_implementation=self.config._attn_implementation, static=static, **sizes)

    def _run_slots(self, X, token_embed, engram_r, ctx: ForwardContext, cache: SpikeWhaleCache | None,
                   hidden_states: list | None, attentions: list | None):
        """Every run of the loop plan through `walk_run`, each slot's update stored in the cache. Returns (X, MoE
        losses); appends each slot's read-out streams and attention weights to the lists."""
        aux_terms, end = [], ctx.past + X.shape[-2]
        compiled = self._compiled_run is not None and self._decode_step_compiles(ctx, cache)
        X = X.contiguous()  # the streams start as an expanded view; one memory layout means one compiled graph
        # A no-grad chunk on a warm cache walks in inference mode (no version counters on a step's many small ops);
        # its states are copied into normal buffers (Elo ratings are kept as made: not with Elo).
        inference = (not torch.compiler.is_compiling() and cache is not None and ctx.past > 0 and not compiled
                     and not torch.is_grad_enabled() and hidden_states is None and attentions is None
                     and not self.config.use_elo)
        with torch.inference_mode() if inference else contextlib.nullcontext():
            for lo, hi, loop_pass in self.loop_plan.runs:
                states = tuple(cache.slot(s) for s in range(lo, hi)) if cache is not None else (None,) * (hi - lo)
                fits = compiled and all(s.keys is not None and (s.mc is not None) == self.config.use_memory_cache
                                        for s in states)
                run = self._compiled_run if fits else self.walk_run
                pass_embed = None  # [1, H], for a run that starts a loop pass
                if loop_pass is not None and self.loop_pass_embed is not None:
                    index = torch.full((1,), loop_pass, dtype=torch.long, device=X.device)
                    pass_embed = _as(_on(self.loop_pass_embed(index), X.device), X.dtype)
                layers = tuple(self.layers[layer_idx] for layer_idx, _ in self.loop_plan.entries[lo:hi])
                X, outs = run(layers, X, pass_embed, token_embed, engram_r, ctx, states)
                for slot, (streams, aux, weights, update) in zip(range(lo, hi), outs):
                    if aux is not None:
                        aux_terms.append(aux.to(ctx.positions.device))
                    if hidden_states is not None:
                        hidden_states.append(self.hc_out_mix(streams) if self.hc_out_mix is not None else streams)
                    if attentions is not None:
                        attentions.append(weights)
                    if update is not None:
                        cache.store_slot(slot, update, end)
        return X, aux_terms

    def _decode_step_compiles(self, ctx: ForwardContext, cache: SpikeWhaleCache | None) -> bool:
        """Whether the compiled `walk_run` runs: a static one-token eval step on a warm cache, no per-slot outputs."""
        if (cache is None or ctx.past == 0 or ctx.positions.shape[1] != 1 or self.training or ctx.need_weights
                or ctx.keep_streams or not ctx.static):
            return False
        X = self.embed_tokens.weight
        if self._compiled_for != (X.dtype, X.device):
            raise ValueError(f"compile_decode() traced this model for {self._compiled_for[0]} on "
                             f"{self._compiled_for[1]}, but it now runs in {X.dtype} on {X.device}; call "
                             "model.compile_decode() again after moving or re-typing it.")
        return True

    @staticmethod
    def packed_sequence_starts(position_ids: torch.Tensor) -> torch.Tensor:
        """[B, S] bool, True at column 0 and wherever positions do not continue by one (padding-free packing)."""
        starts = torch.ones_like(position_ids, dtype=torch.bool)
        starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
        return starts

    def _forward_packed(self, input_ids, inputs_embeds, position_ids, starts, output_hidden_states: bool):
        """Padding-free packing: the rows' sequences run as one right-padded batch (each as alone), packed back."""
        B, S, H = inputs_embeds.shape
        seq_id = starts.flatten().long().cumsum(0) - 1  # [B·S]: the sequence of each token
        n = int(seq_id[-1]) + 1
        lengths = torch.bincount(seq_id, minlength=n)
        L, first = int(lengths.max()), lengths.cumsum(0) - lengths
        dest = seq_id * L + torch.arange(B * S, device=seq_id.device) - first[seq_id]

        def unpack(t: torch.Tensor) -> torch.Tensor:
            flat = t.flatten(0, 1)
            return flat.new_zeros(n * L, *flat.shape[1:]).index_copy(0, dest, flat).view(n, L, *flat.shape[1:])

        def pack(t: torch.Tensor) -> torch.Tensor:
            return t.flatten(0, 1)[dest].view(B, S, *t.shape[2:])

        out = self(input_ids=unpack(input_ids) if input_ids is not None else None, inputs_embeds=unpack(inputs_embeds),
                   attention_mask=unpack(torch.ones_like(starts, dtype=torch.long)),
                   position_ids=unpack(position_ids.expand(B, S)), use_cache=False,
                   output_hidden_states=output_hidden_states, return_dict=True)
        hidden_states = tuple(pack(t) for t in out.hidden_states) if out.hidden_states is not None else None
        return SpikeWhaleModelOutput(last_hidden_state=pack(out.last_hidden_state), hidden_states=hidden_states,
                                     refinement_states=tuple(pack(t) for t in out.refinement_states),
                                     moe_aux_loss=out.moe_aux_loss)

    @can_return_tuple
    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, cache: SpikeWhaleCache | None = None,
                inputs_embeds: torch.FloatTensor | None = None, use_cache: bool | None = None,
                output_attentions: bool | None = None, output_hidden_states: bool | None = None,
                **kwargs) -> SpikeWhaleModelOutput:
        """`hidden_states`: the embedding output (after Engram), then one entry per loop-plan slot, the streams read out
        by `hc_out_mix` (before HRM and the norm). `attentions`: one [B, heads, S, past + S] map per slot. Given both
        `input_ids` and `inputs_embeds`, the embeddings are the input and the ids feed hash routing and Engram."""
        cfg = self.config
        output_attentions = output_attentions if output_attentions is not None else cfg.output_attentions
        output_hidden_states = output_hidden_states if output_hidden_states is not None else cfg.output_hidden_states
        if use_cache is None:
            use_cache = cache is not None or (cfg.use_cache and not self.training)
        first = input_ids if input_ids is not None else inputs_embeds
        # No host reads (`static`): under torch.compile; in a decode step off the CPU (`reads_values_free`); and in a
        # step the compiled walk may take, whose static sizes make one graph for every step, segment openings too.
        static = torch.compiler.is_compiling() or (
            first is not None and isinstance(cache, SpikeWhaleCache) and bool(use_cache) and cache.seq_len > 0
            and (not reads_values_free(first.device) or (self._compiled_run is not None and first.shape[1] == 1)))
        self._check_inputs(input_ids, inputs_embeds, static)
        impl = cfg._attn_implementation or "sdpa"
        eager_weights = output_attentions and not (cfg.use_derf or cfg.use_elo) and (
            impl in ("sdpa", "flex_attention") or impl.startswith("flash"))
        if eager_weights:  # as in-library models: the weights of this call, from eager attention
            logger.warning_once(f"output_attentions=True: the {impl!r} kernel returns no attention weights, so calls "
                                "that ask for them run eager attention; load with attn_implementation=\"eager\" to "
                                "choose it for every call.")
        token_embeds = self.embed_tokens(input_ids) if input_ids is not None else None
        hash_source = token_embeds if inputs_embeds is not None else None
        inputs_embeds = inputs_embeds if inputs_embeds is not None else token_embeds
        B, S, _ = inputs_embeds.shape
        device = inputs_embeds.device
        self._check_attention_mask(attention_mask, B, S, cache if use_cache else None)
        if position_ids is not None and S > 1 and not static:  # rows packed padding-free restart their positions
            starts = self.packed_sequence_starts(position_ids.to(device).expand(B, S))
            if attention_mask is None and (cache is None or cache.seq_len == 0):
                if bool(starts[:, 1:].any()):
                    if output_attentions:
                        raise NotImplementedError("output_attentions=True with padding-free packed rows: each packed "
                                                  "sequence attends only within itself, so there is no per-row "
                                                  "attention map to return; unpack the batch.")
                    return self._forward_packed(input_ids, inputs_embeds, position_ids, starts, output_hidden_states)
            else:
                restarts = starts[:, 1:]
                if attention_mask is not None:
                    real = attention_mask[:, -S:].to(device).bool()
                    restarts = restarts & real[:, 1:] & real[:, :-1]
                if bool(restarts.any()):
                    raise NotImplementedError("position_ids restart inside a row (padding-free packing) together with "
                                              "an attention_mask or a non-empty cache: packed rows are supported as "
                                              "DataCollatorWithFlattening writes them, with position_ids only. Drop "
                                              "the attention_mask, or pad the sequences into separate rows.")
        cache = (cache if cache is not None else SpikeWhaleCache(cfg)) if use_cache else None
        ctx = self._context(B, S, device, attention_mask, position_ids, cache, static)
        ctx.token_ids, ctx.need_weights = input_ids, bool(output_attentions)
        ctx.keep_streams = bool(output_hidden_states)
        if eager_weights:
            ctx.attn_implementation = "eager"

        x = inputs_embeds
        engram_c = engram_r = None
        if self.engram is not None:
            prefix = cache.engram_prefix(cfg.engram_max_ngram - 1) if cache is not None else None
            e, engram_c, engram_r = self.engram(x, ctx.positions, prefix, hash_source)
            x = x + e
        token_embed = inputs_embeds if cfg.use_value_embed else None
        hidden_states = [x] if output_hidden_states else None
        attentions = [] if output_attentions else None
        X = x[:, None].expand(B, cfg.hc_mult, S, x.shape[-1]) if self.hc_out_mix is not None else x
        X, aux_terms = self._run_slots(X, token_embed, engram_r, ctx, cache, hidden_states, attentions)
        x = self.hc_out_mix(X) if self.hc_out_mix is not None else X
        steps = [self.norm(h) for h in (self.hrm_refine(x) if self.hrm_refine is not None else [x])]
        if cache is not None:
            seg = ctx.segments
            per_pos = (seg.base[:, None] + seg.rel[:, S - ctx.record:]) if (seg is not None and ctx.record) else None
            cache.commit(ctx.valid, engram_c, seg.new_segment if seg is not None else None, per_pos)
        moe_aux = torch.stack(aux_terms).mean() if aux_terms else None
        return SpikeWhaleModelOutput(last_hidden_state=steps[-1], **{CACHE_FIELD: cache},
                                     refinement_states=tuple(steps), moe_aux_loss=moe_aux,
                                     hidden_states=tuple(hidden_states) if hidden_states is not None else None,
                                     attentions=tuple(attentions) if attentions is not None else None)


@dataclass
class SpikeWhaleCausalLMOutput(CausalLMOutputWithPast):
    """loss = lm_loss + zloss_coef·z_loss + mtp_loss_weight·mtp_loss + hrm_loss + abstain_loss_weight·abstain_loss
    + moe_aux_loss_coef·moe_aux_loss (each term also un-weighted, None when off); `abstain_probs[b, t]`: P(the argmax
    at t is wrong), `abstain_mask`: it above `abstain_threshold`."""

    lm_loss: torch.FloatTensor | None = None
    z_loss: torch.FloatTensor | None = None
    mtp_loss: torch.FloatTensor | None = None
    hrm_loss: torch.FloatTensor | None = None
    abstain_loss: torch.FloatTensor | None = None
    moe_aux_loss: torch.FloatTensor | None = None
    abstain_probs: torch.FloatTensor | None = None
    abstain_mask: torch.BoolTensor | None = None
    abstain_threshold: float | None = None
    last_hidden_state: torch.FloatTensor | None = None


if CACHE_FIELD != "cache":  # transformers < 5.24: `out.cache` reads the field under its old name
    SpikeWhaleModelOutput.cache = SpikeWhaleCausalLMOutput.cache = property(lambda self: self.past_key_values)


def _cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean CE over targets != -100 (0, not NaN, when a batch has none), in float32."""
    target = target.to(logits.device)
    total = F.cross_entropy(logits.float().flatten(0, 1), target.flatten(), ignore_index=-100, reduction="sum")
    return total / (target != -100).sum().clamp(min=1)


class SpikeWhaleForCausalLM(SpikeWhaleGenerationMixin, SpikeWhalePreTrainedModel):
    """Backbone, tied `lm_head` and MTP heads; the generation mixin first (its `get_compiled_call` wins)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_rep"}  # split by vocabulary, gathered
    _auto_class = "AutoModelForCausalLM"
    accepts_loss_kwargs = False  # the loss is a per-batch mean of several terms: `Trainer` averages it over steps

    def __init__(self, config: SpikeWhaleConfig):
        super().__init__(config)
        self.model = SpikeWhaleModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.mtp_heads = nn.ModuleList(MTPHead(config) for _ in range(config.num_nextn_predict_layers))
        self.abstain_head = nn.Linear(config.hidden_size, 1, bias=True) if config.use_abstain_head else None
        self.post_init()

    def save_pretrained(self, save_directory, *args, **kwargs):
        """`PreTrainedModel.save_pretrained`, with the backbone also in `auto_map` as `AutoModel`."""
        if self._auto_class is not None:
            auto_map = dict(getattr(self.config, "auto_map", None) or {})
            auto_map.setdefault("AutoModel", f"{SpikeWhaleModel.__module__.split('.')[-1]}.{SpikeWhaleModel.__name__}")
            self.config.auto_map = auto_map
        return super().save_pretrained(save_directory, *args, **kwargs)

    @can_return_tuple
    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, cache: SpikeWhaleCache | None = None,
                inputs_embeds: torch.FloatTensor | None = None, labels: torch.LongTensor | None = None,
                use_cache: bool | None = None, logits_to_keep: int | torch.Tensor = 0,
                past_key_values: SpikeWhaleCache | None = None, output_attentions: bool | None = None,
                output_hidden_states: bool | None = None, shift_labels: torch.LongTensor | None = None,
                **kwargs) -> SpikeWhaleCausalLMOutput:
        """See `SpikeWhaleModel.forward`; `shift_labels[:, t]`, position t's target, replaces the shifting of labels."""
        cache = cache if cache is not None else past_key_values
        if cache is not None and not isinstance(cache, SpikeWhaleCache):
            if not (isinstance(cache, Cache) and cache.get_seq_length() == 0):  # an empty one is replaced
                raise TypeError(f"spike_whale needs a SpikeWhaleCache (K/V per loop-plan slot plus Memory-Cache "
                                f"state); got {type(cache).__name__}. Pass cache=None and use_cache=True to have the "
                                "model create one.")
            cache, use_cache = None, True
        if self.training:
            use_cache = False
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                         inputs_embeds=inputs_embeds, use_cache=use_cache, output_attentions=output_attentions,
                         output_hidden_states=output_hidden_states, return_dict=True)
        h = out.last_hidden_state
        with_loss = labels is not None or shift_labels is not None
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        h_out = h if with_loss else h[:, keep]  # a loss reads every position's logits
        logits = self.lm_head(h_out)
        fields = self._losses(h, logits, out, labels, attention_mask, shift_labels, position_ids) if with_loss else {}
        if self.abstain_head is not None:
            probs = torch.sigmoid(self.abstain_head(h_out).squeeze(-1).float())
            threshold = float(self.config.abstain_threshold)
            fields.update(abstain_probs=probs, abstain_mask=probs > threshold, abstain_threshold=threshold)
        return SpikeWhaleCausalLMOutput(logits=logits, **{CACHE_FIELD: out.cache}, hidden_states=out.hidden_states,
                                        attentions=out.attentions, last_hidden_state=h, **fields)

    def _losses(self, h, logits, out, labels, attention_mask, shift_labels, position_ids) -> dict:
        """The loss terms; padding is neither target nor source, and no target crosses into the next packed sequence.
        - lm_loss: CE of logits[:, t] against labels[:, t+1];  z_loss: mean logsumexp(logits)².
        - mtp_loss: mean over heads k of the CE of head k at t against labels[:, t+k+1].
        - hrm_loss: the summed CE of every refinement step before the last (deep supervision).
        - abstain_loss: BCE of the abstain head toward [argmax logits[:, t] != labels[:, t+1]] (`abstain_pos_weight`).
        - moe_aux_loss: the mean load-balance loss of the learned-router layers."""
        cfg, S = self.config, logits.shape[1]
        shifted_by = 0 if shift_labels is not None else 1
        labels = (shift_labels if shift_labels is not None else labels).to(logits.device)
        source_pad = None
        if attention_mask is not None:
            source_pad = attention_mask[:, -S:].to(labels.device) == 0
            if shifted_by:
                labels = labels.masked_fill(source_pad, -100)
        seq_id = None
        if position_ids is not None and attention_mask is None:
            seq_id = self.model.packed_sequence_starts(position_ids.to(labels.device).expand(h.shape[:2])).cumsum(1)

        def shifted(k: int) -> torch.Tensor:
            """Targets k steps past position t's input token; none from padding or across packed sequences."""
            t = labels[:, k - 1 + shifted_by:]
            if source_pad is not None:
                t = t.masked_fill(source_pad[:, : t.shape[1]], -100)
            if seq_id is not None:  # (with shift_labels the last target lies past the row: left as given)
                cross = seq_id[:, k:] != seq_id[:, : S - k]
                t = t.masked_fill(F.pad(cross, (0, t.shape[1] - cross.shape[1])), -100)
            return t

        target = shifted(1)
        n_pred, counted = target.shape[1], target != -100
        terms = dict(lm_loss=_cross_entropy(logits[:, :n_pred], target), z_loss=None, mtp_loss=None, hrm_loss=None,
                     abstain_loss=None, moe_aux_loss=out.moe_aux_loss)
        if cfg.zloss_coef:
            lse = torch.logsumexp(logits[:, :n_pred].float(), -1)
            terms["z_loss"] = (lse.pow(2) * counted).sum() / counted.sum().clamp(min=1)
        if self.mtp_heads and cfg.mtp_loss_weight:
            mtp = [_cross_entropy(self.lm_head(head(h[:, : t.shape[1]])), t)
                   for k, head in enumerate(self.mtp_heads, start=1) if (t := shifted(k + 1)).shape[1] >= 1]
            if mtp:
                terms["mtp_loss"] = torch.stack(mtp).mean()
        earlier = out.refinement_states[:-1]  # HRM steps before the last (none without HRM)
        if cfg.hrm_deep_supervision and earlier:
            terms["hrm_loss"] = torch.stack([_cross_entropy(self.lm_head(s[:, :n_pred]), target)
                                             for s in earlier]).sum()
        if self.abstain_head is not None:
            a_logit = self.abstain_head(h[:, :n_pred]).squeeze(-1).float()
            wrong = (logits[:, :n_pred].detach().argmax(-1) != target).float().to(a_logit.device)
            pos_weight = torch.tensor(float(cfg.abstain_pos_weight), device=a_logit.device)
            bce = F.binary_cross_entropy_with_logits(a_logit, wrong, pos_weight=pos_weight, reduction="none")
            keep = counted.to(a_logit.device)
            terms["abstain_loss"] = (bce * keep).sum() / keep.sum().clamp(min=1)
        coefs = dict(z_loss=cfg.zloss_coef, mtp_loss=cfg.mtp_loss_weight, hrm_loss=1,
                     abstain_loss=cfg.abstain_loss_weight, moe_aux_loss=cfg.moe_aux_loss_coef)
        loss = terms["lm_loss"]
        for name, coef in coefs.items():  # the sum of `SpikeWhaleCausalLMOutput`, terms in order
            if terms[name] is not None and coef:
                loss = loss + coef * terms[name].to(loss.device)
        return dict(loss=loss, **terms)


SpikeWhaleLM = SpikeWhaleForCausalLM
