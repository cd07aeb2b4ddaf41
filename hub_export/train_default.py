"""Train the committed default model (models/spike-whale-demo) on a real English corpus.

    python -m spike_whale.hub_export.train_default OUT_DIR --corpus CORPUS_DIR --tokenizer VOCAB_DIR --size 10m
    python -m spike_whale.hub_export.train_default OUT_DIR --corpus text.txt[.gz]

`--corpus` is either a folder built by `scripts/build_corpus.py` (train.txt is trained on; validation.txt gives the
held-out batch and OUT_DIR/heldout.txt; test.txt is never read here) or one text file, which `prepare_corpus`
reflows into paragraphs and whose last 5% of paragraphs are held out. The vocabulary is `--tokenizer`'s (a folder
written by `spike-whale train-tokenizer`) or is trained on the training text by the project's Length-MAX trainer.
`--bf16` (default: where the CPU has bf16 instructions) runs the step under bf16 autocast, the model keeping its
float32 modules; `--compile` compiles the forward and backward once (fixed shapes). The objective is the model's own (`model(x, labels=x).loss`: CE +
z-loss + MTP + HRM deep supervision) with its three-tier optimizer groups; the schedule is linear warm-up then
cosine over `--max-steps`, so the same command and seed give the same model. `--time-budget-min` only stops a run
that is slower than planned (the record then says so). Every `--eval-every` steps the loss on a fixed held-out batch
is logged next to the training loss (OUT_DIR/training_log.txt). A checkpoint (model + optimizer + step) is written
every `--checkpoint-every` steps and at the run's last step, and `--resume` continues from it; the resumed run draws
its batches from a generator seeded with seed + step, so it is deterministic too, but not the uninterrupted run.

`--mtp-distill-steps N` then trains only the MTP heads, everything else frozen, with the model's MTP loss on its own
greedy continuations of training-text prompts (`mtp_self_distill`), so that their drafts name the token the main
head will choose; `--mtp-distill-from MODEL_DIR` runs only that stage, starting from a finished folder of the same
corpus (its record's commands are kept, this one appended).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import math
import os
import re
import sys
import time

import torch

from ..configuration_spike_whale import SpikeWhaleConfig
from .serving import serving_generation_config
from ..modeling_spike_whale import SpikeWhaleForCausalLM
from ..tokenization_spike import dump_vocab_data, load_vocab_file
from ..tokenization_spike_fast import SpikeTokenizerFast
from .finetune import three_tier_param_groups
from .folder import save_hub_folder
from .output_paths import check_destination
from .train_tokenizer import train_from_files

# A few million parameters with every Byrne mechanism on (MLA + XSA + QK-norm, fractal RoPE, depth attention,
# Hyper-Connections, Engram, Memory Cache, HRM, MTP), 4 layers looped 3 times = 12 loop-plan slots.
DEFAULT_CONFIG = dict(
    hidden_size=128, num_hidden_layers=4, loop_count=3, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, qk_rope_head_dim=16, q_lora_rank=64, o_lora_rank=64, moe_intermediate_size=384,
    engram_compress_dim=16, engram_table_size=1024, hrm_refine_dim=64, mc_segment_len=64, mc_num_heads=2,
    mc_head_dim=16, mc_gate_dim=32, depth_attention_stride=2, max_position_embeddings=512,
)
# ~10M parameters (4.2M of them the tied embedding), the same mechanisms, for the English corpus: rows of 512
# tokens cross 8 Memory-Cache segments.
ENGLISH_CONFIG = dict(
    hidden_size=256, num_hidden_layers=4, loop_count=3, num_attention_heads=4, num_key_value_heads=2,
    head_dim=64, qk_rope_head_dim=32, q_lora_rank=128, o_lora_rank=128, moe_intermediate_size=768,
    engram_compress_dim=32, engram_table_size=4096, hrm_refine_dim=128, mc_segment_len=64, mc_num_heads=4,
    mc_head_dim=32, mc_gate_dim=64, depth_attention_stride=2, max_position_embeddings=1024,
)
SIZES = {"3m": DEFAULT_CONFIG, "10m": ENGLISH_CONFIG}
HELD_OUT_FRACTION = 0.05
# The held-out text written next to a corpus-folder model (the head of validation.txt): the card's quick check.
HELD_OUT_FILE_BYTES = 65536
# What a run writes into OUT_DIR besides the model folder's files (an earlier run's folder may be replaced or resumed).
# MTP self-distillation prompts: `<bos>` + this many training tokens, continued for --seq-len greedy tokens.
MTP_PROMPT_TOKENS = 32
RUN_FILES = frozenset({"heldout.txt", "training_log.txt", "training_record.json", "training"})


def read_text(path: str) -> str:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as handle:
        return handle.read()


def prepare_corpus(raw: str) -> str:
    """One reflowed paragraph per block (blank line between), dropping box-drawing tables and fragments under
    8 words (the table of contents and the lexicon's headword lists)."""
    paragraphs = []
    for block in re.split(r"\n\s*\n", raw):
        if any("\u2500" <= ch <= "\u257f" for ch in block):
            continue
        text = " ".join(block.split())
        if len(text.split()) >= 8:
            paragraphs.append(text)
    return "\n\n".join(paragraphs) + "\n"


def split_held_out(text: str, fraction: float = HELD_OUT_FRACTION) -> tuple[str, str]:
    paragraphs = text.rstrip("\n").split("\n\n")
    cut = len(paragraphs) - max(1, int(len(paragraphs) * fraction))
    return "\n\n".join(paragraphs[:cut]) + "\n", "\n\n".join(paragraphs[cut:]) + "\n"


def lr_at(step: int, args) -> float:
    """Linear warm-up, then cosine to --min-lr over --max-steps; or, with --schedule wsd, constant until the last
    --decay-fraction of the steps and linear to --min-lr there (so a run's --max-steps can still be changed on
    --resume before its decay starts, without changing any step already taken). With --rewarm-at R, steps from R on
    are a second stage with the same shape over steps R..--max-steps: a finished (decayed) run continued with
    --resume warms up again instead of jumping back to --lr."""
    first = args.rewarm_at if getattr(args, "rewarm_at", None) and step >= args.rewarm_at else 0
    step, total = step - first, args.max_steps - first
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    if args.schedule == "wsd":
        decay_start = total - int(args.decay_fraction * total)
        if step < decay_start:
            return args.lr
        progress = min(1.0, (step - decay_start) / max(1, total - decay_start))
        return args.lr + (args.min_lr - args.lr) * progress
    progress = min(1.0, (step - args.warmup_steps) / max(1, total - args.warmup_steps))
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * progress))


