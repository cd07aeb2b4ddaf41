"""The loop-slot cache of spike_whale: per loop-plan slot K/V plus Memory-Cache state, and the Engram prefix.

A generic KV cache silently computes a different function for this model: the stack runs every layer
`loop_count` times (so K/V are keyed by loop-plan slot, never by layer), the Memory Cache branch reads
summaries of every earlier segment, and Engram reads an n-gram window that crosses the cache boundary.
`SpikeWhaleCache` holds all of it, allocated lazily on the device of the first tensor written to each slot
(so an accelerate `device_map` keeps every slot's state next to its layer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
from transformers import GenerationConfig
from transformers.cache_utils import Cache, CacheLayerMixin

from .configuration_spike_whale import SpikeWhaleConfig
from .tokenization_spike import CHAT_EOS_IDS, RESERVED_IDS


@dataclass
class MemoryCacheState:
    """Memory-Cache state of one slot: finished-segment summaries and the running sums of the current segment.

    fin_M[b, i] = Σ_{m∈seg i} φ(k_m) v_mᵀ, fin_z[b, i] = Σ φ(k_m), fin_g[b, i] = mean gate key of segment i
    (only i < the row's current segment is meaningful; the extra last entry is a write sink).
    run_* are the same sums over the current segment so far (run_g a sum, run_n its token count).
    """

    fin_M: torch.Tensor  # [B, n_seg + 1, nh, hd, hd]
    fin_z: torch.Tensor  # [B, n_seg + 1, nh, hd]
    fin_g: torch.Tensor  # [B, n_seg + 1, gd]
    run_M: torch.Tensor  # [B, nh, hd, hd]
    run_z: torch.Tensor  # [B, nh, hd]
    run_g: torch.Tensor  # [B, gd]
    run_n: torch.Tensor  # [B]

    @classmethod
    def empty(cls, batch: int, n_seg: int, nh: int, hd: int, gd: int, device) -> "MemoryCacheState":
        f32 = dict(device=device, dtype=torch.float32)
        return cls(
            fin_M=torch.zeros(batch, n_seg + 1, nh, hd, hd, **f32),
            fin_z=torch.zeros(batch, n_seg + 1, nh, hd, **f32),
            fin_g=torch.zeros(batch, n_seg + 1, gd, **f32),
            run_M=torch.zeros(batch, nh, hd, hd, **f32),
            run_z=torch.zeros(batch, nh, hd, **f32),
            run_g=torch.zeros(batch, gd, **f32),
            run_n=torch.zeros(batch, **f32),
        )

    def running(self) -> tuple[torch.Tensor, ...]:
        return self.run_M, self.run_z, self.run_g, self.run_n

    def map(self, fn) -> "MemoryCacheState":
        return MemoryCacheState(**{f.name: fn(getattr(self, f.name)) for f in fields(self)})


class LoopSlotLayer(CacheLayerMixin):
    """One loop-plan slot: static K (after QK-norm and RoPE) / V (after depth mixing) and Memory-Cache state."""

    is_compileable = False
    is_sliding = False
    is_croppable = True

    def __init__(self, max_cache_len: int):
        super().__init__()
        self.max_cache_len = max_cache_len
        self.mc: MemoryCacheState | None = None
        self._length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self.keys = key_states.new_zeros(b, h, self.max_cache_len, d)
        self.values = value_states.new_zeros(b, value_states.shape[1], self.max_cache_len, value_states.shape[-1])
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        """Write the chunk at the shared write offset (`start`) and return views of everything so far."""
        start = kwargs.get("start", self._length)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = start + key_states.shape[2]
        if end > self.max_cache_len:
            raise ValueError(
                f"The cache holds {self.max_cache_len} positions but this step needs {end}; create a "
                f"SpikeWhaleCache with a larger max_cache_len (at most max_position_embeddings)."
            )
        self.keys[:, :, start:end] = key_states
        self.values[:, :, start:end] = value_states
        self._length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._length + query_length, 0

    def get_seq_length(self) -> int:
        return self._length

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        super().reset()
        self.mc = None
        self._length = 0

    def _select(self, fn) -> None:
        if self.is_initialized:
            self.keys, self.values = fn(self.keys), fn(self.values)
        if self.mc is not None:
            self.mc = self.mc.map(fn)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(lambda t: t[indices.to(t.device)])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select(lambda t: t.repeat_interleave(repeats, dim=0))


class SpikeWhaleCache(Cache):
    """Cache of a SpikeWhale model: one `LoopSlotLayer` per loop-plan entry plus state shared by all slots.

    Shared state (identical for every slot, so kept once): the key-validity mask (padding), each row's
    number of real tokens, the Memory-Cache segment index of each row, and the Engram compressed vectors
    of every cached position (the n-gram prefix of the next chunk).

    Rollback: `crop(n)` removes the last `n` positions. K/V and the Engram prefix are positional; the
    Memory-Cache running sums are not, so every forward records the per-slot running state at each
    position of its chunk while `record_past` is on (see `activate_past_recording`), and at chunk
    starts always; `crop` restores the state recorded at the new length and raises if none was recorded.
    """

    def __init__(self, config: SpikeWhaleConfig, max_cache_len: int | None = None):
        max_cache_len = max_cache_len or config.max_position_embeddings
        if max_cache_len > config.max_position_embeddings:
            raise ValueError(
                f"max_cache_len={max_cache_len} exceeds max_position_embeddings={config.max_position_embeddings}; "
                "positions past the context window are not defined for this model (widen the RoPE caches first)."
            )
        self.config = config
        self.max_cache_len = max_cache_len
        super().__init__(layers=[LoopSlotLayer(max_cache_len) for _ in range(config.num_loop_slots)])
        self.n_mc_segments = math.ceil(max_cache_len / config.mc_segment_len)
        self.seq_len = 0
        self.key_valid: torch.Tensor | None = None  # [B, max_cache_len] bool
        self.num_real: torch.Tensor | None = None  # [B] long
        self.mc_segment: torch.Tensor | None = None  # [B] long
        self.engram_c: torch.Tensor | None = None  # [B, max_cache_len, cd]
        self.record_past = False
        self._history: dict[int, list[MemoryCacheState | None]] = {}

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seq_len

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.max_cache_len

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.seq_len + query_length, 0

    @property
    def batch_size(self) -> int:
        return -1 if self.key_valid is None else self.key_valid.shape[0]

    def begin(self, valid: torch.Tensor) -> None:
        """Allocate the shared state for a batch on first use (lazily, on the device of `valid`)."""
        b = valid.shape[0]
        if self.key_valid is None:
            self.key_valid = torch.zeros(b, self.max_cache_len, dtype=torch.bool, device=valid.device)
            self.num_real = torch.zeros(b, dtype=torch.long, device=valid.device)
            self.mc_segment = torch.zeros(b, dtype=torch.long, device=valid.device)
        elif self.key_valid.shape[0] != b:
            raise ValueError(
                f"This cache holds a batch of {self.key_valid.shape[0]} rows but the input has {b}; "
                "use a new cache (or batch_select_indices) for a different batch."
            )

    def mc_state(self, slot: int) -> MemoryCacheState | None:
        return self.layers[slot].mc

    def set_mc_state(self, slot: int, state: MemoryCacheState, per_position: list | None = None) -> None:
        """Store a slot's new Memory-Cache state; `per_position[j]` is the state after chunk token j."""
        layer = self.layers[slot]
        start = self.seq_len
        hist = self._history.setdefault(slot, [])
        if self.record_past:
            hist.append((start, layer.mc))
            for j, st in enumerate(per_position or []):
                hist.append((start + j + 1, st))
        else:
            hist[:] = [(start, layer.mc)]
        layer.mc = state

    def commit(
        self,
        valid: torch.Tensor,
        engram_c: torch.Tensor | None,
        mc_segment: torch.Tensor | None,
        mc_segment_per_position: torch.Tensor | None = None,
    ) -> None:
        """Advance the shared state by one chunk once every slot has been written."""
        s = valid.shape[1]
        end = self.seq_len + s
        self.key_valid[:, self.seq_len:end] = valid
        self.num_real += valid.sum(-1)
        if engram_c is not None:
            if self.engram_c is None:
                self.engram_c = engram_c.new_zeros(valid.shape[0], self.max_cache_len, engram_c.shape[-1])
            self.engram_c[:, self.seq_len:end] = engram_c
        if mc_segment is not None:
            entries = [(self.seq_len, self.mc_segment)]
            if self.record_past and mc_segment_per_position is not None:
                entries += [(self.seq_len + j + 1, mc_segment_per_position[:, j]) for j in range(s)]
                self._history.setdefault("segment", []).extend(entries)
            else:
                self._history["segment"] = entries
            self.mc_segment = mc_segment
        self.seq_len = end

    def engram_prefix(self, n: int) -> torch.Tensor | None:
        """The last `n` cached compressed vectors (zeros before position 0), or None on an empty cache."""
        if self.engram_c is None or self.seq_len == 0 or n == 0:
            return None
        lo = max(0, self.seq_len - n)
        prefix = self.engram_c[:, lo:self.seq_len]
        if prefix.shape[1] < n:
            prefix = torch.cat([prefix.new_zeros(prefix.shape[0], n - prefix.shape[1], prefix.shape[2]), prefix], 1)
        return prefix

    def activate_past_recording(self) -> None:
        """Record per-position Memory-Cache states until the next `crop`, so any rollback is exact."""
        self.record_past = True

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `tokens_to_remove` positions (negative: keep only `-tokens_to_remove`)."""
        new_len = self.seq_len - tokens_to_remove if tokens_to_remove >= 0 else -tokens_to_remove
        if not 0 <= new_len <= self.seq_len:
            raise ValueError(f"Cannot crop a cache of length {self.seq_len} to {new_len}.")
        if new_len == self.seq_len:
            return
        for slot, layer in enumerate(self.layers):
            if slot in self._history or layer.mc is not None:
                layer.mc = self._recorded(slot, new_len)
            layer._length = new_len
            if layer.is_initialized:
                layer.keys[:, :, new_len:] = 0
                layer.values[:, :, new_len:] = 0
        if "segment" in self._history:
            self.mc_segment = self._recorded("segment", new_len)
        dropped = self.key_valid[:, new_len:self.seq_len]
        self.num_real -= dropped.sum(-1)
        self.key_valid[:, new_len:] = False
        if self.engram_c is not None:
            self.engram_c[:, new_len:] = 0
        self.seq_len = new_len
        self.record_past = False
        self._history = {k: [(p, s) for p, s in v if p <= new_len][-1:] for k, v in self._history.items()}

    def _recorded(self, key, length: int):
        for pos, state in reversed(self._history.get(key, [])):
            if pos == length:
                return state
        raise ValueError(
            f"Cannot roll the Memory-Cache state back to length {length}: no state was recorded there. "
            "Call cache.activate_past_recording() before the forward you may want to undo."
        )

    def _select_shared(self, fn) -> None:
        for name in ("key_valid", "num_real", "mc_segment", "engram_c"):
            if getattr(self, name) is not None:
                setattr(self, name, fn(getattr(self, name)))
        self._history = {}

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._select_shared(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._select_shared(lambda t: t[indices.to(t.device)])

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._select_shared(lambda t: t.repeat_interleave(repeats, dim=0))

    def reset(self) -> None:
        super().reset()
        self.seq_len = 0
        self.key_valid = self.num_real = self.mc_segment = self.engram_c = None
        self._history = {}
        self.record_past = False


def serving_generation_config(config: SpikeWhaleConfig) -> GenerationConfig:
    """The card's serving defaults: temperature 0.7, top_k 40, repetition penalty 1.3, up to 160 new tokens,
    stopping on `<eos>` or `<|im_end|>`, with the 111 reserved ids never generated."""
    eos = [i for i in CHAT_EOS_IDS if i < config.vocab_size]
    return GenerationConfig(
        do_sample=True,
        temperature=0.7,
        top_k=40,
        repetition_penalty=1.3,
        max_new_tokens=160,
        bos_token_id=config.bos_token_id,
        eos_token_id=eos,
        pad_token_id=config.pad_token_id,
        suppress_tokens=[i for i in RESERVED_IDS if i < config.vocab_size],
    )
