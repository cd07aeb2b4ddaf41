"""`spike-whale verify MODEL_DIR`: does the cached generation path compute the same function as a full recompute?

The replacement of the original engine's `verify.py` / `verify_cache.py` / `check_context_ready.py`: the folder is
loaded through the Auto classes (trust_remote_code, exactly as a user would), and greedy generation with the
loop-slot cache is compared token for token and logit for logit with `use_cache=False` (every step recomputed from
position 0) around Memory-Cache segment boundaries, where a wrong cache silently changes the function:

    prefill just under / at / just over a boundary and two segments past it, decode stepping over a boundary,
    multi-token (chunked) decode steps, a left-padded batch against its rows alone, and MTP self-speculation.

Prints the slot count and, per check, "tokens identical N/N" and max |Δlogit| (the card's tables); the exit code
is 1 if any check fails.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch

from .checkpoint import DTYPES


@dataclass
class CheckResult:
    name: str
    identical: int
    total: int
    max_dlogit: float
    tol: float
    note: str = ""
    skipped: bool = False

    @property
    def ok(self) -> bool:
        return self.skipped or (self.identical == self.total and self.max_dlogit <= self.tol)


def _prompt(config, length: int, seed: int) -> torch.Tensor:
    """`<bos>` + random ordinary token ids (no specials, no reserved ids), [1, length]."""
    g = torch.Generator().manual_seed(seed)
    hi = max(16, config.vocab_size - 111)
    ids = torch.randint(10, hi, (1, length), generator=g)
    if config.bos_token_id is not None:
        ids[0, 0] = config.bos_token_id
    return ids


def _greedy(model, ids, new_tokens, use_cache, attention_mask=None, **extra):
    """Plain greedy through `model.generate`, exactly `new_tokens` steps, raw logits returned."""
    out = model.generate(
        input_ids=ids.to(model.device),
        attention_mask=None if attention_mask is None else attention_mask.to(model.device),
        do_sample=False, num_beams=1, repetition_penalty=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        use_cache=use_cache, output_logits=True, return_dict_in_generate=True, **extra,
    )
    return out.sequences[:, ids.shape[1]:].cpu(), torch.stack(out.logits, 1).float().cpu(), out


def _compare(tokens_a, logits_a, tokens_b, logits_b) -> tuple[int, int, float]:
    identical = int((tokens_a == tokens_b).sum())
    return identical, tokens_a.numel(), float((logits_a - logits_b).abs().max())


def check_prefill(model, length: int, new_tokens: int, tol: float, label: str, seed: int) -> CheckResult:
    ids = _prompt(model.config, length, seed)
    tok_c, log_c, _ = _greedy(model, ids, new_tokens, use_cache=True)
    tok_r, log_r, _ = _greedy(model, ids, new_tokens, use_cache=False)
    return CheckResult(label, *_compare(tok_c, log_c, tok_r, log_r), tol)


def check_chunked(model, prefill: int, chunks: list[int], tol: float, label: str, seed: int) -> CheckResult:
    """Teacher-forced decode in multi-token chunks through one cache vs one full forward of the same ids."""
    total = prefill + sum(chunks)
    ids = _prompt(model.config, total, seed).to(model.device)
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits[:, prefill - 1: total - 1].float().cpu()
        out = model(input_ids=ids[:, :prefill], use_cache=True, logits_to_keep=1)
        cache, got, pos = out.cache, [out.logits[:, -1:].float().cpu()], prefill
        for n in chunks[:-1]:
            out = model(input_ids=ids[:, pos:pos + n], cache=cache, use_cache=True)
            got.append(out.logits.float().cpu())
            pos += n
        # The logits of the last chunk's inputs would predict past `total`; feed it for the cache, drop the surplus.
        out = model(input_ids=ids[:, pos:pos + chunks[-1]], cache=cache, use_cache=True)
        got.append(out.logits[:, :-1].float().cpu())
    got = torch.cat(got, 1)
    identical = int((got.argmax(-1) == ref.argmax(-1)).sum())
    return CheckResult(label, identical, ref.shape[1], float((got - ref).abs().max()), tol,
                       note=f"chunks {'+'.join(map(str, chunks))}")


def check_padded_batch(model, lengths: list[int], new_tokens: int, tol: float, label: str, seed: int) -> CheckResult:
    """Left-padded batch with the cache vs each prompt alone with a full recompute."""
    prompts = [_prompt(model.config, n, seed + i) for i, n in enumerate(lengths)]
    width = max(lengths)
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - p.shape[1]:] = p[0]
        mask[i, width - p.shape[1]:] = 1
    tok_b, log_b, _ = _greedy(model, ids, new_tokens, use_cache=True, attention_mask=mask, pad_token_id=pad)
    identical = total = 0
    worst = 0.0
    for i, p in enumerate(prompts):
        tok_r, log_r, _ = _greedy(model, p, new_tokens, use_cache=False)
        same, n, d = _compare(tok_b[i:i + 1], log_b[i:i + 1], tok_r, log_r)
        identical, total, worst = identical + same, total + n, max(worst, d)
    return CheckResult(label, identical, total, worst, tol, note=f"rows of {', '.join(map(str, lengths))} tokens")


def check_mtp(model, length: int, new_tokens: int, tol: float, label: str, seed: int) -> CheckResult:
    ids = _prompt(model.config, length, seed)
    tok_m, log_m, out = _greedy(model, ids, new_tokens, use_cache=True, use_mtp=True)
    tok_r, log_r, _ = _greedy(model, ids, new_tokens, use_cache=False)
    return CheckResult(label, *_compare(tok_m, log_m, tok_r, log_r), tol,
                       note=f"MTP acceptance {out.mtp_acceptance_rate:.2f} ({out.mtp_accepted_tokens}/{out.mtp_drafted_tokens})")


def slot_report(model) -> tuple[str, bool]:
    """The loop plan's slot count and whether one cached forward wrote exactly that many cache slots."""
    cfg = model.config
    ids = _prompt(cfg, 3, 0).to(model.device)
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).cache
    written = sum(bool(getattr(layer, "is_initialized", False)) for layer in cache.layers)
    ok = len(cache.layers) == cfg.num_loop_slots == written
    text = (f"loop slots: {cfg.num_loop_slots} ({cfg.num_hidden_layers} layers x {cfg.loop_count} passes, "
            f"loop_mode {cfg.loop_mode}); cache layers written {written}/{len(cache.layers)}")
    return text, ok


