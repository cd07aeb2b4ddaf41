"""`spike-whale finetune MODEL_DIR OUT_DIR --text FILE`: causal-LM fine-tuning of a model folder on accelerate's
engines: one process as is, data parallel under `accelerate launch` (DDP, or FSDP2 with the decoder layer as the
wrap unit), with a plain training loop or `transformers.Trainer` (`--trainer`).

The text is tokenized into rows of `--seq-len` tokens and step i trains on the same `--batch-size` rows (the
global batch) whatever the number of processes, each process taking an equal share. The model's loss is a
per-batch mean, so N steps on several processes equal N steps on one when every process gets the same number of
target tokens (rows of equal length; `--packed` keeps that) and the MoE load-balance term, a product of batch
statistics, is off. `--packed` feeds padding-free rows (`DataCollatorWithFlattening`): every row is cut into two
documents that are packed back into one row per process, with `position_ids` restarting at each document.

A step whose loss or gradients are not finite stops the run: the weights after the last update that still gave a
finite loss are saved (nothing when the first update did not) and the command fails, instead of writing NaN weights
as a result.

Heavy imports live inside the functions, so that `--help` answers at once.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from .output_paths import (DestinationChanged, check_destination, discard, keep_folder, remove_stale_temps,
                           replace_folder, staging_folder, temp_folder, write_file)

if TYPE_CHECKING:
    from torch import nn


def token_rows(tokenizer, text: str, seq_len: int):
    """The text's token ids cut into consecutive rows of `seq_len` ([n, seq_len] long tensor)."""
    import torch

    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    n = len(ids) // seq_len
    if n == 0:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one row of --seq-len {seq_len}")
    return torch.tensor(ids[: n * seq_len]).view(n, seq_len)


def global_batches(n_rows: int, steps: int, batch_size: int, seed: int):
    """Row indices of each step's global batch ([steps, batch_size]), the same for any process count."""
    import torch

    return torch.randint(0, n_rows, (steps, batch_size), generator=torch.Generator().manual_seed(seed))


def step_features(rows, batch, step: int, packed: bool) -> list[dict]:
    """The global batch of one step as collator features, in row order: one per row (labels = input ids) or,
    `packed`, each row cut at a point seeded by (step, row position) into two documents."""
    import torch

    if not packed:
        return [{"input_ids": rows[i].tolist(), "labels": rows[i].tolist()} for i in batch]
    g = torch.Generator().manual_seed(step)
    cuts = torch.randint(2, rows.shape[1] - 1, (len(batch),), generator=g).tolist()
    return [{"input_ids": rows[i, a:b].tolist()} for i, cut in zip(batch, cuts) for a, b in ((0, cut), (cut, None))]


def collator(packed: bool):
    """`DataCollatorWithFlattening` (one padding-free row, position_ids restarting per document) or plain
    stacking of equal-length rows."""
    from transformers import DataCollatorWithFlattening, default_data_collator

    return DataCollatorWithFlattening(return_tensors="pt") if packed else default_data_collator


def process_share(features: list, index: int, count: int) -> list:
    """This process's equal, contiguous share of a global batch."""
    if len(features) % count:
        raise ValueError(f"a global batch of {len(features)} does not split evenly over {count} processes")
    size = len(features) // count
    return features[index * size: (index + 1) * size]


# Parameters of the "embedding / table" tier of `three_tier_param_groups`.
_EMBEDDING_TIER = re.compile(r"(^|\.)(embed_tokens|engram\.lookup\.tables\.\d+|loop_pass_embed)\.weight$")


