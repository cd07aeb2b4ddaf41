"""A released checkpoint (`.pt`, safetensors folder, GGUF) -> a verified Hub folder (behind `convert`, `from-gguf`,
`widen`).

API: `convert_checkpoint(src, out_dir, ...)` (from a path) and `export_checkpoint(checkpoint, out_dir, ...)` (from a
`Checkpoint` already read). The destination is checked first (never a source, never a user's folder unasked: see
`output_paths`). Both write into a temporary sibling folder, verify it in a fresh process (every tensor
bit-identical, logits equal, through `AutoModelForCausalLM`/`AutoTokenizer` with trust_remote_code), add the model
card and provenance, and only then rename it to `out_dir`: a failure leaves no half-written folder behind.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..tokenization_spike import SpikeTokenizer
from .checkpoint import (
    DTYPES, Checkpoint, CheckpointKeyError, build_model, check_inv_freq, model_state, prepare_state_dict, widen_rope,
)
from .conversion_check import VerificationResult, reference_logits, verify_folder
from .folder import (
    CARD_FILE, EXPORT_FILES, PROVENANCE_FILE, save_hub_folder, sha256_file, write_model_card, write_provenance,
)
from .output_paths import check_destination, config_file, discard, remove_stale_temps, replace_folder, staging_folder
from .sources import load_checkpoint, sniff_format


@dataclass
class ConversionResult:
    out_dir: Path
    verification: VerificationResult
    context: tuple[int, int]
    dtype: str
    notes: list[str] = field(default_factory=list)

    @property
    def files(self) -> list[str]:
        return sorted(p.name for p in self.out_dir.iterdir())


def _source_files(ckpt: Checkpoint, progress: bool) -> dict:
    return {
        "path": str(ckpt.source.resolve()),
        "kind": ckpt.kind,
        "stage": ckpt.stage,
        "tokenizer": str(Path(ckpt.vocab_source).resolve()) if ckpt.vocab_source and Path(ckpt.vocab_source).exists()
        else ckpt.vocab_source,
        "files": {str(p.resolve()): {"sha256": sha256_file(p, progress), "bytes": p.stat().st_size}
                  for p in ckpt.source_files},
    }


def _previous_card(src: Path) -> dict:
    """Stage / license recorded by an earlier export (so `widen` keeps them)."""
    out = {}
    prov = src / PROVENANCE_FILE
    if src.is_dir() and prov.is_file():
        try:
            data = json.loads(prov.read_text(encoding="utf-8"))
            out["stage"] = (data.get("conversion") or {}).get("stage") or (data.get("source") or {}).get("stage")
        except (json.JSONDecodeError, AttributeError):
            pass
    if src.is_dir() and (src / CARD_FILE).is_file():
        try:
            from huggingface_hub import ModelCard

            card = ModelCard.load(str(src / CARD_FILE))
            out["license"] = card.data.get("license")
            out["license_name"] = card.data.get("license_name")
        except Exception:  # a foreign README is not an error
            pass
    return {k: v for k, v in out.items() if v}


def export_checkpoint(
    ckpt: Checkpoint,
    out_dir: str | os.PathLike,
    *,
    dtype: str | None = "fp32",
    max_position_embeddings: int | None = None,
    stage: str | None = None,
    license: str | None = None,
    license_name: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
    command: str = "convert",
    log=print,
) -> ConversionResult:
    """Write `ckpt` as a verified Hub folder at `out_dir` (see the module docstring). `dtype=None` keeps the
    source's floating dtype; `max_position_embeddings` widens the RoPE caches from the checkpoint's inv_freq."""
    out = Path(out_dir)
    sources = [ckpt.source, *ckpt.source_files]
    if ckpt.vocab_source and Path(ckpt.vocab_source).exists():
        sources.append(ckpt.vocab_source)
    check_destination(out, sources, overwrite=overwrite)
    if ckpt.vocab is None:
        raise ValueError(f"{ckpt.source}: no tokenizer found (looked for spike_vocab.json / tokenizer.json next to the "
                         "checkpoint); pass --tokenizer path/to/tokenizer.json")
    notes = list(ckpt.notes)
    config = copy.deepcopy(ckpt.config)
    sd = dict(ckpt.state_dict)
    if dtype is None:
        floats = [t.dtype for t in sd.values() if t.is_floating_point()]
        torch_dtype = max(set(floats), key=floats.count) if floats else DTYPES["fp32"]
    elif dtype in DTYPES:
        torch_dtype = DTYPES[dtype]
    else:
        raise ValueError(f"--dtype must be one of fp32, bf16, fp16; got {dtype!r}")
    check_inv_freq(sd, config, notes)
    source_dtypes = sorted({str(t.dtype).replace("torch.", "") for t in sd.values() if t.is_floating_point()})
    old_ctx = config.max_position_embeddings
    tokenizer = SpikeTokenizer(ckpt.vocab)
    widened = max_position_embeddings is not None and max_position_embeddings != old_ctx
    if widened:
        narrow = build_model(prepare_state_dict(sd, config, torch_dtype, str(ckpt.source)), config)
        narrow_logits, _ = reference_logits(narrow, tokenizer)
        del narrow
        config, delta = widen_rope(sd, config, int(max_position_embeddings))
        notes.append(f"context widened {old_ctx} -> {config.max_position_embeddings}: RoPE caches rebuilt from the "
                     f"checkpoint's inv_freq, the first {old_ctx} positions kept bit-for-bit (recompute max |Δ| {delta:.1e})")
    try:
        prepared = prepare_state_dict(sd, config, torch_dtype, str(ckpt.source))
    except CheckpointKeyError as err:
        for line in err.report.lines():
            log(line)
        raise
    model = build_model(prepared, config)
    expected = model_state(model)
    ref_logits, ref_ids = reference_logits(model, tokenizer)
    if widened and not torch.equal(ref_logits, narrow_logits):
        raise RuntimeError("widening changed the logits inside the old context (max |Δ| "
                           f"{float((ref_logits - narrow_logits).abs().max()):.3g}); refusing to write it")
    for note in notes:
        log(f"  note: {note}")
    staging = staging_folder(out)
    try:
        save_hub_folder(model, tokenizer, staging)
        log(f"verifying {len(expected)} tensors in a fresh process (AutoModelForCausalLM, trust_remote_code=True) ...")
        result = verify_folder(staging, expected, ref_logits, ref_ids, expect_tied=bool(config.tie_word_embeddings))
        dtype_name = str(torch_dtype).replace("torch.", "")
        if ckpt.kind == "gguf":
            types = sorted(set((ckpt.storage_types or {}).values()))
            exact_note = (f"The source is a GGUF container ({', '.join(types)}): the weights here are its dequantized "
                          "values, bit-identical to what the GGUF holds (f16 is within 0.008 and q8_0 within 0.079 of "
                          "the original float32 weights, per tensor). The RoPE caches, which GGUF does not store, were "
                          "rebuilt with the checkpoint's schedule.")
        elif dtype_name != "float32":
            exact_note = f"Stored in {dtype_name}: bit-identical to the source tensors cast to {dtype_name}."
        elif source_dtypes != [dtype_name]:
            exact_note = f"The source's {'/'.join(source_dtypes)} tensors, cast to {dtype_name} (exactly)."
        else:
            exact_note = "Same bits as the source checkpoint."
        if widened:
            exact_note += (f" Context widened from {old_ctx} to {config.max_position_embeddings}: the RoPE caches were "
                           f"extended from each layer's stored inv_freq, their first {old_ctx} rows unchanged, and the "
                           "logits on the prompt equal the unwidened model's.")
        stage = stage or ckpt.stage
        write_model_card(
            staging, model, stage=stage, source_name=ckpt.source.name, source_kind=ckpt.kind,
            verify_summary=result.summary, exact_note=exact_note, notes=notes, license=license,
            license_name=license_name, command=command,
        )
        files = sorted(p.name for p in staging.iterdir())
        expected_files = sorted(f for f in EXPORT_FILES if f != PROVENANCE_FILE)
        if files != expected_files:
            raise RuntimeError(f"unexpected folder contents: {sorted(set(files) ^ set(expected_files))}")
        write_provenance(
            staging,
            source=_source_files(ckpt, progress),
            conversion={"command": f"spike-whale {command}", "stage": stage, "dtype": dtype_name,
                        "max_position_embeddings": {"source": old_ctx, "output": config.max_position_embeddings},
                        "gguf_storage_types": ckpt.storage_types and sorted(set(ckpt.storage_types.values())),
                        "notes": notes},
            verification=result.as_dict(),
            progress=progress,
        )
        replace_folder(staging, out, overwrite=overwrite)
    except BaseException:
        discard(staging)
        raise
    return ConversionResult(out, result, (old_ctx, config.max_position_embeddings), dtype_name, notes)


def convert_checkpoint(
    src: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    config: str | None = None,
    tokenizer: str | os.PathLike | None = None,
    dtype: str | None = "fp32",
    max_position_embeddings: int | None = None,
    stage: str | None = None,
    license: str | None = None,
    license_name: str | None = None,
    overwrite: bool = False,
    expect_kind: str | None = None,
    progress: bool = True,
    command: str = "convert",
    rename_map: dict[str, str] | None = None,
    log=print,
) -> ConversionResult:
    """Read `src` (see `load_checkpoint`) and write it as a verified Hub folder (see `export_checkpoint`)."""
    check_destination(out_dir, [src, tokenizer, config_file(config)], overwrite=overwrite)
    remove_stale_temps(Path(out_dir).absolute().parent)
    if expect_kind is not None and sniff_format(Path(src)) != expect_kind:
        raise ValueError(f"{src}: expected a {expect_kind} file, found {sniff_format(Path(src))}")
    previous = _previous_card(Path(src))
    ckpt = load_checkpoint(src, config=config, tokenizer=tokenizer, progress=progress, rename_map=rename_map)
    return export_checkpoint(
        ckpt, out_dir, dtype=dtype, max_position_embeddings=max_position_embeddings,
        stage=stage or previous.get("stage"), license=license or previous.get("license"),
        license_name=license_name or previous.get("license_name"), overwrite=overwrite, progress=progress,
        command=command, log=log,
    )
