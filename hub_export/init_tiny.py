"""`spike-whale init-tiny OUT_DIR`: build a small spike_whale (random weights) + demo Length-MAX tokenizer."""

from __future__ import annotations

import torch

from ..configuration_spike_whale import SpikeWhaleConfig
from ..modeling_spike_whale import SpikeWhaleForCausalLM
from ..tokenization_spike import build_demo_tokenizer
from .folder import save_hub_folder


def build_tiny(seed: int = 0, preset: str = "tiny", **overrides) -> tuple[SpikeWhaleForCausalLM, object]:
    """A tiny model with every Byrne mechanism on, and the project's demo tokenizer (same id layout)."""
    torch.manual_seed(seed)
    config = SpikeWhaleConfig.from_preset(preset, **overrides)
    model = SpikeWhaleForCausalLM(config).eval()
    tokenizer = build_demo_tokenizer(model_max_length=config.max_position_embeddings)
    return model, tokenizer


def run(args) -> int:
    model, tokenizer = build_tiny(seed=args.seed, preset=args.preset)
    out = save_hub_folder(model, tokenizer, args.out_dir)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: spike_whale preset {args.preset!r}, {n_params:,} parameters, "
          f"{model.config.num_loop_slots} loop slots, context {model.config.max_position_embeddings}")
    return 0


def register(sub) -> None:
    p = sub.add_parser(
        "init-tiny",
        help="write a small random spike_whale + tokenizer as a Hub-style folder",
        description="Build a small spike_whale with random weights and the project's demo Length-MAX tokenizer, "
        "and save both as a folder that AutoModelForCausalLM/AutoTokenizer load with trust_remote_code=True.",
    )
    p.add_argument("out_dir", help="folder to write")
    p.add_argument("--preset", default="tiny", help="config preset (default: tiny)")
    p.add_argument("--seed", type=int, default=0, help="weight-init seed")
    p.set_defaults(func=run)
