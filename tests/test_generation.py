"""Generation with the loop-slot cache: every `generate` path must compute the same function as a full recompute.

Tiny float32 models, Memory-Cache segments of 8 tokens and every zero-init gate opened (conftest), so that a cache
that drops any state (Memory-Cache sums, Engram prefix, padding, per-slot K/V) changes the logits visibly; the
canary test at the end shows that it does. Untied embeddings give non-degenerate greedy continuations.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import transformers
from packaging import version
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    TextIteratorStreamer,
    TextStreamer,
)

from spike_whale import SpikeWhaleCache
from spike_whale.generation_utils import CACHE_FIELD, MemoryCacheState
from spike_whale.hub_export.serving import serving_generation_config
from spike_whale.tokenization_spike import CHAT_EOS_IDS, RESERVED_IDS

from conftest import open_gates, run_fresh_python, tiny_model

L = 8  # Memory-Cache segment length of the tiny config
TOL = 1e-4


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def tokenizer():
    from spike_whale.hub_export.train_tokenizer import build_demo_tokenizer

    return build_demo_tokenizer()


def prompt(n: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    ids = torch.randint(10, 16000, (batch, n), generator=torch.Generator().manual_seed(seed))
    ids[:, 0] = 2  # <bos>
    return ids


def left_pad(prompts: list[torch.Tensor], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(p.shape[1] for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - p.shape[1]:] = p[0]
        mask[i, width - p.shape[1]:] = 1
    return ids, mask


OLD_ASSISTED_DECODING = version.parse(transformers.__version__) < version.parse("5.24")


def greedy(model, ids, n, **kw):
    kw.setdefault("min_new_tokens", n)
    out = model.generate(
        ids, max_new_tokens=n, do_sample=False, output_scores=True, output_logits=True,
        return_dict_in_generate=True, **kw,
    )
    if not hasattr(out, "cache"):  # transformers < 5.24 names the field past_key_values
        out.cache = getattr(out, CACHE_FIELD)
    return out


def max_dlogit(a, b, rows_a=slice(None), rows_b=slice(None)) -> float:
    assert len(a.logits) == len(b.logits)
    return max(float((x[rows_a] - y[rows_b]).abs().max()) for x, y in zip(a.logits, b.logits))


def count_forwards(model):
    calls = []
    handle = model.register_forward_pre_hook(lambda *a: calls.append(1))
    return calls, handle


# ----------------------------------------------------------------------------- greedy == recompute


@pytest.mark.parametrize(
    "prefill,new",
    [(L - 1, 6), (L, 6), (L + 1, 6), (2 * L + 7, 6), (5, 14)],
    ids=["just-under", "at-boundary", "just-over", "two-segments-past", "decode-crosses-two-boundaries"],
)
def test_greedy_cached_equals_full_recompute(model, prefill, new):
    ids = prompt(prefill, seed=prefill)
    cached = greedy(model, ids, new)
    ref = greedy(model, ids, new, use_cache=False)
    assert isinstance(cached.cache, SpikeWhaleCache)
    assert len(cached.cache.layers) == model.config.num_loop_slots == 8
    assert cached.cache.get_seq_length() == prefill + new - 1
    assert torch.equal(cached.sequences, ref.sequences)
    assert max_dlogit(cached, ref) <= TOL
    assert all(torch.allclose(x, y, atol=TOL, rtol=0) for x, y in zip(cached.scores, ref.scores))  # -inf: suppressed


def test_inputs_embeds_and_chunked_prefill_paths(model):
    ids = prompt(2 * L + 3, seed=2)
    ref = greedy(model, ids, 5, use_cache=False)
    for use_mtp in (False, True):
        embeds = greedy(model, None, 5, inputs_embeds=model.get_input_embeddings()(ids), use_mtp=use_mtp)
        assert torch.equal(embeds.sequences[0], ref.sequences[0, ids.shape[1]:]) and max_dlogit(embeds, ref) <= TOL
    chunked = greedy(model, ids, 5, prefill_chunk_size=5)  # 19-token prompt in chunks of 5
    assert torch.equal(chunked.sequences, ref.sequences) and max_dlogit(chunked, ref) <= TOL


def test_chunked_decode_equals_one_token_decode_and_recompute(model):
    ids = prompt(6 + 2 + 3 + 5 + 4 + 2 + 5 + 3, seed=3)  # 30 positions: crosses 8, 16 and 24 inside chunks
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        steps = {}
        for name, sizes in {"one": [1] * 24, "chunks": [2, 3, 5, 4, 2, 5, 3]}.items():
            out = model(ids[:, :6], use_cache=True)
            cache, got, pos = out.cache, [out.logits], 6
            for n in sizes:
                out = model(ids[:, pos:pos + n], cache=cache, use_cache=True)
                got.append(out.logits)
                pos += n
            assert pos == ids.shape[1] and cache.get_seq_length() == pos
            steps[name] = torch.cat(got, 1)
    assert float((steps["chunks"] - steps["one"]).abs().max()) <= TOL
    assert float((steps["chunks"] - full).abs().max()) <= TOL
    assert float((steps["one"] - full).abs().max()) <= TOL


def test_left_padded_batch_equals_rows_alone(model):
    prompts = [prompt(n, seed=10 + n) for n in (5, 9, 2 * L + 1)]
    ids, mask = left_pad(prompts)
    batch = greedy(model, ids, 7, attention_mask=mask)
    width = ids.shape[1]
    for i, p in enumerate(prompts):
        alone = greedy(model, p, 7, use_cache=False)
        assert torch.equal(batch.sequences[i, width:], alone.sequences[0, p.shape[1]:]), f"row {i}"
        assert max_dlogit(batch, alone, rows_a=slice(i, i + 1)) <= TOL, f"row {i}"


def test_beam_search_with_cache_equals_without(model):
    prompts = [prompt(n, seed=20 + n) for n in (6, 11)]
    ids, mask = left_pad(prompts)
    kw = dict(num_beams=3, num_return_sequences=2, max_new_tokens=6, do_sample=False, attention_mask=mask,
              output_scores=True, return_dict_in_generate=True)
    cached = model.generate(ids, **kw)
    ref = model.generate(ids, use_cache=False, **kw)
    assert cached.sequences.shape == (4, ids.shape[1] + 6)
    assert torch.equal(cached.sequences, ref.sequences)
    assert torch.allclose(cached.sequences_scores, ref.sequences_scores, atol=TOL)


def test_sampling_with_cache_equals_without(model):
    ids = prompt(L + 2, seed=4)
    kw = dict(do_sample=True, temperature=0.7, top_k=40, top_p=0.9, repetition_penalty=1.3, max_new_tokens=8,
              num_return_sequences=2)
    torch.manual_seed(123)
    cached = model.generate(ids, **kw)
    torch.manual_seed(123)
    ref = model.generate(ids, use_cache=False, **kw)
    assert cached.shape == (2, L + 2 + 8)
    assert torch.equal(cached, ref)


def test_logits_processor_stopping_criteria_and_stop_strings(model, tokenizer):
    ids = prompt(7, seed=5)
    plain = greedy(model, ids, 6).sequences[0, 7:]

    class Ban(LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores[:, int(plain[0])] = -float("inf")
            return scores

    class StopAt(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= 7 + 4, dtype=torch.bool)

    out = model.generate(ids, max_new_tokens=10, do_sample=False, logits_processor=LogitsProcessorList([Ban()]),
                         stopping_criteria=StoppingCriteriaList([StopAt()]))
    ref = model.generate(ids, max_new_tokens=10, do_sample=False, logits_processor=LogitsProcessorList([Ban()]),
                         stopping_criteria=StoppingCriteriaList([StopAt()]), use_cache=False)
    assert out.shape[1] == 7 + 4 and torch.equal(out, ref)
    assert int(plain[0]) not in out[0, 7:].tolist()

    # stop strings (need the tokenizer): stop at the text of the 3rd generated token
    text = tokenizer.decode(plain[:3])
    stop = text[-2:] if len(text) >= 2 else text
    out = model.generate(ids, max_new_tokens=6, do_sample=False, stop_strings=[stop], tokenizer=tokenizer)
    assert out.shape[1] <= 7 + 3
    assert tokenizer.decode(out[0, 7:]).endswith(stop)


# ----------------------------------------------------------------------------- streamers


def test_text_streamer_and_iterator_streamer(model, tokenizer, capsys):
    ids = prompt(9, seed=6)
    ref = model.generate(ids, max_new_tokens=8, do_sample=False)
    expected = tokenizer.decode(ref[0, 9:], skip_special_tokens=True)

    for use_mtp in (False, True):
        model.generate(ids, max_new_tokens=8, do_sample=False, use_mtp=use_mtp,
                       streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True))
        assert capsys.readouterr().out.rstrip("\n") == expected.rstrip("\n")

        streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True, timeout=60)
        result = {}
        thread = threading.Thread(target=lambda: result.setdefault("ids", model.generate(
            ids, max_new_tokens=8, do_sample=False, use_mtp=use_mtp, streamer=streamer)))
        thread.start()
        pieces = list(streamer)
        thread.join()
        assert "".join(pieces) == expected
        assert torch.equal(result["ids"], ref)


# ----------------------------------------------------------------------------- MTP self-speculation


def test_mtp_equals_greedy_and_reports_acceptance(model):
    ids = prompt(6, seed=7)
    ref = greedy(model, ids, 20)
    seen = []

    class Count(LogitsProcessor):  # a user processor: called once per emitted token, never on drafts
        def __call__(self, input_ids, scores):
            seen.append(input_ids.shape[1])
            return scores

    calls, handle = count_forwards(model)
    try:
        mtp = greedy(model, ids, 20, use_mtp=True, logits_processor=LogitsProcessorList([Count()]))
    finally:
        handle.remove()
    assert seen == list(range(6, 26))
    assert torch.equal(mtp.sequences, ref.sequences)
    assert max_dlogit(mtp, ref) <= TOL
    stats = model.last_mtp_stats
    assert 0.0 <= mtp.mtp_acceptance_rate <= 1.0
    assert mtp.mtp_acceptance_rate == stats.acceptance_rate
    assert stats.drafted == mtp.mtp_drafted_tokens > 0
    assert stats.forwards == len(calls) == 20 - stats.accepted
    assert mtp.cache.get_seq_length() == 6 + 20 - 1


def test_mtp_useful_head_accepts_and_rejects_and_stays_exact():
    """MTP head = identity (proj zeroed, as if trained to copy): the draft is the main head's own choice at the
    same position, which the tied tiny model repeats, except where no_repeat_ngram_size forbids it - so both
    the accept path and the reject/rollback path run, across several segment boundaries."""
    m = tiny_model(seed=0)
    with torch.no_grad():
        m.mtp_heads[0].proj.weight.zero_()
    ids = prompt(6, seed=8)
    kw = dict(no_repeat_ngram_size=2)
    ref = greedy(m, ids, 26, use_cache=False, **kw)
    mtp = greedy(m, ids, 26, use_mtp=True, **kw)
    assert torch.equal(mtp.sequences, ref.sequences)
    assert max_dlogit(mtp, ref) <= TOL
    stats = m.last_mtp_stats
    assert 0.0 < mtp.mtp_acceptance_rate < 1.0, stats
    assert stats.accepted > 0 and stats.rollbacks > 0
    assert stats.forwards < 26  # accepted drafts saved forwards


def test_mtp_two_heads_padded_batch_and_eos():
    m = tiny_model(seed=1, num_nextn_predict_layers=2)
    with torch.no_grad():
        for head in m.mtp_heads:
            head.proj.weight.zero_()
    prompts = [prompt(n, seed=30 + n) for n in (5, 12)]
    ids, mask = left_pad(prompts)
    kw = dict(no_repeat_ngram_size=3, attention_mask=mask, pad_token_id=0)
    ref = greedy(m, ids, 18, use_cache=False, **kw)
    eos = int(ref.sequences[0, ids.shape[1] + 4])  # row 0 finishes early; row 1 runs on (or both stop)
    ref = m.generate(ids, max_new_tokens=18, do_sample=False, eos_token_id=eos, use_cache=False, **kw)
    for draft_tokens in (1, 2):
        out = m.generate(ids, max_new_tokens=18, do_sample=False, eos_token_id=eos, use_mtp=True,
                         mtp_draft_tokens=draft_tokens, **kw)
        assert torch.equal(out, ref), draft_tokens
        assert 0.0 <= m.last_mtp_stats.acceptance_rate <= 1.0
    assert m.last_mtp_stats.drafted > 0


def test_assisted_decoding_and_prompt_lookup_roll_back_exactly(model):
    """transformers' own assisted decoding crops the cache after every verification; the loop-slot cache rolls
    the Memory-Cache state back exactly, so the model is not declared stateful (`_is_stateful`)."""
    assert model._is_stateful is False
    assistant = tiny_model(seed=5, tie_word_embeddings=False, num_hidden_layers=2)
    ids = prompt(6, seed=3)
    ids = torch.cat([ids, ids[:, 1:], ids[:, 1:]], 1)  # repetitive: prompt lookup finds candidates
    for kw in ({"prompt_lookup_num_tokens": 3}, {"assistant_model": assistant}):
        if OLD_ASSISTED_DECODING and "assistant_model" in kw:
            kw = {**kw, "min_new_tokens": None}  # transformers < 5.24 refuses min lengths with an assistant model
        ref = greedy(model, ids, 20, use_cache=False, **{k: v for k, v in kw.items() if k == "min_new_tokens"})
        out = greedy(model, ids, 20, **kw)
        n = ref.sequences.shape[1]
        if OLD_ASSISTED_DECODING and "prompt_lookup_num_tokens" in kw:
            # transformers < 5.24 may accept a prompt-lookup draft past max_length (5.24 added the token budget);
            # exactness is per token, so compare the tokens both runs produced.
            assert out.sequences.shape[1] <= n + kw["prompt_lookup_num_tokens"]
            out.sequences, out.logits = out.sequences[:, :n], out.logits[: len(ref.logits)]
        assert torch.equal(out.sequences, ref.sequences), kw
        assert max_dlogit(out, ref) <= TOL, kw


def test_assisted_decoding_with_a_growing_draft_count_stays_exact(model):
    """The "heuristic" schedule grows an assistant's drafts by 2 after each fully accepted round, past the count that
    transformers >= 5.25 asks the cache to record at the start; `generate` raises the cache's floor to the new tokens,
    so a long rejected draft still rolls back exactly (without it: a ValueError at the first long rollback)."""
    assistant = tiny_model(seed=0, tie_word_embeddings=False)  # agrees with the model until it is pushed off
    assistant.generation_config.num_assistant_tokens = 2
    assistant.generation_config.num_assistant_tokens_schedule = "heuristic"
    seen = {}

    def note_length(module, args, kwargs):
        cache = kwargs.get(CACHE_FIELD)
        seen["length"] = (cache.get_seq_length() if cache is not None else 0) + kwargs["input_ids"].shape[1]

    def push_off(module, args, out):  # from position 22 on, the assistant always drafts token 5
        return out + (torch.arange(out.shape[-1]) == 5) * 1e4 if seen["length"] >= 22 else out

    assistant.register_forward_pre_hook(note_length, with_kwargs=True)
    assistant.lm_head.register_forward_hook(push_off)
    ids = prompt(6, seed=3)
    ref = greedy(model, ids, 30, use_cache=False, min_new_tokens=None)
    out = greedy(model, ids, 30, assistant_model=assistant, min_new_tokens=None)
    assert assistant.generation_config.num_assistant_tokens > 2  # it grew ("heuristic" keeps it across calls)
    assert torch.equal(out.sequences, ref.sequences)
    assert max_dlogit(out, ref) <= TOL


def test_mtp_refuses_what_it_does_not_implement(model):
    ids = prompt(5)
    calls, handle = count_forwards(model)
    try:
        with pytest.raises(NotImplementedError, match="num_beams"):
            model.generate(ids, do_sample=False, num_beams=2, use_mtp=True, max_new_tokens=3)
        with pytest.raises(ValueError, match="use_cache"):
            model.generate(ids, do_sample=False, use_cache=False, use_mtp=True, max_new_tokens=3)
        with pytest.raises(ValueError, match="MTP head"):
            model.generate(ids, do_sample=False, use_mtp=True, mtp_draft_tokens=0, max_new_tokens=3)
    finally:
        handle.remove()
    assert not calls


# ----------------------------------------------------------------------------- crop / rollback


def _prefill_and_chunk(model, ids, prefix, chunk, record):
    with torch.no_grad():
        cache = model(ids[:, :prefix], use_cache=True).cache
        if record:
            cache.activate_past_recording()
        model(ids[:, prefix:prefix + chunk], cache=cache, use_cache=True)
    return cache


@pytest.mark.parametrize("remove", [1, 2, 5, 9, 11, 12])
def test_crop_mid_chunk_restores_state_exactly(model, remove):
    """Chunk 6..17 crosses boundaries 8 and 16; crop back by `remove`, then the next step must equal a fresh run."""
    ids = prompt(20, seed=9)
    cache = _prefill_and_chunk(model, ids, 6, 12, record=True)
    keep = 18 - remove
    cache.crop(-remove)
    assert cache.get_seq_length() == keep and cache.record_past  # transformers: recording outlives crops
    with torch.no_grad():
        got = model(ids[:, keep:keep + 2], cache=cache, use_cache=True).logits
        fresh = model(ids[:, :keep + 2], use_cache=False).logits[:, keep:]
        # and once more after that (the restored state keeps evolving correctly)
        got2 = model(ids[:, keep + 2:keep + 3], cache=cache, use_cache=True).logits
        fresh2 = model(ids[:, :keep + 3], use_cache=False).logits[:, -1:]
    assert float((got - fresh).abs().max()) <= TOL
    assert float((got2 - fresh2).abs().max()) <= TOL


def test_crop_without_recording(model):
    """As transformers' linear-attention layers: without `activate_past_recording` no Memory-Cache state is recorded
    (the state is updated in place), so a crop that removes positions raises and changes nothing."""
    ids = prompt(20, seed=10)
    cache = _prefill_and_chunk(model, ids, 6, 12, record=False)
    for remove in (3, 12):  # mid-chunk, and back to the chunk start
        with pytest.raises(ValueError, match="activate_past_recording"):
            cache.crop(-remove)
    assert cache.get_seq_length() == 18  # a refused crop changes nothing
    cache.crop(0)
    with torch.no_grad():
        got = model(ids[:, 18:20], cache=cache, use_cache=True).logits
        fresh = model(ids[:, :20], use_cache=False).logits[:, 18:]
    assert float((got - fresh).abs().max()) <= TOL


def test_crop_conventions(model):
    ids = prompt(12, seed=11)
    cache = _prefill_and_chunk(model, ids, 4, 8, record=True)
    cache.crop(0)  # transformers' convention: removes nothing
    assert cache.get_seq_length() == 12 and cache.record_past
    for layer in cache.layers:  # how transformers' loops end a recording
        layer.record_past = False
    assert not cache.record_past
    with pytest.raises(ValueError):
        cache.crop(-13)
    with pytest.raises(ValueError):
        cache.crop(13)
    cache.crop(4)  # positive: keep the first 4 (chunk start: always recorded)
    assert cache.get_seq_length() == 4
    assert int(cache.num_real[0]) == 4 and not bool(cache.key_valid[0, 4:].any())
    assert all(layer.get_seq_length() == 4 for layer in cache.layers)
    assert cache.get_max_length() == model.config.max_position_embeddings


@pytest.mark.parametrize("keep", [0, 1, 3])
def test_a_bounded_recording_keeps_the_last_states_only_and_crops_exactly(model, keep):
    """transformers >= 5.25 says how many tokens it may crop (`activate_past_recording(recurrent_states_to_keep=n)`);
    a forward then records the states at its last n lengths besides its start, not one per token in every slot: a
    long chunk across segment boundaries (per-position sums) and a short one inside a segment (running sums)."""
    ids, mask = left_pad([prompt(26, seed=14), prompt(21, seed=15)])
    with torch.no_grad():
        cache = model(ids[:, :6], attention_mask=mask[:, :6], use_cache=True).cache
        assert cache.get_recurrent_states_to_keep() == 0
        cache.activate_past_recording()
        assert cache.get_recurrent_states_to_keep() == cache.max_cache_len  # no bound: every length
        with pytest.raises(ValueError, match="recurrent_states_to_keep must be >= 0"):
            cache.activate_past_recording(recurrent_states_to_keep=-1)
        cache.activate_past_recording(recurrent_states_to_keep=keep)
        assert cache.get_recurrent_states_to_keep() == keep
        model(ids[:, 6:18], attention_mask=mask[:, :18], cache=cache, use_cache=True)  # crosses boundaries 8 and 16
        for layer in cache.layers:
            assert sorted({int(p) for p, _ in layer.history["mc"]}) == [6, *range(18 - keep, 18)]  # 18: the live state
        with pytest.raises(ValueError, match="recurrent_states_to_keep at least"):
            cache.crop(-(keep + 1))  # one more than was recorded: refused, nothing changed
        assert cache.get_seq_length() == 18
        cache.crop(-keep)
        n = 18 - keep
        got = model(ids[:, n:n + 2], attention_mask=mask[:, :n + 2], cache=cache, use_cache=True).logits
        fresh = model(ids[:, :n + 2], attention_mask=mask[:, :n + 2], use_cache=False).logits[:, n:]
        assert float((got - fresh).abs().max()) <= TOL
        t = n + 2  # a 4-token chunk inside segment 16..23
        model(ids[:, t:t + 4], attention_mask=mask[:, :t + 4], cache=cache, use_cache=True)
        for layer in cache.layers:
            assert {int(p) for p, _ in layer.history["mc"]} - set(range(t + 1)) == set(range(t + 4 - keep, t + 4))
        cache.crop(-keep)
        n = t + 4 - keep
        got = model(ids[:, n:n + 2], attention_mask=mask[:, :n + 2], cache=cache, use_cache=True).logits
        fresh = model(ids[:, :n + 2], attention_mask=mask[:, :n + 2], use_cache=False).logits[:, n:]
    assert float((got - fresh).abs().max()) <= TOL
    cache.deactivate_past_recording()
    assert cache.get_recurrent_states_to_keep() == 0 and cache.recurrent_states_to_keep is None


def test_a_bounded_recording_holds_a_few_states_not_one_per_prompt_token(model, monkeypatch):
    """benchmarks/bench_rollback.py's `recorded_bytes` after a 40-token prefill: the running Memory-Cache sums at the
    last n+1 lengths in every slot with a bound n, at all 40 without one, but the last, which is the live state (the
    finished-segment sums stay shared with the live state), plus each recorded length's segment index (one int64 a
    row, and the chunk start's); nothing without recording."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    bench = importlib.import_module("bench_rollback")
    cfg = model.config
    shapes = MemoryCacheState.shapes(0, cfg.mc_num_heads, cfg.mc_head_dim, cfg.mc_gate_dim)
    state_bytes = 4 * sum(math.prod(shape) for name, shape in shapes.items() if name.startswith("run_"))
    for keep, lengths in ((False, 0), (3, 4), (None, 40)):
        cache = SpikeWhaleCache(cfg)
        if keep is not False:
            cache.activate_past_recording(recurrent_states_to_keep=keep)
        with torch.no_grad():
            model(prompt(40, seed=16), cache=cache, use_cache=True)
        slots = sum(layer.mc is not None for layer in cache.layers)
        assert slots == cfg.num_loop_slots
        segments = 8 * (lengths + 1) if keep is not False else 0
        assert bench.recorded_bytes(cache) == max(lengths - 1, 0) * slots * state_bytes + segments, keep


