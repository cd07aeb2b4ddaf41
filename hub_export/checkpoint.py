"""The format-free core of reading a spike_whale checkpoint: what was read, its config, its names, its placement.

The format readers (`pt_reader`, `safetensors_reader`, `gguf_io`) each produce a `Checkpoint` through this module
(`config_from_dict`, `normalize_state_dict`, `complete_rope`); `sources.load_checkpoint` picks the reader.
`prepare_state_dict` checks a state dict against the model and `build_model` builds a `SpikeWhaleForCausalLM` on
the meta device and assigns every tensor; a tensor it cannot place, a shape or dtype that does not match, a
non-finite value, or a parameter / buffer that would stay uninitialised is an error naming the file and the
tensors (with rename candidates, see `key_report`), never a silently random weight. `widen_rope` rebuilds the
RoPE caches for a longer context from the checkpoint's own inverse frequencies.
"""

from __future__ import annotations

import copy
import inspect
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..configuration_spike_whale import SpikeWhaleConfig
from ..modeling_spike_whale import (
    CHECKPOINT_KEY_RENAMES, SpikeWhaleForCausalLM, SpikeWhaleRotaryEmbedding, rope_inv_freq,
)
from ..tokenization_spike import BOS_ID, EOS_ID, PAD_ID

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


def one_line(text: str) -> str:
    return " ".join(str(text).split())


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

def config_fields() -> set[str]:
    """The model's config fields (keyword arguments of `SpikeWhaleConfig`, not transformers' bookkeeping keys)."""
    return set(_field_defaults()) | {"nope_head_dim"}


def find_model_config(blob) -> dict | None:
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
        found = find_model_config(value) if isinstance(value, (dict, str)) else None
        if found is not None:
            return found
    return None


def read_json(path: Path):
    """A JSON file's content; an unreadable or invalid file is a one-line `ValueError` naming it."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not valid JSON (not UTF-8 text)") from err
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from err


def _field_defaults() -> dict:
    """Each model field of `SpikeWhaleConfig` and its default: the fields the class declares (annotations), or, for
    a config class written with an explicit `__init__`, its keyword arguments."""
    declared = SpikeWhaleConfig.__dict__.get("__annotations__", {})
    if declared:
        fields = {n: getattr(SpikeWhaleConfig, n, None) for n in declared if "ClassVar" not in str(declared[n])}
    else:
        params = inspect.signature(SpikeWhaleConfig.__init__).parameters
        fields = {n: p.default for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {n: d for n, d in fields.items() if n != "self" and n not in _HF_ONLY_CONFIG_KEYS}


def _type_error(name: str, value, default) -> str | None:
    """Why `value` cannot be the config field `name` (whose default is `default`), or None if it can."""
    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool)

    if name.endswith("_token_id"):
        ok = value is None or is_int(value) or (isinstance(value, list) and all(is_int(v) for v in value))
        return None if ok else "an integer token id (or a list of them)"
    if isinstance(default, bool):
        return None if isinstance(value, bool) else "true or false"
    if isinstance(default, int):
        return None if is_int(value) else "an integer"
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return "a number"
        return None if math.isfinite(value) else "a finite number"
    if isinstance(default, str):
        return None if isinstance(value, str) else "a string"
    return None


def config_from_dict(data: dict, source: str, notes: list[str]) -> SpikeWhaleConfig:
    """Build a `SpikeWhaleConfig` from a released config.json / config blob; non-model keys are dropped (noted).

    Every field must have its default's type (a JSON `true` is not an integer): a wrong one is a one-line error.
    """
    if not isinstance(data, dict):
        raise ValueError(f"{source}: a config must be a JSON object, found a {type(data).__name__}")
    data = dict(data)
    model_type = data.get("model_type")
    if model_type not in (None, "spike_whale"):
        raise ValueError(f"{source}: model_type is {model_type!r}, not 'spike_whale'")
    known = config_fields()
    for key in _HF_ONLY_CONFIG_KEYS:
        data.pop(key, None)
    dropped = sorted(k for k in data if k not in known)
    if dropped:
        notes.append(f"config: ignored non-model keys {dropped}")
    kwargs = {k: v for k, v in data.items() if k in known}
    defaults = _field_defaults()
    wrong = [f"{k} is {json.dumps(v)[:40]}, expected {why}" for k, v in sorted(kwargs.items())
             if (why := _type_error(k, v, defaults.get(k))) is not None]
    if wrong:
        raise ValueError(f"{source}: invalid spike_whale config: {'; '.join(wrong[:5])}")
    try:
        config = SpikeWhaleConfig(**kwargs)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{source}: invalid spike_whale config ({one_line(err)})") from err
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
        data = read_json(Path(value))
    found = find_model_config(data)
    if found is None:
        raise ValueError(f"{source}: no spike_whale model config in it (no object with hidden_size and vocab_size)")
    return config_from_dict(found, source, notes)


# ---------------------------------------------------------------------------------------------------------------
# state dicts
# ---------------------------------------------------------------------------------------------------------------

def normalize_state_dict(sd: dict, source: str, notes: list[str],
                         rename_map: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """Strip trainer wrapper prefixes (only when every key has one), apply the user's `rename_map`
    ({checkpoint name: our name}, from `convert --rename-map`), then the model's rename table."""
    bad = sorted(k for k, v in sd.items() if not isinstance(v, torch.Tensor))
    if bad:
        raise ValueError(f"{source}: state dict entries that are not tensors: {bad[:10]}")
    for prefix in WRAPPER_PREFIXES:
        if sd and all(k.startswith(prefix) for k in sd):
            sd = {k[len(prefix):]: v for k, v in sd.items()}
            notes.append(f"stripped the wrapper prefix {prefix!r} from every key")
    if rename_map:
        absent = sorted(set(rename_map) - set(sd))
        if absent:
            raise ValueError(f"--rename-map names keys that {source} does not have: {absent[:10]}")
        mapped = {rename_map.get(k, k): v for k, v in sd.items()}
        if len(mapped) != len(sd):
            raise ValueError(f"--rename-map maps several keys of {source} onto the same name")
        sd = mapped
        notes.append(f"renamed {len(rename_map)} checkpoint keys through --rename-map")
    renamed = rename_checkpoint_keys(sd)
    if len(renamed) != len(sd):
        raise ValueError(f"{source}: the rename table maps several checkpoint keys onto the same name")
    changed = sum(1 for a, b in zip(sd, renamed) if a != b)
    if changed:
        notes.append(f"renamed {changed} checkpoint keys through CHECKPOINT_KEY_RENAMES")
    return renamed


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


