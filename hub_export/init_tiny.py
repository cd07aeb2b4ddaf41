"""`spike-whale init-tiny OUT_DIR`: build a small spike_whale (random weights) + demo Length-MAX tokenizer."""

from __future__ import annotations

import torch

from ..configuration_spike_whale import SpikeWhaleConfig
from ..modeling_spike_whale import SpikeWhaleForCausalLM
from ..tokenization_spike import DEMO_CORPUS, build_demo_tokenizer
from .folder import save_hub_folder


def build_tiny(seed: int = 0, preset: str = "tiny", **overrides) -> tuple[SpikeWhaleForCausalLM, object]:
    """A tiny model with every Byrne mechanism on, and the project's demo tokenizer (same id layout)."""
    torch.manual_seed(seed)
    config = SpikeWhaleConfig.from_preset(preset, **overrides)
    model = SpikeWhaleForCausalLM(config).eval()
    tokenizer = build_demo_tokenizer(model_max_length=config.max_position_embeddings)
    return model, tokenizer


def train_on_demo_corpus(model, tokenizer, steps: int, seq_len: int = 64, batch: int = 8, lr: float = 3e-3,
                         seed: int = 0, log=print) -> tuple[float, float]:
    """Fit the model to the built-in demo corpus (next-token loss with every auxiliary term); returns
    (first loss, last loss). A few hundred steps make the offline demo print text rather than noise."""
    ids = torch.tensor(tokenizer(DEMO_CORPUS)["input_ids"])
    seq_len = min(seq_len, len(ids) - 1, model.config.max_position_embeddings)
    g = torch.Generator().manual_seed(seed)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    model.train()
    first = last = float("nan")
    for step in range(steps):
        starts = torch.randint(0, len(ids) - seq_len, (batch,), generator=g)
        x = torch.stack([ids[s:s + seq_len] for s in starts])
        loss = model(x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        sched.step()
        last = loss.item()
        first = last if step == 0 else first
        if log and (step % 50 == 0 or step == steps - 1):
            log(f"step {step:4d}  loss {last:.3f}")
    model.eval()
    return first, last


def run(args) -> int:
    model, tokenizer = build_tiny(seed=args.seed, preset=args.preset)
    if args.train_steps:
        first, last = train_on_demo_corpus(model, tokenizer, args.train_steps, seed=args.seed)
        print(f"trained {args.train_steps} steps on the demo corpus: loss {first:.3f} -> {last:.3f}")
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
    p.add_argument("--train-steps", type=int, default=0,
                   help="fit the model to the built-in demo corpus for this many steps (0: random weights)")
    p.set_defaults(func=run)