# ----------------------------------------------------------------------------- context window


def test_overflow_raises_before_any_work(model):
    P = model.config.max_position_embeddings
    ids = prompt(P - 6)
    calls, handle = count_forwards(model)
    try:
        with pytest.raises(ValueError, match=rf"{P - 6} tokens and max_new_tokens=10.*max_position_embeddings={P}"):
            model.generate(ids, max_new_tokens=10, do_sample=False)
        with pytest.raises(ValueError, match="truncate_to_context=True"):
            model.generate(ids, max_length=P + 1, do_sample=False)
        small = SpikeWhaleCache(model.config, max_cache_len=32)
        with pytest.raises(ValueError, match="max_cache_len=32"):
            model.generate(prompt(30), max_new_tokens=5, do_sample=False, cache=small)
    finally:
        handle.remove()
    assert not calls
    with pytest.raises(ValueError, match="context window"):  # the forward itself never wraps either
        model(torch.full((1, P + 1), 7))
    out = model.generate(ids, max_new_tokens=6, do_sample=False)  # exactly fills the window
    assert out.shape[1] == P


def test_truncate_to_context_keeps_bos_and_newest_tokens(model):
    P = model.config.max_position_embeddings
    long, short = prompt(P - 4, seed=12), prompt(7, seed=13)
    ids, mask = left_pad([long, short])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, truncate_to_context=True)
    keep = P - 6
    assert out.shape[1] == P
    expect_long = torch.cat([long[:, :1], long[:, -(keep - 1):]], 1)  # <bos> + the newest tokens
    alone = model.generate(expect_long, max_new_tokens=6, do_sample=False)
    assert torch.equal(out[0], alone[0])
    alone_short = model.generate(short, max_new_tokens=6, do_sample=False)
    assert torch.equal(out[1, -(7 + 6):], alone_short[0])


