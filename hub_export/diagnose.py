"""`spike-whale diagnose MODEL_DIR [TEXT_FILE]`: the release's engine tools, each a small table.

- mc: Memory-Cache knock-out - perplexity intact, with every Memory-Cache branch silenced, and with each loop-plan
  slot's branch silenced alone (its output, tanh(mc_gate) * o_proj(y), set to zero in that slot only).
- rope: RoPE swap - the checkpoint's own inverse frequencies with the cos/sin caches rebuilt from them, against the
  other family (geometric θ^(-2j/d) for a fractal checkpoint, fractal γ=1 for a geometric one), same θ.
- loops: loop-pass contribution - perplexity with the first 1, 2, ... loop_count passes of the looped stack.
- compare: checkpoint comparison (`--compare OTHER_DIR`) - per-tensor relative difference |a-b|/|a| and the
  logits of both on prompts cut from the text (max and mean |Δlogit|, top-1 agreement, KL).
- context: context readiness - cached greedy generation against a full recompute (the checks of `verify`) with
  prompts filling a quarter, half and all of the context window the folder claims.

Perplexities are those of `spike-whale eval` (same windows) on the first `--max-tokens` tokens of TEXT_FILE
(default: MODEL_DIR/heldout.txt, the held-out text the default model ships with).
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import sys

TABLES = ("mc", "rope", "loops", "compare", "context")


class Evaluator:
    """Perplexity and bits per byte of one fixed text under the model as it is at the time of the call."""

    def __init__(self, model, ids: list[int], n_bytes: int, context: int, stride: int, batch_size: int):
        self.model, self.ids, self.n_bytes = model, ids, n_bytes
        self.context, self.stride, self.batch_size = context, stride, batch_size

    def __call__(self) -> tuple[float, float]:
        from .perplexity import score_ids

        nll = score_ids(self.model, self.ids, self.context, self.stride, self.batch_size)
        return math.exp(nll / len(self.ids)), nll / (self.n_bytes * math.log(2))


def modules_named(model, class_name: str):
    return [(name, m) for name, m in model.named_modules() if type(m).__name__ == class_name]


@contextlib.contextmanager
def silenced_memory_cache(model, slots: set[int] | None):
    """Zero the Memory-Cache branch output in the given loop-plan slots (None: every slot). A forward walks the loop
    plan slot by slot, so the n-th branch call of a backbone forward is slot n."""
    calls = [0]

    def reset(module, args, kwargs):
        calls[0] = 0

    def hook(module, args, output):
        slot, calls[0] = calls[0], calls[0] + 1
        if slots is not None and slot not in slots:
            return output
        if isinstance(output, tuple):  # (output, the slot's state after the chunk, per-position states)
            return (output[0] * 0, *output[1:])
        return output * 0

    handles = [model.model.register_forward_pre_hook(reset, with_kwargs=True)]
    handles += [m.register_forward_hook(hook) for _, m in modules_named(model, "MemoryCacheBranch")]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def rope_frequencies(model, inv_freq):
    """Every attention's RoPE caches rebuilt from `inv_freq` (restored afterwards)."""
    ropes = [m for _, m in modules_named(model, "SpikeWhaleRotaryEmbedding")]
    saved = [(r.inv_freq.clone(), r.cos_cache.clone(), r.sin_cache.clone()) for r in ropes]
    try:
        for r in ropes:
            for buf, value in zip((r.inv_freq, r.cos_cache, r.sin_cache), r.compute(inv_freq.clone())):
                buf.copy_(value.to(buf.device, buf.dtype))
        yield
    finally:
        for r, values in zip(ropes, saved):
            for buf, value in zip((r.inv_freq, r.cos_cache, r.sin_cache), values):
                buf.copy_(value)


@contextlib.contextmanager
def loop_passes(model, passes: int):
    """The backbone's loop plan cut to the first `passes` loop passes (restored afterwards)."""
    backbone = model.model
    plan = backbone.loop_plan
    config = copy.copy(model.config)
    config.loop_count = passes
    backbone.loop_plan = type(plan).from_config(config)
    try:
        yield
    finally:
        backbone.loop_plan = plan


def table(title: str, header: tuple[str, ...], rows: list[tuple]) -> str:
    cells = [header] + [tuple(f"{c:.4f}" if isinstance(c, float) else str(c) for c in row) for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [title] + ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                       for r in cells]
    return "\n".join(lines)


def mc_knockout(model, evaluate, progress) -> tuple[str, list[dict]]:
    if not model.config.use_memory_cache:
        return "Memory-Cache knock-out: skipped (use_memory_cache=False)", []
    entries = model.model.loop_plan.entries
    cases = [("intact", None, False), ("all slots silenced", None, True)] + [
        (f"slot {s} (layer {layer}, pass {p}) silenced", {s}, True) for s, (layer, p) in enumerate(entries)]
    rows = []
    for label, slots, knock in cases:
        with silenced_memory_cache(model, slots) if knock else contextlib.nullcontext():
            ppl, bpb = evaluate()
        rows.append({"case": label, "perplexity": ppl, "bits_per_byte": bpb})
        progress(f"mc: {label}")
    base = rows[0]["perplexity"]
    return table("Memory-Cache knock-out", ("case", "perplexity", "Δ vs intact", "bits_per_byte"),
                 [(r["case"], r["perplexity"], r["perplexity"] - base, r["bits_per_byte"]) for r in rows]), rows


