"""What a command reads: the format of a source (from its content), the reader for it, the vocab next to it."""

from __future__ import annotations

import os
from pathlib import Path

from ..configuration_spike_whale import SpikeWhaleConfig
from ..tokenization_spike import VOCAB_FILE_NAME, load_vocab_file
from .checkpoint import Checkpoint, infer_stage, normalize_state_dict, read_config_arg
from .gguf_io import read_gguf
from .pt_reader import read_pt
from .safetensors_reader import read_safetensors_folder


def sniff_format(path: Path) -> str:
    """'gguf', 'pt', 'safetensors' or 'folder', from the content (not the suffix); unknown is an error."""
    if path.is_dir():
        return "folder"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    if path.stat().st_size == 0:
        raise ValueError(f"{path}: the file is empty (0 bytes); not a spike_whale checkpoint")
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
    rename_map: dict[str, str] | None = None,
) -> Checkpoint:
    """Read `src` (released `.pt`, safetensors folder / file, exported Hub folder, or GGUF) into a `Checkpoint`.

    `config` (a `SpikeWhaleConfig`, a config.json path or inline JSON) replaces the config found in the source;
    `tokenizer` (a spike_vocab.json or custom-format tokenizer.json) replaces the vocab found next to it;
    `rename_map` ({checkpoint name: our name}) is applied before the model's own rename table.
    """
    path = Path(src)
    notes: list[str] = []
    cfg = read_config_arg(config, notes) if isinstance(config, str) else config
    fmt = sniff_format(path)
    vocab = None
    vocab_source = None
    if fmt == "gguf":
        ckpt = read_gguf(path, config=cfg, progress=progress, rename_map=rename_map)
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
    sd = normalize_state_dict(sd, str(path), notes, rename_map)
    vocab_path = Path(tokenizer) if tokenizer is not None else find_vocab(search)
    if vocab_path is not None:
        vocab = load_vocab_file(vocab_path)
        vocab_source = str(vocab_path)
        if vocab_path not in files:
            files.append(vocab_path)
    return Checkpoint(sd, cfg, vocab, fmt if fmt != "folder" else "safetensors", path, files, infer_stage(path),
                      notes, vocab_source=vocab_source)