def three_tier_param_groups(
    model: nn.Module,
    lr: float,
    embedding_lr_scale: float = 0.1,
    weight_decay: float = 0.1,
) -> list[dict]:
    """The seed's "three-tier optimizer" as `torch.optim` parameter groups (e.g. `AdamW(groups)`).

    1. "embedding": the token embedding (= the tied lm_head), the Engram n-gram tables and the loop-pass
       embeddings, at `lr * embedding_lr_scale` and no weight decay — they are lookup tables whose rows
       see few updates each, so they train at a lower LR (the seed: "embed/table params trained at lower LR").
    2. "matrix": every other parameter with 2+ dims (projections, experts, heads) at `lr` with `weight_decay`.
    3. "scalar": vectors and scalars (norm weights, biases, gates, DERF/Elo/HC parameters) at `lr`, no decay.

    The frozen Engram compressor (and anything else with requires_grad=False) is left out, so it stays frozen
    whatever the optimizer does; tied parameters appear once. The 0.1 LR scale and the decay split are this
    port's defaults [U]: the seed names the tiers' purpose, not their numbers.
    """
    groups = {"embedding": [], "matrix": [], "scalar": []}
    seen = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if _EMBEDDING_TIER.search(name) or name.endswith("lm_head.weight"):
            groups["embedding"].append(p)
        elif p.dim() >= 2:
            groups["matrix"].append(p)
        else:
            groups["scalar"].append(p)
    settings = {
        "embedding": dict(lr=lr * embedding_lr_scale, weight_decay=0.0),
        "matrix": dict(lr=lr, weight_decay=weight_decay),
        "scalar": dict(lr=lr, weight_decay=0.0),
    }
    return [dict(params=ps, name=tier, **settings[tier]) for tier, ps in groups.items() if ps]


def param_groups(model, lr: float) -> list[dict]:
    """The model's three-tier AdamW groups, the main (matrix) group first: the Trainer logs the first group's rate,
    which is then `--lr` itself, not the embeddings' scaled one."""
    return sorted(three_tier_param_groups(model, lr), key=lambda group: group.get("name") != "matrix")


class Diverged(RuntimeError):
    """Training stopped at a non-finite loss or gradient (or non-finite weights after the last step); the model
    holds the last good weights, those after `steps` optimizer steps. `result` is what the training function
    would have returned."""

    def __init__(self, message: str, steps: int, result):
        super().__init__(message)
        self.steps, self.result = steps, result


class LastGoodWeights:
    """A copy of the trained parameters as of the last step whose loss and gradients were finite, put back when a
    step goes non-finite: a diverged run ends with its last good state, never with NaN weights. Costs one copy of
    the parameters, on their device."""

    def __init__(self, optimizer, accelerator=None):
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.accelerator = accelerator if accelerator is not None and accelerator.num_processes > 1 else None
        self.copy = None
        self.steps = 0

    def all_finite(self, tensors) -> bool:
        """Whether every tensor is finite on every process (a sharded tensor is checked by its local part)."""
        import torch

        bad = sum(int(not torch.isfinite(t.to_local() if hasattr(t, "to_local") else t).all())
                  for t in tensors if t is not None)
        if self.accelerator is not None:
            bad = int(settled(self.accelerator.reduce(torch.tensor(bad, device=self.accelerator.device), "sum")))
        return bad == 0

    def keep(self, steps: int) -> None:
        """The weights now (after `steps` optimizer steps) gave a finite loss and gradients: keep them."""
        import torch

        with torch.no_grad():
            if self.copy is None:
                self.copy = [p.detach().clone() for p in self.params]
            else:
                for c, p in zip(self.copy, self.params):
                    c.copy_(p)
        self.steps = steps

    def restore(self) -> None:
        import torch

        if self.copy is not None:
            with torch.no_grad():
                for c, p in zip(self.copy, self.params):
                    p.copy_(c)

    def diverged(self, what: str, result) -> Diverged:
        self.restore()
        return Diverged(what, self.steps, result)


def sharded_by_transformers(model) -> bool:
    """Whether transformers' own FSDP2 (`DistributedConfig(fsdp_size=N)`) sharded the model at load."""
    return getattr(model, "is_distributed_loading_by_transformers", False)


