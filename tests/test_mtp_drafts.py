"""How `generate(use_mtp=True)` drafts: a greedy draft is the MTP head's argmax after the square root of the repetition
penalty (the head is trained on the model's own processed greedy text and has learnt part of the penalty), the
confidence gate (`assistant_confidence_threshold`), and chained drafts past the model's heads (`mtp_draft_tokens`,
`num_assistant_tokens`): y_{k+1} = head_1(norm(y_k))."""

from __future__ import annotations

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from conftest import tiny_model

IDS = torch.tensor([[2, 40, 41, 42, 43, 44, 45, 46]])


def _recorded_run(model, ids, **settings):
    """Greedy MTP ids and, per forward, (cache length before it, the ids it was fed, its final hidden states)."""
    forwards = []

    def before(mod, args, kwargs):
        cache = kwargs.get("cache") or kwargs.get("past_key_values")
        forwards.append([cache.get_seq_length(), kwargs["input_ids"], None])

    def after(mod, args, kwargs, out):
        forwards[-1][2] = out.last_hidden_state

    hooks = [model.register_forward_pre_hook(before, with_kwargs=True),
             model.register_forward_hook(after, with_kwargs=True)]
    try:
        with torch.no_grad():
            out = model.generate(ids, use_mtp=True, do_sample=False, **settings)
    finally:
        for hook in hooks:
            hook.remove()
    return out, forwards


def _draft_logits(model, h, k):
    """The logits [B, k, V] of k drafts from the final hidden state h [B, H] of the place that chose the pending
    token: head i for the first drafts, then head 1 chained on the final norm of the previous draft state."""
    heads, states = model.mtp_heads, []
    for i in range(k):
        states.append(heads[i](h) if i < len(heads) else heads[0](model.model.norm(states[-1])))
    with torch.no_grad():
        return torch.stack([model.lm_head(y) for y in states], 1)


def _steps(model, forwards, k):
    """Per decode step after the prefill: (the context before the step's drafts, its draft logits [B, k, V], the
    ids it fed). The pending token (the first id fed) was chosen at the place before it, computed by the
    previous forward."""
    steps = []
    for (prev_len, _, prev_h), (length, chunk, _) in zip(forwards, forwards[1:]):
        steps.append((length, _draft_logits(model, prev_h[:, length - 1 - prev_len], k), chunk))
    return steps


def test_greedy_draft_is_the_heads_argmax_under_the_square_root_of_the_repetition_penalty():
    # With a zero MTP projection the head's raw argmax is the main head's raw argmax at the same place, an id the
    # context already holds (the pending token, or one the penalty pushed aside), so the penalties change drafts.
    model = tiny_model(seed=3)
    with torch.no_grad():
        model.mtp_heads[0].proj.weight.zero_()
    settings = dict(max_new_tokens=12, repetition_penalty=2.0)
    mtp, forwards = _recorded_run(model, IDS, **settings)
    with torch.no_grad():
        plain = model.generate(IDS, do_sample=False, **settings)
    assert torch.equal(mtp, plain)
    verify = [(length, logits, chunk) for length, logits, chunk in _steps(model, forwards, 1) if chunk.shape[1] == 2]
    assert len(verify) > 3
    half, full = RepetitionPenaltyLogitsProcessor(2.0 ** 0.5), RepetitionPenaltyLogitsProcessor(2.0)
    raw_differs = full_differs = 0
    for length, logits, chunk in verify:
        context = mtp[:, : length + 1]  # the cached positions and the pending token
        assert torch.equal(chunk[:, 1], half(context, logits[:, 0].clone()).argmax(-1))
        raw_differs += int(logits[:, 0].argmax(-1).item() != chunk[0, 1].item())
        full_differs += int(full(context, logits[:, 0].clone()).argmax(-1).item() != chunk[0, 1].item())
    assert raw_differs > 0 and full_differs > 0


def _gated_run(model, ids, **settings):
    """Greedy MTP ids, the top probability of each draft decision's distribution, and whether that step fed a draft."""
    out, forwards = _recorded_run(model, ids, **settings)
    max_length = ids.shape[1] + settings["max_new_tokens"]
    penalty = RepetitionPenaltyLogitsProcessor(settings["repetition_penalty"] ** 0.5) \
        if "repetition_penalty" in settings else (lambda ids, scores: scores)
    probs, fed = [], []
    for length, logits, chunk in _steps(model, forwards, 1):
        if max_length - (length + 1) - 1 > 0:  # room for a draft before max_length
            probs.append(torch.softmax(penalty(out[:, : length + 1], logits[:, 0].float()), -1).amax(-1).item())
            fed.append(chunk.shape[1] == 2)
        else:
            assert chunk.shape[1] == 1
    return out, probs, fed


