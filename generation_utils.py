"""The loop-slot cache of spike_whale and its `generate`. A generic KV cache silently computes a different function
for this model: the stack runs every layer `loop_count` times (K/V are keyed by loop-plan slot, never by layer), the
Memory Cache reads summaries of every earlier segment, and Engram reads an n-gram window across the cache boundary."""

from __future__ import annotations

import copy
import math
from bisect import bisect_left
from dataclasses import dataclass, field, fields, replace
from typing import NamedTuple

import torch
from transformers import (GenerationConfig, GenerationMixin, LogitsProcessor, LogitsProcessorList,
                          RepetitionPenaltyLogitsProcessor, StoppingCriteria, StoppingCriteriaList)
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.generation import GenerateDecoderOnlyOutput
from transformers.utils import logging

from .configuration_spike_whale import SpikeWhaleConfig

logger = logging.get_logger(__name__)

# The cache field of transformers' model and generate outputs: `cache` from 5.24, `past_key_values` before.
CACHE_FIELD = "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"


@dataclass
class SegmentLayout:
    """Where each chunk token falls in the Memory-Cache segments; built once per forward, shared by all slots.
    rel[b, t]: row b's segment after token t, relative to `base[b]`, its segment before the chunk (padding keeps the
    last). The first `split` tokens take the chunk form, the rest the step form. The chunk form puts token t at row
    idx[b, t] of a block buffer [B, n_rel, width, ...] (block rel[b, t]; padding to the sink row n_rel·width), so it
    costs O(split·width); idx is None where it is 0..split-1 (the chunk itself, zero-padded to whole blocks).
    n_fin: the finished-segment entries a token may read; fin_readable: every token may read all of them. A `static`
    layout reads no value on the host: block counts are bounds, padding and unreadable entries always assumed."""

    base: torch.Tensor
    rel: torch.Tensor
    valid_f: torch.Tensor
    padded: bool  # some token is padding (always assumed when static)
    n_rel: int  # blocks: relative segments the chunk touches
    n_fin: int
    fin_readable: bool
    split: int
    width: int
    idx: torch.Tensor | None

    @classmethod
    def build(cls, positions, valid, base, seg_len: int, n_fin: int, steps: int, static: bool) -> "SegmentLayout":
        """steps: the chunk's last tokens that go through the step form."""
        B, S = positions.shape
        seg = torch.div(positions, seg_len, rounding_mode="floor") - base[:, None]
        rel = torch.where(valid, seg, torch.zeros_like(seg)).clamp(min=0).cummax(1).values if S else seg
        if static:  # the most segments S positions after `base` can touch
            n_rel = (S - 1) // seg_len + 2 if S else 1
            torch._assert_async((rel < n_rel).all(), "positions do not continue the cache's Memory-Cache segment")
        else:
            n_rel = int(rel[:, -1].max()) + 1 if S else 1
        padded, fin_readable = static or not bool(valid.all()), not static and bool((base >= n_fin).all())
        split = S - steps
        width = torch.sym_min(split, seg_len)
        idx = None
        if split and (padded or n_rel > 1):
            rel_c, real = rel[:, :split], valid[:, :split].long()
            count = torch.zeros(B, n_rel, dtype=torch.long, device=rel.device).scatter_add_(1, rel_c, real)
            start = count.cumsum(1) - count  # real tokens before each block
            at = rel_c * width + real.cumsum(1) - 1 - start.gather(1, rel_c)
            idx = torch.where(real.bool(), at, torch.full_like(at, n_rel * width))
            if not padded and bool((idx == torch.arange(split, device=idx.device)).all()):
                idx = None
        return cls(base, rel, valid.float(), padded, n_rel, n_fin, fin_readable, split, width, idx)

    @property
    def new_segment(self) -> torch.Tensor:
        """[B]: each row's segment after the chunk."""
        return self.base + self.rel[:, -1] if self.rel.shape[1] else self.base


@dataclass
class MemoryCacheState:
    """Memory-Cache state of one slot: fin_M[b, i] = Σ_{m∈seg i} φ(k_m) v_mᵀ, fin_z[b, i] = Σ φ(k_m), fin_g[b, i] =
    mean gate key of finished segment i (only i < the row's current segment is meaningful; the last entry is a write
    sink); run_* the same sums over the current segment so far (run_g a sum, run_n its token count). Each field declares
    its per-row shape, sizes named in `shapes`: allocation, copies, batch selection, snapshots and footprint follow."""

    fin_M: torch.Tensor = field(metadata={"dims": ("entries", "nh", "hd", "hd")})
    fin_z: torch.Tensor = field(metadata={"dims": ("entries", "nh", "hd")})
    fin_g: torch.Tensor = field(metadata={"dims": ("entries", "gd")})
    run_M: torch.Tensor = field(metadata={"dims": ("nh", "hd", "hd")})
    run_z: torch.Tensor = field(metadata={"dims": ("nh", "hd")})
    run_g: torch.Tensor = field(metadata={"dims": ("gd",)})
    run_n: torch.Tensor = field(metadata={"dims": ()})

    @classmethod
    def shapes(cls, n_seg: int, nh: int, hd: int, gd: int) -> dict[str, tuple[int, ...]]:
        """Each field's shape for one batch row (float32), with `n_seg` finished-segment entries plus the sink."""
        size = {"entries": n_seg + 1, "nh": nh, "hd": hd, "gd": gd}
        return {name: tuple(size[d] for d in dims) for name, dims in _MC_DIMS.items()}

    @classmethod
    def empty(cls, batch: int, n_seg: int, nh: int, hd: int, gd: int, device) -> "MemoryCacheState":
        return cls(**{name: torch.zeros(batch, *shape, device=device, dtype=torch.float32)
                      for name, shape in cls.shapes(n_seg, nh, hd, gd).items()})

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in _MC_DIMS]

    def map(self, fn) -> "MemoryCacheState":
        return type(self)(**{name: fn(getattr(self, name)) for name in _MC_DIMS})

    def copy_(self, other: "MemoryCacheState | None") -> None:
        """Write `other` into these buffers (None: zero them, the empty state); they keep their addresses (CUDA graphs
        replay on them). The finished-segment summaries the branch wrote in place are these very tensors: no copy."""
        for name in _MC_DIMS:
            mine, new = getattr(self, name), getattr(other, name, None)
            if new is None:
                mine.zero_()
            elif mine is not new:
                mine.copy_(new)

    def snapshot(self) -> "MemoryCacheState":
        """A rollback point that survives later in-place updates: running sums copied, finished-segment summaries
        shared (an entry is written once, when its segment ends, and a row reads only entries below its segment)."""
        return replace(self, **{name: getattr(self, name).clone() for name in _MC_DIMS if name.startswith("run_")})


_MC_DIMS = {f.name: f.metadata["dims"] for f in fields(MemoryCacheState)}  # torch.compile cannot trace fields(cls)


class SlotState(NamedTuple):
    """What one loop-plan slot carries from chunk to chunk, as its block reads it: static K/V buffers
    [B, kvh, max_cache_len, hd], the Memory-Cache state and the Elo ratings (each None before it is first written)."""

    keys: torch.Tensor | None
    values: torch.Tensor | None
    mc: MemoryCacheState | None
    elo: torch.Tensor | None


class SlotUpdate(NamedTuple):
    """A block's result for its slot after a chunk (`SpikeWhaleCache.store_slot`): K/V buffers it allocated (None: it
    wrote the slot's own in place), the new recurrent states and, while recording, those after its last tokens."""

    kv: tuple[torch.Tensor, torch.Tensor] | None
    mc: MemoryCacheState | None
    mc_steps: list | None
    elo: torch.Tensor | None
    elo_steps: list | None


