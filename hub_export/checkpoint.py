"""Read a released spike_whale checkpoint (`.pt`, safetensors folder, GGUF) and place it into the model, exactly.

`load_checkpoint(path)` returns a `Checkpoint`: the state dict under our names (through the model's one rename
table, `rename_checkpoint_keys`), the config, the tokenizer vocab (released file format) and what was read.
`build_model(checkpoint)` builds a `SpikeWhaleForCausalLM` on the meta device and assigns every tensor; a tensor
it cannot place, a shape that does not match, or a parameter / buffer that would stay uninitialised is an error
listing the names (never a silently random weight). `widen_rope` rebuilds the RoPE caches for a longer context
from the checkpoint's own inverse frequencies.
"""

from __future__ import annotations

import copy
import inspect
import json
import os
import pickle
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..configuration_spike_whale import SpikeWhaleConfig
from ..modeling_spike_whale import SpikeWhaleForCausalLM, SpikeWhaleRotaryEmbedding, rename_checkpoint_keys, rope_inv_freq
from ..tokenization_spike import BOS_ID, EOS_ID, PAD_ID, VOCAB_FILE_NAME, load_vocab_file

# Where a training checkpoint keeps its weights and its config blob (checked in this order).
STATE_DICT_KEYS = ("model", "state_dict", "model_state_dict", "model_state", "module", "weights", "params", "net")
CONFIG_KEYS = ("config", "cfg", "model_config", "model_cfg", "hparams", "hyper_parameters", "hyperparameters",
               "args", "model_args")
# Wrapper prefixes some trainers add to every key (torch.compile, DDP); stripped only when *every* key has one.
WRAPPER_PREFIXES = ("_orig_mod.", "module.")
# Keys of a saved HF config that are not model fields.
_HF_ONLY_CONFIG_KEYS = ("architectures", "auto_map", "transformers_version", "_name_or_path", "dtype", "torch_dtype",
                        "model_type", "use_cache", "output_hidden_states", "output_attentions", "return_dict",
                        "chunk_size_feed_forward", "is_encoder_decoder", "problem_type", "id2label", "label2id",
                        "tokenizer_class", "task_specific_params")
ROPE_CACHE_RE = re.compile(r"\.rope\.(cos_cache|sin_cache)$")
ROPE_INV_FREQ_RE = re.compile(r"\.rope\.inv_freq$")
TIED_HEAD = "lm_head.weight"
TIED_SOURCE = "model.embed_tokens.weight"
STAGE_RE = re.compile(r"(base|sft|dpo)[_-]?(\d+k?)", re.IGNORECASE)
STAGE_TEXT = {
    "base": "pretrained base: continues text, score it as a language model",
    "sft": "supervised fine-tune (ChatML chat format)",
    "dpo": "DPO on top of the SFT stage (ChatML chat format)",
}


@dataclass
class Checkpoint:
    """A checkpoint read from disk: tensors under our state-dict names, config, vocab and where it all came from."""

    state_dict: dict[str, torch.Tensor]
    config: SpikeWhaleConfig
    vocab: dict | None
    kind: str  # "pt" | "safetensors" | "gguf"
    source: Path
    source_files: list[Path]
    stage: str | None = None
    notes: list[str] = field(default_factory=list)
    storage_types: dict[str, str] | None = None  # GGUF: tensor name -> stored type (F32/F16/Q8_0)
    vocab_source: str | None = None


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def sniff_format(path: Path) -> str:
    """'gguf', 'pt', 'safetensors' or 'folder', from the content (not the suffix); unknown is an error."""
    if path.is_dir():
        return "folder"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    with open(path, "rb") as handle:
        head = handle.read(16)
    if head[:4] == b"GGUF":
        return "gguf"
    if head[:4] == b"PK\x03\x04" or head[:1] == b"\x80":
        return "pt"
    if len(head) >= 9 and head[8:9] == b"{":
        return "safetensors"
    if path.suffix == ".safetensors":
        return "safetensors"
    if path.suffix in (".pt", ".pth", ".bin", ".ckpt"):
        return "pt"
    if path.suffix == ".gguf":
        return "gguf"
    raise ValueError(f"{path}: not a spike_whale checkpoint (expected a .pt, a safetensors folder or a GGUF file)")


