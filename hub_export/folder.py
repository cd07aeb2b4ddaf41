"""Write a model + tokenizer as a Hub-style folder that loads with the Auto classes and trust_remote_code."""

from __future__ import annotations

import os

from ..generation_utils import serving_generation_config
from ..modeling_spike_whale import SpikeWhaleForCausalLM
from ..tokenization_spike import SpikeTokenizer


def register_auto_classes() -> None:
    """Make `save_pretrained`/`push_to_hub` write `auto_map` and copy the flat code files."""
    SpikeWhaleForCausalLM.config_class.register_for_auto_class("AutoConfig")
    SpikeWhaleForCausalLM.register_for_auto_class("AutoModelForCausalLM")
    SpikeTokenizer.register_for_auto_class("AutoTokenizer")


def save_hub_folder(model: SpikeWhaleForCausalLM, tokenizer: SpikeTokenizer, out_dir: str | os.PathLike) -> str:
    """Save weights (safetensors, tied head stored once), config with `auto_map`, the code files, the
    tokenizer (vocab, config with its `auto_map`, ChatML template) and the serving `generation_config.json`."""
    register_auto_classes()
    os.makedirs(out_dir, exist_ok=True)
    model.generation_config = serving_generation_config(model.config)
    tokenizer.model_max_length = model.config.max_position_embeddings
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return str(out_dir)
