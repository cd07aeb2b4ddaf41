"""Token healing for the greedy Length-MAX tokenizer (`generate(..., token_healing=True, tokenizer=tok)`).

A prompt that ends inside a token the model usually sees whole can break over two or more tokens (`' wh', 'o'` where
the vocabulary has `' who '` but not `' who'`): healing drops the prompt's tail from the first token that more text
could re-tokenize and makes the first new tokens spell it again, so they may cross the prompt's end.
"""

from __future__ import annotations

import os

import pytest
import torch

from _tiny_folder import load_folder
from spike_whale.generation_utils import GreedyVocabIndex, HealedTailLogitsProcessor, _heal_prompt, \
    first_unstable_token
from spike_whale.tokenization_spike import SpikeTokenizer
from spike_whale.tokenization_spike_fast import SpikeTokenizerFast

FOLDER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "spike-whale-demo")
TINY_TOKENS = [" wh", " who ", " whom", "or", "ab", "abcd", " a"]


@pytest.fixture(scope="module")
def tiny_tok():
    vocab = {chr(b): b + 4 for b in range(256)}
    vocab.update({t: 260 + i for i, t in enumerate(TINY_TOKENS)})
    return SpikeTokenizer({"vocab": vocab, "max_token_len": 8})


@pytest.fixture(scope="module")
def demo():
    return load_folder(FOLDER)


def pieces(tok, text):
    return tok.convert_ids_to_tokens(tok(text, add_special_tokens=False)["input_ids"])


def test_unstable_token_rule_on_a_tiny_vocabulary(tiny_tok):
    index = GreedyVocabIndex(tiny_tok.greedy_vocab)
    assert SpikeTokenizerFast(tiny_tok.vocab_data).greedy_vocab == tiny_tok.greedy_vocab
    assert pieces(tiny_tok, "x who") == ["x", " wh", "o"]
    # ' who ' extends " who": the break spans two tokens, both go (one-token healing keeps ' wh').
    assert first_unstable_token(["x", " wh", "o"], index) == 1
    assert first_unstable_token(["x", " who "], index) == 2  # nothing extends ' who ': stable
    assert first_unstable_token(["x", " whom"], index) == 2
    # 'c' alone is stable, but 'abcd' extends "abc": the token before the last one is the first to go.
    assert pieces(tiny_tok, "abc") == ["ab", "c"] and first_unstable_token(["ab", "c"], index) == 0
    assert first_unstable_token(["x", " "], index) == 1  # ' wh', ' a', ... extend " "
    assert first_unstable_token([], index) == 0
    assert index.longest_prefix(" who") == tiny_tok.convert_tokens_to_ids(" wh")
    assert sorted(tiny_tok.convert_ids_to_tokens(index.extending(" wh"))) == [" wh", " who ", " whom"]


def test_processor_allows_only_the_tokens_greedy_matching_could_take(tiny_tok):
    index = GreedyVocabIndex(tiny_tok.greedy_vocab)
    ids = tiny_tok.convert_tokens_to_ids
    processor = HealedTailLogitsProcessor([" who", ""], prompt_length=2, index=index)

    def allowed(generated):
        rows = torch.tensor([[5, 6, *generated], [5, 6, *generated]])
        scores = processor(rows, torch.zeros(2, 300))
        assert not torch.isinf(scores[1]).any()  # the row with nothing to heal is free
        return sorted(tiny_tok.convert_ids_to_tokens(torch.nonzero(~torch.isinf(scores[0])).flatten().tolist()))

    # The prompt's own first token or one that crosses the end; never a shorter piece (' ', ' w') or a wrong one.
    assert allowed([]) == [" wh", " who ", " whom"]
    assert allowed([ids(" wh")]) == ["o", "or"]
    for done in ([ids(" who ")], [ids(" wh"), ids("or")], [ids(" wh"), ids("o")], [ids(" wh"), ids("o"), 7]):
        assert allowed(done) == sorted(tiny_tok.convert_ids_to_tokens(range(300)))
    # Beams and return sequences repeat each prompt: rows map to their prompt's tail.
    beams = processor(torch.tensor([[5, 6]] * 4), torch.zeros(4, 300))
    assert torch.isinf(beams[:2]).any() and not torch.isinf(beams[2:]).any()