def infer_stage(path: Path) -> str | None:
    """'base_62k' / 'sft_7100' / 'dpo_3200' from a released path (folder or file name), if it names one."""
    for part in reversed(path.resolve().parts):
        m = STAGE_RE.search(part)
        if m:
            return f"{m.group(1).lower()}_{m.group(2)}"
    return None


# ---------------------------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------------------------

def _config_fields() -> set[str]:
    params = inspect.signature(SpikeWhaleConfig.__init__).parameters
    return {n for n, p in params.items() if p.kind is p.POSITIONAL_OR_KEYWORD and n != "self"} | {"nope_head_dim"}


def _find_model_config(blob) -> dict | None:
    """The dict holding the model fields: the blob itself or a nested section (e.g. {'model': {...}, 'train': ...})."""
    if isinstance(blob, str):
        try:
            blob = json.loads(blob)
        except json.JSONDecodeError:
            return None
    if not isinstance(blob, dict):
        return None
    if "hidden_size" in blob and "vocab_size" in blob:
        return blob
    for value in blob.values():
        found = _find_model_config(value) if isinstance(value, (dict, str)) else None
        if found is not None:
            return found
    return None


def config_from_dict(data: dict, source: str, notes: list[str]) -> SpikeWhaleConfig:
    """Build a `SpikeWhaleConfig` from a released config.json / config blob; non-model keys are dropped (noted)."""
    data = dict(data)
    model_type = data.get("model_type")
    if model_type not in (None, "spike_whale"):
        raise ValueError(f"{source}: model_type is {model_type!r}, not 'spike_whale'")
    known = _config_fields()
    for key in _HF_ONLY_CONFIG_KEYS:
        data.pop(key, None)
    dropped = sorted(k for k in data if k not in known)
    if dropped:
        notes.append(f"config: ignored non-model keys {dropped}")
    kwargs = {k: v for k, v in data.items() if k in known}
    try:
        config = SpikeWhaleConfig(**kwargs)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{source}: invalid spike_whale config ({_one_line(err)})") from err
    # The family's config.py defaults bos/eos to 0/1, which are <pad>/<unk> in the released tokenizer.
    fixes = []
    if config.bos_token_id != BOS_ID:
        fixes.append(f"bos_token_id {config.bos_token_id} -> {BOS_ID}")
        config.bos_token_id = BOS_ID
    eos = config.eos_token_id
    if not (eos == EOS_ID or (isinstance(eos, list) and EOS_ID in eos)):
        fixes.append(f"eos_token_id {eos} -> {EOS_ID}")
        config.eos_token_id = EOS_ID
    if config.pad_token_id != PAD_ID:
        fixes.append(f"pad_token_id {config.pad_token_id} -> {PAD_ID}")
        config.pad_token_id = PAD_ID
    if fixes:
        notes.append("config: corrected special-token ids to the released tokenizer's layout (" + ", ".join(fixes) + ")")
    return config