def write_kv(keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int | torch.Tensor):
    """Write a chunk's K/V [B, kvh, S, hd] into a slot's static buffers at `start`, in place. An int start (eager)
    returns views of everything written so far; a 0-d tensor (compiled: the graph must not change with the length)
    returns the whole buffers, whose unwritten keys the mask hides, as transformers' `StaticLayer` does."""
    if isinstance(start, torch.Tensor):
        at = start + torch.arange(k.shape[2], device=keys.device)
        keys.index_copy_(2, at, k)
        values.index_copy_(2, at, v)
        return keys, values
    end = start + k.shape[2]
    keys[:, :, start:end] = k
    values[:, :, start:end] = v
    return keys[:, :, :end], values[:, :, :end]


def _mark_static(*tensors: torch.Tensor) -> None:
    """Tell torch.compile these buffers keep their address: CUDA graphs replay on them in place (as static layers)."""
    if not torch.compiler.is_compiling():
        for t in tensors:
            torch._dynamo.mark_static_address(t)


def _select_into(t: torch.Tensor, fn, filled: int | None = None) -> torch.Tensor:
    """A batch selection `fn` of buffer t: in place where the batch size stays (beam reordering keeps the static
    addresses; of a K/V buffer only its `filled` positions move), a new buffer where it changes."""
    part = t if filled is None else t[:, :, :filled]
    new = fn(part)
    if new.shape[0] == t.shape[0]:
        part.copy_(new)
        return t
    new = fn(t) if filled is not None else new
    _mark_static(new)
    return new


class _BatchSelection:
    """transformers' batch operations, each one selection `fn` of every batch-first buffer (`_select`)."""

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(lambda t: t[indices.to(t.device)])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select(lambda t: t.repeat_interleave(repeats, dim=0))


class LoopSlotLayer(_BatchSelection, CacheLayerMixin):
    """One loop-plan slot of the cache's length: static K (after QK-norm and RoPE) / V (after depth mixing), the
    Memory-Cache state, the Elo ratings and the rollback history of those two (`history[kind]`: [(length, state)])."""

    is_compileable = CACHE_FIELD == "cache"  # 5.24+: earlier 5.x refuse assisted decoding with compileable layers
    is_sliding, is_croppable = False, True
    STATES = ("mc", "elo")  # the slot's recurrent (not positional) states

    def __init__(self, cache: "SpikeWhaleCache", max_cache_len: int):
        super().__init__()
        self.cache, self.max_cache_len = cache, max_cache_len
        self.mc: MemoryCacheState | None = None
        self.elo: torch.Tensor | None = None  # Elo ratings [B, heads, length] of the cached keys (un-scaled Σ of steps)
        self.record_past = False  # set on every slot by `SpikeWhaleCache.activate_past_recording`
        self.history: dict[str, list] = {}

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.keys = key_states.new_zeros(*key_states.shape[:2], self.max_cache_len, key_states.shape[-1])
        self.values = value_states.new_zeros(*value_states.shape[:2], self.max_cache_len, value_states.shape[-1])
        _mark_static(self.keys, self.values)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        """transformers' cache-layer API: write a chunk at the cache's length (`start` to override) and return views
        of everything so far; the length advances once per forward (`SpikeWhaleCache.commit`)."""
        start = kwargs.get("start", self.get_seq_length())
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = start + key_states.shape[2]
        if end > self.max_cache_len:
            raise ValueError(f"The cache holds {self.max_cache_len} positions but this step needs {end}; create a "
                             "SpikeWhaleCache with a larger max_cache_len (at most max_position_embeddings).")
        return write_kv(self.keys, self.values, key_states, value_states, start)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.cache.seq_len

    def get_max_length(self) -> int:
        return self.max_cache_len

    get_max_cache_shape = get_max_length  # abstract in transformers < 5.2x

    def reset(self) -> None:
        """Zero the buffers in place (they keep their addresses) and forget the history."""
        super().reset()
        if self.mc is not None:
            self.mc.copy_(None)
        self.elo, self.history = None, {}

    def _select(self, fn) -> None:
        self.history = {}  # recorded states are of the old batch
        if self.is_initialized:
            n = self.get_seq_length()
            self.keys, self.values = _select_into(self.keys, fn, n), _select_into(self.values, fn, n)
        if self.mc is not None:
            self.mc = self.mc.map(lambda t: _select_into(t, fn))
        if self.elo is not None:
            self.elo = fn(self.elo)


