"""spike_whale: Hugging Face transformers integration of the SpikeWhale v2 / Byrne looped decoder."""

import importlib

# Imported on first use, so that `spike-whale --help` (which imports this package) does not load torch.
_LAZY = {
    "PRESETS": "configuration_spike_whale", "LoopPlan": "configuration_spike_whale",
    "SpikeWhaleConfig": "configuration_spike_whale",
    "SpikeWhaleCache": "generation_utils",
    "SpikeWhaleForCausalLM": "modeling_spike_whale", "SpikeWhaleLM": "modeling_spike_whale",
    "SpikeWhaleModel": "modeling_spike_whale", "SpikeWhalePreTrainedModel": "modeling_spike_whale",
    "SpikeTokenizer": "tokenization_spike",
}


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "PRESETS",
    "LoopPlan",
    "SpikeTokenizer",
    "SpikeWhaleCache",
    "SpikeWhaleConfig",
    "SpikeWhaleForCausalLM",
    "SpikeWhaleLM",
    "SpikeWhaleModel",
    "SpikeWhalePreTrainedModel",
]
