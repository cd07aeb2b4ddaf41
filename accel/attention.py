"""One-query softmax attention for CPU decode steps, registered with transformers' `AttentionInterface`.

`cpu_decode_attention` is softmax(q·kᵀ·scaling + mask)·v for the few queries of a decode step or a verify chunk,
each KV head's query group read at once (no K/V repeat, where transformers' SDPA path copies every K/V head for its
group under a mask), with bf16 and float16 read in float32 and rounded once (oneDNN's bf16 batched GEMM of these
few-row shapes builds a new kernel for every cache length). Longer chunks go to SDPA. It takes SDPA's boolean mask
(`sdpa_mask` is registered for it), so the model hands it the same mask as SDPA.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "spike_whale_cpu"
FEW_QUERIES = 8  # the longest chunk read by the one-query kernel; longer ones are SDPA's


def cpu_decode_attention(module, query, key, value, attention_mask, scaling: float, dropout: float = 0.0,
                         is_causal: bool | None = None, **kwargs):
    """transformers' attention-function signature: ([B, S, nh, hd], None). attention_mask: boolean
    [B|1, 1, S, N] or None."""
    B, nh, S, hd = query.shape
    if S > FEW_QUERIES or (is_causal and S > 1) or (dropout and module.training) or not query.is_cpu:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    kvh, dtype = key.shape[1], value.dtype
    if dtype in (torch.bfloat16, torch.float16):
        query, key, value = query.float(), key.float(), value.float()
    scores = torch.matmul(query.reshape(B, kvh, nh // kvh * S, hd), key.transpose(-1, -2)) * scaling
    if attention_mask is not None:
        N = scores.shape[-1]
        scores = scores.view(B, kvh, nh // kvh, S, N).masked_fill(~attention_mask[:, :, None], float("-inf"))
        scores = scores.view(B, kvh, -1, N)
    probs = torch.softmax(scores, -1).to(value.dtype)
    out = torch.matmul(probs, value).view(B, nh, S, hd).to(dtype)
    return out.transpose(1, 2), None


def register() -> str:
    """Register the kernel and its mask form (idempotent); returns its name."""
    AttentionInterface.register(NAME, cpu_decode_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