class SpikeWhaleCache(_BatchSelection, Cache):
    """Cache of a SpikeWhale model: one `LoopSlotLayer` per loop-plan entry, one length and the batch-first state all
    slots share (`SHARED`): padding mask key_valid [B, max_cache_len], real-token counts num_real [B], Memory-Cache
    segments mc_segment [B], Engram compressed vectors engram_c [B, max_cache_len, cd] (the next chunk's n-gram
    prefix). Each buffer is allocated once, on the device of the first tensor written to it (a `device_map` keeps
    each slot's state next to its layer), and updated in place, its address static. For `crop`, K/V and the Engram
    prefix are positional; the Memory-Cache and Elo states are not, so while recording (`activate_past_recording`)
    every forward records them at its start and at the lengths a crop may return to; `crop` restores them."""

    SHARED = ("key_valid", "num_real", "mc_segment", "engram_c")

    def __init__(self, config: SpikeWhaleConfig, max_cache_len: int | None = None):
        max_cache_len = max_cache_len or config.max_position_embeddings
        if max_cache_len > config.max_position_embeddings:
            raise ValueError(
                f"max_cache_len={max_cache_len} exceeds max_position_embeddings={config.max_position_embeddings}; "
                "positions past the context window are not defined for this model (widen the RoPE caches first).")
        self.config = config
        super().__init__(layers=[LoopSlotLayer(self, max_cache_len) for _ in range(config.num_loop_slots)])
        self.n_mc_segments = math.ceil(max_cache_len / config.mc_segment_len)
        # Positions cached, a tensor so that a compiled decode step reads and advances it in its graph (a Python int
        # would be a constant of the graph: one recompile per step); eager code reads its host copy (`seq_len`).
        self.length = torch.zeros((), dtype=torch.long)
        self._seq_len: int | None = 0
        self.key_valid = self.num_real = self.mc_segment = self.engram_c = None  # `SHARED`, allocated on first use
        self.recurrent_states_to_keep: int | None = None  # see `activate_past_recording`
        self.min_states_to_keep = 0  # a floor under that bound (`generate` raises it for growing draft counts)
        self._history: dict[str, list] = {}  # "segment" -> [(length, each row's segment)]; slots keep their own
        self._chunk_start = 0

    @property
    def seq_len(self) -> int:
        """Positions cached, on the host: the copy kept with `length`, re-read from it (once) after a compiled step."""
        if self._seq_len is None:
            self._seq_len = int(self.length)
        return self._seq_len

    def _set_length(self, n: int | torch.Tensor) -> None:
        """Set `length` in place and, for an int (eager), the host copy; a 0-d tensor (compiled) drops the copy."""
        self.length.fill_(n)
        self._seq_len = n if isinstance(n, int) else None

    def _position(self, device=None):
        """The length: in a compiled graph a copy of the tensor (on `device` if given), else the host int."""
        return self.length.to(device, copy=True) if torch.compiler.is_compiling() else self.seq_len

    @property
    def record_past(self) -> bool:
        """Whether forwards record states for `crop`: every slot's flag (transformers' loops clear those to stop)."""
        return all(layer.record_past for layer in self.layers)

    @record_past.setter
    def record_past(self, value: bool) -> None:
        for layer in self.layers:
            layer.record_past = bool(value)

    @property
    def max_cache_len(self) -> int:
        """Positions every slot holds (one length for all; read-only, as transformers' `Cache.max_cache_len`)."""
        return self.layers[0].max_cache_len

    def get_max_length(self, layer_idx: int | None = None) -> int:  # not on transformers < 5.2x's `Cache`
        return self.max_cache_len

    def begin(self, valid: torch.Tensor) -> None:
        """Allocate the shared state for a batch on first use (lazily, on the device of `valid`)."""
        b = valid.shape[0]
        if self.key_valid is None:
            self.key_valid = torch.zeros(b, self.max_cache_len, dtype=torch.bool, device=valid.device)
            self.num_real = torch.zeros(b, dtype=torch.long, device=valid.device)
            self.mc_segment = torch.zeros(b, dtype=torch.long, device=valid.device)
            self.length = self.length.to(valid.device)
            _mark_static(self.key_valid, self.num_real, self.mc_segment, self.length)
        elif self.key_valid.shape[0] != b:
            raise ValueError(f"This cache holds a batch of {self.key_valid.shape[0]} rows but the input has {b}; "
                             "use a new cache (or batch_select_indices) for a different batch.")

    def slot_state(self, slot: int, kind: str):
        """A slot's recurrent state, kind "mc" or "elo" (`LoopSlotLayer.STATES`); None before the first chunk."""
        return getattr(self.layers[slot], kind)

    def slot(self, slot: int) -> SlotState:
        layer = self.layers[slot]
        kv = (layer.keys, layer.values) if layer.is_initialized else (None, None)
        return SlotState(*kv, *(self.slot_state(slot, kind) for kind in LoopSlotLayer.STATES))

    def store_slot(self, slot: int, update: SlotUpdate, end: int) -> None:
        """Store a block's `update` for slot `slot` after a chunk ending at `end`. While recording, the non-positional
        recurrent states at the chunk's start and after each token in `*_steps` but the last (the live state) are kept
        for `crop`. A Memory-Cache state is copied into the slot's buffers, allocated by its first chunk."""
        layer = self.layers[slot]
        if update.kv is not None:
            layer.keys, layer.values = update.kv
            _mark_static(*update.kv)
            layer.is_initialized = True
        for kind in LoopSlotLayer.STATES:
            value, steps = getattr(update, kind), getattr(update, f"{kind}_steps") or []
            if value is None:
                continue
            current = getattr(layer, kind)
            hist = layer.history.setdefault(kind, [])
            if layer.record_past:  # the slot's own flag (`record_past` of the cache is all of them)
                hist.append((self._position(), current.snapshot() if kind == "mc" and current is not None else current))
                hist.extend((end - len(steps) + 1 + j, st) for j, st in enumerate(steps[:-1]))
            else:
                hist.clear()
            if kind == "elo":
                layer.elo = value
            elif current is None:
                _mark_static(*value.tensors())
                layer.mc = value
            else:
                current.copy_(value)

    def commit(self, valid: torch.Tensor, engram_c: torch.Tensor | None, mc_segment: torch.Tensor | None,
               mc_segment_per_position: torch.Tensor | None = None) -> None:
        """Advance the shared state by one chunk once every slot has been written."""
        s, start = valid.shape[1], self._position()
        at = torch.arange(s, device=self.length.device) + start  # the chunk's cache positions, no host sync
        self.key_valid.index_copy_(1, at.to(self.key_valid.device), valid.to(self.key_valid.device))
        self.num_real += valid.sum(-1)
        if engram_c is not None:
            if self.engram_c is None:
                self.engram_c = engram_c.new_zeros(valid.shape[0], self.max_cache_len, engram_c.shape[-1])
                _mark_static(self.engram_c)
            self.engram_c.index_copy_(1, at.to(self.engram_c.device), engram_c.to(self.engram_c.dtype))
        if mc_segment is not None:
            if self.record_past:
                entries = self._history.setdefault("segment", [])
                entries.append((start, self.mc_segment.clone()))
                if mc_segment_per_position is not None:  # [B, the chunk's last n tokens]
                    n = mc_segment_per_position.shape[1]
                    entries += [(start + s - n + 1 + j, mc_segment_per_position[:, j]) for j in range(n)]
            else:
                self._history.clear()
            self.mc_segment.copy_(mc_segment)
        self._chunk_start = start
        self._set_length(start + s)

    def engram_prefix(self, n: int) -> torch.Tensor | None:
        """The last `n` cached compressed vectors (zeros before position 0), or None on an empty cache."""
        if self.engram_c is None or n == 0 or (not torch.compiler.is_compiling() and self.seq_len == 0):
            return None
        at = torch.arange(n, device=self.engram_c.device) + (self._position(self.engram_c.device) - n)
        return self.engram_c[:, at.clamp(min=0)] * (at >= 0)[None, :, None]

    def activate_past_recording(self, recurrent_states_to_keep: int | None = None) -> None:
        """Record the recurrent states at the start of every following forward and at its last
        `recurrent_states_to_keep` lengths (all when None), so that `crop` can remove that many of its tokens exactly.
        On across crops until `deactivate_past_recording()`; transformers >= 5.25 passes the tokens it may crop."""
        if recurrent_states_to_keep is not None and recurrent_states_to_keep < 0:
            raise ValueError(
                f"recurrent_states_to_keep must be >= 0 (or None: every length), got {recurrent_states_to_keep}")
        self.record_past = True
        self.recurrent_states_to_keep = (None if recurrent_states_to_keep is None
                                         else max(recurrent_states_to_keep, self.min_states_to_keep))

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        """How many of a forward's last tokens a `crop` may remove (the same for every slot, 0 when not recording)."""
        if not self.record_past:
            return 0
        return self.max_cache_len if self.recurrent_states_to_keep is None else self.recurrent_states_to_keep

    def deactivate_past_recording(self) -> None:
        self.record_past, self.recurrent_states_to_keep = False, None
        self._trim_history(lambda v: [])

    def _trim_history(self, keep) -> None:
        """Apply `keep` ([(length, state)] -> the entries to keep) to every recorded history, the segment index's and
        each slot's. Lengths recorded inside a compiled graph are tensors; they become ints here."""
        for hist in (self._history, *(layer.history for layer in self.layers)):
            for key, entries in hist.items():
                hist[key] = keep([(int(p), s) for p, s in entries])

    def crop(self, max_length: int) -> None:
        """Roll back: `crop(-k)` removes the last `k` positions, `crop(n > 0)` keeps the first `n`, `crop(0)` nothing.
        The recurrent states are restored from those recorded at the new length (`ValueError` where none was). Records
        no longer needed are dropped; recording stays on (assisted decoding activates it once and crops every step)."""
        old_len = self.seq_len
        new_len = old_len + max_length if max_length <= 0 else max_length
        if not 0 <= new_len <= old_len:
            raise ValueError(f"Cannot crop a cache of length {old_len} with crop({max_length}): crop(-k) removes k "
                             f"positions (0 <= k <= {old_len}), crop(n) keeps the first n.")
        if new_len == old_len:
            if self.record_past:  # keep the states at the last chunk's start and at the current length
                keep = (int(self._chunk_start), old_len)
                self._trim_history(lambda v: [(p, s) for p, s in v if p in keep][-2:])
            else:
                self.deactivate_past_recording()
            return
        # Every state is looked up before anything is touched, so a failed crop leaves the cache intact.
        restored = [(layer, kind, self._recorded(layer.history.get(kind, []), new_len))
                    for layer in self.layers for kind in LoopSlotLayer.STATES if getattr(layer, kind) is not None]
        segment = (self._recorded(self._history.get("segment", []), new_len)
                   if self.mc_segment is not None and self.config.use_memory_cache else None)
        for layer, kind, state in restored:
            if kind == "mc":
                layer.mc.copy_(state)  # None: back before the first chunk, the empty state
            else:
                layer.elo = state
        for layer in self.layers:
            if layer.is_initialized:
                layer.keys[:, :, new_len:old_len] = 0
                layer.values[:, :, new_len:old_len] = 0
        if segment is not None:
            self.mc_segment.copy_(segment)
        self.num_real -= self.key_valid[:, new_len:old_len].sum(-1)
        self.key_valid[:, new_len:old_len] = False
        if self.engram_c is not None:
            self.engram_c[:, new_len:old_len] = 0
        self._set_length(new_len)
        self._chunk_start = new_len
        self._trim_history(lambda v: [(p, s) for p, s in v if p <= new_len][-1:])

    @staticmethod
    def _recorded(history: list, length: int):
        for pos, state in reversed(history):
            if int(pos) == length:
                return state
        raise ValueError(
            f"Cannot roll the Memory-Cache state back to length {length}: no state was recorded there. Call "
            "cache.activate_past_recording() before the forward you may want to undo, with recurrent_states_to_keep "
            "at least the number of its tokens you may remove (None: all of them).")

    def _select(self, fn) -> None:
        for layer in self.layers:
            layer._select(fn)
        for name in self.SHARED:
            if getattr(self, name) is not None:
                setattr(self, name, _select_into(getattr(self, name), fn))
        self._history = {}

    def reset(self) -> None:
        """Empty the cache, keeping its buffers (zeroed in place) and their batch size."""
        super().reset()
        self._set_length(0)
        for name in self.SHARED:
            if getattr(self, name) is not None:
                getattr(self, name).zero_()
        self.deactivate_past_recording()