# ----------------------------------------------------------------------------- multi-turn chat


@pytest.mark.parametrize("use_mtp", [False, True])
def test_a_cache_that_holds_the_whole_prompt_is_refused(model, use_mtp):
    """Nothing new to feed: transformers would feed the whole prompt again on top of the cache (positions counted
    twice, a silently different function), so generate refuses before any work, naming the fix."""
    ids = prompt(5, seed=44)
    with torch.no_grad():
        cache = model(ids, use_cache=True).cache
    with pytest.raises(ValueError, match="already holds 5 positions, as many as the prompt"):
        model.generate(ids, cache=cache, max_new_tokens=3, do_sample=False, use_mtp=use_mtp)
    assert cache.get_seq_length() == 5


def test_multi_turn_continues_from_cache_exactly(model):
    prompts = [prompt(n, seed=40 + n) for n in (6, 3)]
    ids, mask = left_pad(prompts)
    turn1 = greedy(model, ids, 5, attention_mask=mask)
    user2 = prompt(7, seed=41)[:, 1:].expand(2, -1)  # 6 more tokens per row: history crosses 8 and 16
    ids2 = torch.cat([turn1.sequences, user2], 1)
    mask2 = torch.cat([mask, torch.ones(2, 5 + 6, dtype=mask.dtype)], 1)
    cache = turn1.cache
    past = cache.get_seq_length()
    calls = []
    handle = model.register_forward_pre_hook(lambda mod, args, kwargs: calls.append(kwargs["input_ids"].shape[1]),
                                             with_kwargs=True)
    try:
        cont = greedy(model, ids2, 6, attention_mask=mask2, cache=cache)
    finally:
        handle.remove()
    assert calls[0] == ids2.shape[1] - past  # only the new tokens were prefilled
    fresh = greedy(model, ids2, 6, attention_mask=mask2)
    ref = greedy(model, ids2, 6, attention_mask=mask2, use_cache=False)
    assert torch.equal(cont.sequences, ref.sequences) and torch.equal(fresh.sequences, ref.sequences)
    assert max_dlogit(cont, ref) <= TOL

    # third turn with MTP from the second turn's cache
    ids3 = torch.cat([cont.sequences, user2[:, :3]], 1)
    mask3 = torch.cat([mask2, torch.ones(2, 6 + 3, dtype=mask.dtype)], 1)
    mtp = greedy(model, ids3, 5, attention_mask=mask3, cache=cont.cache, use_mtp=True)
    ref3 = greedy(model, ids3, 5, attention_mask=mask3, use_cache=False)
    assert torch.equal(mtp.sequences, ref3.sequences)
    assert max_dlogit(mtp, ref3) <= TOL


