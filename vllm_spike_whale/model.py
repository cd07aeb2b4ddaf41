"""spike_whale in vLLM: the Hub model's own forward, with vLLM holding the K/V and the recurrent state.

Design (what vLLM's hybrid models do, fitted to a looped decoder):

* One copy of the math. The model is the folder's own `modeling_spike_whale.SpikeWhaleModel` (loaded as transformers
  loads it with trust_remote_code) and its `forward` runs unchanged: embeddings and Engram, the loop plan with every
  block (MLA, QK-norm, RoPE, depth attention, XSA, Memory Cache, HC, FFN/MoE), the HC mix, HRM and the norm; the LM
  head is the Hub's `lm_head`. What differs is only where its cache lives: the forward is handed a `StepCache`, which
  offers the interface `SpikeWhaleCache` offers the model (`slot`, `store_slot`, `engram_prefix`, `commit`, ...) but
  reads and writes vLLM's per-request buffers.
* The batch. vLLM flattens the scheduled tokens of all requests; the step cuts them at `query_start_loc` into a
  right-padded [requests, widest chunk] batch with a padding mask and the requests' absolute positions, which the Hub
  model already supports (padding is no token: the Memory Cache adds nothing for it, MoE does not route it, Engram's
  windows of real tokens never reach it). Right padding keeps each row's n-gram window contiguous with its cached
  prefix.
* Attention. One vLLM `Attention` per loop-plan slot (`slots.{i}.attn`, one integer per cache-layer name), since the
  same weights see other activations on every pass. The Hub block computes q, k, v (after QK-norm, RoPE and depth
  mixing) and calls its attention kernel through transformers' `AttentionInterface`; this plugin registers that
  kernel: it unpads q, k, v to vLLM's token order and runs the slot's `Attention` (paged K/V, chunked prefill, prefix
  caching). The slot is the next one the walk asked the cache for (`StepCache.slot`), checked against the block's
  layer.
* Recurrent state. One state layer per slot (`slots.{i}.state`, a `MambaBase` of the linear-attention kind, as
  MiniMax and Qwen3-Next declare theirs) holds, per request: the slot's Memory-Cache state (`MemoryCacheState`: the
  finished-segment summaries, at most ceil(max_model_len / mc_segment_len) plus the write sink, and the running sums),
  and the Engram window (the compressed codes of the last engram_max_ngram - 1 tokens; every slot's spec has it so
  that all state layers share one spec, slot 0's is used). vLLM passes only the scheduled tokens, so the window must
  be state. A request whose context is empty starts from zeros. With prefix caching vLLM's "align" mode copies a
  state to the block a step resumes from; each state tensor is copied whole (`get_temporal_copy_spec`).
* Refused at engine start, with the reason: speculative decoding (the Memory-Cache and Engram states would need the
  per-draft-token rollback vLLM keeps only for its own kernels; a wrong draft would silently corrupt the state),
  Elo and DERF attention (not softmax attention: vLLM's kernels cannot compute them), and tensor parallelism (the Hub
  block's head counts are whole-model).
"""

from __future__ import annotations

import copy
import math
import re
import sys
import threading
from collections import deque
from collections.abc import Iterable

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from vllm.config import VllmConfig, get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import get_temporal_copy_spec
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid, SupportsMambaPrefixCaching
from vllm.sequence import IntermediateTensors
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

# The attention "implementation" name the Hub blocks are switched to; it runs the slot's vLLM `Attention`.
ATTN_IMPL = "spike_whale_vllm"


def hub_modules(vllm_config: VllmConfig):
    """The folder's `modeling_spike_whale` module, loaded as transformers loads it (trust_remote_code)."""
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    mc = vllm_config.model_config
    ref = (getattr(mc.hf_config, "auto_map", None) or {}).get("AutoModelForCausalLM")
    if ref is None:
        raise ValueError(f"{mc.model}: config.json has no auto_map['AutoModelForCausalLM']; serve a folder written by "
                         "spike_whale's save_pretrained (its Hub code files beside the weights).")
    cls = get_class_from_dynamic_module(ref, mc.model, revision=mc.code_revision)
    return sys.modules[cls.__module__]


def state_shapes(hub, config, max_model_len: int) -> tuple[tuple[int, ...], ...]:
    """Per-request state of one slot: the `MemoryCacheState` fields (in their order), then the Engram window."""
    shapes = []
    if config.use_memory_cache:
        n_seg = math.ceil(max_model_len / config.mc_segment_len)
        shapes += hub.MemoryCacheState.shapes(n_seg, config.mc_num_heads, config.mc_head_dim,
                                              config.mc_gate_dim).values()
    if config.use_engram:
        shapes.append((config.engram_max_ngram - 1, config.engram_compress_dim))
    return tuple(tuple(s) for s in shapes)