def batch_of(ids: torch.Tensor, starts: torch.Tensor, seq_len: int, bos: int) -> torch.Tensor:
    """Rows of `<bos>` + the seq_len - 1 tokens from each start."""
    return torch.stack([torch.cat([torch.tensor([bos]), ids[s:s + seq_len - 1]]) for s in starts.tolist()])


def held_out_batch(held_ids: torch.Tensor, seq_len: int, bos: int) -> torch.Tensor:
    """The fixed held-out batch: up to 8 consecutive rows from the start of the held-out text."""
    rows = min(8, (len(held_ids) - 1) // seq_len)
    return batch_of(held_ids, torch.arange(rows) * seq_len, seq_len, bos)


@torch.no_grad()
def held_out_loss(model, batch: torch.Tensor) -> float:
    """Mean next-token cross-entropy (nats) of the LM head on a fixed held-out batch."""
    model.eval()
    logits = model(batch, use_cache=False).logits[:, :-1].float()
    model.train()
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()


def corpus_texts(args) -> tuple[str, str, str, dict]:
    """(train text, held-out text, what the held-out batch is drawn from, corpus facts for the record)."""
    if os.path.isdir(args.corpus):
        manifest_path = os.path.join(args.corpus, "manifest.json")
        manifest = json.load(open(manifest_path, encoding="utf-8"))
        train_text = read_text(os.path.join(args.corpus, "train.txt"))
        validation = read_text(os.path.join(args.corpus, "validation.txt"))
        held_text = validation.encode()[:HELD_OUT_FILE_BYTES].decode("utf-8", "ignore")
        facts = {"corpus": "scripts/build_corpus.py folder",
                 "corpus_sha256": {k: v["sha256"] for k, v in manifest["splits"].items()},
                 "manifest_sha256": hashlib.sha256(open(manifest_path, "rb").read()).hexdigest()}
        return train_text, held_text, validation, facts
    text = prepare_corpus(read_text(args.corpus))
    train_text, held_text = split_held_out(text)
    facts = {"corpus": os.path.basename(args.corpus),
             "corpus_sha256": hashlib.sha256(open(args.corpus, "rb").read()).hexdigest(),
             "prepared_sha256": hashlib.sha256(text.encode()).hexdigest()}
    return train_text, held_text, held_text, facts


def encode_cached(tokenizer, text: str, work: str, name: str) -> torch.Tensor:
    """The text's ids, kept in the work folder under the text's and vocabulary's hash (a resumed run skips the
    encoding of a large corpus)."""
    key = hashlib.sha256(text.encode() + tokenizer.backend_tokenizer.to_str().encode()).hexdigest()[:16]
    path = os.path.join(work, f"{name}-{key}.pt")
    if os.path.exists(path):
        return torch.load(path)
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.int32)
    torch.save(ids, path + ".tmp")
    os.replace(path + ".tmp", path)
    return ids


