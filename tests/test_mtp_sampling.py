"""`generate(use_mtp=True, do_sample=True)`: speculative sampling keeps plain sampling's distribution (the exact
distribution of the first tokens against the empirical one, chi-square), and the check catches a sampler that
keeps every draft the main head allows."""

from __future__ import annotations

import math

import torch

from conftest import tiny_model

# Sharp enough that the MTP head's draft distribution differs clearly from the main head's.
SETTINGS = dict(do_sample=True, top_k=4, temperature=0.15, repetition_penalty=1.0)
PROMPT = torch.tensor([[2, 300, 301, 302, 303, 304, 305]])
N_NEW = 3  # t1 from the prefill, t2 accepted or resampled against the MTP draft, t3 after either
# The rule does not depend on the vocabulary's size; a small one keeps the 1,500 sampled rows' sampling cheap (with the
# tokenizer's 16,512 ids, torch.multinomial over every row was most of these tests' time).
VOCAB = 512


def exact_distribution(model, prompt, n):
    """P(t1..tn) of plain sampling with SETTINGS over every path through the top-k ids, from full forwards."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

    warp = LogitsProcessorList([TemperatureLogitsWarper(SETTINGS["temperature"]), TopKLogitsWarper(SETTINGS["top_k"])])
    probs = {(): 1.0}
    for depth in range(n):
        paths = list(probs)  # every path of this depth in one batch: same length, so no padding
        tails = torch.tensor(paths, dtype=torch.long).reshape(len(paths), depth)
        ids = torch.cat([prompt.expand(len(paths), -1), tails], 1)
        with torch.no_grad():
            scores = warp(ids, model(input_ids=ids, use_cache=False).logits[:, -1].float())
        nxt = {}
        for path, dist in zip(paths, torch.softmax(scores, -1)):
            for t in torch.nonzero(dist > 0).flatten().tolist():
                nxt[path + (t,)] = probs[path] * dist[t].item()
        probs = nxt
    return probs


def chi_square(model, rows: int = 250, rounds: int = 6, n_new: int = N_NEW, **extra) -> tuple[float, float]:
    """(statistic, its 99.9% quantile) of MTP sampling's paths against `exact_distribution`."""
    exact = exact_distribution(model, PROMPT, n_new)
    counts = dict.fromkeys(exact, 0)
    torch.manual_seed(0)
    for _ in range(rounds):  # rows of a batch are independent samples (they advance in lockstep)
        ids = PROMPT.expand(rows, -1)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), use_mtp=True,
                             max_new_tokens=n_new, min_new_tokens=n_new, **SETTINGS, **extra)
        for row in out[:, PROMPT.shape[1]:].tolist():
            counts[tuple(row)] += 1  # a path outside the exact support raises KeyError
    total = rows * rounds
    cells, pooled_obs, pooled_exp = [], 0, 0.0  # rare paths pooled so every expected count is >= 5
    for path, p in sorted(exact.items(), key=lambda kv: -kv[1]):
        if p * total >= 5:
            cells.append((counts[path], p * total))
        else:
            pooled_obs, pooled_exp = pooled_obs + counts[path], pooled_exp + p * total
    if pooled_exp > 0:
        cells.append((pooled_obs, pooled_exp))
    chi2 = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    z = 3.09  # 99.9% (Wilson-Hilferty): a correct sampler fails for about one seed in a thousand
    return chi2, dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def test_mtp_sampling_matches_plain_sampling_distribution():
    model = tiny_model(seed=3, vocab_size=VOCAB)
    chi2, limit = chi_square(model)
    assert chi2 < limit, (chi2, limit)
    drafted = accepted = 0
    for _ in range(20):  # one row at a time: the step statistics then show both branches of the rule
        model.generate(input_ids=PROMPT, attention_mask=torch.ones_like(PROMPT), use_mtp=True,
                       max_new_tokens=N_NEW, min_new_tokens=N_NEW, **SETTINGS)
        drafted += model.last_mtp_stats.drafted
        accepted += model.last_mtp_stats.accepted
    assert 0 < accepted < drafted


def test_the_check_catches_a_sampler_that_keeps_every_allowed_draft(monkeypatch):
    model = tiny_model(seed=3, vocab_size=VOCAB)
    # u = 0 makes the rule keep every draft with p > 0, i.e. the draft distribution wherever the main head allows it.
    monkeypatch.setattr(torch, "rand", lambda *args, **kwargs: torch.zeros(*args, **kwargs))
    chi2, limit = chi_square(model)
    assert chi2 > limit, (chi2, limit)


def test_chained_drafts_keep_plain_sampling_distribution():
    # 4 new tokens: t1 from the prefill, then one step drafting 2 (head 1, then head 1 chained on its own state)
    # whose q's come from the processed chained logits, so t2 and t3 each pass the accept/reject rule.
    model = tiny_model(seed=3, vocab_size=VOCAB)
    chi2, limit = chi_square(model, n_new=4, mtp_draft_tokens=2)
    assert chi2 < limit, (chi2, limit)
    widths = []
    handle = model.register_forward_pre_hook(lambda mod, args, kwargs: widths.append(kwargs["input_ids"].shape[1]),
                                             with_kwargs=True)
    try:
        accepted = 0
        for _ in range(20):
            model.generate(input_ids=PROMPT, attention_mask=torch.ones_like(PROMPT), use_mtp=True,
                           max_new_tokens=4, min_new_tokens=4, mtp_draft_tokens=2, **SETTINGS)
            accepted += model.last_mtp_stats.accepted
    finally:
        handle.remove()
    assert 3 in widths and accepted > 20  # two drafts fed, and more kept than one per run
