"""Read safetensors weights: a released folder (config.json + model.safetensors [+ index] + tokenizer.json), an
exported Hub folder, or a lone `.safetensors` file next to a config.json."""

from __future__ import annotations

from pathlib import Path

import torch

from ..configuration_spike_whale import SpikeWhaleConfig
from .checkpoint import config_from_dict, one_line, read_json


def _safetensors_error(path: Path, err: Exception) -> ValueError:
    return ValueError(f"{path}: not a valid safetensors file ({one_line(err)[:200]})")


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
            weight_map = read_json(weights)["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError("weight_map is not an object of file names")
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{weights}: not a valid safetensors index ({one_line(err)})") from err
        sd, files = {}, []
        for shard in sorted(set(weight_map.values())):
            if Path(shard).name != shard:
                raise ValueError(f"{weights}: shard {shard!r} is not a file name in {folder}")
            sd.update(read_safetensors_file(folder / shard))
            files.append(folder / shard)
    else:
        sd, files = read_safetensors_file(weights), [weights]
    if config is None:
        cfg_path = folder / "config.json"
        if not cfg_path.is_file():
            raise FileNotFoundError(f"{folder}: no config.json; pass --config")
        config = config_from_dict(read_json(cfg_path), str(cfg_path), notes)
    return sd, config, files