@dataclass
class MTPStats:
    """Counters of one `generate(..., use_mtp=True)` call, also left on the model as `model.last_mtp_stats`."""

    drafted: int = 0  # drafts compared with the main head's choice
    accepted: int = 0  # drafts the main head agreed with (emitted without a forward of their own)
    verify_steps: int = 0  # forwards that fed drafts
    rollbacks: int = 0  # forwards whose rejected drafts were cropped from the cache
    withheld: int = 0  # steps whose drafting the confidence gate stopped
    forwards: int = 0  # model forwards, prefill included

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


@dataclass
class SpikeWhaleGenerateOutput(GenerateDecoderOnlyOutput):
    """`generate(..., use_mtp=True, return_dict_in_generate=True)`: transformers' output plus `MTPStats`' rate."""

    if CACHE_FIELD != "cache":  # transformers < 5.24: `out.cache` reads the field under its old name
        cache = property(lambda self: self.past_key_values)
    mtp_acceptance_rate: float | None = None
    mtp_drafted_tokens: int | None = None
    mtp_accepted_tokens: int | None = None


def _effective_generation_config(model, generation_config: GenerationConfig | None, kwargs: dict) -> GenerationConfig:
    """The values `generate` will use, for the checks made before any work; not transformers' own merge, which fills
    the defaults meant for an assistant model (0.4, 20) that MTP tells apart from unset."""
    eff = copy.deepcopy(generation_config) if generation_config is not None else GenerationConfig()
    eff.update(**model.generation_config.to_dict(), defaults_only=True, allow_custom_entries=True)
    eff.update(**{k: v for k, v in kwargs.items() if hasattr(eff, k)})
    caller_length_wins(eff, generation_config, kwargs)
    for name, default in (("max_length", 20), ("do_sample", False), ("num_beams", 1), ("use_cache", True)):
        if getattr(eff, name, None) is None:
            setattr(eff, name, default)  # not `update`, which validates (and warns) before generate does
    return eff


def caller_length_wins(config: GenerationConfig, passed: GenerationConfig | None, kwargs: dict) -> GenerationConfig:
    """A caller's `max_length` (argument or passed config) without a `max_new_tokens` of its own drops the serving
    default `max_new_tokens`, silently, as with in-library models. Edits and returns `config`."""
    caller = {n: kwargs.get(n) is not None or getattr(passed, n, None) is not None
              for n in ("max_length", "max_new_tokens")}
    if caller["max_length"] and not caller["max_new_tokens"]:
        config.max_new_tokens = None
    return config


def _prompt_width(ids, embeds, mask, bos_id) -> int:
    """The prompt's width, once the shapes `generate` cannot work with are refused with what to pass instead."""
    if ids is not None and (not isinstance(ids, torch.Tensor) or ids.dim() != 2):
        got = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"input_ids must be a [batch, seq] tensor, got {got}.")
    if ids is not None and ids.shape[1] == 0 and embeds is None:
        raise ValueError(f"input_ids is empty (shape {tuple(ids.shape)}): generate needs at least one prompt token; "
                         f"start from the <bos> id, e.g. input_ids=torch.tensor([[{bos_id}]]).")
    if embeds is not None and (embeds.dim() != 3 or embeds.shape[1] == 0):
        raise ValueError(f"inputs_embeds must be [batch, seq >= 1, hidden], got {tuple(embeds.shape)}.")
    ref = ids if ids is not None and ids.shape[1] else embeds
    expected = tuple(ref.shape[:2]) if ref is not None else None
    if mask is not None and (mask.dim() != 2 or (expected is not None and tuple(mask.shape) != expected)):
        raise ValueError(f"attention_mask has shape {tuple(mask.shape)} but the prompt is {expected}: pass a 2D "
                         "[batch, seq] padding mask (1 = real token), one entry per prompt token (a tokenizer's mask).")
    return expected[1] if expected is not None else mask.shape[1] if mask is not None else 1


_PROCESSOR_FIELDS = {  # the library processors `generate` builds from a config field
    "RepetitionPenaltyLogitsProcessor": "repetition_penalty", "SuppressTokensLogitsProcessor": "suppress_tokens",
    "SuppressTokensAtBeginLogitsProcessor": "begin_suppress_tokens", "NoBadWordsLogitsProcessor": "bad_words_ids",
    "NoRepeatNGramLogitsProcessor": "no_repeat_ngram_size", "SequenceBiasLogitsProcessor": "sequence_bias",
    "TemperatureLogitsWarper": "temperature", "TopKLogitsWarper": "top_k", "TopPLogitsWarper": "top_p",
    "MinPLogitsWarper": "min_p", "TypicalLogitsWarper": "typical_p",
}
_SAMPLING_NEUTRAL = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "typical_p": 1.0, "min_p": None,
                     "epsilon_cutoff": 0.0, "eta_cutoff": 0.0}  # the sampling fields with their "off" values


