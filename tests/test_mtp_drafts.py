"""`generate(use_mtp=True, do_sample=False)` drafts the MTP head's raw argmax: the head is trained on the model's own
processed greedy text (train_default's MTP self-distillation), so the repetition penalty is not applied again."""

from __future__ import annotations

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from conftest import tiny_model


def test_greedy_draft_is_the_heads_raw_argmax_under_a_repetition_penalty():
    # With a zero MTP projection the head's raw argmax is the main head's raw argmax at the same place, an id the
    # context already holds (the pending token, or one the penalty pushed aside), so a penalised draft differs.
    model = tiny_model(seed=3)
    with torch.no_grad():
        model.mtp_heads[0].proj.weight.zero_()
    head_logits, fed = [], []
    model.mtp_heads[0].register_forward_hook(lambda mod, args, out: head_logits.append(model.lm_head(out)))
    model.register_forward_pre_hook(
        lambda mod, args, kwargs: fed.append(((kwargs.get("cache") or kwargs["past_key_values"]).get_seq_length(), kwargs["input_ids"])), with_kwargs=True)
    ids = torch.tensor([[2, 40, 41, 42, 43, 44, 45, 46]])
    settings = dict(do_sample=False, max_new_tokens=12, repetition_penalty=1000.0)
    with torch.no_grad():
        mtp = model.generate(ids, use_mtp=True, **settings)
        verify = [(length, chunk) for length, chunk in fed if chunk.shape[1] == 2]
        plain = model.generate(ids, **settings)
    assert torch.equal(mtp, plain)
    assert len(verify) == len(head_logits) > 3
    penalty = RepetitionPenaltyLogitsProcessor(1000.0)
    penalised_differs = 0
    for (length, chunk), logits in zip(verify, head_logits):
        context = mtp[:, : length + 1]  # the cached positions and the pending token
        assert torch.equal(chunk[:, 1], logits.argmax(-1))
        penalised_differs += int(penalty(context, logits.clone()).argmax(-1).item() != chunk[0, 1].item())
    assert penalised_differs > 0


def _gated_run(model, ids, **settings):
    """Greedy MTP ids, the MTP head's top probability at each draft decision, and whether the forward after it fed
    a draft (two tokens)."""
    probs, widths = [], []
    hooks = [
        model.mtp_heads[0].register_forward_hook(
            lambda mod, args, out: probs.append(torch.softmax(model.lm_head(out).float(), -1).amax(-1).item())),
        model.register_forward_pre_hook(lambda mod, args, kwargs: widths.append(kwargs["input_ids"].shape[1]),
                                        with_kwargs=True),
    ]
    try:
        with torch.no_grad():
            out = model.generate(ids, use_mtp=True, do_sample=False, **settings)
    finally:
        for hook in hooks:
            hook.remove()
    fed = [w == 2 for w in widths[1:]]  # widths[0] is the prefill
    assert not any(fed[len(probs):])  # the head runs at every step with room for a draft (not the last ones)
    return out, probs, fed[: len(probs)]


def test_confidence_gate_drafts_exactly_where_the_heads_top_probability_is_above_the_threshold():
    model = tiny_model(seed=3)
    ids = torch.tensor([[2, 40, 41, 42, 43, 44, 45, 46]])
    settings = dict(max_new_tokens=16, min_new_tokens=16, repetition_penalty=1000.0)
    with torch.no_grad():
        plain = model.generate(ids, do_sample=False, **settings)
    ungated, probs, fed = _gated_run(model, ids, **settings)
    assert torch.equal(ungated, plain) and all(fed)  # unset: every step drafts (not transformers' 0.4 default)
    threshold = sorted(probs)[len(probs) // 2]  # the median head probability: some steps above, some not
    out, probs, fed = _gated_run(model, ids, assistant_confidence_threshold=threshold, **settings)
    assert torch.equal(out, plain)
    assert fed == [p > threshold for p in probs]
    assert 0 < sum(fed) < len(fed)
    stats = model.last_mtp_stats
    assert stats.verify_steps == sum(fed) and stats.withheld == len(fed) - sum(fed)


def test_confidence_threshold_one_never_drafts_and_comes_from_the_caller_or_generation_config():
    model = tiny_model(seed=3)
    ids = torch.tensor([[2, 40, 41, 42, 43, 44, 45, 46]])
    settings = dict(max_new_tokens=10, min_new_tokens=10)
    with torch.no_grad():
        plain = model.generate(ids, do_sample=False, **settings)
    out, _, fed = _gated_run(model, ids, assistant_confidence_threshold=1.0, **settings)
    assert torch.equal(out, plain) and not any(fed) and model.last_mtp_stats.drafted == 0
    model.generation_config.assistant_confidence_threshold = 1.0  # a model-level default (generation_config.json)
    out, _, fed = _gated_run(model, ids, **settings)
    assert torch.equal(out, plain) and not any(fed)
    out, _, fed = _gated_run(model, ids, assistant_confidence_threshold=0.0, **settings)  # the caller's value wins
    assert torch.equal(out, plain) and all(fed)
    with pytest.raises(ValueError, match=r"assistant_confidence_threshold=1\.5.*\[0, 1\]"):
        _gated_run(model, ids, assistant_confidence_threshold=1.5, **settings)


def test_sampling_with_every_draft_withheld_is_plain_sampling():
    # The gate draws nothing from the random stream, so with no drafts the same seed gives plain sampling's ids.
    model = tiny_model(seed=3)
    ids = torch.tensor([[2, 40, 41, 42, 43, 44, 45, 46]])
    settings = dict(do_sample=True, top_k=8, max_new_tokens=12, min_new_tokens=12)
    with torch.no_grad():
        torch.manual_seed(7)
        plain = model.generate(ids, **settings)
        torch.manual_seed(7)
        gated = model.generate(ids, use_mtp=True, assistant_confidence_threshold=1.0, **settings)
    assert torch.equal(gated, plain) and model.last_mtp_stats.drafted == 0
