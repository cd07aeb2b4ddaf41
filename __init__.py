"""spike_whale: Hugging Face transformers integration of the SpikeWhale v2 / Byrne looped decoder."""

from .configuration_spike_whale import PRESETS, LoopPlan, SpikeWhaleConfig
from .generation_utils import SpikeWhaleCache
from .modeling_spike_whale import SpikeWhaleForCausalLM, SpikeWhaleLM, SpikeWhaleModel, SpikeWhalePreTrainedModel
from .tokenization_spike import SpikeTokenizer

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
