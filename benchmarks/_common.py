"""Helpers shared by the decode benchmarks (bench_decode.py, bench_speed.py, bench_ab.py): the 114M spike_whale preset
and its in-library Llama anchor with random weights, decode timing through `model.generate`, and the CPU's
description."""

from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path

import torch

from spike_whale import SpikeWhaleConfig, SpikeWhaleForCausalLM

PRESET = "byrne-100m-ultra-mc"


def cpu_info() -> dict:
    """CPU model, the vector and native-bf16 flags (avx512_bf16, AMX) and the last-level cache size."""
    flags, model = set(), platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
            elif line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    l3 = None
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            if (index / "level").read_text().strip() == "3":
                l3 = (index / "size").read_text().strip()
        except OSError:
            continue
    return {
        "model": model, "avx512_bf16": "avx512_bf16" in flags, "amx_bf16": "amx_bf16" in flags,
        "amx_int8": "amx_int8" in flags, "avx512f": "avx512f" in flags, "avx512_vnni": "avx512_vnni" in flags,
        "avx2": "avx2" in flags,
        "l3": l3, "cpu_count": os.cpu_count(),
    }


def llama_config(sw_cfg: SpikeWhaleConfig):
    """The anchor: the looped stack unrolled, 48 layers, hidden 768, 12/2 heads of 64, FFN 2048, tied embeddings."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=sw_cfg.vocab_size, hidden_size=768, num_hidden_layers=48, num_attention_heads=12,
        num_key_value_heads=2, head_dim=64, intermediate_size=2048,
        max_position_embeddings=sw_cfg.max_position_embeddings, tie_word_embeddings=True, bos_token_id=2,
        eos_token_id=3, pad_token_id=0,
    )


def build_models(seed: int = 0, max_position_embeddings: int | None = None):
    """(spike_whale 114M, Llama anchor), float32, eval, random weights. max_position_embeddings widens the
    context window of both (the preset's is 1024) for long prefills; parameters are unchanged."""
    import transformers
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    overrides = {"max_position_embeddings": max_position_embeddings} if max_position_embeddings else {}
    sw_cfg = SpikeWhaleConfig.from_preset(PRESET, **overrides)
    spike = SpikeWhaleForCausalLM(sw_cfg).eval()
    torch.manual_seed(seed)
    llama = LlamaForCausalLM(llama_config(sw_cfg)).eval()
    transformers.logging.set_verbosity_error()
    return spike, llama


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


class _Clock:
    """Pass-through logits processor recording when each decode step's logits arrive."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def time_generate(model, ids: torch.Tensor, new_tokens: int, use_cache: bool = True, **kw) -> dict:
    """Greedy `generate` of exactly `new_tokens`; decode tok/s over the steps after the first logits (prefill
    excluded, generate's per-step overhead included). `step_s`: each decode step's seconds (a compiled twin's
    slowest first step is where it is traced and compiled)."""
    from transformers import LogitsProcessorList

    clock = _Clock()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=False, use_cache=use_cache, logits_processor=LogitsProcessorList([clock]), pad_token_id=0, **kw,
        )
    assert out.shape[1] == ids.shape[1] + new_tokens
    steps = len(clock.times) - 1
    decode_s = clock.times[-1] - clock.times[0]
    return {
        "prefill_s": clock.times[0] - t0,
        "step_s": [b - a for a, b in zip(clock.times, clock.times[1:])],
        "decode_s": decode_s,
        "decode_steps": steps,
        "decode_tok_s": steps * ids.shape[0] / decode_s if steps else float("nan"),
        "ms_per_step": 1000 * decode_s / steps if steps else float("nan"),
        "ids": out,
    }


def median_rows(rows: list[dict]) -> dict:
    out = {k: v for k, v in rows[0].items() if k not in ("ids", "step_s")}
    for key in ("prefill_s", "decode_s", "decode_tok_s", "ms_per_step"):
        out[key] = statistics.median(r[key] for r in rows)
    out["runs"] = len(rows)
    out["decode_tok_s_all_runs"] = [round(r["decode_tok_s"], 3) for r in rows]
    return out