def _as_assistant_call(generation_config: GenerationConfig, kwargs: dict) -> tuple[GenerationConfig, dict]:
    """transformers' assisted decoding calls a draft model with the main call's merged config, length arguments and
    built processors (four warnings): fold the arguments into the config, turn off the sampling flags a greedy draft
    ignores and drop the library processors the config builds again. The same draft, no warnings."""
    config = copy.deepcopy(generation_config)
    if not config.do_sample:
        config.update(**_SAMPLING_NEUTRAL)  # fields this transformers lacks are left out
    kwargs = config.update(**kwargs)
    if kwargs.get("logits_processor") is not None:
        kwargs["logits_processor"] = LogitsProcessorList(p for p in kwargs["logits_processor"] if not (
            type(p).__module__.startswith("transformers.generation.")
            and getattr(config, _PROCESSOR_FIELDS.get(type(p).__name__, ""), None) is not None))
    return config, kwargs


class GreedyVocabIndex:
    """Prefix search over the tokens of a greedy longest-match tokenizer (`greedy_vocab`: text -> id)."""

    def __init__(self, vocab: dict[str, int]):
        self.vocab, self.max_len, self.text_of = vocab, max(map(len, vocab)), {i: t for t, i in vocab.items()}
        self.sorted_texts = sorted(vocab)
        self.sorted_ids = [vocab[t] for t in self.sorted_texts]

    def extending(self, text: str) -> list[int]:
        """Ids of the tokens that start with `text` (itself included)."""
        lo = bisect_left(self.sorted_texts, text)
        return self.sorted_ids[lo:bisect_left(self.sorted_texts, text + "\U0010ffff", lo)]

    def longest_prefix(self, text: str) -> int:
        """Id of the longest token `text` starts with: what greedy matching takes at its start."""
        return next(self.vocab[text[:n]] for n in range(min(len(text), self.max_len), 0, -1) if text[:n] in self.vocab)


def first_unstable_token(pieces: list[str], index: GreedyVocabIndex) -> int:
    """The first piece of a greedy tokenization that more text could change: the smallest i such that a token strictly
    extends the text from piece i on (greedy matching takes the longest token), len(pieces) if none."""
    first, rest = len(pieces), ""
    for i in range(len(pieces) - 1, -1, -1):
        rest = pieces[i] + rest
        if len(rest) >= index.max_len:
            break
        if len(index.extending(rest)) > (rest in index.vocab):
            first = i
    return first


class HealedTailLogitsProcessor(LogitsProcessor):
    """Until the new tokens have spelled the tail R that healing dropped, allow only what greedy matching could take:
    the longest token the rest of R starts with, or one that starts with all of it (crossing the prompt's end)."""

    def __init__(self, tails: list[str], prompt_length: int, index: GreedyVocabIndex):
        self.tails, self.prompt_length, self.index = tails, prompt_length, index
        self.longest = max(map(len, tails), default=0)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if input_ids.shape[1] - self.prompt_length >= self.longest:  # each token spells a character of the tail
            return scores
        allowed = torch.ones_like(scores, dtype=torch.bool)
        for row, (rest, _) in enumerate(self.spelled(input_ids)):
            if rest:
                allowed[row] = False
                allowed[row, [self.index.longest_prefix(rest), *self.index.extending(rest)]] = True
        return scores.masked_fill(~allowed, -float("inf"))

    def spelled(self, input_ids: torch.LongTensor) -> list[tuple[str, int]]:
        """Per row: what is left of its prompt's tail after the new tokens, and how many of them spelled it."""
        per_prompt, out = input_ids.shape[0] // len(self.tails), []  # beams and return sequences repeat each prompt
        for row, generated in enumerate(input_ids[:, self.prompt_length:].tolist()):
            rest, spent = self.tails[row // per_prompt], 0
            while rest and spent < len(generated):
                text = self.index.text_of.get(generated[spent])
                # A token off the tail (a finished row's padding) ends the constraint as covering the tail does.
                rest = rest[len(text):] if text is not None and rest.startswith(text) else ""
                spent += 1
            out.append((rest, spent))
        return out


class MaxNewTokensAfterHealedTail(StoppingCriteria):
    """A row is done with `max_new_tokens` tokens after those that spell its healed tail again: the tail is prompt."""

    def __init__(self, healing: HealedTailLogitsProcessor, max_new_tokens: int):
        self.healing, self.max_new_tokens = healing, max_new_tokens

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        new = input_ids.shape[1] - self.healing.prompt_length
        done = [not rest and new - spent >= self.max_new_tokens for rest, spent in self.healing.spelled(input_ids)]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


def _heal_prompt(ids: torch.Tensor, mask: torch.Tensor | None, tokenizer):
    """`token_healing=True`: each row loses its tail from the first token more text could re-tokenize (never its first
    token, nor a special token or what precedes one); the processor returned with the left-padded rows and their mask
    makes the first new tokens spell it again, so they may cross the prompt's end (`' wh', 'o'` -> `' who '`)."""
    if tokenizer is None:
        raise ValueError("token_healing=True needs the prompt's tokenizer: pass tokenizer=... to generate.")
    if getattr(tokenizer, "greedy_vocab", None) is None:
        raise ValueError("token_healing=True re-spells the prompt's tail with the tokens of a greedy longest-match "
                         f"tokenizer (`tokenizer.greedy_vocab`), which {type(tokenizer).__name__} does not have: pass "
                         "this model's SpikeTokenizer/SpikeTokenizerFast, or token_healing=False.")
    index = GreedyVocabIndex(tokenizer.greedy_vocab)
    real = mask.bool() if mask is not None else torch.ones_like(ids, dtype=torch.bool)
    rows, tails = [], []
    for row, keep in zip(ids.tolist(), real.tolist()):
        tokens = [t for t, k in zip(row, keep) if k]
        start = len(tokens)
        while start > 1 and tokens[start - 1] in index.text_of:  # the text after the last special token
            start -= 1
        cut = start + first_unstable_token([index.text_of[t] for t in tokens[start:]], index)
        rows.append(tokens[:cut])
        tails.append("".join(index.text_of[t] for t in tokens[cut:]))
    if not any(tails):
        return ids, mask, HealedTailLogitsProcessor(tails, ids.shape[-1], index)
    width = max(map(len, rows))
    new_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(r)) + r for r in rows], dtype=ids.dtype)
    new_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return new_ids.to(ids.device), new_mask.to(ids.device), HealedTailLogitsProcessor(tails, width, index)