def read_config_arg(value: str, notes: list[str]) -> SpikeWhaleConfig:
    """`--config`: a path to a JSON file (config.json or a blob with a model section) or an inline JSON object."""
    text = value.strip()
    if text.startswith("{"):
        source = "--config"
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"--config: not valid JSON ({err})") from err
    else:
        source = value
        try:
            data = json.loads(Path(value).read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise ValueError(f"{value}: not valid JSON ({err})") from err
    found = _find_model_config(data)
    if found is None:
        raise ValueError(f"{source}: no spike_whale model config in it (no object with hidden_size and vocab_size)")
    return config_from_dict(found, source, notes)


# ---------------------------------------------------------------------------------------------------------------
# state dicts
# ---------------------------------------------------------------------------------------------------------------

def _is_tensor_dict(obj) -> bool:
    return isinstance(obj, dict) and bool(obj) and all(isinstance(k, str) for k in obj) and all(
        isinstance(v, torch.Tensor) for v in obj.values()
    )


def normalize_state_dict(sd: dict, source: str, notes: list[str]) -> dict[str, torch.Tensor]:
    """Strip trainer wrapper prefixes (only when every key has one), then apply the model's rename table."""
    bad = sorted(k for k, v in sd.items() if not isinstance(v, torch.Tensor))
    if bad:
        raise ValueError(f"{source}: state dict entries that are not tensors: {bad[:10]}")
    for prefix in WRAPPER_PREFIXES:
        if sd and all(k.startswith(prefix) for k in sd):
            sd = {k[len(prefix):]: v for k, v in sd.items()}
            notes.append(f"stripped the wrapper prefix {prefix!r} from every key")
    renamed = rename_checkpoint_keys(sd)
    if len(renamed) != len(sd):
        raise ValueError(f"{source}: the rename table maps several checkpoint keys onto the same name")
    changed = sum(1 for a, b in zip(sd, renamed) if a != b)
    if changed:
        notes.append(f"renamed {changed} checkpoint keys through CHECKPOINT_KEY_RENAMES")
    return renamed


def _torch_load(path: Path):
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        msg = str(err)
        m = re.search(r"Unsupported global: GLOBAL ([\w\.]+)", msg) or re.search(r"GLOBAL ([\w\.]+)", msg)
        what = f" ({m.group(1)})" if m else ""
        raise ValueError(
            f"{path}: refusing to load: it contains a pickled Python object{what} that torch.load(weights_only=True) "
            "does not allow; a released checkpoint holds only tensors and plain containers"
        ) from err
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError, AttributeError) as err:
        raise ValueError(f"{path}: not a readable PyTorch checkpoint ({_one_line(err)[:200]})") from err


def read_pt(path: Path, config: SpikeWhaleConfig | None, notes: list[str]) -> tuple[dict, SpikeWhaleConfig]:
    """A released `.pt`: the state dict and the config blob under the usual keys (or the bare state dict)."""
    obj = _torch_load(path)
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a dict (state dict + config), found a {type(obj).__name__}")
    keys = [str(k) for k in obj]
    if _is_tensor_dict(obj):
        sd, holder = obj, None
    else:
        sd = holder = None
        for key in STATE_DICT_KEYS:
            value = obj.get(key)
            if _is_tensor_dict(value):
                sd, holder = value, key
                break
            if isinstance(value, dict):  # one level of nesting, e.g. {"model": {"state_dict": ...}}
                inner = next((value[k] for k in STATE_DICT_KEYS if _is_tensor_dict(value.get(k))), None)
                if inner is not None:
                    sd, holder = inner, key
                    break
        if sd is None:
            raise ValueError(
                f"{path}: unknown checkpoint layout: no state dict under any of {list(STATE_DICT_KEYS)}; "
                f"keys found: {keys[:30]}"
            )
    if holder:
        notes.append(f"state dict read from key {holder!r} of the .pt")
    if config is None:
        blob = None
        for key in CONFIG_KEYS:
            if key in obj:
                blob = _find_model_config(obj[key])
                if blob is not None:
                    notes.append(f"config read from key {key!r} of the .pt")
                    break
        if blob is None:
            sibling = path.parent / "config.json"
            if sibling.is_file():
                blob = _find_model_config(json.loads(sibling.read_text(encoding="utf-8")))
                notes.append(f"config read from {sibling}")
        if blob is None:
            raise ValueError(
                f"{path}: no spike_whale config found (looked under {list(CONFIG_KEYS)}; keys found: {keys[:30]}); "
                "pass --config path/to/config.json"
            )
        config = config_from_dict(blob, str(path), notes)
    return sd, config


def _safetensors_error(path: Path, err: Exception) -> ValueError:
    return ValueError(f"{path}: not a valid safetensors file ({_one_line(err)[:200]})")