# ----------------------------------------------------------------------------- cache API


def test_reorder_and_batch_selection(model):
    ids = prompt(10, seed=14, batch=3)
    nxt = prompt(2, seed=15, batch=3)
    with torch.no_grad():
        ref = model(torch.cat([ids, nxt], 1), use_cache=False).logits[:, -2:]

        cache = model(ids, use_cache=True).cache
        assert cache.layers[0].keys.shape[2] == model.config.max_position_embeddings  # static
        perm = torch.tensor([2, 0, 1])
        cache.reorder_cache(perm)
        got = model(nxt[perm], cache=cache, use_cache=True).logits
        assert float((got - ref[perm]).abs().max()) <= TOL

        cache = model(ids, use_cache=True).cache
        cache.batch_select_indices(torch.tensor([0, 2]))
        got = model(nxt[[0, 2]], cache=cache, use_cache=True).logits
        assert float((got - ref[[0, 2]]).abs().max()) <= TOL

        cache = model(ids, use_cache=True).cache
        cache.batch_repeat_interleave(2)
        got = model(nxt.repeat_interleave(2, 0), cache=cache, use_cache=True).logits
        assert float((got - ref.repeat_interleave(2, 0)).abs().max()) <= TOL


# ----------------------------------------------------------------------------- serving defaults


