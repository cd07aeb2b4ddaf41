"""GGUF export and import for spike_whale, through the `gguf` package (no hand-written GGUF code).

Layout (the released one): architecture `spike_whale`; tensors under their state-dict names; the full config as the
string `spike_whale.config_json`; the tokenizer tokens by id (`tokenizer.ggml.tokens`, each token the latin-1
string of its bytes, so the bytes survive exactly) with `spike_whale.tokenizer.max_token_len`; RoPE cos/sin caches
are not stored and are rebuilt at load with the checkpoint's schedule (fractal stays fractal). The tied head is
stored once (as the embedding).

Storage types: `f16` stores every matrix as F16; `q8_0` stores matrices whose rows are a multiple of 32 as Q8_0
(the rest F16). Always F32: 1-D tensors, buffers (RoPE inv_freq and the Engram hash projections, which must be
loaded, never regenerated) and the Engram compressor that feeds the sign-bit hash. Round-trip bounds per tensor:
f16 max |Δ| <= 0.008, q8_0 <= 0.079 (checked after every export).
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..configuration_spike_whale import SpikeWhaleConfig
from ..modeling_spike_whale import SpikeWhaleForCausalLM
from ..tokenization_spike import (
    BOS_ID, BYTE_OFFSET, CHATML_TEMPLATE, EOS_ID, FIRST_MULTIBYTE_ID, PAD_ID, SPECIAL_START_ID, SPECIAL_TOKENS, UNK_ID,
    VOCAB_SIZE, normalize_vocab_data,
)
from .checkpoint import (
    ROPE_CACHE_RE, TIED_HEAD, Checkpoint, check_config_sizes, complete_rope, config_fields, config_from_dict,
    infer_stage, normalize_state_dict, one_line,
)
from .output_paths import discard, replace_file, staging_file

GGUF_ARCH = "spike_whale"
CONFIG_KEY = f"{GGUF_ARCH}.config_json"
MAX_TOKEN_LEN_KEY = f"{GGUF_ARCH}.tokenizer.max_token_len"
ALGORITHM_KEY = f"{GGUF_ARCH}.tokenizer.algorithm"
TOKENIZER_MODEL = "spike-lengthmax"
ROUND_TRIP_BOUNDS = {"f16": 0.008, "q8_0": 0.079}
# Metadata the writer stores next to the config (GGUF key suffix -> config field); a reader cross-checks them.
METADATA_FIELDS = {
    "context_length": "max_position_embeddings", "embedding_length": "hidden_size", "block_count": "num_hidden_layers",
    "feed_forward_length": "moe_intermediate_size", "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads", "vocab_size": "vocab_size",
}
# Most bytes the RoPE caches of a file's context may take before the file is refused (they are rebuilt, not read).
MAX_ROPE_CACHE_BYTES = 4 << 30
# Inputs of the Engram sign-bit hash: rounding them moves tokens between buckets, so they stay F32.
KEEP_F32 = (re.compile(r"\.engram\.compressor\."),)


def _gguf():
    import gguf

    return gguf


@dataclass
class GGUFReport:
    path: Path
    qtype: str
    tensors: int
    types: dict[str, int]
    max_delta: dict[str, float]
    bound: float
    vocab_ok: bool

    @property
    def worst(self) -> tuple[str, float]:
        name = max(self.max_delta, key=self.max_delta.get)
        return name, self.max_delta[name]


def buffer_names(config: SpikeWhaleConfig) -> set[str]:
    with torch.device("meta"):
        model = SpikeWhaleForCausalLM(config)
    return {n for n, _ in model.named_buffers()}


def storage_type(name: str, tensor: torch.Tensor, qtype: str, buffers: set[str]):
    g = _gguf().GGMLQuantizationType
    if name in buffers or tensor.dim() < 2 or any(p.search(name) for p in KEEP_F32):
        return g.F32
    if qtype == "q8_0" and tensor.shape[-1] % 32 == 0:
        return g.Q8_0
    return g.F16


def config_json(config: SpikeWhaleConfig) -> str:
    """Every SpikeWhaleConfig field (the model's full config; no transformers bookkeeping keys)."""
    fields = config_fields()
    data = {k: v for k, v in config.to_dict().items() if k in fields}
    data["model_type"] = "spike_whale"
    return json.dumps(data, sort_keys=True)


def _token_table(vocab: dict) -> tuple[list[str], list[int]]:
    gguf = _gguf()
    tokens = [""] * VOCAB_SIZE
    for tok, idx in vocab["vocab"].items():
        tokens[idx] = tok
    types = []
    for idx, tok in enumerate(tokens):
        if idx == UNK_ID:
            types.append(gguf.TokenType.UNKNOWN)
        elif idx < BYTE_OFFSET or idx >= SPECIAL_START_ID:
            types.append(gguf.TokenType.CONTROL)
        elif idx < FIRST_MULTIBYTE_ID:
            types.append(gguf.TokenType.BYTE)
        elif tok == "":
            types.append(gguf.TokenType.UNUSED)
        else:
            types.append(gguf.TokenType.NORMAL)
    return tokens, [int(t) for t in types]


def export_tensors(sd: dict[str, torch.Tensor], config: SpikeWhaleConfig) -> dict[str, torch.Tensor]:
    """The tensors a GGUF holds: everything but the RoPE caches and the tied head."""
    out = {}
    for name, t in sd.items():
        if ROPE_CACHE_RE.search(name) or (name == TIED_HEAD and config.tie_word_embeddings):
            continue
        out[name] = t
    return out


def write_gguf(
    ckpt: Checkpoint, out_path: str | os.PathLike, qtype: str = "f16", name: str | None = None, progress: bool = True
) -> GGUFReport:
    """Write `ckpt` as GGUF (`f16` or `q8_0`), re-read it, and check every tensor against the bounds.

    The file is written next to `out_path` under a temporary name and renamed only after the check passes.
    """
    from tqdm import tqdm

    gguf = _gguf()
    if qtype not in ROUND_TRIP_BOUNDS:
        raise ValueError(f"--type must be one of {sorted(ROUND_TRIP_BOUNDS)}, got {qtype!r}")
    if ckpt.vocab is None:
        raise ValueError(f"{ckpt.source}: no tokenizer found next to the checkpoint; pass --tokenizer")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    config = ckpt.config
    tensors = export_tensors(ckpt.state_dict, config)
    buffers = buffer_names(config)
    tmp = staging_file(out_path)
    try:
        writer = gguf.GGUFWriter(tmp, arch=GGUF_ARCH)
        writer.add_type("model")
        writer.add_name(name or f"spike_whale {ckpt.stage or ckpt.source.stem} {qtype}")
        writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q8_0 if qtype == "q8_0" else gguf.LlamaFileType.MOSTLY_F16))
        if qtype == "q8_0":
            writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        writer.add_string(CONFIG_KEY, config_json(config))
        writer.add_context_length(config.max_position_embeddings)
        writer.add_embedding_length(config.hidden_size)
        writer.add_block_count(config.num_hidden_layers)
        writer.add_feed_forward_length(config.moe_intermediate_size)
        writer.add_head_count(config.num_attention_heads)
        writer.add_head_count_kv(config.num_key_value_heads)
        writer.add_vocab_size(config.vocab_size)
        tokens, types = _token_table(ckpt.vocab)
        writer.add_tokenizer_model(TOKENIZER_MODEL)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_uint32(MAX_TOKEN_LEN_KEY, int(ckpt.vocab["max_token_len"]))
        writer.add_string(ALGORITHM_KEY, str(ckpt.vocab.get("algorithm", "length-max")))
        writer.add_bos_token_id(BOS_ID)
        writer.add_eos_token_id(EOS_ID)
        writer.add_pad_token_id(PAD_ID)
        writer.add_unk_token_id(UNK_ID)
        writer.add_add_bos_token(True)
        writer.add_chat_template(CHATML_TEMPLATE)
        for tname, t in tqdm(tensors.items(), desc=f"quantizing ({qtype})", unit="tensor", disable=None if progress else True):
            gtype = storage_type(tname, t, qtype, buffers)
            arr = t.detach().float().cpu().numpy()
            data = gguf.quants.quantize(arr, gtype)
            writer.add_tensor(tname, data, raw_dtype=gtype if gtype == gguf.GGMLQuantizationType.Q8_0 else None)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file(progress=bool(progress) and sys.stderr.isatty())
        writer.close()
        report = check_round_trip(tmp, tensors, ckpt.vocab, qtype)
        replace_file(tmp, out_path)
        report.path = out_path
        return report
    except BaseException:
        discard(tmp)
        raise