# Our names for tensors whose released names the blueprint could not see ([U] in architecture.md §2.2).
GUESSED_KEYS: tuple[str, ...] = (
    r"model\.layers\.\d+\.hc_(attn|ffn)\.(pre_logits|post_scale)",
    r"model\.hc_out_mix\.mix_logits",
    r"model\.engram\.gate\.(proj\.weight|proj\.bias|alpha|beta|gamma)",
    r"model\.engram\.lookup\.hash_proj_n\d+_p\d+",
    r"model\.loop_pass_embed\.weight",
    r"model\.layers\.\d+\.attn\.depth_gate",
    r"model\.layers\.\d+\.attn\.mc\.(qkv_proj\.(weight|bias)|o_proj\.(weight|bias)|gate_proj\.weight|gate_bias|feature_scale|mc_gate)",
    # Mechanisms off in the 114M checkpoints (MoE, Elo, value embeddings, Engram fusion, abstain head).
    r"model\.layers\.\d+\.ffn\.(gate\.weight|experts\.\d+\.(gate|up|down)_proj\.weight|shared_experts\.(gate|up|down)_proj\.weight)",
    r"model\.layers\.\d+\.attn\.(elo_gain|elo_k)",
    r"model\.layers\.\d+\.engram_fusion\.(norm\.weight|q_proj\.weight|k_proj\.weight|o_proj\.weight)",
    r"abstain_head\.(weight|bias)",
)