def test_serving_generation_config_and_reserved_ids_suppressed(model):
    cfg = serving_generation_config(model.config)
    assert (cfg.do_sample, cfg.temperature, cfg.top_k, cfg.repetition_penalty, cfg.max_new_tokens) == (
        True, 0.7, 40, 1.3, 160)
    assert list(cfg.eos_token_id) == list(CHAT_EOS_IDS) and cfg.pad_token_id == 0
    assert sorted(cfg.suppress_tokens) == list(RESERVED_IDS) and len(cfg.suppress_tokens) == 111

    reserved = torch.tensor(list(RESERVED_IDS))

    def love_reserved(module, args, out):  # a model that would always pick a reserved id
        out = out.clone()
        out[..., reserved] += 100.0
        return out

    handle = model.lm_head.register_forward_hook(love_reserved)
    try:
        ids = prompt(6, seed=16)
        unsuppressed = model.generate(ids, max_new_tokens=4, do_sample=False)
        assert all(t in RESERVED_IDS for t in unsuppressed[0, 6:].tolist())
        torch.manual_seed(0)
        for kw in ({"do_sample": False}, {}, {"use_mtp": True, "do_sample": False}):
            out = model.generate(ids, generation_config=cfg, max_new_tokens=6, **kw)
            assert not any(t in RESERVED_IDS for t in out[0, 6:].tolist()), kw
    finally:
        handle.remove()