def spike_whale_generate(model, parent_generate, inputs=None, generation_config=None, **kwargs):
    """`SpikeWhaleGenerationMixin.generate` on the model; `parent_generate` is transformers' own."""
    if getattr(generation_config, "is_assistant", False):
        generation_config, kwargs = _as_assistant_call(generation_config, kwargs)
    own = ("use_mtp", "truncate_to_context", "mtp_draft_tokens")  # arguments transformers does not know
    use_mtp, truncate, draft_tokens = (kwargs.pop(name, None) for name in own)
    eff = _effective_generation_config(model, generation_config, kwargs)
    if getattr(eff, "use_mtp", None):
        # The library's own MTP path (DeepSeek-V3's layout, refusing stateful models) must never see it: ours is below.
        generation_config = copy.deepcopy(model.generation_config if generation_config is None else generation_config)
        generation_config.use_mtp = False
        use_mtp = True if use_mtp is None else use_mtp

    ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
    embeds, mask = kwargs.get("inputs_embeds"), kwargs.get("attention_mask")
    if "cache" in kwargs and CACHE_FIELD != "cache":  # transformers < 5.24 carries the cache as past_key_values
        kwargs[CACHE_FIELD] = kwargs.pop("cache")
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    past = cache.get_seq_length() if cache is not None else 0
    width = _prompt_width(ids, embeds, mask, model.config.bos_token_id)
    new_tokens = eff.max_new_tokens if eff.max_new_tokens is not None else eff.max_length - width
    if past and past >= width:  # nothing new to feed: transformers would feed the whole prompt again on top of it
        raise ValueError(f"The cache passed in already holds {past} positions, as many as the prompt ({width}); to "
                         "continue a conversation pass the full ids (previous turns + the new tokens) together with "
                         "the returned cache.")

    if ids is not None and getattr(eff, "token_healing", False):
        if past:
            raise ValueError(f"token_healing=True re-tokenizes the prompt's end, but the cache passed in holds {past} "
                             "of its positions: continue with token_healing=False, or heal from a fresh cache.")
        healed_ids, healed_mask, healing = _heal_prompt(ids, mask, kwargs.get("tokenizer"))
        kwargs["logits_processor"] = LogitsProcessorList([*(kwargs.get("logits_processor") or []), healing])
        fields = {"token_healing": False}  # transformers' own healing would undo ours
        if healed_ids is not ids:  # the tail spelled again is prompt: each row gets `new_tokens` tokens after it
            kwargs["stopping_criteria"] = StoppingCriteriaList(
                [*(kwargs.get("stopping_criteria") or []), MaxNewTokensAfterHealedTail(healing, new_tokens)])
            kwargs.pop("max_length", None)
            new_tokens += int(((mask.sum(-1) if mask is not None else width) - healed_mask.sum(-1)).max())
            fields["max_new_tokens"] = eff.max_new_tokens = new_tokens
        if generation_config is None:  # settings go where the call carries them (transformers warns on a mix)
            kwargs.update(fields)
        else:
            generation_config = copy.deepcopy(generation_config)
            generation_config.update(**fields)
            kwargs = {k: v for k, v in kwargs.items() if k not in fields}
        ids, mask, width = healed_ids, healed_mask, healed_ids.shape[-1]

    limit = model.config.max_position_embeddings
    where = f"this model's context window (max_position_embeddings={limit})"
    if isinstance(cache, SpikeWhaleCache) and cache.max_cache_len < limit:
        limit, where = cache.max_cache_len, f"the SpikeWhaleCache passed in (max_cache_len={cache.max_cache_len})"
    if new_tokens > 0 and width + new_tokens > limit:
        asked = (f"max_new_tokens={new_tokens}" if eff.max_new_tokens is not None
                 else f"max_length={eff.max_length} ({new_tokens} new tokens)")
        if new_tokens >= limit:
            raise ValueError(f"{asked} alone does not fit {where}: even a one-token prompt would need "
                             f"{new_tokens + 1} positions. Ask for at most {limit - 1} new tokens.")
        if not truncate:
            raise ValueError(
                f"The prompt is {width} tokens and {asked}: {width + new_tokens} positions, more than {where} "
                f"(spike_whale never wraps positions or silently drops context). Shorten the prompt to at most "
                f"{limit - new_tokens} tokens, ask for at most {max(limit - width, 0)} new tokens, or pass "
                "truncate_to_context=True to drop the oldest prompt tokens (keeping <bos>).")
        if ids is None:
            raise NotImplementedError("truncate_to_context=True drops the oldest input_ids, not inputs_embeds.")
        if past:
            raise ValueError("truncate_to_context=True cannot drop tokens that the cache passed in holds; start from a "
                             "fresh cache (cache=None) with the truncated conversation instead.")
        # Keep the newest limit - new_tokens columns; a row that started with <bos> and lost tokens gets it back.
        drop, bos = width + new_tokens - limit, model.config.bos_token_id
        real = mask.bool() if mask is not None else torch.ones_like(ids, dtype=torch.bool)
        first, lost = ids.gather(1, real.long().argmax(1, keepdim=True))[:, 0], real[:, :drop].any(1)
        ids, mask = ids[:, drop:].clone(), mask[:, drop:] if mask is not None else None
        if bos is not None:
            ids[lost & (first == bos), 0] = bos
        logger.warning(f"truncate_to_context=True: dropped the oldest {drop} of {width} prompt tokens so that the "
                       f"prompt plus {new_tokens} new tokens fits {where}.")
        kwargs.pop("position_ids", None)
    if mask is not None:
        kwargs["attention_mask"] = mask

    # Assisted decoding crops the cache after each verification: transformers < 5.24 without recording first, >= 5.25
    # recording the first round's draft count, which "heuristic" schedules outgrow; a round drafts at most new_tokens.
    assistant = kwargs.get("assistant_model")
    if (assistant is not None or getattr(eff, "prompt_lookup_num_tokens", None)) and eff.use_cache \
            and cache is None and eff.cache_implementation is None:
        cache = kwargs[CACHE_FIELD] = SpikeWhaleCache(model.config)
        if CACHE_FIELD != "cache" and not eff.prefill_chunk_size:
            cache.activate_past_recording()
    schedule = getattr(getattr(assistant, "generation_config", None), "num_assistant_tokens_schedule", None)
    if schedule in ("heuristic", "heuristic_transient") and isinstance(cache, SpikeWhaleCache):
        cache.min_states_to_keep = max(new_tokens, 0)

    if use_mtp:
        # Unset (`_effective_generation_config`): no gate and one draft per MTP head.
        heads, threshold = len(getattr(model, "mtp_heads", ())), eff.assistant_confidence_threshold
        threshold = 0.0 if threshold is None else threshold
        name = "mtp_draft_tokens" if draft_tokens is not None else "num_assistant_tokens"
        count = draft_tokens if draft_tokens is not None else eff.num_assistant_tokens
        count = heads if count is None else count
        for refused, error, message in (
            (kwargs.get("custom_generate") is not None, ValueError,
             "use_mtp=True runs spike_whale's own decoding loop; it cannot be combined with custom_generate."),
            (assistant is not None, ValueError,
             "use_mtp=True drafts with the model's own MTP head; do not pass an assistant_model."),
            (eff.num_beams != 1, NotImplementedError, "use_mtp=True implements greedy and sampling self-speculative "
             f"decoding (num_beams=1); got num_beams={eff.num_beams}. Drop num_beams or use_mtp."),
            (not heads, ValueError, "use_mtp=True needs an MTP head, but this config has num_nextn_predict_layers=0."),
            (not eff.use_cache, ValueError,
             "use_mtp=True verifies drafts against the cache and rolls it back; it needs use_cache=True."),
            (isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold <= 1,
             ValueError, f"assistant_confidence_threshold={threshold!r}: use_mtp=True drafts only when the MTP head's "
             "top probability is above it, so it must be a number in [0, 1] (0 drafts every step, 1 never drafts)."),
            (isinstance(count, bool) or not isinstance(count, int) or count < 1, ValueError,
             f"{name}={count!r}: use_mtp=True drafts that many tokens per step (MTP head k drafts the k-th, the first "
             f"head chained drafts those past this model's {heads} MTP head(s)), so it must be an int >= 1."),
        ):
            if refused:
                raise error(message)
        kwargs.update(custom_generate=mtp_speculative_generate, mtp_streamer=kwargs.pop("streamer", None),
                      mtp_confidence_threshold=float(threshold), mtp_draft_tokens=count)
    elif draft_tokens is not None:
        raise ValueError("mtp_draft_tokens only applies with use_mtp=True.")
    return parent_generate(ids, generation_config=generation_config, **kwargs)


