"""What the command line derives from a config alone: the card's serving generation defaults, written into every
exported folder, and the bytes a full loop-slot cache holds."""

from __future__ import annotations

import math

import torch
from transformers import GenerationConfig

from ..configuration_spike_whale import CHAT_EOS_IDS, RESERVED_IDS, SpikeWhaleConfig
from ..generation_utils import MemoryCacheState


def serving_generation_config(config: SpikeWhaleConfig) -> GenerationConfig:
    """The card's serving defaults: temperature 0.7, top_k 40, repetition penalty 1.3, up to 160 new tokens,
    stopping on `<eos>` or `<|im_end|>`, with the 111 reserved ids never generated."""
    return GenerationConfig(
        do_sample=True, temperature=0.7, top_k=40, repetition_penalty=1.3, max_new_tokens=160,
        bos_token_id=config.bos_token_id, pad_token_id=config.pad_token_id,
        eos_token_id=[i for i in CHAT_EOS_IDS if i < config.vocab_size],
        suppress_tokens=[i for i in RESERVED_IDS if i < config.vocab_size])


def cache_footprint(config: SpikeWhaleConfig, batch_size: int = 1, dtype: torch.dtype = torch.bfloat16,
                    max_cache_len: int | None = None) -> dict[str, int]:
    """Bytes a full `SpikeWhaleCache` holds, computed without allocating: K/V of every slot in `dtype` (`kv`), the
    float32 Memory-Cache state (`memory_cache`, O(segments)), the Engram codes (`engram`), the Elo ratings (`elo`,
    float32 [B, heads, length] per slot) and the padding/length bookkeeping (`bookkeeping`)."""
    P = max_cache_len or config.max_position_embeddings
    slots, B = config.num_loop_slots, batch_size
    item = torch.empty((), dtype=dtype).element_size()
    out = {"kv": 2 * slots * B * config.num_key_value_heads * P * config.head_dim * item, "memory_cache": 0}
    if config.use_memory_cache:
        n_seg = math.ceil(P / config.mc_segment_len)
        shapes = MemoryCacheState.shapes(n_seg, config.mc_num_heads, config.mc_head_dim, config.mc_gate_dim)
        out["memory_cache"] = slots * B * 4 * sum(math.prod(shape) for shape in shapes.values())
    out["engram"] = B * P * config.engram_compress_dim * item if config.use_engram else 0
    out["elo"] = slots * B * config.num_attention_heads * P * 4 if getattr(config, "use_elo", False) else 0
    out["bookkeeping"] = B * P + 2 * B * 8  # key_valid (bool), num_real and mc_segment (int64)
    out["total"] = sum(out.values())
    return out