def rope_swap(model, evaluate, progress) -> tuple[str, list[dict]]:
    rope_inv_freq = sys.modules[type(model.model).__module__].rope_inv_freq  # the folder's own modeling code
    c = model.config
    ropes = modules_named(model, "SpikeWhaleRotaryEmbedding")
    own = ropes[0][1].inv_freq.detach().float().cpu()
    fractal = bool(c.use_fractal_rope and c.fractal_rope_gamma)
    other = rope_inv_freq(c.qk_rope_head_dim, c.rope_theta, not fractal, 1.0)
    names = ("fractal", "geometric") if fractal else ("geometric", "fractal γ=1")
    rows = []
    for label, inv in ((f"{names[0]} (the checkpoint's inv_freq, caches rebuilt)", own),
                       (f"{names[1]} (θ={c.rope_theta:g})", other)):
        with rope_frequencies(model, inv):
            ppl, bpb = evaluate()
        rows.append({"case": label, "perplexity": ppl, "bits_per_byte": bpb})
        progress(f"rope: {label}")
    return table("RoPE swap", ("inverse frequencies", "perplexity", "bits_per_byte"),
                 [(r["case"], r["perplexity"], r["bits_per_byte"]) for r in rows]), rows


def loop_contribution(model, evaluate, progress) -> tuple[str, list[dict]]:
    rows = []
    for passes in range(1, model.config.loop_count + 1):
        with loop_passes(model, passes):
            ppl, bpb = evaluate()
        rows.append({"passes": passes, "slots": passes * model.config.num_hidden_layers, "perplexity": ppl,
                     "bits_per_byte": bpb})
        progress(f"loops: {passes} pass(es)")
    return table("Loop-pass contribution", ("loop passes", "perplexity", "bits_per_byte"),
                 [(r["passes"], r["perplexity"], r["bits_per_byte"]) for r in rows]), rows