def refuse_unsupported(vllm_config: VllmConfig, config) -> None:
    """Raise, at engine start, for what this plugin would otherwise compute wrongly."""
    if vllm_config.speculative_config is not None:
        raise ValueError(
            "spike_whale under vLLM does not support speculative decoding: a rejected draft must roll back each loop "
            "slot's Memory-Cache state and the Engram window, which vLLM's speculative decoding does not do for this "
            "model's state. Serve without --speculative-config (transformers' generate has exact MTP, assisted and "
            "prompt-lookup decoding for this model).")
    if config.use_elo or config.use_derf:
        raise ValueError(
            f"spike_whale under vLLM serves softmax attention only; this config uses "
            f"{'Elo' if config.use_elo else 'DERF'} attention, which vLLM's attention kernels cannot compute. "
            "Use transformers' generate for this model.")
    if vllm_config.parallel_config.tensor_parallel_size > 1 or vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise ValueError(
            "spike_whale under vLLM runs on one device (tensor_parallel_size=1, pipeline_parallel_size=1): the Hub "
            "blocks it runs hold every attention head and the whole vocabulary. For tensor parallelism use "
            "transformers' DistributedConfig(tp_size=...) (see the README).")
    if not (config.use_memory_cache or config.use_engram):
        raise ValueError("spike_whale under vLLM expects a recurrent state (use_memory_cache or use_engram); "
                         "this config has neither.")


class LoopSlotState(nn.Module, MambaBase):
    """The per-request recurrent state of one loop-plan slot; vLLM allocates it and binds `kv_cache` (one tensor per
    entry of `state_shapes`, [state blocks, *shape])."""

    def __init__(self, shapes: tuple[tuple[int, ...], ...], prefix: str):
        super().__init__()
        self.shapes, self.prefix = shapes, prefix
        self.kv_cache = ()
        static = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in static:
            raise ValueError(f"Duplicate layer name: {prefix}")
        static[prefix] = self

    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        return self.shapes

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        # The Memory Cache computes in float32 under any load dtype; the Engram codes are kept exactly.
        return (torch.float32,) * len(self.shapes)

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.LINEAR


class LoopSlot(nn.Module):
    """A loop-plan slot's vLLM layers: its K/V (`attn`) and its recurrent state (`state`). No weights."""

    def __init__(self, config, vllm_config: VllmConfig, shapes, prefix: str):
        super().__init__()
        hd = config.head_dim
        self.attn = Attention(config.num_attention_heads, hd, hd**-0.5, num_kv_heads=config.num_key_value_heads,
                              cache_config=vllm_config.cache_config, quant_config=None, prefix=f"{prefix}.attn")
        self.state = LoopSlotState(shapes, f"{prefix}.state")


_ACTIVE = threading.local()  # the `StepCache` of the forward running in this thread


def slot_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
                   **kwargs):
    """transformers' attention-function signature ([B, heads, S, hd] in, [B, S, heads, hd] out), run by the slot's
    vLLM `Attention` on the step's real tokens. `key`/`value` end with the chunk's K/V (`write_kv`)."""
    step: StepCache = _ACTIVE.step
    slot = step.pending.popleft()
    if step.plan_layers[slot] != module.layer_idx:
        raise RuntimeError(f"loop slot {slot} runs layer {step.plan_layers[slot]}, but layer {module.layer_idx} "
                           "asked for attention: the walk no longer follows the loop plan's order")
    if scaling is not None and abs(scaling - module.hd**-0.5) > 1e-12:
        raise RuntimeError("spike_whale's attention scaling changed; vLLM's Attention was built with hd**-0.5")
    R, nh, W, hd = query.shape
    valid = step.valid
    q = query.transpose(1, 2)[valid]
    k = key[:, :, -W:].transpose(1, 2)[valid]
    v = value[:, :, -W:].transpose(1, 2)[valid]
    n = q.shape[0]
    out = step.attn[slot](q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1))
    y = query.new_zeros(R, W, nh, hd)
    y[valid] = out.view(n, nh, hd).to(y.dtype)
    return y, None