def mtp_speculative_generate(model, input_ids: torch.LongTensor, logits_processor, stopping_criteria,
                             generation_config: GenerationConfig, mtp_streamer=None, mtp_draft_tokens: int = 1,
                             mtp_confidence_threshold: float = 0.0, **model_kwargs):
    """`generate(use_mtp=True)` (a `custom_generate`) with plain decoding's greedy ids or sampling law. A forward feeds
    the pending token and K drafts (head k drafts k places on; past the heads y_{k+1} = head_1(norm(y_k))); the main
    head's choices are emitted as in `_sample` while they equal the drafts in every unfinished row, the rest is cropped.
    Greedy drafts take the square root of the repetition penalty (the heads learnt part of it); sampling keeps d ~ q
    with probability min(1, p/q), else draws from norm(max(0, p - q)). The gate (`assistant_confidence_threshold`) stops
    drafting unless every unfinished row's top draft probability is above it: it reads the context only (law kept)."""
    streamer, K, threshold = mtp_streamer, mtp_draft_tokens, mtp_confidence_threshold
    heads, norm, do_sample = model.mtp_heads, model.model.norm, bool(generation_config.do_sample)
    return_dict = generation_config.return_dict_in_generate
    scores = () if return_dict and generation_config.output_scores else None
    raw_logits = () if return_dict and generation_config.output_logits else None
    pad = generation_config._pad_token_tensor if any(hasattr(c, "eos_token_id") for c in stopping_criteria) else None
    unfinished, stats = torch.ones(input_ids.shape[0], dtype=torch.long, device=input_ids.device), MTPStats()
    if streamer is not None:
        streamer.put(input_ids.cpu())

    def padded(tok):  # finished rows get the pad token, as in `_sample`
        return tok if pad is None else tok * unfinished + pad * (1 - unfinished)

    def pick(next_scores, drafted=None, q=None):
        """Greedy: argmax. Sampling: a draw from p, or `drafted` kept with probability min(1, p/q), else redrawn."""
        if not do_sample:
            return next_scores.argmax(-1)
        p = torch.softmax(next_scores, dim=-1)
        if drafted is None:
            return torch.multinomial(p, num_samples=1).squeeze(1)
        p_d, q_d = p.gather(1, drafted[:, None]).squeeze(1), q.gather(1, drafted[:, None]).squeeze(1)
        keep = torch.rand(p_d.shape, device=p.device) * q_d < p_d
        residual = (p - q).clamp_min(0)
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
        return torch.where(keep, drafted, torch.multinomial(residual, num_samples=1).squeeze(1))

    def emit(next_logits, drafted=None, q=None):  # one step of `_sample`
        nonlocal input_ids, unfinished, scores, raw_logits
        next_logits = next_logits.to(copy=True, dtype=torch.float32, device=input_ids.device)
        next_scores = logits_processor(input_ids, next_logits)
        if scores is not None:
            scores += (next_scores,)
        if raw_logits is not None:
            raw_logits += (next_logits,)
        tok = padded(pick(next_scores, drafted, q))
        input_ids = torch.cat([input_ids, tok[:, None]], dim=-1)
        if streamer is not None:
            streamer.put(tok.cpu())
        unfinished = unfinished & ~stopping_criteria(input_ids, scores)
        return tok

    # Sampled drafts see the library's own (stateless) processors, so that q is close to the processed p; a caller's
    # processors run on emitted tokens only, as in plain decoding (they may keep state).
    library = [p for p in logits_processor if type(p).__module__.startswith("transformers.generation.")]
    penalties = [copy.copy(p) for p in logits_processor if isinstance(p, RepetitionPenaltyLogitsProcessor)]
    for p in penalties:
        p.penalty **= 0.5
    draft_processor = LogitsProcessorList(library if do_sample else penalties)

    def draft(draft_logits, k):
        """Up to k drafts [B, k'] from draft logits [B, K, V] (fewer where the gate stops) and their distributions."""
        ctx, dists = input_ids, []
        for i in range(k):
            next_scores = draft_processor(ctx, draft_logits[:, i].float())
            dist = torch.softmax(next_scores, dim=-1) if do_sample or threshold > 0 else None
            if threshold > 0 and not bool(((dist.amax(-1) > threshold) | (unfinished == 0)).all()):
                stats.withheld += 1
                break
            d = padded(torch.multinomial(dist, num_samples=1).squeeze(1) if do_sample else next_scores.argmax(-1))
            dists.append(dist)
            ctx = torch.cat([ctx, d[:, None]], dim=-1)
        return ctx[:, input_ids.shape[1]:], dists

    cache, embeds = model_kwargs.get(CACHE_FIELD), model_kwargs.get("inputs_embeds")
    past = cache.get_seq_length() if cache is not None else 0
    prompt = {"inputs_embeds": embeds[:, past:]} if embeds is not None else {"input_ids": input_ids[:, past:]}
    no_logits = torch.empty(0, dtype=torch.long, device=input_ids.device)  # made below, with the drafts' logits
    feed, drafts, dists = {**prompt, "attention_mask": model_kwargs.get("attention_mask")}, input_ids[:, :0], []
    try:
        while True:  # the prefill, then steps of the pending token and its drafts
            out = model(**feed, cache=cache, use_cache=True, logits_to_keep=no_logits)
            if not stats.forwards:  # after the prefill: a step's crop removes at most its K drafts
                cache = getattr(out, CACHE_FIELD)
                cache.activate_past_recording(recurrent_states_to_keep=K)
            k = drafts.shape[1]
            stats.forwards, stats.verify_steps = stats.forwards + 1, stats.verify_steps + int(k > 0)
            # One lm_head product: main logits [B, k + 1, V] at the fed places, draft logits [B, k + 1, K, V] from each.
            h = out.last_hidden_state[:, -(k + 1):]
            states = [heads[i](h) for i in range(min(K, len(heads)))]
            while len(states) < K:
                states.append(heads[0](norm(states[-1])))
            both = model.lm_head(torch.cat([h, torch.stack(states, 2).flatten(1, 2)], 1))
            logits, draft_logits = both[:, :k + 1], both[:, k + 1:].unflatten(1, (k + 1, K))
            for j in range(k + 1):  # the main head's choice after each fed token, while it equals the draft
                tok = emit(logits[:, j], *((drafts[:, j], dists[j]) if j < k else ()))
                if j == k or unfinished.max() == 0:
                    break
                stats.drafted += 1
                if not bool(((tok == drafts[:, j]) | (unfinished == 0)).all()):
                    stats.rollbacks += 1
                    break
                stats.accepted += 1
            cache.crop(j - k)  # drop the drafts after the last emitted token (crop(0) only trims the records)
            if unfinished.max() == 0:
                break
            cur = input_ids.shape[1]  # the cache holds cur - 1 positions; `tok` (the last id) is pending
            k = max(0, min(K, generation_config.max_length - cur - 1, cache.max_cache_len - cur))
            drafts, dists = draft(draft_logits[:, j], k)  # from the place of the last emitted token
            feed = {"input_ids": torch.cat([tok[:, None], drafts], 1)}
    finally:
        if stats.forwards:
            cache.deactivate_past_recording()
    if streamer is not None:
        streamer.end()
    model.last_mtp_stats = stats
    if not return_dict:
        return input_ids
    return SpikeWhaleGenerateOutput(sequences=input_ids, scores=scores, logits=raw_logits, **{CACHE_FIELD: cache},
                                    mtp_acceptance_rate=stats.acceptance_rate, mtp_drafted_tokens=stats.drafted,
                                    mtp_accepted_tokens=stats.accepted)