def compare_checkpoints(model, other, ids: list[int], progress, n_prompts: int = 4, length: int = 64
                        ) -> tuple[str, dict]:
    import torch

    a_state, b_state = model.state_dict(), other.state_dict()
    common = [k for k in a_state if k in b_state and a_state[k].shape == b_state[k].shape]
    diffs = []
    for k in common:
        a, b = a_state[k].float(), b_state[k].float()
        norm = a.norm().item()
        rel = (a - b).norm().item() / norm if norm else float((a - b).abs().max() > 0)
        diffs.append((k, rel))
    diffs.sort(key=lambda kv: -kv[1])
    only_a = sorted(set(a_state) - set(b_state))
    only_b = sorted(set(b_state) - set(a_state))
    mismatched = [k for k in a_state if k in b_state and a_state[k].shape != b_state[k].shape]
    bos = model.config.bos_token_id
    step = max(1, (len(ids) - length) // n_prompts)
    prompts = torch.tensor([[bos] + ids[i * step: i * step + length - 1] for i in range(n_prompts)
                            if i * step + length - 1 <= len(ids)])
    with torch.no_grad():
        la = model(input_ids=prompts, use_cache=False).logits.float()
        lb = other(input_ids=prompts.to(other.device), use_cache=False).logits.float().to(la.device)
    delta = (la - lb).abs()
    kl = torch.nn.functional.kl_div(lb.log_softmax(-1), la.log_softmax(-1), log_target=True,
                                    reduction="none").sum(-1)
    progress("compare: done")
    report = {
        "tensors_compared": len(common), "tensors_identical": sum(1 for _, r in diffs if r == 0.0),
        "only_in_model": only_a, "only_in_other": only_b, "shape_mismatch": mismatched,
        "largest_relative_differences": diffs[:10], "prompts": int(prompts.shape[0]), "prompt_tokens": length,
        "max_abs_dlogit": delta.max().item(), "mean_abs_dlogit": delta.mean().item(),
        "top1_agreement": (la.argmax(-1) == lb.argmax(-1)).float().mean().item(), "mean_kl": kl.mean().item(),
    }
    lines = [table("Checkpoint comparison: tensors", ("tensor (10 largest |a-b|/|a|)", "relative difference"),
                   [(k, f"{r:.3e}") for k, r in diffs[:10]]),
             f"{report['tensors_identical']}/{len(common)} tensors identical; only in MODEL_DIR: {len(only_a)}, "
             f"only in --compare: {len(only_b)}, shape mismatches: {len(mismatched)}",
             table(f"Checkpoint comparison: logits on {report['prompts']} prompts of {length} tokens",
                   ("max |Δlogit|", "mean |Δlogit|", "top-1 agreement", "mean KL(a||b)"),
                   [(f"{report['max_abs_dlogit']:.3e}", f"{report['mean_abs_dlogit']:.3e}",
                     f"{report['top1_agreement']:.2%}", f"{report['mean_kl']:.3e}")])]
    return "\n".join(lines), report


def context_readiness(model, progress, new_tokens: int = 4) -> tuple[str, list[dict]]:
    from .cache_check import check_prefill, logits_scale, tolerance

    limit = model.config.max_position_embeddings
    tol = tolerance(next(model.parameters()).dtype, logits_scale(model))
    rows = []
    for i, length in enumerate(sorted({max(2, limit // 4), max(2, limit // 2), limit - new_tokens})):
        r = check_prefill(model, length, new_tokens, tol, f"prompt {length} + {new_tokens} new = {length + new_tokens}",
                          seed=i)
        rows.append({"case": r.name, "identical": r.identical, "total": r.total, "max_abs_dlogit": r.max_dlogit,
                     "tolerance": tol, "ok": r.ok, "note": r.note})
        progress(f"context: {r.name}")
    text = table(f"Context readiness (context window {limit}; cached vs full recompute, greedy)",
                 ("positions", "tokens identical", "max |Δlogit|", "result"),
                 [(r["case"], f"{r['identical']}/{r['total']}", f"{r['max_abs_dlogit']:.2e}",
                   ("ok" if r["ok"] else "FAIL") + (f" ({r['note']})" if r["note"] else "")) for r in rows])
    return text, rows


def run(args) -> int:
    from .generate_text import check_model_dir, load
    from .perplexity import check_json_output, check_text_file, read_texts, window_arguments, write_json

    only = args.only or [t for t in TABLES if t != "compare" or args.compare]
    if "compare" in only and not args.compare:
        raise ValueError("--only compare needs --compare OTHER_DIR")
    if args.compare:
        check_model_dir(args.compare)
    text_file = args.text_file or os.path.join(args.model_dir, "heldout.txt")
    needs_text = any(t in only for t in ("mc", "rope", "loops", "compare"))
    if needs_text and args.text_file:
        check_text_file(text_file)
    elif needs_text and not os.path.isfile(text_file):
        raise FileNotFoundError(f"no TEXT_FILE given and {text_file} does not exist: pass a text file to score")
    context, stride = window_arguments(args)
    check_json_output(args, [args.model_dir, text_file if needs_text else None, args.compare])
    tokenizer, model = load(args)

    def progress(message: str) -> None:
        if not args.quiet:
            print(f"  ... {message}", flush=True)

    report = {"model": args.model_dir}
    if needs_text:
        (_, text), = read_texts([text_file])
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"][: args.max_tokens]
        n_bytes = len(tokenizer.decode(ids).encode("utf-8"))
        evaluate = Evaluator(model, ids, n_bytes, context, stride, args.batch_size)
        report.update(text=text_file, tokens=len(ids), bytes=n_bytes, context=context, stride=stride)
        print(f"{args.model_dir}: {len(ids):,} tokens ({n_bytes:,} bytes) of {text_file}, windows of {context} "
              f"positions, stride {stride}\n", flush=True)
    for name in only:
        if name == "mc":
            out, report["mc_knockout"] = mc_knockout(model, evaluate, progress)
        elif name == "rope":
            out, report["rope_swap"] = rope_swap(model, evaluate, progress)
        elif name == "loops":
            out, report["loop_passes"] = loop_contribution(model, evaluate, progress)
        elif name == "compare":
            other_args = copy.copy(args)
            other_args.model_dir = args.compare
            _, other = load(other_args)
            out, report["compare"] = compare_checkpoints(model, other, ids, progress)
        else:
            out, report["context_readiness"] = context_readiness(model, progress)
        print(out + "\n", flush=True)
    if args.json:
        write_json(args.json, report)
    failed = [r for r in report.get("context_readiness", []) if not r["ok"]]
    return 1 if failed else 0


def register(sub) -> None:
    import argparse

    from .generate_text import DTYPE_NAMES, positive_int

    p = sub.add_parser("diagnose", help="engine diagnostics: MC knock-out, RoPE swap, loop passes, compare, context",
                       description=__doc__.split("\n\n", 1)[1].strip(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir")
    p.add_argument("text_file", nargs="?", help="UTF-8 text to score (default: MODEL_DIR/heldout.txt)")
    p.add_argument("--only", action="append", choices=TABLES, help="run only this table (repeatable)")
    p.add_argument("--compare", metavar="OTHER_DIR", help="a second model folder for the checkpoint comparison")
    p.add_argument("--max-tokens", type=positive_int, default=4096, help="tokens of the text scored (default 4096)")
    p.add_argument("--context", type=positive_int, default=None, help="window length (default: the model's)")
    p.add_argument("--stride", type=positive_int, default=None, help="tokens between windows (default: half)")
    p.add_argument("--batch-size", type=positive_int, default=8)
    p.add_argument("--json", help="write every table to this JSON file")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --json file")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="fp32")
    p.add_argument("--threads", type=positive_int, default=None)
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=run)