def train(args) -> int:
    torch.set_num_threads(args.threads)
    os.makedirs(args.out_dir, exist_ok=True)
    work = os.path.join(args.out_dir, "training")
    os.makedirs(work, exist_ok=True)
    train_text, held_text, held_source, facts = corpus_texts(args)
    heldout_sha256 = hashlib.sha256(held_text.encode()).hexdigest()
    source = None
    if args.mtp_distill_from:
        source = json.load(open(os.path.join(args.mtp_distill_from, "training_record.json")))
        if source["heldout_sha256"] != heldout_sha256:
            raise ValueError(f"{args.mtp_distill_from} was trained with another held-out split than --corpus "
                             f"{args.corpus} gives; pass the corpus it was trained on.")
    with open(os.path.join(args.out_dir, "heldout.txt"), "w", encoding="utf-8") as handle:
        handle.write(held_text)

    vocab_path = os.path.join(args.mtp_distill_from or args.tokenizer or work, "spike_vocab.json")
    if not os.path.exists(vocab_path):
        train_path = os.path.join(work, "train.txt")
        with open(train_path, "w", encoding="utf-8") as handle:
            handle.write(train_text)
        t0 = time.time()
        data = train_from_files([train_path], vocab_size=args.vocab_size, show_progress=False)
        with open(vocab_path, "w", encoding="utf-8") as handle:
            handle.write(dump_vocab_data(data))
        print(f"Length-MAX vocab (vocab_size {args.vocab_size}) trained in {time.time() - t0:.0f}s", flush=True)
    tokenizer = SpikeTokenizerFast(load_vocab_file(vocab_path))
    ids = encode_cached(tokenizer, train_text, work, "train").long()
    held_ids = encode_cached(tokenizer, held_source, work, "held").long()
    log_path = os.path.join(args.out_dir, "training_log.txt")
    earlier_log = open(os.path.join(args.mtp_distill_from, "training_log.txt")).read() if source else ""
    log_file = open(log_path, "a" if args.resume else "w", encoding="utf-8")
    log_file.write(earlier_log)

    def log(line: str) -> None:
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    if source:
        model = SpikeWhaleForCausalLM.from_pretrained(args.mtp_distill_from, dtype=torch.float32)
        run = {k: source[k] for k in ("steps", "tokens_seen", "minutes", "stopped_by", "seed", "final_lm_loss_ema",
                                      "final_held_out_loss")}
        run["commands"] = source["commands"] + [args.command]
        log(f"from {args.mtp_distill_from} ({run['steps']} steps): MTP self-distillation only")
    else:
        log(f"train: {len(train_text.encode()):,} bytes -> {len(ids):,} tokens; held out: "
            f"{len(held_source.encode()):,} bytes -> {len(held_ids):,} tokens")
        model, run = train_lm(args, ids, held_ids, log)
    if args.mtp_distill_steps:
        run["mtp_self_distillation"] = mtp_self_distill(model, ids, held_ids, args, log)
    log_file.close()
    model.eval()
    save_hub_folder(model, tokenizer, args.out_dir)
    record = {
        "commands": run.pop("commands"),
        **facts,
        "vocab_sha256": hashlib.sha256(open(vocab_path, "rb").read()).hexdigest(),
        "heldout_sha256": heldout_sha256,
        "train_bytes": len(train_text.encode()), "train_tokens": len(ids),
        **run,
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    with open(os.path.join(args.out_dir, "training_record.json"), "w") as handle:
        json.dump(record, handle, indent=2)
    print(json.dumps(record, indent=2), flush=True)
    return 0


def use_bf16(choice: str) -> bool:
    """--bf16 auto: bf16 autocast where the CPU has bf16 instructions (AVX512-BF16 or AMX)."""
    if choice != "auto":
        return choice == "on"
    from ..accel.kernels import cpu_has_mkldnn_bf16
    return cpu_has_mkldnn_bf16()


def train_lm(args, ids: torch.Tensor, held_ids: torch.Tensor, log) -> tuple[SpikeWhaleForCausalLM, dict]:
    """The model's own objective over the LM schedule (from OUT_DIR/training/checkpoint.pt with --resume)."""
    work = os.path.join(args.out_dir, "training")
    torch.manual_seed(args.seed)
    config = SpikeWhaleConfig.from_preset("tiny", **SIZES[args.size])
    model = SpikeWhaleForCausalLM(config)
    eval_batch = held_out_batch(held_ids, args.seq_len, config.bos_token_id)
    opt = torch.optim.AdamW(three_tier_param_groups(model, args.lr, embedding_lr_scale=args.embedding_lr_scale,
                                                   weight_decay=args.weight_decay), betas=(0.9, 0.95),
                            foreach=True)
    base_lrs = [group["lr"] / args.lr for group in opt.param_groups]
    ckpt_path = os.path.join(work, "checkpoint.pt")
    commands_path = os.path.join(work, "commands.json")
    step, spent = 0, 0.0
    if args.resume and os.path.exists(ckpt_path):
        state = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, spent = state["step"], state["elapsed"]
        if step < min(args.max_steps, args.stop_at_step or args.max_steps) and spent >= 60 * args.time_budget_min:
            # Before the record lists this command: a run that trains no step must leave the record as it was.
            raise SystemExit(f"error: --time-budget-min {args.time_budget_min:g} is spent already: it counts the whole "
                             f"run, which has trained {spent / 60:.1f} min; pass a larger one")
        log(f"resumed at step {step} ({spent / 60:.1f} min spent)")
    commands = json.load(open(commands_path)) if args.resume and os.path.exists(commands_path) else []
    commands.append(args.command)
    with open(commands_path, "w") as handle:
        json.dump(commands, handle)
    g = torch.Generator().manual_seed(args.seed + step)
    model.train()
    bf16 = use_bf16(args.bf16)

    def objective(x):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = model(x, labels=x)
        return out.loss, getattr(out, "lm_loss", None), getattr(out, "mtp_loss", None)

    step_fn = torch.compile(objective) if args.compile else objective
    log(f"{sum(p.numel() for p in model.parameters()):,} parameters; bf16 autocast {'on' if bf16 else 'off'}; "
        f"compiled {'yes' if args.compile else 'no'}; {args.threads} threads")
    start = time.time() - spent
    window_start, window_tokens = time.time(), 0
    ema = None
    last = min(args.max_steps, args.stop_at_step or args.max_steps)
    while step < last and time.time() - start < 60 * args.time_budget_min:
        lr = lr_at(step, args)
        for group, scale in zip(opt.param_groups, base_lrs):
            group["lr"] = lr * scale
        starts = torch.randint(0, len(ids) - args.seq_len - 1, (args.batch_size,), generator=g)
        x = batch_of(ids, starts, args.seq_len, config.bos_token_id)
        loss, lm_loss, mtp_loss = step_fn(x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        if not (torch.isfinite(loss) and torch.isfinite(grad_norm)):
            raise FloatingPointError(f"step {step + 1}: the loss or the gradient is not finite; resume from the "
                                     f"last checkpoint with a lower --lr")
        opt.step()
        step += 1
        window_tokens += x.numel()
        lm = lm_loss.item() if lm_loss is not None else loss.item()
        ema = lm if ema is None else 0.95 * ema + 0.05 * lm
        if step % args.log_every == 0 or step % args.eval_every == 0 or step == 1:
            held = f"  held-out {held_out_loss(model, eval_batch):.3f}" if step % args.eval_every == 0 else ""
            mtp = f"  mtp {mtp_loss.item():.3f}" if mtp_loss is not None else ""
            rate = window_tokens / (time.time() - window_start)
            log(f"step {step:5d}  lr {lr:.2e}  loss {loss.item():.3f}  lm {lm:.3f} (ema {ema:.3f}){mtp}{held}  "
                f"{rate:.0f} tok/s  {(time.time() - start) / 60:.1f} min")
            window_start, window_tokens = time.time(), 0
        if step % args.checkpoint_every == 0 or step == last:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
                        "elapsed": time.time() - start}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
    if step >= args.max_steps:
        stopped = "max_steps"
    elif step == args.stop_at_step:
        stopped = "stop_at_step (continue with --resume)"
    else:
        stopped = "time budget (schedule not finished: not reproducible)"
    final_held = held_out_loss(model, eval_batch)
    log(f"stopped by {stopped} at step {step}; held-out loss {final_held:.4f}")
    return model, {
        "commands": commands, "steps": step, "tokens_seen": step * args.batch_size * args.seq_len,
        "minutes": round((time.time() - start) / 60, 1), "stopped_by": stopped, "seed": args.seed,
        "final_lm_loss_ema": round(ema, 4) if ema is not None else None, "final_held_out_loss": round(final_held, 4),
    }


def greedy_continuations(model, ids: torch.Tensor, n: int, new_tokens: int, seed: int) -> torch.Tensor:
    """`<bos>` + MTP_PROMPT_TOKENS tokens from n random places of `ids`, each continued by the model's greedy
    decoding with its serving settings (repetition penalty, suppressed ids), as `generate(do_sample=False)` runs."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - MTP_PROMPT_TOKENS, (n,), generator=g)
    prompts = batch_of(ids, starts, MTP_PROMPT_TOKENS + 1, model.config.bos_token_id)
    settings = serving_generation_config(model.config)
    settings.update(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    model.eval()
    with torch.no_grad():
        return torch.cat([model.generate(input_ids=chunk, attention_mask=torch.ones_like(chunk),
                                         generation_config=settings) for chunk in prompts.split(64)])


def mtp_self_distill(model, ids: torch.Tensor, held_ids: torch.Tensor, args, log) -> dict:
    """Train only the MTP heads (everything else frozen) with the model's MTP loss on the model's own greedy
    continuations of training-text prompts (self-distillation, as Medusa-2 trains its heads): self-speculation
    accepts a draft when it is the main head's greedy choice, which corpus text does not show a head that cannot
    see the next token. Draft agreement (head 1's argmax = the greedy token after next) is measured on greedy
    continuations of held-out prompts, before and after."""
    start = time.time()
    texts = greedy_continuations(model, ids, args.mtp_distill_prompts, args.seq_len, args.seed)
    held = greedy_continuations(model, held_ids, max(1, args.mtp_distill_prompts // 16), args.seq_len, args.seed)
    targets = texts.clone()
    targets[:, :MTP_PROMPT_TOKENS + 1] = -100  # only the model's own tokens are targets
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("mtp_heads."))
    heads = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(heads, lr=args.mtp_distill_lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(args.seed)
    before = draft_agreement(model, held)
    log(f"MTP self-distillation: {len(texts)} greedy continuations of {args.seq_len} tokens "
        f"({time.time() - start:.0f} s); held-out draft agreement {before:.3f}")
    for step in range(1, args.mtp_distill_steps + 1):
        rows = torch.randint(0, len(texts), (args.batch_size,), generator=g)
        loss = model(texts[rows], labels=targets[rows]).mtp_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % args.log_every == 0 or step == args.mtp_distill_steps:
            log(f"distill {step:5d}  mtp {loss.item():.3f}  {(time.time() - start) / 60:.1f} min")
    for p in model.parameters():
        p.requires_grad_(True)
    after = draft_agreement(model, held)
    log(f"held-out draft agreement {before:.3f} -> {after:.3f}")
    return {"steps": args.mtp_distill_steps, "continuations": len(texts), "new_tokens": args.seq_len,
            "lr": args.mtp_distill_lr, "minutes": round((time.time() - start) / 60, 1),
            "held_out_draft_agreement_before": round(before, 4), "held_out_draft_agreement_after": round(after, 4)}


@torch.no_grad()
def draft_agreement(model, texts: torch.Tensor) -> float:
    """Fraction of the greedy tokens (all but the first of each row) that MTP head 1 drafts from two places back."""
    model.eval()
    h = model(texts).last_hidden_state[:, MTP_PROMPT_TOKENS:-2]
    draft = model.lm_head(model.mtp_heads[0](h)).argmax(-1)
    return (draft == texts[:, MTP_PROMPT_TOKENS + 2:]).float().mean().item()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m spike_whale.hub_export.train_default", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", help="model folder to write (training state goes to OUT_DIR/training)")
    p.add_argument("--corpus", required=True,
                   help="a folder built by scripts/build_corpus.py, or one text file (.gz read as gzip)")
    p.add_argument("--tokenizer", default=None, metavar="VOCAB_DIR",
                   help="use this spike-whale train-tokenizer folder's vocabulary (default: train one here)")
    p.add_argument("--size", choices=sorted(SIZES), default="3m", help="model size (3m: the old demo's shape)")
    p.add_argument("--bf16", choices=("auto", "on", "off"), default="auto",
                   help="bf16 autocast (auto: where the CPU has bf16 instructions)")
    p.add_argument("--compile", action="store_true", help="compile the forward and backward (fixed shapes)")
    p.add_argument("--schedule", choices=("cosine", "wsd"), default="cosine")
    p.add_argument("--decay-fraction", type=float, default=0.2, help="wsd: the share of steps that decay")
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--vocab-size", type=int, default=4484,
                   help="Length-MAX vocab size as spike-whale train-tokenizer counts it (4484: 4,096 multi-byte tokens)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--embedding-lr-scale", type=float, default=1.0)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--warmup-steps", type=int, default=30)
    p.add_argument("--max-steps", type=int, default=4000)
    p.add_argument("--time-budget-min", type=float, default=80.0,
                   help="stop a run that is slower than planned; counts the whole run across --resume (the schedule "
                        "follows --max-steps only)")
    p.add_argument("--eval-every", type=int, default=50, help="log the held-out loss every N steps")
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop-at-step", type=int, default=None,
                   help="end after this step (checkpoint written), e.g. to continue with --resume and a longer --max-steps")
    p.add_argument("--rewarm-at", type=int, default=None, metavar="STEP",
                   help="from STEP on, warm up again and run the schedule over STEP..--max-steps (continue a "
                        "finished run with --resume)")
    p.add_argument("--resume", action="store_true",
                   help="continue from OUT_DIR/training/checkpoint.pt (the record lists every command of the run)")
    p.add_argument("--mtp-distill-steps", type=int, default=0,
                   help="then train only the MTP heads, this many steps, on the model's own greedy continuations")
    p.add_argument("--mtp-distill-prompts", type=int, default=256,
                   help="training-text prompts the model continues greedily for the MTP self-distillation")
    p.add_argument("--mtp-distill-lr", type=float, default=3e-3)
    p.add_argument("--mtp-distill-from", default=None, metavar="MODEL_DIR",
                   help="skip the LM schedule: start the MTP self-distillation from this trained folder (same corpus)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier run's folder (never a folder holding files this command does not write)")
    args = p.parse_args(argv)
    args.command = " ".join([p.prog] + (sys.argv[1:] if argv is None else list(argv)))
    if os.path.isdir(args.corpus):
        missing = [f for f in ("train.txt", "validation.txt", "manifest.json")
                   if not os.path.isfile(os.path.join(args.corpus, f))]
        if missing:
            p.error(f"corpus folder {args.corpus!r} lacks {', '.join(missing)} (build it with scripts/build_corpus.py)")
    elif not os.path.isfile(args.corpus):
        p.error(f"corpus {args.corpus!r} not found (a scripts/build_corpus.py folder or a text file)")
    if args.tokenizer and not os.path.isfile(os.path.join(args.tokenizer, "spike_vocab.json")):
        p.error(f"--tokenizer {args.tokenizer!r} holds no spike_vocab.json (write one with spike-whale train-tokenizer)")
    if args.rewarm_at is not None and not (0 < args.rewarm_at < args.max_steps):
        p.error("--rewarm-at must lie between 0 and --max-steps (exclusive)")
    if not (0.0 <= args.decay_fraction <= 1.0):
        p.error("--decay-fraction must lie in [0, 1]")
    if not (math.isfinite(args.lr) and args.lr > 0 and math.isfinite(args.max_grad_norm) and args.max_grad_norm > 0):
        p.error("--lr and --max-grad-norm must be finite and > 0")
    if args.mtp_distill_from and not args.mtp_distill_steps:
        p.error("--mtp-distill-from needs --mtp-distill-steps N (the MTP self-distillation is all it runs)")
    if args.mtp_distill_from and not os.path.isfile(os.path.join(args.mtp_distill_from, "training_record.json")):
        p.error(f"--mtp-distill-from {args.mtp_distill_from}: no training_record.json (a train_default folder)")
    if args.mtp_distill_from and args.resume:
        p.error("--mtp-distill-from starts from a finished folder; it does not combine with --resume")
    try:
        check_destination(args.out_dir, [args.corpus] + ([args.tokenizer] if args.tokenizer else []) + ([args.mtp_distill_from] if args.mtp_distill_from else []), overwrite=args.overwrite or args.resume, also_ours=RUN_FILES)
    except ValueError as err:
        p.error(str(err))
    return train(args)


if __name__ == "__main__":
    sys.exit(main())