def read_safetensors_file(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as err:  # SafetensorError is not an OSError/ValueError subclass
        if isinstance(err, FileNotFoundError):
            raise
        raise _safetensors_error(path, err) from err


def read_safetensors_folder(folder: Path, config: SpikeWhaleConfig | None, notes: list[str], weights: Path | None = None):
    """A released safetensors folder (config.json + model.safetensors [+ index] + tokenizer.json) or one of ours."""
    if weights is None:
        index = folder / "model.safetensors.index.json"
        single = folder / "model.safetensors"
        if single.is_file():
            weights = single
        elif index.is_file():
            weights = index
        else:
            present = sorted(p.name for p in folder.iterdir())
            raise FileNotFoundError(f"{folder}: no model.safetensors (files found: {present[:20]})")
    if weights.name.endswith(".index.json"):
        try:
            weight_map = json.loads(weights.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(f"{weights}: not a valid safetensors index ({_one_line(err)})") from err
        sd, files = {}, []
        for shard in sorted(set(weight_map.values())):
            sd.update(read_safetensors_file(folder / shard))
            files.append(folder / shard)
    else:
        sd, files = read_safetensors_file(weights), [weights]
    if config is None:
        cfg_path = folder / "config.json"
        if not cfg_path.is_file():
            raise FileNotFoundError(f"{folder}: no config.json; pass --config")
        try:
            data = json.loads(cfg_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise ValueError(f"{cfg_path}: not valid JSON ({err})") from err
        config = config_from_dict(data, str(cfg_path), notes)
    return sd, config, files


def find_vocab(paths: list[Path]) -> Path | None:
    """The first `spike_vocab.json` / custom-format `tokenizer.json` in the given folders."""
    for folder in paths:
        for name in (VOCAB_FILE_NAME, "tokenizer.json"):
            candidate = folder / name
            if candidate.is_file():
                return candidate
    return None


def load_checkpoint(
    src: str | os.PathLike,
    config: str | SpikeWhaleConfig | None = None,
    tokenizer: str | os.PathLike | None = None,
    progress: bool = True,
) -> Checkpoint:
    """Read `src` (released `.pt`, safetensors folder / file, exported Hub folder, or GGUF) into a `Checkpoint`.

    `config` (a `SpikeWhaleConfig`, a config.json path or inline JSON) replaces the config found in the source;
    `tokenizer` (a spike_vocab.json or custom-format tokenizer.json) replaces the vocab found next to it.
    """
    path = Path(src)
    notes: list[str] = []
    cfg = read_config_arg(config, notes) if isinstance(config, str) else config
    fmt = sniff_format(path)
    vocab = None
    vocab_source = None
    if fmt == "gguf":
        from .gguf_io import read_gguf

        ckpt = read_gguf(path, config=cfg, progress=progress)
        ckpt.notes[:0] = notes
        if tokenizer is not None:
            ckpt.vocab, ckpt.vocab_source = load_vocab_file(tokenizer), str(tokenizer)
        return ckpt
    if fmt == "pt":
        sd, cfg = read_pt(path, cfg, notes)
        files = [path]
        search = [path.parent, path.parent.parent]
    elif fmt == "folder":
        sd, cfg, files = read_safetensors_folder(path, cfg, notes)
        files = sorted({*files, *(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))})
        search = [path]
    else:  # a lone .safetensors file
        sd, cfg, files = read_safetensors_folder(path.parent, cfg, notes, weights=path)
        search = [path.parent]
    sd = normalize_state_dict(sd, str(path), notes)
    vocab_path = Path(tokenizer) if tokenizer is not None else find_vocab(search)
    if vocab_path is not None:
        vocab = load_vocab_file(vocab_path)
        vocab_source = str(vocab_path)
        if vocab_path not in files:
            files.append(vocab_path)
    return Checkpoint(sd, cfg, vocab, fmt if fmt != "folder" else "safetensors", path, files, infer_stage(path),
                      notes, vocab_source=vocab_source)


# ---------------------------------------------------------------------------------------------------------------
# RoPE caches
# ---------------------------------------------------------------------------------------------------------------

def rope_caches(config: SpikeWhaleConfig, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin caches for `config.max_position_embeddings` positions from `inv_freq`, exactly as the model builds them."""
    with torch.device("meta"):
        rope = SpikeWhaleRotaryEmbedding(config)
    _, cos, sin = rope.compute(inv_freq.detach().float().cpu())
    return cos, sin


def rope_module_prefixes(config: SpikeWhaleConfig) -> list[str]:
    with torch.device("meta"):
        model = SpikeWhaleForCausalLM(config)
    return [k[: -len("cos_cache")] for k in model.state_dict() if k.endswith(".rope.cos_cache")]


def complete_rope(sd: dict[str, torch.Tensor], config: SpikeWhaleConfig, notes: list[str]) -> None:
    """Fill in RoPE caches a container left out (GGUF): from the stored inv_freq, else the config's schedule
    (fractal stays fractal: `rope_inv_freq(..., use_fractal_rope, fractal_rope_gamma)`)."""
    rebuilt = from_config = 0
    for prefix in rope_module_prefixes(config):
        inv = sd.get(prefix + "inv_freq")
        if inv is None:
            inv = rope_inv_freq(config.qk_rope_head_dim, config.rope_theta, config.use_fractal_rope,
                                config.fractal_rope_gamma)
            sd[prefix + "inv_freq"] = inv
            from_config += 1
        if prefix + "cos_cache" not in sd or prefix + "sin_cache" not in sd:
            sd[prefix + "cos_cache"], sd[prefix + "sin_cache"] = rope_caches(config, inv)
            rebuilt += 1
    if rebuilt:
        schedule = f"fractal, gamma={config.fractal_rope_gamma}" if config.use_fractal_rope else "geometric"
        src = "the config's schedule" if from_config else "the stored inv_freq"
        notes.append(f"RoPE caches rebuilt for {rebuilt} layers from {src} ({schedule}), "
                     f"{config.max_position_embeddings} positions")


def check_inv_freq(sd: dict[str, torch.Tensor], config: SpikeWhaleConfig, notes: list[str]) -> None:
    """Note (do not fail) when the stored inverse frequencies differ from the config's formula: the file wins."""
    formula = rope_inv_freq(config.qk_rope_head_dim, config.rope_theta, config.use_fractal_rope,
                            config.fractal_rope_gamma)
    worst = 0.0
    for key, value in sd.items():
        if ROPE_INV_FREQ_RE.search(key) and value.shape == formula.shape:
            worst = max(worst, float((value.float() - formula).abs().max()))
    if worst > 1e-6:
        notes.append(f"stored RoPE inv_freq differs from the config's schedule by {worst:.3e}; the stored values are used")


def widen_rope(sd: dict[str, torch.Tensor], config: SpikeWhaleConfig, new_len: int) -> tuple[SpikeWhaleConfig, float]:
    """Rebuild every RoPE cache for `new_len` positions from the checkpoint's own inv_freq (in place on `sd`).

    Rows below the old length are kept bit-for-bit; the recomputation must reproduce them (max |Δ| returned),
    otherwise the stored caches do not follow the stored inv_freq and widening is refused.
    """
    old_len = config.max_position_embeddings
    if new_len < old_len:
        raise ValueError(f"--max-position-embeddings {new_len} is below the checkpoint's {old_len}; only widening is supported")
    wide = copy.deepcopy(config)
    wide.max_position_embeddings = new_len
    worst = 0.0
    for prefix in rope_module_prefixes(config):
        try:
            inv, old_cos, old_sin = (sd[prefix + n] for n in ("inv_freq", "cos_cache", "sin_cache"))
        except KeyError as err:
            raise ValueError(f"cannot widen: {err.args[0]} is missing from the checkpoint") from err
        cos, sin = rope_caches(wide, inv)
        for old, new, name in ((old_cos, cos, "cos_cache"), (old_sin, sin, "sin_cache")):
            delta = float((new[:old_len].to(old.dtype).float() - old.float()).abs().max()) if old_len else 0.0
            tol = 8 * torch.finfo(old.dtype).eps
            if delta > tol:
                raise ValueError(
                    f"cannot widen: {prefix}{name} does not follow the stored inv_freq (recomputed rows differ by "
                    f"{delta:.3e} > {tol:.1e}); the cache was not built with this schedule"
                )
            worst = max(worst, delta)
            sd[prefix + name] = torch.cat([old, new[old_len:].to(old.dtype)], 0)
    return wide, worst


# ---------------------------------------------------------------------------------------------------------------
# placing the tensors
# ---------------------------------------------------------------------------------------------------------------

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def prepare_state_dict(
    sd: dict[str, torch.Tensor], config: SpikeWhaleConfig, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Check `sd` against the model's tensors and return exactly the tensors the model will hold (in `dtype`).

    Raises a `ValueError` listing tensors the model has no place for, shape mismatches and missing tensors.
    A tied head present in the source must equal the embedding bit for bit (it is then dropped, re-tied on load).
    """
    with torch.device("meta"):
        model = SpikeWhaleForCausalLM(config)
    expected = {k: v for k, v in model.state_dict().items()}
    tied = bool(config.tie_word_embeddings)
    sd = dict(sd)
    if tied and TIED_HEAD in sd:
        head, emb = sd.pop(TIED_HEAD), sd.get(TIED_SOURCE)
        if emb is None or head.shape != emb.shape or not torch.equal(head, emb):
            raise ValueError(
                f"{TIED_HEAD} differs from {TIED_SOURCE} but the config ties them (tie_word_embeddings=True); "
                "refusing to drop a distinct output head"
            )
    unexpected = sorted(set(sd) - set(expected))
    if unexpected:
        raise ValueError(f"{len(unexpected)} checkpoint tensors have no place in the model: {unexpected[:20]}")
    wanted = set(expected) - ({TIED_HEAD} if tied else set())
    missing = sorted(wanted - set(sd))
    if missing:
        raise ValueError(f"{len(missing)} parameters/buffers would be left uninitialised (absent from the checkpoint): "
                         f"{missing[:20]}")
    bad_shape = [f"{k}: checkpoint {tuple(sd[k].shape)} vs model {tuple(expected[k].shape)}"
                 for k in sorted(sd) if tuple(sd[k].shape) != tuple(expected[k].shape)]
    if bad_shape:
        raise ValueError(f"{len(bad_shape)} tensors have the wrong shape for this config: {bad_shape[:10]}")
    # The model keeps some buffers in float32 under any load dtype (RoPE caches, Engram hash projections);
    # store them that way too, so a bf16/fp16 export reloads bit-identically and hashes as the source does.
    keep_fp32 = tuple(SpikeWhaleForCausalLM._keep_in_fp32_modules_strict or ())
    out = {}
    for k in sorted(sd):
        t = sd[k].detach()
        if t.is_floating_point():
            t = t.to(torch.float32 if any(p in k for p in keep_fp32) else dtype)
        out[k] = t.contiguous()
    return out


def build_model(sd: dict[str, torch.Tensor], config: SpikeWhaleConfig) -> SpikeWhaleForCausalLM:
    """Assign a prepared state dict (see `prepare_state_dict`) into a model built on the meta device, tie the head,
    and refuse if any parameter or buffer is still unset."""
    with torch.device("meta"):
        model = SpikeWhaleForCausalLM(config)
    result = model.load_state_dict(sd, strict=False, assign=True)
    if result.unexpected_keys:
        raise ValueError(f"tensors with no place in the model: {sorted(result.unexpected_keys)[:20]}")
    if config.tie_word_embeddings:
        model.tie_weights()
    unset = [n for n, t in (*model.named_parameters(remove_duplicate=False), *model.named_buffers()) if t.is_meta]
    if unset:
        raise ValueError(f"{len(unset)} parameters/buffers left uninitialised: {unset[:20]}")
    if config.tie_word_embeddings and model.lm_head.weight is not model.model.embed_tokens.weight:
        raise RuntimeError("the output head was not re-tied to the embedding")
    return model.eval()


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor a loaded model holds, under its state-dict name (the tied head included)."""
    return {k: v.detach() for k, v in model.state_dict().items()}