def test_heal_prompt_cuts_batch_rows_and_keeps_specials(tiny_tok):
    ids = tiny_tok.convert_tokens_to_ids
    pad, bos = tiny_tok.pad_token_id, tiny_tok.bos_token_id
    rows = torch.tensor([[pad, pad, bos, ids("x"), ids(" wh"), ids("o")],
                         [bos, ids("x"), ids(" who "), ids("a"), ids("b"), ids("c")],
                         [pad, pad, pad, pad, bos, ids(" ")],
                         [pad, pad, bos, ids("x"), ids(" who "), ids("y")]])
    mask = (rows != pad).long()
    new_ids, new_mask, processor = _heal_prompt(rows, mask, tiny_tok)
    # Row 2: 'a','b','c' is not greedy's own split of "abc", but 'abcd' could still extend it from 'a' on.
    assert new_ids.tolist() == [[pad, pad, bos, ids("x")],
                                [pad, bos, ids("x"), ids(" who ")],
                                [pad, pad, pad, bos],
                                [bos, ids("x"), ids(" who "), ids("y")]]
    assert new_mask.tolist() == (new_ids != pad).long().tolist()
    assert processor.tails == [" who", "abc", " ", ""] and processor.prompt_length == 4
    # Nothing to heal: the caller's tensors come back as they are.
    stable = torch.tensor([[bos, ids("x"), ids(" who ")]])
    same_ids, same_mask, _ = _heal_prompt(stable, None, tiny_tok)
    assert same_ids is stable and same_mask is None
    # A row without <bos> keeps its first token.
    assert _heal_prompt(torch.tensor([[ids(" wh"), ids("o")]]), None, tiny_tok)[2].tails == ["o"]


def test_healing_needs_the_greedy_tokenizer():
    from conftest import tiny_model

    model, enc = tiny_model(), {"input_ids": torch.tensor([[2, 100, 120]])}
    with pytest.raises(ValueError, match="needs the prompt's tokenizer"):
        model.generate(**enc, max_new_tokens=2, do_sample=False, token_healing=True)
    with pytest.raises(ValueError, match="greedy_vocab"):
        model.generate(**enc, max_new_tokens=2, do_sample=False, token_healing=True, tokenizer=object())


def healed(demo, prompts, **kwargs):
    tok, model = demo
    enc = tok(prompts, return_tensors="pt", padding=True)
    kwargs = {"max_new_tokens": 8, "do_sample": False, **kwargs}
    return enc, model.generate(**enc, token_healing=True, tokenizer=tok, **kwargs)


@pytest.mark.parametrize("prompt,kept,crossing", [
    ("The harbour w", ["The ", "har", "bour"], " w"),
    ("A hacker is a person w", ["A", " hack", "er i", "s a ", "person"], " w"),
])
def test_demo_prompt_ending_inside_a_token_crosses_the_boundary(demo, prompt, kept, crossing):
    tok, _ = demo
    enc, out = healed(demo, [prompt])
    tokens = [tok.decode([i]) for i in out[0].tolist()]
    text = tok.decode(out[0], skip_special_tokens=True)
    assert text.startswith(prompt), text
    assert tokens[1:len(kept) + 1] == kept
    first = tokens[len(kept) + 1]
    assert first.startswith(crossing) and len(first) > len(crossing), tokens  # e.g. ' was ', ' which '
    # ... exactly as greedy matching tokenizes the text: the model continues from a tokenization it was trained on.
    assert tok(text)["input_ids"][:len(kept) + 2] == out[0, :len(kept) + 2].tolist()


@pytest.mark.parametrize("prompt", ["A hacker is a person who ", "The function returns the "])
def test_well_tokenized_prompt_is_unchanged(demo, prompt):
    tok, model = demo
    enc, out = healed(demo, [prompt])
    plain = model.generate(**enc, max_new_tokens=8, do_sample=False)
    assert torch.equal(out, plain)
    assert tok.decode(out[0], skip_special_tokens=True).startswith(prompt)


def test_trailing_space_is_kept(demo):
    tok, _ = demo
    for prompt in ("A hacker is a person who ", "A hacker is a person who is ", "A hacker is a person who,\n"):
        _, out = healed(demo, [prompt])
        assert tok.decode(out[0], skip_special_tokens=True).startswith(prompt)


def test_batch_with_left_padding_heals_each_row_as_alone(demo):
    tok, model = demo
    prompts = ["The harbour w", "A hacker is a person in the ", "A hacker is a person w", "hacker"]
    enc, out = healed(demo, prompts)
    assert enc["attention_mask"][:, -1].all() and not enc["attention_mask"][:, 0].all()  # left padded
    texts = tok.batch_decode(out, skip_special_tokens=True)
    for prompt, text in zip(prompts, texts):
        _, alone = healed(demo, [prompt])
        assert text == tok.decode(alone[0], skip_special_tokens=True)
        assert text.startswith(prompt), (prompt, text)


def test_healing_under_sampling_mtp_assisted_and_beams(demo):
    tok, model = demo
    prompts = ["The harbour w", "A hacker is a person who is "]
    for seed in (0, 1, 2):
        torch.manual_seed(seed)
        _, out = healed(demo, prompts, do_sample=True, top_k=5)
        assert all(t.startswith(p) for p, t in zip(prompts, tok.batch_decode(out, skip_special_tokens=True)))
    _, greedy = healed(demo, prompts)
    _, mtp = healed(demo, prompts, use_mtp=True)
    assert torch.equal(mtp, greedy)
    _, assisted = healed(demo, prompts[:1], assistant_model=load_folder(FOLDER)[1])
    assert torch.equal(assisted, healed(demo, prompts[:1])[1])
    _, beams = healed(demo, prompts, num_beams=2, num_return_sequences=2)
    assert all(t.startswith(p) for p, t in zip([p for p in prompts for _ in (0, 1)],
                                               tok.batch_decode(beams, skip_special_tokens=True)))