def test_confidence_gate_drafts_exactly_where_the_heads_top_probability_is_above_the_threshold():
    model = tiny_model(seed=3)
    settings = dict(max_new_tokens=16, min_new_tokens=16, repetition_penalty=1000.0)
    with torch.no_grad():
        plain = model.generate(IDS, do_sample=False, **settings)
    ungated, probs, fed = _gated_run(model, IDS, **settings)
    assert torch.equal(ungated, plain) and all(fed)  # unset: every step drafts (not transformers' 0.4 default)
    threshold = sorted(probs)[len(probs) // 2]  # the median head probability: some steps above, some not
    out, probs, fed = _gated_run(model, IDS, assistant_confidence_threshold=threshold, **settings)
    assert torch.equal(out, plain)
    assert fed == [p > threshold for p in probs]
    assert 0 < sum(fed) < len(fed)
    stats = model.last_mtp_stats
    assert stats.verify_steps == sum(fed) and stats.withheld == len(fed) - sum(fed)


def test_confidence_threshold_one_never_drafts_and_comes_from_the_caller_or_generation_config():
    model = tiny_model(seed=3)
    settings = dict(max_new_tokens=10, min_new_tokens=10)
    with torch.no_grad():
        plain = model.generate(IDS, do_sample=False, **settings)
    out, _, fed = _gated_run(model, IDS, assistant_confidence_threshold=1.0, **settings)
    assert torch.equal(out, plain) and not any(fed) and model.last_mtp_stats.drafted == 0
    model.generation_config.assistant_confidence_threshold = 1.0  # a model-level default (generation_config.json)
    out, _, fed = _gated_run(model, IDS, **settings)
    assert torch.equal(out, plain) and not any(fed)
    out, _, fed = _gated_run(model, IDS, assistant_confidence_threshold=0.0, **settings)  # the caller's value wins
    assert torch.equal(out, plain) and all(fed)
    with pytest.raises(ValueError, match=r"assistant_confidence_threshold=1\.5.*\[0, 1\]"):
        _gated_run(model, IDS, assistant_confidence_threshold=1.5, **settings)


def test_sampling_with_every_draft_withheld_is_plain_sampling():
    # The gate draws nothing from the random stream, so with no drafts the same seed gives plain sampling's ids.
    model = tiny_model(seed=3)
    settings = dict(do_sample=True, top_k=8, max_new_tokens=12, min_new_tokens=12)
    with torch.no_grad():
        torch.manual_seed(7)
        plain = model.generate(IDS, **settings)
        torch.manual_seed(7)
        gated = model.generate(IDS, use_mtp=True, assistant_confidence_threshold=1.0, **settings)
    assert torch.equal(gated, plain) and model.last_mtp_stats.drafted == 0


def test_drafts_past_the_heads_chain_the_first_head_and_stay_exact():
    # A zero projection makes head 1 the identity, so chained drafts are the main head's argmax of norm^k(h); on the
    # tied tiny model, whose greedy text repeats where no_repeat_ngram_size allows, chained drafts are both
    # accepted and rejected.
    model = tiny_model(seed=1)
    with torch.no_grad():
        model.mtp_heads[0].proj.weight.zero_()
    settings = dict(max_new_tokens=24, min_new_tokens=24, no_repeat_ngram_size=3)
    with torch.no_grad():
        plain = model.generate(IDS, do_sample=False, **settings)
    rows = []  # rows of each lm_head product
    hook = model.lm_head.register_forward_hook(lambda mod, args, out: rows.append(args[0].numel() // args[0].shape[-1]))
    out, forwards = _recorded_run(model, IDS, mtp_draft_tokens=3, **settings)
    hook.remove()
    assert torch.equal(out, plain)
    steps = _steps(model, forwards, 3)
    accepted, rejected = [0, 0, 0], [0, 0, 0]
    for length, logits, chunk in steps:
        drafts = chunk[:, 1:]
        assert torch.equal(drafts, logits[:, : drafts.shape[1]].argmax(-1))
        for i in range(drafts.shape[1]):
            if length + 1 + i < out.shape[1]:
                kept = bool(out[0, length + 1 + i] == drafts[0, i])
                accepted[i], rejected[i] = accepted[i] + kept, rejected[i] + (not kept)
                if not kept:
                    break
    assert accepted[1] > 0 and rejected[1] > 0  # the first chained draft, both ways
    assert model.last_mtp_stats.accepted == sum(accepted)
    # One lm_head product per forward gives its main logits and the drafts from each of its places (the model's own
    # product is asked for no rows), so a step that emits fewer tokens than it fed needs no second product.
    assert [r for r in rows if r] == [1 + 3] + [chunk.shape[1] * (1 + 3) for _, _, chunk in steps]


def test_draft_count_comes_from_mtp_draft_tokens_or_num_assistant_tokens_else_the_heads():
    model = tiny_model(seed=0)
    settings = dict(max_new_tokens=8, min_new_tokens=8)

    def widest(**extra):
        _, forwards = _recorded_run(model, IDS, **settings, **extra)
        return max(chunk.shape[1] for _, chunk, _ in forwards[1:])

    assert widest() == 2  # one MTP head: one draft (not transformers' assistant default of 20)
    assert widest(num_assistant_tokens=3) == 4
    model.generation_config.num_assistant_tokens = 2  # generation_config.json
    assert widest() == 3
    assert widest(num_assistant_tokens=1) == 2  # the caller's value wins
    assert widest(mtp_draft_tokens=4, num_assistant_tokens=1) == 5  # and mtp_draft_tokens over both
    for bad in ({"mtp_draft_tokens": 0}, {"num_assistant_tokens": -1}, {"mtp_draft_tokens": 1.5}):
        with pytest.raises(ValueError, match=r"=(0|-1|1\.5): use_mtp=True drafts that many tokens.*int >= 1"):
            widest(**bad)