def compile_blocker(model) -> str | None:
    """Why `compile_decode` cannot compile this model's decode steps, or None."""
    if model.config.use_elo:
        return "Elo attention keeps per-key ratings"
    if model.config.use_moe:
        return "MoE layers route by token id"
    if any(hasattr(layer, "_hf_hook") for layer in model.layers):
        return "accelerate hooks move tensors between devices"
    if any("forward" in vars(layer.attn) for layer in model.layers):
        return "a wrapper of the attention's forward (a tensor-parallel style) must run outside the compiled graph"
    return None


def compiled_decode_guards(entries) -> list[bool]:
    """The dynamo guards `compile_decode` keeps: all but those on built-in modules and on parameter tensors (their
    metadata too, for tensor subclasses such as int8), which change only when the model is moved or re-typed
    (checked by `_decode_step_compiles`) or its weights replaced."""
    return [not (e.orig_guard.source.is_unspecialized_builtin_nn_module()
                 or (e.guard_type in ("TENSOR_MATCH", "TENSOR_SUBCLASS_METADATA_MATCH", "EQUALS_MATCH")
                     and "._parameters[" in e.name)) for e in entries]


def compile_walk(walk_run, options: dict, compile_kwargs: dict):
    """The model's `walk_run` through `torch.compile`; the blocks' Python floats (eps, ...) are traced as constants."""
    compiled = torch.compile(walk_run, options=options, **compile_kwargs)
    return torch._dynamo.config.patch(specialize_float=True)(compiled)


def decode_compile_options(model, compile_kwargs: dict) -> tuple[dict, dict]:
    """(inductor options, torch.compile kwargs) of a compiled decode walk: dynamic shapes, `compiled_decode_guards`, no
    per-call asserts (the guards pin sizes and strides), `mode` as options, CUDA graphs only on CUDA."""
    reason = compile_blocker(model)
    if reason is not None:
        raise ValueError(f"compile_decode() cannot compile this model's decode steps because {reason}; they run "
                         "eagerly. Generate without it.")
    compile_kwargs = {"dynamic": True, **compile_kwargs}
    options = {"guard_filter_fn": compiled_decode_guards, "size_asserts": False, "alignment_asserts": False,
               "scalar_asserts": False}
    options.update(torch._inductor.list_mode_options(compile_kwargs.pop("mode", None) or "default",
                                                     compile_kwargs["dynamic"]))
    if model.device.type != "cuda":
        options.pop("triton.cudagraphs", None)
    options.update(compile_kwargs.pop("options", None) or {})
    return options, compile_kwargs


class SpikeWhaleGenerationMixin(GenerationMixin):
    """transformers' `GenerationMixin` on the loop-slot cache: the cache is created before the prefill, a caller's
    `max_length` wins over the default `max_new_tokens`, and `compile_config` compiles the decode walk."""

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False

    def _prepare_generation_config(self, generation_config=None, *args, **kwargs):
        config, model_kwargs = super()._prepare_generation_config(generation_config, *args, **kwargs)
        return caller_length_wins(config, generation_config, kwargs), model_kwargs

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """A `SpikeWhaleCache` before the prefill: "static" sized to this call (args[2]: the positions transformers
        counts it feeding, + 1; else `max_length`) or `max_cache_len` if larger, else to the context window."""
        impl = generation_config.cache_implementation
        if model_kwargs.get(CACHE_FIELD) is not None or generation_config.use_cache is False:
            return super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        if impl not in (None, "static", "dynamic", "dynamic_full"):  # "dynamic_full": no sliding layers, never had here
            raise NotImplementedError(
                f"cache_implementation={impl!r} is not available for spike_whale: no generic (offloaded, quantized, "
                'sliding) cache holds its per-loop-slot K/V, Memory-Cache and Engram state. Use "static" or "dynamic".')
        fed = kwargs.get("max_cache_length", args[2] if len(args) > 2 else None)
        length = fed + 1 if fed is not None else generation_config.max_length or 0
        size = max(length, getattr(generation_config, "max_cache_len", None) or 0, 1) if impl == "static" else None
        cache = model_kwargs[CACHE_FIELD] = SpikeWhaleCache(
            self.config, max_cache_len=min(size, self.config.max_position_embeddings) if size else None)
        if getattr(generation_config, "is_assistant", False):  # a draft model's candidates get rolled back
            cache.activate_past_recording(getattr(generation_config, "num_assistant_tokens", None))

    def _valid_auto_compile_criteria(self, model_kwargs, generation_config) -> bool:
        """An explicit `compile_config` compiles on any device (CPU included); without one, as in-library, a static
        cache on an accelerator does. Never where `compile_blocker` objects."""
        if generation_config.disable_compile or not isinstance(model_kwargs.get(CACHE_FIELD), SpikeWhaleCache):
            return super()._valid_auto_compile_criteria(model_kwargs, generation_config)
        reason = compile_blocker(self.model)
        if reason is not None:
            if generation_config.compile_config is not None:
                logger.warning_once(f"compile_config is ignored: decode steps run eagerly because {reason}.")
            return False
        return generation_config.compile_config is not None or (
            generation_config.cache_implementation == "static"
            and super()._valid_auto_compile_criteria(model_kwargs, generation_config))

    def create_masks_for_generate(self, attention_mask=None, inputs_embeds=None, **kwargs):
        """Only the chunk's mask columns: earlier keys' validity is cached; a fixed width keeps one compiled graph."""
        if attention_mask is None or inputs_embeds is None:
            return attention_mask
        return attention_mask[:, -inputs_embeds.shape[1]:]

    def get_compiled_call(self, compile_config):
        """`generate(..., compile_config=...)`: compiles the one-token decode step per loop-plan run (`compile_decode`)
        rather than the whole forward, which would unroll every slot of every pass into one graph."""
        config = compile_config.to_dict() if compile_config is not None else {}
        if config != getattr(self, "_decode_compile_config", None) or self.model._compiled_for is None:
            kwargs = {k: v for k, v in config.items() if k in ("fullgraph", "backend", "mode", "options")
                      or (k == "dynamic" and v is not None)}
            self.compile_decode(**kwargs)
            self._decode_compile_config = config
        return self.__call__

    def generate(self, inputs: torch.Tensor | None = None, generation_config=None, **kwargs):
        """`GenerationMixin.generate` on the loop-slot cache (`spike_whale_generate`), inputs checked before any work: a
        prompt past the context raises (`truncate_to_context=True` drops its oldest tokens); `token_healing` re-spells
        its tail; `use_mtp=True` decodes MTP self-speculatively, ids identical to greedy (`mtp_draft_tokens`,
        `assistant_confidence_threshold`); `cache=out.cache` with the full ids continues a conversation."""
        return spike_whale_generate(self, super().generate, inputs, generation_config, **kwargs)

    def compile_decode(self, enable: bool = True, **compile_kwargs) -> None:
        """Run one-token decode steps through `torch.compile(**compile_kwargs)`: one graph of `walk_run` (a loop pass;
        the weights are shared) serves every pass and step; other chunks run the same walk eagerly. Parameter guards
        are skipped, so moving or re-typing the model raises until this is called again. `enable=False`: eager."""
        model = self.model
        if not enable:
            model._compiled_run, model._compiled_for = None, None
            return
        model._compiled_run = compile_walk(model.walk_run, *decode_compile_options(model, compile_kwargs))
        model._compiled_for = (model.embed_tokens.weight.dtype, model.embed_tokens.weight.device)