def run_checks(model, new_tokens: int = 6, tol: float = 1e-4, seed: int = 0) -> list[CheckResult]:
    cfg = model.config
    L, P = cfg.mc_segment_len, cfg.max_position_embeddings
    under = max(2, L - 4)
    plan = [
        ("prefill", under, new_tokens, f"prefill {under} tok (just under a segment)"),
        ("prefill", L, new_tokens, f"prefill {L} tok (at a segment boundary)"),
        ("prefill", L + 4, new_tokens, f"prefill {L + 4} tok (just over)"),
        ("prefill", 2 * L + 7, new_tokens, f"prefill {2 * L + 7} tok (two segments)"),
        ("prefill", max(2, L - 3), 8, f"decode crossing a boundary (prefill {max(2, L - 3)})"),
        ("chunked", max(2, L - 5), None, "chunked decode, 2-5 tokens per step"),
        ("padded", [max(2, L - 3), L + 2, 2 * L + 1], new_tokens, "left-padded batch == rows alone"),
        ("mtp", max(2, L - 3), 2 * new_tokens, "MTP self-speculative == recompute"),
    ]
    results = []
    for i, (kind, length, n, label) in enumerate(plan):
        need = (max(length) if isinstance(length, list) else length) + (n or 16)
        if need > P:
            results.append(CheckResult(label, 0, 0, 0.0, tol, note=f"needs {need} positions > context {P}", skipped=True))
            continue
        if kind == "mtp" and not len(getattr(model, "mtp_heads", ())):
            results.append(CheckResult(label, 0, 0, 0.0, tol, note="no MTP head", skipped=True))
            continue
        if kind == "prefill":
            results.append(check_prefill(model, length, n, tol, label, seed + i))
        elif kind == "chunked":
            results.append(check_chunked(model, length, [2, 3, 5, 4, 2], tol, label, seed + i))
        elif kind == "padded":
            results.append(check_padded_batch(model, length, n, tol, label, seed + i))
        else:
            results.append(check_mtp(model, length, n, tol, label, seed + i))
    return results