def check_round_trip(path, tensors: dict[str, torch.Tensor], vocab: dict, qtype: str) -> GGUFReport:
    """Re-read a written GGUF and compare every tensor with its source (max |Δ| per tensor) and the vocab."""
    back = read_gguf(Path(path), rebuild_rope=False, progress=False)
    names_out, names_in = set(back.state_dict), set(tensors)
    if names_out != names_in:
        raise RuntimeError(f"GGUF round trip: tensor names differ (missing {sorted(names_in - names_out)[:5]}, "
                           f"extra {sorted(names_out - names_in)[:5]})")
    bound = ROUND_TRIP_BOUNDS[qtype]
    deltas, over = {}, []
    for name, src in tensors.items():
        d = float((back.state_dict[name] - src.detach().float().cpu()).abs().max()) if src.numel() else 0.0
        deltas[name] = d
        exact = back.storage_types[name] == "F32"
        if d > bound or (exact and d != 0.0):
            over.append(f"{name} ({back.storage_types[name]}, {d:.4g})")
    if over:
        raise RuntimeError(f"GGUF round trip exceeds the {qtype} bound {bound}: {over[:10]}")
    vocab_ok = back.vocab is not None and back.vocab["vocab"] == normalize_vocab_data(vocab)["vocab"] and \
        back.vocab["max_token_len"] == vocab["max_token_len"]
    if not vocab_ok:
        raise RuntimeError("GGUF round trip: the tokenizer vocabulary did not survive byte-for-byte")
    types: dict[str, int] = {}
    for t in back.storage_types.values():
        types[t] = types.get(t, 0) + 1
    return GGUFReport(Path(path), qtype, len(tensors), types, deltas, bound, vocab_ok)