def train_loop(model, rows, batches, *, lr: float, max_grad_norm: float = 1.0, packed: bool = False,
               accelerator=None):
    """AdamW on the model's three-tier parameter groups, one optimizer step per global batch, gradient norm
    clipped. Returns (the model as `accelerator` prepared it, each step's loss averaged over the processes); raises
    `Diverged`, the last good weights put back, when a loss or gradient (or the final weights) is not finite.

    accelerate wraps the model (DDP, or FSDP2 from the launch config); a model transformers already sharded with
    FSDP2 is left as it is (its gradients are reduced by FSDP2 itself). Without `accelerator`: plain torch."""
    import torch

    optimizer = torch.optim.AdamW(param_groups(model, lr), lr=lr)
    index, count = 0, 1
    wrap = accelerator is not None and not sharded_by_transformers(model)
    if wrap:
        model, optimizer = accelerator.prepare(model, optimizer)
    if accelerator is not None:
        index, count = accelerator.process_index, accelerator.num_processes
    collate = collator(packed)
    guard = LastGoodWeights(optimizer, accelerator)
    model.train()
    losses = []
    total = len(batches)
    for step, batch in enumerate(batches.tolist()):
        loss = model(**collate(process_share(step_features(rows, batch, step, packed), index, count))).loss
        if wrap:
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        value = float(settled(accelerator.reduce(loss.detach(), "mean")) if accelerator is not None else loss.detach())
        if not (math.isfinite(value) and guard.all_finite(p.grad for p in guard.params)):
            model.eval()
            raise guard.diverged(f"step {step + 1} of {total}: the loss ({value}) or its gradients are not finite",
                                 (model, losses))
        guard.keep(step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(value)
    model.eval()
    if not guard.all_finite(guard.params):
        raise guard.diverged(f"step {total} of {total}: the update made the weights non-finite", (model, losses))
    return model, losses


def trainer_arguments(work_dir: str, *, global_batch: int, steps: int, lr: float, max_grad_norm: float):
    """`TrainingArguments` for the same steps as `train_loop`: constant LR, no weight decay, clipping, batches read
    in order (accelerate then hands each process its share of each global batch), a loss logged every step."""
    from transformers import TrainingArguments

    from accelerate import PartialState

    args = TrainingArguments(
        output_dir=work_dir, per_device_train_batch_size=1, max_steps=steps, learning_rate=lr,
        lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=max_grad_norm, logging_steps=1,
        save_strategy="no", report_to=[], train_sampling_strategy="sequential", dataloader_num_workers=0,
        disable_tqdm=True, logging_nan_inf_filter=False,  # a NaN loss is logged as one, not hidden
    )
    args.per_device_train_batch_size = global_batch // PartialState().num_processes  # set up by TrainingArguments
    return args


def train_with_trainer(model, rows, batches, args, *, lr: float, packed: bool = False):
    """`train_loop`'s steps through `transformers.Trainer` (`args` from `trainer_arguments`): the global batches'
    features laid out in order and the same AdamW groups. Returns (the Trainer, its logged per-step losses); raises
    `Diverged` as `train_loop` does (gradients checked before each optimizer step)."""
    import torch
    from transformers import Trainer, TrainerCallback

    features = [f for step, batch in enumerate(batches.tolist()) for f in step_features(rows, batch, step, packed)]
    if packed:  # two documents per row
        args.per_device_train_batch_size *= 2
    optimizer = torch.optim.AdamW(param_groups(model, lr), lr=lr)
    state = {}

    class StopAtNonFinite(TrainerCallback):
        """Before each optimizer step: keep finite weights, or put the last good ones back, drop the gradients
        (the step then changes nothing) and stop."""

        def on_pre_optimizer_step(self, args, trainer_state, control, **kwargs):
            guard = state.setdefault("guard", LastGoodWeights(optimizer, trainer.accelerator))
            if guard.all_finite(p.grad for p in guard.params):
                guard.keep(trainer_state.global_step)
                return
            state["step"] = trainer_state.global_step + 1
            guard.restore()
            for p in guard.params:
                p.grad = None
            control.should_training_stop = True

    trainer = Trainer(model=model, args=args, train_dataset=features, data_collator=collator(packed),
                      optimizers=(optimizer, None), callbacks=[StopAtNonFinite()])
    trainer.train()
    model.eval()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    guard = state["guard"]
    if "step" in state:
        raise guard.diverged(f"step {state['step']} of {args.max_steps}: the loss or its gradients are not finite",
                             (trainer, losses))
    if not guard.all_finite(guard.params):
        raise guard.diverged(f"step {args.max_steps} of {args.max_steps}: the update made the weights non-finite",
                             (trainer, losses))
    return trainer, losses


def settled(tensor):
    """`tensor`, once no collective holds it any more. gloo's worker threads free a finished collective's tensors
    after its caller has moved on, and freeing a tensor Python made takes the GIL; the process group's destructor
    joins those threads while holding the GIL, so a group dropped before they have freed it deadlocks the process.
    Every collective on CPU tensors here therefore waits (the GIL released) until its tensors are this process's
    alone, at most 10 s; a device tensor's collective (NCCL) is not gloo's and does not wait."""
    import time

    import torch.distributed as dist

    if not dist.is_initialized() or tensor.device.type != "cpu":
        return tensor
    deadline = time.monotonic() + 10
    while getattr(tensor, "_use_count", lambda: 1)() > 1 and time.monotonic() < deadline:
        time.sleep(0.0005)
    return tensor


def broadcast_from_main(value: str | None, accelerator) -> str | None:
    """`value` as the main process has it, on every process (through tensors it sees `settled`)."""
    import torch
    import torch.distributed as dist

    if accelerator.num_processes == 1:
        return value
    data = json.dumps(value).encode() if accelerator.is_main_process else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=accelerator.device)
    dist.broadcast(size, src=0)
    buffer = torch.zeros(int(settled(size)), dtype=torch.uint8, device=accelerator.device)
    if accelerator.is_main_process:
        buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buffer, src=0)
    return json.loads(bytes(settled(buffer).cpu().tolist()).decode())