def format_table(results: list[CheckResult]) -> str:
    width = max(len(r.name) for r in results) + 2
    lines = [f"{'check':<{width}}{'tokens identical':>18}{'max |Δlogit|':>15}  result"]
    for r in results:
        if r.skipped:
            lines.append(f"{r.name:<{width}}{'-':>18}{'-':>15}  skipped ({r.note})")
            continue
        tokens = f"{r.identical}/{r.total}"
        verdict = "ok" if r.ok else "FAIL"
        note = f"  ({r.note})" if r.note else ""
        lines.append(f"{r.name:<{width}}{tokens:>18}{r.max_dlogit:>15.2e}  {verdict}{note}")
    return "\n".join(lines)


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def run(args) -> int:
    from transformers import AutoModelForCausalLM

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    tol = args.tol if args.tol is not None else (1e-4 if dtype == torch.float32 else 5e-2)
    t0 = time.time()
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, trust_remote_code=True, dtype=dtype)
    model = model.to(args.device).eval()
    cfg = model.config
    n_params = sum(p.numel() for p in model.parameters())
    print(f"spike-whale verify {args.model_dir}")
    print(f"model: {cfg.model_type}, {n_params:,} parameters, {args.dtype} on {args.device}")
    slots, slots_ok = slot_report(model)
    print(slots + ("" if slots_ok else "  FAIL"))
    from ..generation_utils import cache_footprint

    fp = cache_footprint(cfg, 1, dtype)
    print(f"static cache per sequence at the full context ({cfg.num_loop_slots} slots x {cfg.max_position_embeddings} "
          f"tok, {args.dtype}): K/V {_size(fp['kv'])} + Memory-Cache state {_size(fp['memory_cache'])} "
          f"+ Engram codes {_size(fp['engram'])}")
    mc = f"Memory-Cache segment {cfg.mc_segment_len} tokens" if cfg.use_memory_cache else "Memory Cache off"
    print(f"{mc}; context {cfg.max_position_embeddings}; reference: use_cache=False (full recompute every step)")
    print()
    results = run_checks(model, new_tokens=args.new_tokens, tol=tol, seed=args.seed)
    print(format_table(results))
    ran = [r for r in results if not r.skipped]
    failed = [r for r in ran if not r.ok] + ([] if slots_ok else ["slots"])
    print()
    if failed:
        print(f"FAILED: {len(failed)} of {len(ran) + 1} checks (tolerance {tol:.0e}); the cached path computes a "
              f"different function than a full recompute. ({time.time() - t0:.1f}s)")
        return 1
    print(f"all {len(ran) + 1} checks passed (tokens identical, max |Δlogit| <= {tol:.0e}; {time.time() - t0:.1f}s)")
    return 0


def register(sub) -> None:
    p = sub.add_parser(
        "verify",
        help="check that cached generation == full recompute on a checkpoint folder",
        description="Load MODEL_DIR with AutoModelForCausalLM (trust_remote_code=True) and compare greedy generation "
        "with the loop-slot cache against use_cache=False around Memory-Cache segment boundaries: prefill just "
        "under/at/just over/two segments past a boundary, decode crossing a boundary, chunked decode, a left-padded "
        "batch against its rows alone, and MTP self-speculation. Exit code 1 on any failure.",
    )
    p.add_argument("model_dir")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="load dtype (default float32)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--new-tokens", type=int, default=6, help="greedy tokens per check (default 6)")
    p.add_argument("--tol", type=float, default=None,
                   help="max |Δlogit| allowed (default 1e-4 in float32, 5e-2 otherwise)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    p.set_defaults(func=run)


if __name__ == "__main__":  # pragma: no cover
    from .cli import main

    sys.exit(main(["verify", *sys.argv[1:]]))