def _field(reader, key: str):
    f = reader.get_field(key)
    return None if f is None else f.contents()


def check_config_against_file(reader, config: SpikeWhaleConfig, path: Path, rename_map=None) -> None:
    """Refuse a config that contradicts the file's own metadata (`spike_whale.context_length`, ...) or the shapes of
    its tensors, before anything is allocated from it; the RoPE caches it implies must also stay bounded."""
    wrong = []
    for suffix, name in METADATA_FIELDS.items():
        stored = _field(reader, f"{GGUF_ARCH}.{suffix}")
        if stored is not None and stored != getattr(config, name):
            wrong.append(f"{name} {getattr(config, name)} vs {GGUF_ARCH}.{suffix} {stored}")
    if wrong:
        raise ValueError(f"{path}: the config contradicts the file's metadata ({'; '.join(wrong)}); refusing it")
    with torch.device("meta"):
        stored = {t.name: torch.empty(tuple(int(d) for d in reversed(t.shape.tolist()))) for t in reader.tensors}
        named = normalize_state_dict(stored, str(path), [], rename_map)
        check_config_sizes({k: tuple(v.shape) for k, v in named.items()}, config, str(path))
        model = SpikeWhaleForCausalLM(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    bad = [f"{k} {tuple(v.shape)} vs {expected[k]}" for k, v in named.items() if k in expected and tuple(v.shape) != expected[k]]
    if bad:
        raise ValueError(f"{path}: the config contradicts the file's tensor shapes ({'; '.join(bad[:5])}); refusing it")
    layers = sum(1 for k in expected if k.endswith(".rope.cos_cache"))
    rope_bytes = 2 * 4 * layers * config.max_position_embeddings * config.qk_rope_head_dim
    if rope_bytes > MAX_ROPE_CACHE_BYTES:
        raise ValueError(f"{path}: max_position_embeddings {config.max_position_embeddings} would need "
                         f"{rope_bytes / 2**30:.1f} GiB of RoPE caches (limit {MAX_ROPE_CACHE_BYTES / 2**30:.0f} GiB); "
                         "refusing it")


def read_gguf(path: Path, config: SpikeWhaleConfig | None = None, rebuild_rope: bool = True,
              progress: bool = True, rename_map: dict[str, str] | None = None) -> Checkpoint:
    """Read a spike_whale GGUF into a float32 `Checkpoint` (dequantized), RoPE caches rebuilt (see `complete_rope`).

    The config (the file's `spike_whale.config_json`, or `config`) is cross-checked first with the file's own
    metadata and tensor shapes (`check_config_against_file`), the tokenizer's sizes with the config.
    """
    from tqdm import tqdm

    gguf = _gguf()
    path = Path(path)
    size = path.stat().st_size
    try:
        reader = gguf.GGUFReader(path)
    except Exception as err:
        raise ValueError(f"{path}: truncated or corrupt GGUF file ({one_line(err)[:160]})") from err
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ValueError(f"{path}: truncated GGUF file (tensor {t.name} ends at byte {t.data_offset + t.n_bytes}, "
                             f"file has {size})")
    arch = _field(reader, "general.architecture")
    if arch != GGUF_ARCH:
        raise ValueError(f"{path}: GGUF architecture is {arch!r}, not {GGUF_ARCH!r}")
    notes: list[str] = []
    if config is None:
        raw = _field(reader, CONFIG_KEY)
        if raw is None:
            raise ValueError(f"{path}: no {CONFIG_KEY} in the GGUF metadata; pass --config")
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: {CONFIG_KEY} is not valid JSON ({err})") from err
        config = config_from_dict(data, f"{path}:{CONFIG_KEY}", notes)
    check_config_against_file(reader, config, path, rename_map)
    sd, storage = {}, {}
    for t in tqdm(reader.tensors, desc="dequantizing", unit="tensor", disable=None if progress else True):
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as err:
            raise ValueError(f"{path}: tensor {t.name} has unsupported type {t.tensor_type.name}") from err
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        arr = np.array(arr, dtype=np.float32, copy=True).reshape(shape)
        sd[t.name] = torch.from_numpy(arr)
        storage[t.name] = t.tensor_type.name
    sd = normalize_state_dict(sd, str(path), notes, rename_map)
    storage = {k2: storage[k1] for k1, k2 in zip(storage, sd)}
    if rebuild_rope:
        complete_rope(sd, config, notes)
    vocab = None
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if tokens is not None:
        types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
        if len(tokens) != config.vocab_size or len(types) != len(tokens):
            raise ValueError(f"{path}: {len(tokens)} tokens and {len(types)} token types for a vocab_size of "
                             f"{config.vocab_size}; refusing a file that contradicts itself")
        unused = int(gguf.TokenType.UNUSED)
        longest = max((len(t) for t, ty in zip(tokens, types) if ty == int(gguf.TokenType.NORMAL)), default=1)
        max_len = _field(reader, MAX_TOKEN_LEN_KEY)
        if max_len is not None and not (isinstance(max_len, int) and longest <= max_len):
            raise ValueError(f"{path}: {MAX_TOKEN_LEN_KEY} is {max_len!r} but the longest token has {longest} bytes; "
                             "refusing a file that contradicts itself")
        data = {
            "vocab": {tok: i for i, (tok, ty) in enumerate(zip(tokens, types)) if tok != "" and ty != unused},
            "max_token_len": int(max_len or longest),
            "algorithm": _field(reader, ALGORITHM_KEY) or "length-max",
            "special_tokens": list(SPECIAL_TOKENS),
        }
        vocab = normalize_vocab_data(data, source=f"{path}:tokenizer.ggml.tokens")
    return Checkpoint(sd, config, vocab, "gguf", path, [path], infer_stage(path), notes, storage,
                      vocab_source=f"{path.name} (tokenizer.ggml.tokens)" if vocab is not None else None)
