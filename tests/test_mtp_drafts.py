"""`generate(use_mtp=True, do_sample=False)` drafts the MTP head's raw argmax: the head is trained on the model's own
processed greedy text (train_default's MTP self-distillation), so the repetition penalty is not applied again."""

from __future__ import annotations

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
