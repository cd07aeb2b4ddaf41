"""Read a released `.pt` training checkpoint (`torch.load(weights_only=True)`: a pickled object is refused, never run).

The state dict is found under the usual keys (or the file is the bare state dict), the config blob likewise (or a
`config.json` next to the file).
"""

from __future__ import annotations

import pickle
import re
import zipfile
from pathlib import Path

import torch

from ..configuration_spike_whale import SpikeWhaleConfig
from .checkpoint import config_from_dict, find_model_config, one_line, read_json

# Where a training checkpoint keeps its weights and its config blob (checked in this order).
STATE_DICT_KEYS = ("model", "state_dict", "model_state_dict", "model_state", "module", "weights", "params", "net")
CONFIG_KEYS = ("config", "cfg", "model_config", "model_cfg", "hparams", "hyper_parameters", "hyperparameters",
               "args", "model_args")

def _is_tensor_dict(obj) -> bool:
    return isinstance(obj, dict) and bool(obj) and all(isinstance(k, str) for k in obj) and all(
        isinstance(v, torch.Tensor) for v in obj.values()
    )


def _torch_load(path: Path):
    if path.stat().st_size == 0:
        raise ValueError(f"{path}: the file is empty (0 bytes); not a PyTorch checkpoint")
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
        raise ValueError(f"{path}: not a readable PyTorch checkpoint ({one_line(err)[:200]})") from err


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
                blob = find_model_config(obj[key])
                if blob is not None:
                    notes.append(f"config read from key {key!r} of the .pt")
                    break
        if blob is None:
            sibling = path.parent / "config.json"
            if sibling.is_file():
                blob = find_model_config(read_json(sibling))
                notes.append(f"config read from {sibling}")
        if blob is None:
            raise ValueError(
                f"{path}: no spike_whale config found (looked under {list(CONFIG_KEYS)}; keys found: {keys[:30]}); "
                "pass --config path/to/config.json"
            )
        config = config_from_dict(blob, str(path), notes)
    return sd, config