# ----------------------------------------------------------------------------- canary


def test_identity_checks_detect_a_broken_cache(model, monkeypatch):
    """With these gates and segments, a cache that loses the Memory-Cache or Engram state changes the logits
    far beyond the tolerance, so the identity tests above can fail."""
    ids = prompt(L + 3, seed=17)
    ref = greedy(model, ids, 6, use_cache=False)
    for attr, broken in (("slot_state", lambda self, slot, kind: None), ("engram_prefix", lambda self, n: None)):
        with monkeypatch.context() as mp:
            mp.setattr(SpikeWhaleCache, attr, broken)
            bad = greedy(model, ids, 6)
        assert max_dlogit(bad, ref) > 10 * TOL, attr


# ----------------------------------------------------------------------------- Hub folder: pipeline, CLI


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from spike_whale.hub_export.folder import save_hub_folder
    from spike_whale.hub_export.init_tiny import build_tiny

    model, tok = build_tiny(seed=0, mc_segment_len=8, max_position_embeddings=128, tie_word_embeddings=False)
    open_gates(model)
    path = tmp_path_factory.mktemp("hub") / "spike-tiny"
    save_hub_folder(model, tok, path)
    return path


def test_pipeline_strings_and_chat_messages(tiny_folder, tmp_path):
    out = run_fresh_python(f"""
        import json, torch
        torch.set_num_threads(1)
        from transformers import pipeline
        pipe = pipeline("text-generation", model={str(tiny_folder)!r}, trust_remote_code=True)
        model, tok = pipe.model, pipe.tokenizer
        res = {{"gen_config": model.generation_config.to_dict()}}
        prompt = "The harbour was quiet before dawn."
        res["text"] = pipe(prompt, max_new_tokens=6, do_sample=False)[0]["generated_text"]
        enc = tok(prompt, return_tensors="pt")
        ref = model.generate(**enc, max_new_tokens=6, do_sample=False, use_cache=False)
        res["text_ref"] = prompt + tok.decode(ref[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        res["text_mtp"] = pipe(prompt, max_new_tokens=6, do_sample=False, use_mtp=True)[0]["generated_text"]
        batch = pipe([prompt, "Hi"], max_new_tokens=4, do_sample=False, batch_size=2)
        res["batch"] = [b[0]["generated_text"] for b in batch]
        enc = tok("Hi", return_tensors="pt")
        ref = model.generate(**enc, max_new_tokens=4, do_sample=False, use_cache=False)
        res["batch_ref"] = "Hi" + tok.decode(ref[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        messages = [{{"role": "user", "content": "Why is the sea salty?"}}]
        chat = pipe(messages, max_new_tokens=5, do_sample=False)[0]["generated_text"]
        res["chat"] = chat
        enc = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True, return_tensors="pt")
        ref = model.generate(**enc, max_new_tokens=5, do_sample=False, use_cache=False)
        res["chat_ref"] = tok.decode(ref[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        torch.manual_seed(0)
        res["sampled"] = pipe(prompt, max_new_tokens=5)[0]["generated_text"]  # serving defaults: sampling
        print("RESULT" + json.dumps(res))
    """, tmp_path, timeout=400)
    res = json.loads(out.split("RESULT", 1)[1])
    gc = res["gen_config"]
    assert (gc["temperature"], gc["top_k"], gc["repetition_penalty"], gc["do_sample"]) == (0.7, 40, 1.3, True)
    assert len(gc["suppress_tokens"]) == 111 and sorted(gc["eos_token_id"]) == sorted(CHAT_EOS_IDS)
    assert res["text"] == res["text_ref"] == res["text_mtp"]
    assert res["batch"][0] == res["text"][: len(res["batch"][0])] and res["batch"][1] == res["batch_ref"]
    assert res["chat"][0]["content"] == "Why is the sea salty?"
    assert res["chat"][-1]["role"] == "assistant" and res["chat"][-1]["content"] == res["chat_ref"]
    assert res["sampled"].startswith("The harbour was quiet before dawn.")


