"""`spike-whale init-tiny OUT_DIR`: build a small spike_whale (random weights) + demo Length-MAX tokenizer.

torch, the model and the tokenizer are imported inside the functions, so that `spike-whale init-tiny --help` and
argument errors answer at once.
"""

from __future__ import annotations

from pathlib import Path

from .output_paths import check_destination, discard, remove_stale_temps, replace_folder, staging_folder


def build_tiny(seed: int = 0, preset: str = "tiny", **overrides):
    """A tiny model with every Byrne mechanism on, and the project's demo tokenizer (same id layout)."""
    import torch

    from ..configuration_spike_whale import SpikeWhaleConfig
    from ..modeling_spike_whale import SpikeWhaleForCausalLM
    from .train_tokenizer import build_demo_tokenizer

    torch.manual_seed(seed)
    config = SpikeWhaleConfig.from_preset(preset, **overrides)
    model = SpikeWhaleForCausalLM(config).eval()
    tokenizer = build_demo_tokenizer(model_max_length=config.max_position_embeddings)
    return model, tokenizer


def train_on_demo_corpus(model, tokenizer, steps: int, seq_len: int = 64, batch: int = 8, lr: float = 3e-3,
                         seed: int = 0, log=print) -> tuple[float, float]:
    """Fit the model to the built-in demo corpus (next-token loss with every auxiliary term); returns
    (first loss, last loss). A few hundred steps make the offline demo print text rather than noise."""
    import torch

    from .train_tokenizer import DEMO_CORPUS

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


def write_tiny_folder(out_dir, model, tokenizer, overwrite: bool = False) -> Path:
    """Save as a Hub folder at `out_dir` through a staging folder (permissions from the umask); a non-empty
    `out_dir` is replaced, whole, only with `overwrite` and only if it holds nothing but export files."""
    from .folder import save_hub_folder

    out = Path(out_dir)
    check_destination(out, overwrite=overwrite)
    remove_stale_temps(out.absolute().parent)
    staging = staging_folder(out)
    try:
        save_hub_folder(model, tokenizer, staging)
        replace_folder(staging, out, overwrite=overwrite)
    except BaseException:
        discard(staging)
        raise
    return out


def run(args) -> int:
    check_destination(args.out_dir, overwrite=args.overwrite)
    model, tokenizer = build_tiny(seed=args.seed, preset=args.preset)
    if args.train_steps:
        first, last = train_on_demo_corpus(model, tokenizer, args.train_steps, seed=args.seed)
        print(f"trained {args.train_steps} steps on the demo corpus: loss {first:.3f} -> {last:.3f}")
    out = write_tiny_folder(args.out_dir, model, tokenizer, overwrite=args.overwrite)
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
    p.add_argument("out_dir", help="folder to write (must not exist or be empty)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier export at OUT_DIR, whole (never a folder holding other files)")
    p.add_argument("--preset", default="tiny", help="config preset (default: tiny)")
    p.add_argument("--seed", type=int, default=0, help="weight-init seed")
    p.add_argument("--train-steps", type=int, default=0,
                   help="fit the model to the built-in demo corpus for this many steps (0: random weights)")
    p.set_defaults(func=run)