AttentionInterface.register(ATTN_IMPL, slot_attention)
AttentionMaskInterface.register(ATTN_IMPL, sdpa_mask)  # the Hub then passes its boolean mask through, unused


class StepCache:
    """What `SpikeWhaleModel.forward` reads from its cache, for one vLLM step over a right-padded batch of requests.

    Every request's cached length may differ; the Hub model sees `seq_len`, the longest, which only bounds what it
    reads: its K/V writes land in a scratch that `slot_attention` reads the chunk from, and the Memory Cache masks
    each row's finished segments by the row's own segment (`mc_segment`)."""

    record_past = False

    def __init__(self, hub, config, slots, dtype, rows: torch.Tensor, ctx_lens: torch.Tensor, valid: torch.Tensor,
                 plan_layers):
        R, W = valid.shape
        self.hub, self.slots, self.rows, self.valid, self.plan_layers = hub, slots, rows, valid, plan_layers
        self.attn = [slot.attn for slot in slots]
        self.ctx_lens = ctx_lens  # each row's cached tokens
        self.fresh = ctx_lens == 0  # these rows start from the empty state, whatever their state blocks hold
        self.seq_len = int(ctx_lens.max())
        self.max_cache_len = self.seq_len + W
        self.use_mc, self.use_engram = config.use_memory_cache, config.use_engram
        if self.use_mc:
            L = config.mc_segment_len
            self.n_mc_segments = slots[0].state.shapes[0][0] - 1
            self.mc_segment = torch.where(self.fresh, 0, (ctx_lens - 1) // L)  # each row's segment before the chunk
        else:
            self.mc_segment, self.n_mc_segments = None, 0
        self.key_valid = torch.ones(1, 1, dtype=torch.bool, device=valid.device).expand(R, self.max_cache_len)
        # One K/V scratch for every slot: a block writes its chunk there and its attention reads it at once.
        kv_shape = (R, config.num_key_value_heads, self.max_cache_len, config.head_dim)
        self.scratch = (torch.empty(kv_shape, dtype=dtype, device=valid.device),
                        torch.empty(kv_shape, dtype=dtype, device=valid.device))
        self.pending: deque[int] = deque()

    def begin(self, valid: torch.Tensor) -> None:
        pass

    def _gather(self, buf: torch.Tensor) -> torch.Tensor:
        t = buf.index_select(0, self.rows)
        return t.masked_fill_(self.fresh.view(-1, *[1] * (t.dim() - 1)), 0.0)

    def slot(self, s: int):
        self.pending.append(s)
        mc = None
        if self.use_mc:
            bufs = self.slots[s].state.kv_cache
            names = list(self.hub.MemoryCacheState.__dataclass_fields__)
            mc = self.hub.MemoryCacheState(**{name: self._gather(bufs[i]) for i, name in enumerate(names)})
        return self.hub.SlotState(*self.scratch, mc, None)

    def store_slot(self, s: int, update, end) -> None:
        if update.mc is not None:
            bufs = self.slots[s].state.kv_cache
            for buf, t in zip(bufs, update.mc.tensors()):
                buf.index_copy_(0, self.rows, t.to(buf.dtype))

    def engram_prefix(self, n: int) -> torch.Tensor:
        return self._gather(self.slots[0].state.kv_cache[-1])

    def commit(self, valid, engram_c, mc_segment, mc_segment_per_position=None) -> None:
        if not self.use_engram or engram_c is None:
            return
        buf = self.slots[0].state.kv_cache[-1]
        n = buf.shape[1]
        ext = torch.cat([self._gather(buf), engram_c.to(buf.dtype)], 1)  # rows are right-padded: real codes first
        at = valid.sum(1)[:, None] + torch.arange(n, device=valid.device)[None, :]
        buf.index_copy_(0, self.rows, ext.gather(1, at[..., None].expand(-1, -1, ext.shape[-1])))


class SpikeWhaleForCausalLM(nn.Module, HasInnerState, IsHybrid, SupportsMambaPrefixCaching):
    """spike_whale for vLLM: the Hub causal LM (`hf`) plus one `LoopSlot` per loop-plan slot."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        hub = hub_modules(vllm_config)
        config = copy.deepcopy(vllm_config.model_config.hf_config)  # its attention implementation is set below
        refuse_unsupported(vllm_config, config)
        self.hub, self.config = hub, config
        self.hf = hub.SpikeWhaleForCausalLM(config).eval()
        if config.tie_word_embeddings:
            self.hf.lm_head.weight = self.hf.model.embed_tokens.weight
        self.hf.config._attn_implementation = ATTN_IMPL
        plan = config.loop_plan
        self.plan_layers = [layer for layer, _ in plan.entries]
        shapes = state_shapes(hub, config, vllm_config.model_config.max_model_len)
        pre = f"{prefix}." if prefix else ""
        self.slots = nn.ModuleList(LoopSlot(config, vllm_config, shapes, f"{pre}slots.{i}")
                                   for i in range(len(plan.entries)))
        self.state_name = self.slots[0].state.prefix

    # -- vLLM's hybrid-model interface -------------------------------------------------------------------------------
    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        return state_shapes(hub_modules(vllm_config), vllm_config.model_config.hf_config,
                            vllm_config.model_config.max_model_len)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig):
        return (torch.float32,) * len(cls.get_mamba_state_shape_from_config(vllm_config))

    @classmethod
    def get_mamba_state_copy_func(cls):
        # One whole-tensor copy per state tensor (`get_mamba_state_copy_funcs` counts them for this model).
        return (get_temporal_copy_spec,)

    def get_mamba_state_copy_funcs(self, mamba_types):
        n = len(self.slots[0].state.shapes)
        return {t: (get_temporal_copy_spec,) * n for t in mamba_types}

    # -- forward ----------------------------------------------------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.hf.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None, inputs_embeds: torch.Tensor | None = None,
                **kwargs) -> torch.Tensor:
        if input_ids is None:
            raise NotImplementedError("spike_whale needs token ids (Engram hashes them); prompt embeddings are not "
                                      "supported")
        T = input_ids.shape[0]
        H = self.config.hidden_size
        meta = get_forward_context().attn_metadata
        meta = meta.get(self.state_name) if isinstance(meta, dict) else None
        out = torch.zeros(T, H, dtype=self.hf.model.embed_tokens.weight.dtype, device=input_ids.device)
        if meta is None:  # a warm-up or profiling run: nothing is scheduled and no state may change
            return out
        qsl = meta.query_start_loc.to(torch.long)
        R = qsl.shape[0] - 1
        qlen = qsl[1:] - qsl[:-1]
        n = int(qsl[-1])
        ctx_lens = meta.seq_lens[:R].to(torch.long) - qlen
        rows = meta.state_indices_tensor[:R].to(torch.long)
        W = int(qlen.max())
        dev = input_ids.device
        row_of = torch.repeat_interleave(torch.arange(R, device=dev), qlen)
        col = torch.arange(n, device=dev) - qsl[row_of]
        ids = torch.zeros(R, W, dtype=input_ids.dtype, device=dev)
        pos = torch.zeros(R, W, dtype=torch.long, device=dev)
        valid = torch.zeros(R, W, dtype=torch.bool, device=dev)
        ids[row_of, col] = input_ids[:n]
        pos[row_of, col] = positions[:n].to(torch.long)
        valid[row_of, col] = True
        step = StepCache(self.hub, self.config, list(self.slots), out.dtype, rows, ctx_lens, valid, self.plan_layers)
        _ACTIVE.step = step
        try:
            hidden = self.hf.model(input_ids=ids, attention_mask=valid.long(), position_ids=pos, cache=step,
                                   use_cache=True, return_dict=True).last_hidden_state
        finally:
            _ACTIVE.step = None
        if step.pending:
            raise RuntimeError(f"{len(step.pending)} loop slots were prepared but never attended")
        out[:n] = hidden[valid].to(out.dtype)
        return out

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.hf.lm_head(hidden_states)

    # -- weights ----------------------------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The folder's safetensors names are the Hub model's (`CHECKPOINT_KEY_RENAMES` applied, as its loader does);
        persistent buffers (RoPE tables, Engram hash projections) load too."""
        renames = [(re.compile(a), b) for a, b in getattr(self.hub, "CHECKPOINT_KEY_RENAMES", {}).items()]
        targets = dict(self.hf.named_parameters())
        targets.update(self.hf.named_buffers())
        loaded = set()
        for name, tensor in weights:
            for pattern, repl in renames:
                name = pattern.sub(repl, name)
            target = targets.get(name)
            if target is None:
                raise ValueError(f"checkpoint tensor {name!r} has no place in spike_whale's Hub model")
            if target.shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the model "
                                 f"{tuple(target.shape)}")
            with torch.no_grad():
                target.copy_(tensor)
            loaded.add(f"hf.{name}")
        if self.config.tie_word_embeddings:
            loaded.add("hf.lm_head.weight")
        return loaded
