"""The checks behind `spike-whale verify MODEL_DIR`: does the cached generation path compute the same function as a
full recompute?

The replacement of the original engine's `verify.py` / `verify_cache.py` / `check_context_ready.py`: the folder is
loaded through the Auto classes (trust_remote_code, exactly as a user would), and greedy generation with the
loop-slot cache is compared token for token and logit for logit with `use_cache=False` (every step recomputed from
position 0) around Memory-Cache segment boundaries, where a wrong cache silently changes the function:

    prefill just under / at / just over a boundary and two segments past it, decode stepping over a boundary,
    multi-token (chunked) decode steps, a left-padded batch against its rows alone, and MTP self-speculation.

Each check reports token agreement first, then max |Δlogit| against a tolerance derived from the dtype and the
logits' scale (`tolerance`): in bfloat16 a cached step and a recompute round differently, so a fixed float32-style
bound would accuse a healthy model. Where greedy decoding parts at a near-tie (the reference's top-2 margin within
the tolerance) the comparison stops there and says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# max |Δlogit| allowed = max(floor, TOL_ULPS * eps(dtype) * max |logit|): a few roundings of the largest logit.
TOL_ULPS = 8
TOL_FLOOR = {torch.float32: 1e-4, torch.float16: 1e-3, torch.bfloat16: 1e-2}


def tolerance(dtype: torch.dtype, logits_scale: float) -> float:
    """The |Δlogit| that rounding alone can explain for logits of magnitude `logits_scale` computed in `dtype`."""
    return max(TOL_FLOOR.get(dtype, 1e-4), TOL_ULPS * torch.finfo(dtype).eps * float(logits_scale))


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


def _margin(logits: torch.Tensor) -> float:
    top = logits.float().topk(2, dim=-1).values
    return float((top[..., 0] - top[..., 1]).min())


def _compare(tokens_a, logits_a, tokens_b, logits_b, tol: float) -> tuple[int, int, float, str]:
    """(identical tokens, tokens compared, max |Δlogit|, note) of one row (or rows) of greedy decoding; a
    divergence at a near-tie of the reference (top-2 margin <= tol) ends the comparison at that step."""
    same = (tokens_a == tokens_b).all(0) if tokens_a.dim() > 1 else tokens_a == tokens_b
    steps = tokens_a.shape[-1]
    first = int((~same).nonzero()[0]) if not bool(same.all()) else steps
    note = ""
    if first < steps:
        margin = _margin(logits_b[..., first, :])
        if margin <= tol:
            note = f"parted at a near-tie at step {first + 1} (top-2 margin {margin:.2e}); compared up to it"
            delta = float((logits_a[..., :first + 1, :] - logits_b[..., :first + 1, :]).abs().max())
            return first * tokens_a.shape[0], first * tokens_a.shape[0], delta, note
    identical = int((tokens_a == tokens_b).sum())
    return identical, tokens_a.numel(), float((logits_a - logits_b).abs().max()), note


def check_prefill(model, length: int, new_tokens: int, tol: float, label: str, seed: int) -> CheckResult:
    ids = _prompt(model.config, length, seed)
    tok_c, log_c, _ = _greedy(model, ids, new_tokens, use_cache=True)
    tok_r, log_r, _ = _greedy(model, ids, new_tokens, use_cache=False)
    identical, total, delta, note = _compare(tok_c, log_c, tok_r, log_r, tol)
    return CheckResult(label, identical, total, delta, tol, note=note)


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
    # Teacher-forced: a different argmax is only a disagreement where the reference's choice was not a near-tie.
    top = ref.topk(2, dim=-1).values
    tie = (top[..., 0] - top[..., 1]) <= tol
    identical = int(((got.argmax(-1) == ref.argmax(-1)) | tie).sum())
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
    notes = [f"rows of {', '.join(map(str, lengths))} tokens"]
    for i, p in enumerate(prompts):
        tok_r, log_r, _ = _greedy(model, p, new_tokens, use_cache=False)
        same, n, d, note = _compare(tok_b[i:i + 1], log_b[i:i + 1], tok_r, log_r, tol)
        identical, total, worst = identical + same, total + n, max(worst, d)
        notes += [f"row {i}: {note}"] if note else []
    return CheckResult(label, identical, total, worst, tol, note="; ".join(notes))


def check_mtp(model, length: int, new_tokens: int, tol: float, label: str, seed: int) -> CheckResult:
    ids = _prompt(model.config, length, seed)
    tok_m, log_m, out = _greedy(model, ids, new_tokens, use_cache=True, use_mtp=True)
    tok_r, log_r, _ = _greedy(model, ids, new_tokens, use_cache=False)
    identical, total, delta, note = _compare(tok_m, log_m, tok_r, log_r, tol)
    accept = f"MTP acceptance {out.mtp_acceptance_rate:.2f} ({out.mtp_accepted_tokens}/{out.mtp_drafted_tokens})"
    return CheckResult(label, identical, total, delta, tol, note="; ".join(filter(None, [accept, note])))


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


def logits_scale(model, seed: int = 0) -> float:
    """max |logit| of the model on a prompt of one Memory-Cache segment: the scale its rounding errors grow with."""
    ids = _prompt(model.config, min(model.config.mc_segment_len, model.config.max_position_embeddings), seed)
    with torch.no_grad():
        return float(model(input_ids=ids.to(model.device), use_cache=False).logits.float().abs().max())


def run_checks(model, new_tokens: int = 6, tol: float | None = None, seed: int = 0, on_result=None) -> list[CheckResult]:
    """Run every check; `tol=None` derives the tolerance (`tolerance`); `on_result(i, n, result, seconds)` is
    called as each one finishes (progress)."""
    import time

    if tol is None:
        tol = tolerance(next(model.parameters()).dtype, logits_scale(model, seed))
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
        t0 = time.time()
        need = (max(length) if isinstance(length, list) else length) + (n or 16)
        if need > P:
            result = CheckResult(label, 0, 0, 0.0, tol, note=f"needs {need} positions > context {P}", skipped=True)
        elif kind == "mtp" and not len(getattr(model, "mtp_heads", ())):
            result = CheckResult(label, 0, 0, 0.0, tol, note="no MTP head", skipped=True)
        elif kind == "prefill":
            result = check_prefill(model, length, n, tol, label, seed + i)
        elif kind == "chunked":
            result = check_chunked(model, length, [2, 3, 5, 4, 2], tol, label, seed + i)
        elif kind == "padded":
            result = check_padded_batch(model, length, n, tol, label, seed + i)
        else:
            result = check_mtp(model, length, n, tol, label, seed + i)
        results.append(result)
        if on_result is not None:
            on_result(i, len(plan), result, time.time() - t0)
    return results


def format_line(r: CheckResult) -> str:
    if r.skipped:
        return f"{r.name}: skipped ({r.note})"
    note = f" ({r.note})" if r.note else ""
    return (f"{r.name}: tokens identical {r.identical}/{r.total}, max |Δlogit| {r.max_dlogit:.2e} "
            f"(tolerance {r.tol:.1e}) {'ok' if r.ok else 'FAIL'}{note}")


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