def save_folder(model, tokenizer, out_dir, accelerator, source_dir, overwrite: bool = False) -> None:
    """Save the trained weights gathered whole, the model's code files and config, and the tokenizer as a folder
    that loads with `trust_remote_code=True`, through a staging folder. Every process must call it.

    OUT_DIR is checked again before the swap (training takes long; the user may have made it meanwhile): if it may
    no longer be written, the saved folder is kept next to it and the error says where."""
    from torch.distributed.fsdp import FSDPModule

    out = Path(out_dir)
    error = None
    main = accelerator.is_main_process
    if main:
        remove_stale_temps(out.absolute().parent)
    staging = Path(broadcast_from_main(str(staging_folder(out)) if main else None, accelerator))
    try:
        unwrapped = accelerator.unwrap_model(model)
        if isinstance(unwrapped, FSDPModule):
            # FSDP2 (accelerate's or transformers' own) gives the model torch's wrapper class, whose code
            # save_pretrained would copy (and name in auto_map): gather the weights with torch and save them through
            # an unsharded copy of the source model.
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
            from transformers import AutoModelForCausalLM

            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            state_dict = get_model_state_dict(unwrapped, options=options)
            if main:
                plain = AutoModelForCausalLM.from_pretrained(source_dir, trust_remote_code=True, dtype=unwrapped.dtype)
                plain.save_pretrained(staging, state_dict=state_dict)
        else:
            state_dict = accelerator.get_state_dict(model)
            if main:
                unwrapped.save_pretrained(staging, state_dict=state_dict)
        if main:
            tokenizer.save_pretrained(staging)
            try:
                replace_folder(staging, out, overwrite=overwrite)
            except DestinationChanged as err:
                error = f"{err}: the trained model was saved to {keep_folder(staging, out)} instead"
    except BaseException:
        if main:
            discard(staging)
        raise
    error = broadcast_from_main(error, accelerator)  # every process waits for the save, and fails with it
    if error:
        raise ValueError(error)