def _cli(args, tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"), TRANSFORMERS_VERBOSITY="error")
    return subprocess.run([sys.executable, "-m", "spike_whale", *args], capture_output=True, text=True, env=env,
                          timeout=400, cwd=str(tmp_path))


def test_verify_cli_passes_on_a_good_folder_and_fails_on_a_broken_cache(tiny_folder, tmp_path):
    proc = _cli(["verify", str(tiny_folder), "--threads", "1"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "loop slots: 8 (4 layers x 2 passes" in out and "cache layers written 8/8" in out
    for label in ("just under a segment", "at a segment boundary", "just over", "two segments",
                  "decode crossing a boundary", "chunked decode", "left-padded batch", "MTP"):
        line = next(ln for ln in out.splitlines() if label in ln)
        assert line.split()[-1] == "ok" or " ok " in line, line
    assert "6/6" in out and "8/8" in out and "all 9 checks passed" in out

    # The same folder with the Memory-Cache state dropped from its (remote) cache code must fail.
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny_folder.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    with open(broken / "generation_utils.py", "a") as fh:
        fh.write("\nSpikeWhaleCache.slot_state = lambda self, slot, kind: None  # sabotage for the test\n")
    proc = _cli(["verify", str(broken), "--new-tokens", "3", "--threads", "1"], tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL" in proc.stdout and "FAILED" in proc.stdout


def test_cache_footprint_matches_a_real_cache_and_the_card():
    from spike_whale import SpikeWhaleConfig
    from spike_whale.hub_export.serving import cache_footprint

    m = tiny_model(seed=0)
    ids = prompt(20, batch=2)
    with torch.no_grad():
        cache = m(ids, use_cache=True).cache
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    real = {
        "kv": sum(nbytes(layer.keys) + nbytes(layer.values) for layer in cache.layers),
        "memory_cache": sum(sum(nbytes(t) for t in vars(layer.mc).values()) for layer in cache.layers),
        "engram": nbytes(cache.engram_c),
        "bookkeeping": nbytes(cache.key_valid) + nbytes(cache.num_real) + nbytes(cache.mc_segment),
    }
    est = cache_footprint(m.config, batch_size=2, dtype=torch.float32)
    assert {k: est[k] for k in real} == real
    # The card: 48-slot K/V at 16,384 positions in bf16 is 0.40 GB; the Memory-Cache state adds O(segments).
    big = cache_footprint(SpikeWhaleConfig.from_preset("byrne-100m-ultra-mc", max_position_embeddings=16384))
    assert big["kv"] == 48 * 2 * 2 * 16384 * 64 * 2 and round(big["kv"] / 1e9, 2) == 0.40
    assert big["memory_cache"] < 0.15 * big["kv"]


def test_token_healing_keeps_bos_and_a_fitting_mask(tokenizer):
    """transformers' heal_tokens swaps <bos> for <pad> and re-tokenizes (a trailing space changes the length, so the
    caller's mask no longer fits); generate repairs both before decoding."""
    model = tiny_model(seed=0)
    model.generation_config = serving_generation_config(model.config)  # samples by default: healing must not
    pad, bos = tokenizer.pad_token_id, model.config.bos_token_id
    for text in ("The harbour ", "The harbour w"):
        enc = tokenizer([text], return_tensors="pt")
        runs = [model.generate(**enc, max_new_tokens=3, do_sample=False, token_healing=True, tokenizer=tokenizer)
                for seed in (1, 2, 3) if torch.manual_seed(seed) is not None]
        out = runs[0]
        assert all(torch.equal(r, out) for r in runs), runs  # the healed token is picked greedily
        assert out[0, 0] == bos and not (out[0] == pad).any(), out
        assert tokenizer.decode(out[0], skip_special_tokens=True).startswith(text.strip())


def greedy_tiny_tokenizer():
    """Byte tokens plus ' wh', ' who ', 'or': "x who" tokenizes as 'x', ' wh', 'o', and ' who ' can cross its end."""
    from spike_whale.tokenization_spike import SpikeTokenizer

    vocab = {chr(b): b + 4 for b in range(256)}
    vocab.update({t: 260 + i for i, t in enumerate([" wh", " who ", "or"])})
    tok = SpikeTokenizer({"vocab": vocab, "max_token_len": 8})
    tok.padding_side = "left"
    return tok


@pytest.mark.parametrize("respell", [[" wh", "o"], [" who "]])
def test_token_healing_tail_does_not_count_against_the_length_limit(model, respell, caplog):
    """The tail token healing drops (' wh', 'o' of "x who") and the first new tokens spell again is prompt, as
    transformers' heal_tokens does not count its healed token: max_new_tokens=4, or the max_length that gives 4 on
    the prompt as passed, leaves 4 tokens after the tail whether it is spelled again in two tokens or crossed by one;
    a row with nothing to heal stops after 4 and is padded."""
    tok = greedy_tiny_tokenizer()
    ids_of = tok.convert_tokens_to_ids
    enc = tok(["x who", "xyz"], return_tensors="pt", padding=True)
    assert enc["input_ids"].shape[1] == 4
    kw = dict(do_sample=False, token_healing=True, tokenizer=tok, pad_token_id=0, suppress_tokens=[3],
              sequence_bias={(ids_of(t),): 50.0 for t in respell})
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=4, **kw)
        assert torch.equal(out, model.generate(**enc, max_length=4 + 4, **kw))
        # The same settings as a generation_config: the same ids, and healing adds no generate argument beside it.
        config = GenerationConfig(max_new_tokens=4, **{k: v for k, v in kw.items() if k != "tokenizer"})
        with caplog.at_level(logging.WARNING):
            assert torch.equal(out, model.generate(**enc, generation_config=config, tokenizer=tok))
        assert not [r for r in caplog.records if "together with generation-related" in r.getMessage()]
    healed_width = 4  # "xyz" keeps its 4 tokens; "x who" keeps <bos>, 'x'
    assert out.shape[1] == healed_width + len(respell) + 4
    assert out[0, :healed_width + len(respell)].tolist() == [0, 0, 2, ids_of("x")] + ids_of(respell)
    assert (out[1, healed_width:healed_width + 4] != 0).all() and (out[1, healed_width + 4:] == 0).all()


def test_token_healing_refuses_a_cache_that_already_holds_the_prompt(model):
    """Healing re-tokenizes the prompt's end, which a passed cache holding those positions cannot follow: refused
    before any work, naming the way out."""
    tok = greedy_tiny_tokenizer()
    enc = tok(["x who"], return_tensors="pt")
    with torch.no_grad():
        cache = model(enc["input_ids"][:, :-1], use_cache=True).cache
        with pytest.raises(ValueError, match="token_healing=False"):
            model.generate(**enc, cache=cache, max_new_tokens=2, token_healing=True, tokenizer=tok)
    assert cache.get_seq_length() == 3