def rename_checkpoint_keys(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Apply `CHECKPOINT_KEY_RENAMES` to a released state dict (identity while the table is empty)."""
    out = {}
    for key, value in state_dict.items():
        for pattern, repl in CHECKPOINT_KEY_RENAMES.items():
            key = re.sub(pattern, repl, key)
        out[key] = value
    return out


def checkpoint_key_report(checkpoint_shapes: dict, model_shapes: dict) -> dict:
    """How a checkpoint's names ({name: shape or None}) meet the model's ({name: shape}), so that a real header that
    differs from our guesses gets a useful report instead of a bare "missing keys" list: `matched`, `unexpected`
    (no place in the model), `missing` (absent; `guessed` are those `GUESSED_KEYS` names), for each unexpected tensor
    the missing ones of the same shape (`candidates`), the unambiguous renames (`rename_map`), and the text `lines`."""
    unexpected = sorted(set(checkpoint_shapes) - set(model_shapes))
    missing = sorted(set(model_shapes) - set(checkpoint_shapes))
    guessed = [k for k in missing if any(re.fullmatch(p, k) for p in GUESSED_KEYS)]
    candidates = {k: [m for m in missing if checkpoint_shapes[k] is not None
                      and tuple(model_shapes[m]) == tuple(checkpoint_shapes[k])] for k in unexpected}
    claims: dict[str, int] = {}
    for options in candidates.values():
        for m in options:
            claims[m] = claims.get(m, 0) + 1
    rename_map = {k: c[0] for k, c in candidates.items() if len(c) == 1 and claims[c[0]] == 1}
    matched = len(set(checkpoint_shapes) & set(model_shapes))
    lines = [f"checkpoint names vs the model: {matched} of {len(model_shapes)} model tensors matched, "
             f"{len(unexpected)} checkpoint tensors unplaceable, {len(missing)} model tensors absent "
             f"({len(guessed)} of them guessed names, GUESSED_KEYS in hub_export/checkpoint.py)"]
    lines += [f"  absent: {k}{'  (guessed name)' if k in guessed else ''}" for k in missing]
    for k in unexpected:
        options = candidates[k]
        lines.append(f"  unplaceable: {k} -> same-shape candidates: {', '.join(options[:6]) or 'none'}"
                     f"{' ...' if len(options) > 6 else ''}")
    if rename_map:
        lines.append(f"  a rename map for these (spike-whale convert --rename-map, or CHECKPOINT_KEY_RENAMES): "
                     f"'{json.dumps(rename_map)}'")
    return {"matched": matched, "expected": len(model_shapes), "unexpected": unexpected, "missing": missing,
            "guessed": guessed, "candidates": candidates, "rename_map": rename_map, "lines": lines}


@dataclass
class KeyReport:
    """`checkpoint_key_report` of a checkpoint against the model."""

    matched: int
    expected: int
    unexpected: list[str]
    missing: list[str]
    guessed: list[str]
    candidates: dict[str, list[str]]
    rename_map: dict[str, str]
    text: list[str]

    def lines(self) -> list[str]:
        return list(self.text)


def key_report(shapes: dict[str, tuple], expected: dict[str, tuple], ignore=()) -> KeyReport:
    """Compare checkpoint tensor shapes {name: shape} with the model's (see `KeyReport`)."""
    r = checkpoint_key_report(shapes, {k: v for k, v in expected.items() if k not in ignore})
    return KeyReport(r["matched"], r["expected"], r["unexpected"], r["missing"], r["guessed"], r["candidates"],
                     r["rename_map"], r["lines"])


LAYER_INDEX_RE = re.compile(r"^model\.layers\.(\d+)\.")


def check_config_sizes(shapes: dict[str, tuple], config: SpikeWhaleConfig, source: str) -> None:
    """Refuse a config whose sizes contradict the tensors it came with, before a model (even on the meta device,
    where modules still cost memory per layer) is built from it: layer count, vocabulary and width from the
    embedding, context from the RoPE caches."""
    wrong = []
    layers = {int(m.group(1)) for k in shapes if (m := LAYER_INDEX_RE.match(k))}
    if layers and config.num_hidden_layers != max(layers) + 1:
        wrong.append(f"num_hidden_layers {config.num_hidden_layers} vs layers 0..{max(layers)} in the tensors")
    emb = shapes.get(TIED_SOURCE)
    if emb is not None and len(emb) == 2 and (config.vocab_size, config.hidden_size) != tuple(emb):
        wrong.append(f"vocab_size x hidden_size {config.vocab_size} x {config.hidden_size} vs {TIED_SOURCE} {tuple(emb)}")
    cos = next((v for k, v in shapes.items() if k.endswith(".rope.cos_cache")), None)
    if cos is not None and len(cos) == 2 and cos[0] != config.max_position_embeddings:
        wrong.append(f"max_position_embeddings {config.max_position_embeddings} vs RoPE caches of {cos[0]} positions")
    if wrong:
        raise ValueError(f"{source}: the config contradicts the checkpoint's tensors ({'; '.join(wrong)}); "
                         "pass the right --config")


class CheckpointKeyError(ValueError):
    """The checkpoint's names do not fit the model; `report` is the full `KeyReport`."""

    def __init__(self, message: str, report: KeyReport):
        super().__init__(message)
        self.report = report


def prepare_state_dict(
    sd: dict[str, torch.Tensor], config: SpikeWhaleConfig, dtype: torch.dtype = torch.float32, source: str = "checkpoint"
) -> dict[str, torch.Tensor]:
    """Check `sd` against the model's tensors and return exactly the tensors the model will hold (in `dtype`).

    Raises a `ValueError` naming `source`: a `CheckpointKeyError` (with a `KeyReport`) for tensors the model has no
    place for or missing tensors, then shape mismatches, integer tensors where the model holds floats, and NaN/inf.
    A tied head present in the source must equal the embedding bit for bit (it is then dropped, re-tied on load).
    """
    check_config_sizes({k: tuple(v.shape) for k, v in sd.items()}, config, source)
    with torch.device("meta"):
        model = SpikeWhaleForCausalLM(config)
    expected = {k: v for k, v in model.state_dict().items()}
    tied = bool(config.tie_word_embeddings)
    sd = dict(sd)
    if tied and TIED_HEAD in sd:
        head, emb = sd.pop(TIED_HEAD), sd.get(TIED_SOURCE)
        if emb is None or head.shape != emb.shape or not torch.equal(head, emb):
            raise ValueError(
                f"{source}: {TIED_HEAD} differs from {TIED_SOURCE} but the config ties them (tie_word_embeddings=True); "
                "refusing to drop a distinct output head"
            )
    report = key_report({k: tuple(v.shape) for k, v in sd.items()}, {k: tuple(v.shape) for k, v in expected.items()},
                        ignore={TIED_HEAD} if tied else ())
    if report.unexpected or report.missing:
        parts = []
        if report.unexpected:
            parts.append(f"{len(report.unexpected)} checkpoint tensors have no place in the model: {report.unexpected[:20]}")
        if report.missing:
            parts.append(f"{len(report.missing)} parameters/buffers would be left uninitialised (absent from the "
                         f"checkpoint): {report.missing[:20]} ({len(report.guessed)} of them guessed names)")
        fix = (f"; --rename-map '{json.dumps(report.rename_map)}' would place {len(report.rename_map)}"
               if report.rename_map else "")
        raise CheckpointKeyError(f"{source}: {'; '.join(parts)}; {report.matched} of {report.expected} matched{fix}",
                                 report)
    bad_shape = [f"{k}: checkpoint {tuple(sd[k].shape)} vs model {tuple(expected[k].shape)}"
                 for k in sorted(sd) if tuple(sd[k].shape) != tuple(expected[k].shape)]
    if bad_shape:
        raise ValueError(f"{source}: {len(bad_shape)} tensors have the wrong shape for this config: {bad_shape[:10]}")
    bad_dtype = [f"{k} ({str(sd[k].dtype).replace('torch.', '')}, the model holds "
                 f"{str(expected[k].dtype).replace('torch.', '')})" for k in sorted(sd)
                 if expected[k].is_floating_point() != sd[k].is_floating_point()]
    if bad_dtype:
        raise ValueError(f"{source}: {len(bad_dtype)} tensors have the wrong kind of dtype: {bad_dtype[:10]}")
    non_finite = [k for k in sorted(sd) if sd[k].is_floating_point() and not bool(torch.isfinite(sd[k]).all())]
    if non_finite:
        raise ValueError(f"{source}: {len(non_finite)} tensors hold NaN or inf values: {non_finite[:10]}; the "
                         "checkpoint is damaged (refusing to convert it)")
    # The model keeps some buffers in float32 under any load dtype (RoPE caches, Engram hash projections);
    # store them that way too, so a bf16/fp16 export reloads bit-identically and hashes as the source does.
    keep_fp32 = tuple(SpikeWhaleForCausalLM._keep_in_fp32_modules_strict or ())
    out = {}
    for k in sorted(sd):
        t = sd[k].detach()
        if t.is_floating_point():
            t = t.to(torch.float32 if any(re.search(p, k) for p in keep_fp32) else dtype)
        elif t.dtype != expected[k].dtype:
            raise ValueError(f"{source}: {k} is {t.dtype}, the model holds {expected[k].dtype}")
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