def unsupported(trainer: bool, fsdp_size: int) -> str | None:
    """Why the installed transformers cannot run these options, or None."""
    from transformers import TrainingArguments
    from transformers.distributed import DistributedConfig

    if trainer and "train_sampling_strategy" not in {f.name for f in dataclasses.fields(TrainingArguments)}:
        return ("--trainer needs TrainingArguments(train_sampling_strategy=...) to read the batches in order "
                "(transformers 5.18 has it, 5.0 does not)")
    if fsdp_size > 1 and "fsdp_size" not in {f.name for f in dataclasses.fields(DistributedConfig)}:
        return "--fsdp-size needs DistributedConfig(fsdp_size=...) (transformers 5.18 has it, 5.0 does not)"
    return None


def run(args) -> int:
    """Runs in every process `accelerate launch` starts; accelerate's state (or the Trainer's arguments) is set up
    first, so that `ACCELERATE_USE_CPU=1` and the launch's DDP/FSDP settings apply."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from accelerate import Accelerator, PartialState

    from .generate_text import check_model_dir
    from .perplexity import check_text_file

    for flag, value, least in (("--steps", args.steps, 1), ("--batch-size", args.batch_size, 1),
                               ("--seq-len", args.seq_len, 4)):
        if value < least:
            raise ValueError(f"{flag} must be at least {least}, got {value}")
    for flag, value in (("--lr", args.lr), ("--max-grad-norm", args.max_grad_norm)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{flag} must be a finite number above 0, got {value}")
    reason = unsupported(args.trainer, args.fsdp_size)
    if reason is not None:
        raise NotImplementedError(reason)
    check_model_dir(args.model_dir)
    check_text_file(args.text, "--text")
    check_destination(args.out_dir, [args.model_dir, args.text], overwrite=args.overwrite)
    if args.losses_json:
        check_destination(args.losses_json, [args.model_dir, args.text, args.out_dir], overwrite=args.overwrite,
                          kind="file", flag="--losses-json")
    text = Path(args.text).read_text(encoding="utf-8")
    work_dir = temp_folder("spike-whale-trainer")  # the Trainer's output_dir
    try:
        if args.trainer:
            training_args = trainer_arguments(str(work_dir), global_batch=args.batch_size, steps=args.steps, lr=args.lr,
                                              max_grad_norm=args.max_grad_norm)
            first = training_args.main_process_first
        else:
            accelerator = Accelerator()
            first = accelerator.main_process_first
        load = {}
        state = PartialState()
        accelerate_fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
        if args.batch_size % state.num_processes:
            raise ValueError(f"--batch-size {args.batch_size} does not split evenly over {state.num_processes} "
                             "processes; give a multiple of the process count")
        if args.fsdp_size > 1:
            if accelerate_fsdp:
                raise ValueError("--fsdp-size shards with transformers' own FSDP2; drop accelerate's --use_fsdp flags")
            if args.fsdp_size != state.num_processes:
                raise ValueError(f"--fsdp-size {args.fsdp_size} must equal the number of processes "
                                 f"({state.num_processes}); launch with --num_processes {args.fsdp_size}")
            from transformers.distributed import DistributedConfig

            load["distributed_config"] = DistributedConfig(fsdp_size=args.fsdp_size)
        elif accelerate_fsdp and str(state.distributed_type) != "DistributedType.FSDP":
            raise NotImplementedError(
                f"the launch asks for FSDP but accelerate set up {state.distributed_type} (accelerate turns FSDP on "
                "only on accelerator devices, not on CPU); on CPU use transformers' own FSDP2 instead: drop the "
                "--use_fsdp flags and pass --fsdp-size N"
            )
        with first():  # the first load writes the folder's code into the modules cache
            tokenizer = AutoTokenizer.from_pretrained(args.model_dir, trust_remote_code=True)
            model = AutoModelForCausalLM.from_pretrained(args.model_dir, trust_remote_code=True, dtype=torch.float32,
                                                         **load)
        rows = token_rows(tokenizer, text, args.seq_len)
        batches = global_batches(rows.shape[0], args.steps, args.batch_size, args.seed)
        try:
            if args.trainer:
                result = train_with_trainer(model, rows, batches, training_args, lr=args.lr, packed=args.packed)
            else:
                result = train_loop(model, rows, batches, lr=args.lr, max_grad_norm=args.max_grad_norm,
                                    packed=args.packed, accelerator=accelerator)
            diverged = None
        except Diverged as err:
            diverged, result = err, err.result
        if args.trainer:
            trainer, losses = result
            accelerator, model = trainer.accelerator, trainer.model_wrapped
        else:
            model, losses = result
    finally:
        discard(work_dir)
    if diverged is None or diverged.steps > 0:
        save_folder(model, tokenizer, args.out_dir, accelerator, args.model_dir, overwrite=args.overwrite)
    if accelerator.is_main_process:
        state = accelerator.state
        summary = {"processes": state.num_processes, "distributed_type": str(state.distributed_type),
                   "steps": args.steps, "global_batch": args.batch_size, "losses": losses}
        if diverged is not None:
            summary["diverged"] = str(diverged)
        if args.losses_json:
            write_file(args.losses_json, json.dumps(summary, indent=2))
    main_process, processes, kind = accelerator.is_main_process, accelerator.num_processes, accelerator.distributed_type
    # Leave the process group: a gloo thread still running at interpreter exit aborts the process.
    accelerator.end_training()
    if diverged is not None:
        kept = (f"stopped and saved the weights after step {diverged.steps}, the last good ones, to {args.out_dir}"
                if diverged.steps else f"stopped; no step gave good weights, nothing was written to {args.out_dir}")
        raise RuntimeError(f"training diverged at {diverged}; {kept} (try a lower --lr)")
    if main_process:
        print(f"trained {args.steps} steps on {processes} process(es) ({kind}): "
              f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; wrote {args.out_dir}")
    return 0


def register(sub) -> None:
    p = sub.add_parser(
        "finetune",
        help="fine-tune a model folder on a text file (one process, or DDP/FSDP2 under accelerate)",
        description="Fine-tune a model folder on a UTF-8 text file and save it as a new folder. Run it as is, or "
        "under `accelerate launch --num_processes N` for DDP or FSDP2 (see the README's Scaling out section).",
    )
    p.add_argument("model_dir", help="model folder (loaded with trust_remote_code=True)")
    p.add_argument("out_dir", help="folder to write (must not exist or be empty)")
    p.add_argument("--text", required=True, help="UTF-8 text file to train on")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps (default: 100)")
    p.add_argument("--batch-size", type=int, default=8,
                   help="rows per step over all processes together (default: 8); must divide by the process count")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per row (default: 128)")
    p.add_argument("--lr", type=float, default=1e-4,
                   help="learning rate (default: 1e-4, constant; the embeddings get 0.1 of it)")
    p.add_argument("--max-grad-norm", type=float, default=1.0,
                   help="gradient clipping norm, above 0 (default: 1.0)")
    p.add_argument("--seed", type=int, default=0, help="seed of the row sampling (default: 0)")
    p.add_argument("--packed", action="store_true",
                   help="padding-free packed rows (DataCollatorWithFlattening), two documents per row")
    p.add_argument("--trainer", action="store_true", help="train through transformers.Trainer")
    p.add_argument("--fsdp-size", type=int, default=1,
                   help="shard the model with transformers' own FSDP2 over this many processes (DistributedConfig"
                   "(fsdp_size=N), the decoder layer as the wrap unit); works on CPU, where accelerate's FSDP does not")
    p.add_argument("--losses-json", help="also write the per-step losses to this JSON file")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier export at OUT_DIR, whole (never a folder holding other files)")
    p.set_defaults(func=run)
