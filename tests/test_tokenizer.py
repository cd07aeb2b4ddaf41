"""Tests for `spike_whale.tokenization_spike` (slow Length-MAX greedy tokenizer, vocab builder).

Everything is offline.  No released vocab is available, so the tests use vocabs trained on the
built-in demo corpus, plus hand-written adversarial tokens (partial UTF-8 sequences, tokens whose
prefixes are missing, special-token fragments, regex metacharacters, a token longer than
`max_token_len`).  The greedy encoder is checked against an independent pure-Python reference.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap

import pytest

from spike_whale.tokenization_spike import (
    ALL_SPECIAL_IDS,
    BOS_ID,
    CHAT_EOS_IDS,
    EOS_ID,
    IM_END_ID,
    IM_START_ID,
    PAD_ID,
    RESERVED_IDS,
    RESERVED_TOKENS,
    SPECIAL_TOKENS,
    UNK_ID,
    VOCAB_SIZE,
    SpikeTokenizer,
)
from spike_whale.hub_export.train_tokenizer import DEMO_CORPUS, build_demo_tokenizer, build_lengthmax_vocab

MAX_LEN = 24
SPECIAL_LAYOUT = {
    "<|im_start|>": 16384, "<|im_end|>": 16385, "<think>": 16386, "</think>": 16387,
    "<begin_solution>": 16388, "<end_solution>": 16389, "<tool_call>": 16390, "</tool_call>": 16391,
    "<tool_response>": 16392, "</tool_response>": 16393, "<|system|>": 16394, "<|user|>": 16395,
    "<|assistant|>": 16396, "<|fim_prefix|>": 16397, "<|fim_middle|>": 16398, "<|fim_suffix|>": 16399,
    "<|endoftext|>": 16400,
}  # written out literally (not derived from the module) so a layout change fails the tests
ALL_SPECIAL_STRINGS = [
    "<pad>", "<unk>", "<bos>", "<eos>", *SPECIAL_LAYOUT, *(f"<|reserved_special_{i}|>" for i in range(111)),
]

# Adversarial tokens added after the trained ones.  "x" * 30 is longer than max_token_len: it must be
# decodable but never produced.  "abcdefgh" without "abcdefg"/"abcdef"/... forces deep backtracking.
TRICKY = [
    "\xe4\xb8", "\xf0\x9f", "\x98\x80", "\xe2\x82", "\xc3\xa9" * 6, "\xe4\xb8\xad\xe6",
    "abcdefgh", "abcd", "ab", "bcdefghij", "hij", "a" * 24, "a" * 7, " " * 24, " " * 5, "=" * 12, "\x00" * 5,
    "<|im_", "im_end|>", "<think", "|>\n", "<bos", "s>", "end_solution", "reserved_special_",
    "\\d+", "[a-", "(?:", "$^.*", ")|(", "\\", "\r\n", "\n\n\n", "\n    ", "x" * 30,
]


# ----------------------------------------------------------------------------------------------
# Independent reference implementation
# ----------------------------------------------------------------------------------------------


def ref_split_specials(text: str, specials: list[str]) -> list[tuple[bool, str]]:
    """Leftmost-longest split of `text` on special strings -> [(is_special, piece), ...]."""
    by_first: dict[str, list[str]] = {}
    for s in sorted(specials, key=len, reverse=True):
        by_first.setdefault(s[0], []).append(s)
    out, buf, i = [], [], 0
    while i < len(text):
        hit = next((s for s in by_first.get(text[i], ()) if text.startswith(s, i)), None)
        if hit is None:
            buf.append(text[i])
            i += 1
            continue
        if buf:
            out.append((False, "".join(buf)))
            buf = []
        out.append((True, hit))
        i += len(hit)
    if buf:
        out.append((False, "".join(buf)))
    return out


def ref_greedy_ids(text: str, vocab: dict[str, int], max_len: int) -> list[int]:
    """Greedy longest match over UTF-8 bytes, the released way: try every length from max_len down."""
    greedy = {t: i for t, i in vocab.items() if 4 <= i < 16384 and len(t) <= max_len}
    data = text.encode("utf-8").decode("latin-1")
    ids, i = [], 0
    while i < len(data):
        for length in range(min(max_len, len(data) - i), 0, -1):
            tok_id = greedy.get(data[i : i + length])
            if tok_id is not None:
                ids.append(tok_id)
                i += length
                break
        else:
            raise AssertionError("reference: no token matched")
    return ids


def ref_encode(text: str, vocab: dict[str, int], max_len: int) -> list[int]:
    ids = []
    for is_special, piece in ref_split_specials(text, ALL_SPECIAL_STRINGS):
        ids.extend([vocab[piece]] if is_special else ref_greedy_ids(piece, vocab, max_len))
    return ids


# ----------------------------------------------------------------------------------------------
# Random text
# ----------------------------------------------------------------------------------------------

_WORDS = DEMO_CORPUS.split()
_PIECES = [
    "é", "ü", "ß", "ñ", "中", "文", "日本語", "한국어", "Привет", "😀", "🐋", "👍🏽", "👨‍👩‍👧", "🇫🇷", "❤️", "e\u0301",
    "\u200b", "\ufeff", "\ufffd", "\u2028", "\x00", "\x01", "\x1b[0m", "\x7f", "\x85", "\x9f", "\t", "\r\n", "\n",
    "𝔘𝔫𝔦", "\U0010ffff", "abcdefg", "abcdefgh", "abcdefghij", "<|im_", "im_end|>", "<<think>>",
    "<|im_end|><|im_start|>",
    "<bos", "s>", "<|reserved_special_", "<|reserved_special_110|>", "\\d+", "[a-(?:", "    ", "=" * 3,
]


def random_text(rng: random.Random, with_specials: bool = True) -> str:
    parts = []
    for _ in range(rng.randint(0, 12)):
        kind = rng.random()
        if kind < 0.25:
            parts.append(rng.choice(_WORDS) + rng.choice([" ", "", "\n", "  "]))
        elif kind < 0.45:
            parts.append(rng.choice(_PIECES))
        elif kind < 0.55 and with_specials:
            parts.append(rng.choice(ALL_SPECIAL_STRINGS))
        elif kind < 0.62:
            parts.append(rng.choice(["a", " ", "=", "é", "中", "😀", "\x00", "x", "\n"]) * rng.randint(1, 120))
        elif kind < 0.75:
            parts.append("".join(chr(rng.randint(0x20, 0x7E)) for _ in range(rng.randint(1, 30))))
        elif kind < 0.9:  # random BMP (no surrogates) and astral code points
            cps = [rng.choice([rng.randint(0, 0xD7FF), rng.randint(0xE000, 0xFFFF), rng.randint(0x10000, 0x10FFFF)])
                   for _ in range(rng.randint(1, 8))]
            parts.append("".join(map(chr, cps)))
        else:
            start = rng.randrange(len(DEMO_CORPUS))
            parts.append(DEMO_CORPUS[start : start + rng.randint(1, 200)])
    return "".join(parts)


# ----------------------------------------------------------------------------------------------
# Fixtures
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_data():
    return build_lengthmax_vocab([DEMO_CORPUS], vocab_size=2176)


@pytest.fixture(scope="module")
def tricky_data(demo_data):
    data = json.loads(json.dumps(demo_data))
    vocab = data["vocab"]
    next_id = max(i for i in vocab.values() if i < 16384) + 1
    for tok in TRICKY:
        if tok not in vocab:
            vocab[tok] = next_id
            next_id += 1
    assert next_id < 16384
    return data


@pytest.fixture(scope="module")
def tok(tricky_data):
    return SpikeTokenizer(tricky_data, model_max_length=4096)


@pytest.fixture(scope="module")
def bytes_tok():
    """A tokenizer whose vocab holds only the 256 bytes (no multi-byte tokens at all)."""
    return SpikeTokenizer(build_lengthmax_vocab(["anything"], vocab_size=388))


# ----------------------------------------------------------------------------------------------
# Id layout
# ----------------------------------------------------------------------------------------------


def test_id_layout(tok):
    assert len(tok) == tok.vocab_size == VOCAB_SIZE == 16512
    assert (tok.pad_token_id, tok.unk_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2, 3)
    assert (PAD_ID, UNK_ID, BOS_ID, EOS_ID, IM_START_ID, IM_END_ID) == (0, 1, 2, 3, 16384, 16385)
    assert tok.convert_ids_to_tokens([0, 1, 2, 3]) == ["<pad>", "<unk>", "<bos>", "<eos>"]
    for b in range(256):
        assert tok.convert_ids_to_tokens(b + 4) == chr(b)
        assert tok.convert_tokens_to_ids(chr(b)) == b + 4
    assert list(SPECIAL_TOKENS) == list(SPECIAL_LAYOUT)
    assert tok.convert_tokens_to_ids(list(SPECIAL_LAYOUT)) == list(range(16384, 16401))
    assert RESERVED_IDS == range(16401, 16512)
    assert list(RESERVED_TOKENS) == [f"<|reserved_special_{i}|>" for i in range(111)]
    assert tok.convert_ids_to_tokens(list(RESERVED_IDS)) == list(RESERVED_TOKENS)
    assert tok.convert_ids_to_tokens(16511) == "<|reserved_special_110|>"
    assert sorted(tok.all_special_ids) == sorted(ALL_SPECIAL_IDS) == [0, 1, 2, 3, *range(16384, 16512)]
    assert set(CHAT_EOS_IDS) == {3, 16385}
    assert tok.model_input_names == ["input_ids", "attention_mask"]
    assert tok.model_max_length == 4096
    # every multi-byte token sits in 260..16383
    for token, idx in tok.get_vocab().items():
        if 4 <= idx < 260:
            assert len(token) == 1
        elif 260 <= idx < 16384 and token in tok.greedy_vocab:
            assert 2 <= len(token) <= MAX_LEN


def test_bytes_map_to_b_plus_4(bytes_tok):
    text = "Hé 😀\x00\n中"
    assert bytes_tok(text)["input_ids"] == [2] + [b + 4 for b in text.encode("utf-8")]
    assert bytes_tok.decode([b + 4 for b in text.encode("utf-8")]) == text


def test_len_grows_with_user_added_tokens(tricky_data):
    t = SpikeTokenizer(tricky_data)
    assert t.add_tokens(["<my_tool>"]) == 1
    assert len(t) == 16513 and t.convert_tokens_to_ids("<my_tool>") == 16512
    ids = t.encode("a<my_tool>é", add_special_tokens=False)
    assert 16512 in ids
    assert t.decode(ids) == "a<my_tool>é"


# ----------------------------------------------------------------------------------------------
# Encoding: exact greedy longest match
# ----------------------------------------------------------------------------------------------


def test_greedy_matches_reference_on_random_text(tok, tricky_data):
    vocab = tricky_data["vocab"]
    rng = random.Random(1234)
    texts = [random_text(rng) for _ in range(600)]
    texts += ["", " ", "\r\n", "abcdefg", "abcdefgh", "abcdefghij", "a" * 101, "x" * 100, "\xe9" * 50,
              "中" * 300, "😀" * 60, "<|im_start|>user\nhi<|im_end|>", "<<think>>", DEMO_CORPUS]
    for text in texts:
        expected = ref_encode(text, vocab, MAX_LEN)
        assert tok.encode(text, add_special_tokens=False) == expected, repr(text)
        plain = ref_greedy_ids(text, vocab, MAX_LEN)
        assert tok.encode_ordinary(text) == plain, repr(text)
        assert tok.encode(text, add_special_tokens=False, split_special_tokens=True) == plain, repr(text)


def test_greedy_hand_checked_cases(tok, tricky_data):
    vocab = tricky_data["vocab"]
    v = lambda s: vocab[s]  # noqa: E731
    # deep backtracking: "abcdefg" is not a token but "abcd" is; "abcdefgh" is
    ids = tok.encode_ordinary("abcdefg")
    assert ids[0] == v("abcd") and ids == ref_greedy_ids("abcdefg", vocab, MAX_LEN)
    assert tok.encode_ordinary("abcdefgh") == [v("abcdefgh")]
    # a token longer than max_token_len is never produced (but is decodable)
    ids = tok.encode_ordinary("x" * 30)
    assert v("x" * 30) not in ids and len(ids) > 1
    assert tok.decode([v("x" * 30)]) == "x" * 30
    # long runs are cut at max_token_len
    ids = tok.encode_ordinary("a" * 50)
    assert ids[:2] == [v("a" * 24)] * 2 and len(ids) in (3, 4)
    assert tok.encode_ordinary("a" * 48) == [v("a" * 24)] * 2
    # regex metacharacters are literal
    assert tok.encode_ordinary("(?:") == [v("(?:")]
    assert tok.encode_ordinary("$^.*") == [v("$^.*")]
    # partial UTF-8 tokens: 中 = e4 b8 ad; "\xe4\xb8\xad\xe6" is a token, so "中文" starts with it
    assert tok.encode_ordinary("中文")[0] == v("\xe4\xb8\xad\xe6")
    assert tok.decode(tok.encode_ordinary("中文")) == "中文"


def test_specials_are_atomic(tok):
    text = "x<|im_start|>user\n<think>a</think><|reserved_special_7|><|endoftext|>"
    ids = tok.encode(text, add_special_tokens=False)
    assert [i for i in ids if i >= 16384] == [16384, 16386, 16387, 16408, 16400]
    # partial / nested special-looking text stays text
    ids = tok.encode("<|im_<<think>>end|>", add_special_tokens=False)
    assert ids.count(16386) == 1 and all(i < 16384 or i == 16386 for i in ids)


def test_split_special_tokens_encodes_bytes(tok):
    text = "<|im_start|>user<bos><|reserved_special_3|>"
    ids = tok.encode(text, add_special_tokens=False, split_special_tokens=True)
    assert all(4 <= i < 16384 for i in ids)
    assert ids == tok.encode_ordinary(text)
    assert tok.decode(ids) == text
    assert tok.tokenize(text, split_special_tokens=True) == tok.convert_ids_to_tokens(ids)
    # the default still splits them out
    assert tok.encode(text, add_special_tokens=False)[0] == 16384


def test_pickle_and_deepcopy(tok):
    import copy
    import pickle

    text = "<bos>hello <|im_end|> 😀" + DEMO_CORPUS[:300]
    expected = tok(text)["input_ids"]
    for clone in (pickle.loads(pickle.dumps(tok)), copy.deepcopy(tok)):
        assert clone(text)["input_ids"] == expected and clone.decode(expected) == tok.decode(expected)


def test_lone_surrogate_is_rejected(tok):
    with pytest.raises(UnicodeEncodeError):
        tok.encode("a\ud800b")


# ----------------------------------------------------------------------------------------------
# Decoding
# ----------------------------------------------------------------------------------------------


def test_round_trip_random_unicode(tok):
    rng = random.Random(99)
    for _ in range(400):
        text = random_text(rng)
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
        without_specials = "".join(p for is_sp, p in ref_split_specials(text, ALL_SPECIAL_STRINGS) if not is_sp)
        assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == without_specials
        assert tok.decode(tok(text)["input_ids"]) == ("" if text.startswith("<bos>") else "<bos>") + text
        split_ids = tok(text, split_special_tokens=True)["input_ids"]
        assert tok.decode(split_ids, skip_special_tokens=True) == text
        assert tok.batch_decode([split_ids[1:]])[0] == text


def test_every_id_decodes(tok, tricky_data):
    id_to_tok = {i: t for t, i in tricky_data["vocab"].items()}
    for i in range(VOCAB_SIZE):
        out = tok.decode([i])
        skipped = tok.decode([i], skip_special_tokens=True)
        assert isinstance(out, str) and isinstance(skipped, str)
        if 4 <= i < 260:
            assert out == bytes([i - 4]).decode("utf-8", errors="replace")
        elif i in ALL_SPECIAL_IDS:
            assert out == ALL_SPECIAL_STRINGS[i if i < 4 else i - 16380] and skipped == ""
        elif i in id_to_tok:
            assert out == id_to_tok[i].encode("latin-1").decode("utf-8", errors="replace")
        else:  # unused slot between the last multi-byte token and 16383: empty, never produced
            assert 260 < i < 16384 and out == "" and skipped == ""
    everything = tok.decode(list(range(VOCAB_SIZE)))
    assert everything.startswith("<pad><unk><bos><eos>\x00\x01") and everything.endswith("<|reserved_special_110|>")
    assert tok.decode([16512, -100, 70]) == "<unk><unk>B"  # out of range: visible, no crash


def test_decode_partial_utf8_and_specials_break_sequences(tok):
    smile = [b + 4 for b in "😀".encode("utf-8")]
    assert [tok.decode(smile[:k]) for k in range(5)] == ["", "\ufffd", "\ufffd", "\ufffd", "😀"]
    assert tok.decode([smile[0], 16384, *smile[1:]]) == "\ufffd<|im_start|>\ufffd\ufffd\ufffd"
    assert tok.decode([smile[0], 16384, *smile[1:]], skip_special_tokens=True) == "😀"
    assert tok.convert_tokens_to_string(["a", "b", "<think>", "c"]) == "ab<think>c"  # no spaces


# ----------------------------------------------------------------------------------------------
# BOS, masks, padding, truncation
# ----------------------------------------------------------------------------------------------


def test_bos_added_once(tok):
    body = tok.encode("hello", add_special_tokens=False)
    assert tok("hello")["input_ids"] == [BOS_ID] + body
    assert tok("<bos>hello")["input_ids"] == [BOS_ID] + body
    assert tok.encode("<bos>hello") == [BOS_ID] + body
    assert tok([BOS_ID] + body)["input_ids"] == [BOS_ID] + body  # pre-encoded ids
    assert tok("")["input_ids"] == [BOS_ID]
    assert tok("<bos><bos>x")["input_ids"][:3] == [BOS_ID, BOS_ID, 4 + ord("x")]  # only the added one is deduplicated
    assert EOS_ID not in tok("hello")["input_ids"]
    assert tok("hello", return_special_tokens_mask=True)["special_tokens_mask"] == [1] + [0] * len(body)
    assert tok("<bos>hello", return_special_tokens_mask=True)["special_tokens_mask"] == [1] + [0] * len(body)
    # direct calls of the hook used by the base class dedupe too
    assert tok.build_inputs_with_special_tokens([BOS_ID, 70]) == [BOS_ID, 70]
    assert tok.build_inputs_with_special_tokens([70]) == [BOS_ID, 70]
    batch = tok(["<bos>a", "b"])["input_ids"]
    assert batch == [[BOS_ID, 4 + ord("a")], [BOS_ID, 4 + ord("b")]]


def test_add_bos_token_false(tricky_data, tmp_path):
    t = SpikeTokenizer(tricky_data, add_bos_token=False)
    assert t("hi")["input_ids"] == t.encode_ordinary("hi")
    t.save_pretrained(str(tmp_path / "no_bos"))
    reloaded = SpikeTokenizer.from_pretrained(str(tmp_path / "no_bos"))
    assert reloaded.add_bos_token is False and reloaded("hi")["input_ids"] == t.encode_ordinary("hi")
    t.add_bos_token = True
    assert t("hi")["input_ids"][0] == BOS_ID
    t.save_pretrained(str(tmp_path / "bos"))
    assert SpikeTokenizer.from_pretrained(str(tmp_path / "bos"))("hi")["input_ids"][0] == BOS_ID


def test_truncation_keeps_single_bos(tok):
    text = "<bos>" + "the whale " * 20
    ids = tok(text, truncation=True, max_length=5)["input_ids"]
    assert len(ids) == 5 and ids[0] == BOS_ID and ids.count(BOS_ID) == 1
    assert ids == tok("the whale " * 20, truncation=True, max_length=5)["input_ids"]


def test_attention_mask_and_left_padding(tok):
    enc = tok(["a", "The whale surfaced twice"], padding=True)
    long_ids = tok("The whale surfaced twice")["input_ids"]
    n = len(long_ids)
    assert tok.padding_side == "left"
    assert enc["input_ids"][1] == long_ids
    assert enc["input_ids"][0] == [PAD_ID] * (n - 2) + [BOS_ID, 4 + ord("a")]
    assert enc["attention_mask"][0] == [0] * (n - 2) + [1, 1]
    assert enc["attention_mask"][1] == [1] * n
    right = tok(["a", "The whale surfaced twice"], padding=True, padding_side="right")
    assert right["input_ids"][0] == [BOS_ID, 4 + ord("a")] + [PAD_ID] * (n - 2)
    assert tok("abc")["attention_mask"] == [1] * len(tok("abc")["input_ids"])


def test_return_tensors_pt(tok):
    torch = pytest.importorskip("torch")
    enc = tok(["a", "bcd efg"], padding=True, return_tensors="pt")
    assert isinstance(enc["input_ids"], torch.Tensor) and enc["input_ids"].shape == enc["attention_mask"].shape


# ----------------------------------------------------------------------------------------------
# Chat template
# ----------------------------------------------------------------------------------------------


def test_chat_template_ids(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  hi <think>  \n"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == ("<bos><|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\n  hi <think>  \n<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, sanitize_control_tokens=False)["input_ids"]
    o = tok.encode_ordinary
    expected = ([BOS_ID, IM_START_ID] + o("system\nBe brief.") + [IM_END_ID] + o("\n") + [IM_START_ID]
                + o("user\n  hi ") + [16386] + o("  \n") + [IM_END_ID] + o("\n") + [IM_START_ID] + o("assistant\n"))
    assert ids == expected
    safe = tok.apply_chat_template(msgs, add_generation_prompt=True)["input_ids"]  # <think> in content is text
    assert safe == ([BOS_ID, IM_START_ID] + o("system\nBe brief.") + [IM_END_ID] + o("\n") + [IM_START_ID]
                    + o("user\n  hi ") + o("<think>") + o("  \n") + [IM_END_ID] + o("\n") + [IM_START_ID]
                    + o("assistant\n"))
    assert ids.count(BOS_ID) == 1
    assert tok(text)["input_ids"] == expected  # re-encoding the rendered text: still one <bos>
    no_prompt = tok.apply_chat_template(msgs[:1], tokenize=False)
    assert no_prompt == "<bos><|im_start|>system\nBe brief.<|im_end|>\n"


def test_chat_template_sanitize_control_tokens(tok):
    """Issue 11 item 9: message content is encoded with specials split by default; the template's stay special."""
    msgs = [{"role": "user", "content": "say <|im_end|> and <bos>"}]
    default = tok.apply_chat_template(msgs, add_generation_prompt=True)["input_ids"]
    plain = tok.apply_chat_template(msgs, add_generation_prompt=True, sanitize_control_tokens=False)["input_ids"]
    safe = tok.apply_chat_template(msgs, add_generation_prompt=True, sanitize_control_tokens=True)["input_ids"]
    assert default == safe
    assert plain.count(IM_END_ID) == 2 and safe.count(IM_END_ID) == 1
    assert plain.count(BOS_ID) == 2 and safe.count(BOS_ID) == 1
    assert tok.decode(safe) == tok.decode(plain)
    assert tok("<|im_end|>")["input_ids"] == [BOS_ID, IM_END_ID]  # plain tok(text) keeps transformers' default


# ----------------------------------------------------------------------------------------------
# Vocab files, save / load
# ----------------------------------------------------------------------------------------------


def test_save_vocabulary_round_trips(tok, tmp_path):
    (path,) = tok.save_vocabulary(str(tmp_path))
    assert os.path.basename(path) == "spike_vocab.json"
    with open(path, encoding="utf-8") as f:
        raw = f.read()
    data = json.loads(raw)
    assert set(data) >= {"vocab", "max_token_len", "vocab_size", "algorithm", "special_tokens"}
    assert data["vocab_size"] == 16512 and data["max_token_len"] == MAX_LEN and data["algorithm"] == "length-max"
    assert data["special_tokens"] == list(SPECIAL_LAYOUT)
    assert raw.startswith('{"vocab": {"<pad>": 0, "<unk>": 1, "<bos>": 2, "<eos>": 3, "\\u0000": 4')
    assert data["vocab"]["<|reserved_special_110|>"] == 16511
    reloaded = SpikeTokenizer(path)
    assert reloaded.vocab_data == tok.vocab_data
    other = tmp_path / "again"
    other.mkdir()
    (path2,) = reloaded.save_vocabulary(str(other))
    with open(path2, encoding="utf-8") as f:
        assert f.read() == raw
    sample = DEMO_CORPUS[:500] + "<|im_end|>😀"
    assert reloaded(sample)["input_ids"] == tok(sample)["input_ids"]


def test_released_tokenizer_json_positional(tricky_data, tok, tmp_path):
    released = json.loads(json.dumps(tricky_data))
    # released files: no reserved slots, base specials present, max_token_len optional
    released["vocab"] = {t: i for t, i in released["vocab"].items() if i < 16401}
    del released["max_token_len"]
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(released), encoding="utf-8")
    t = SpikeTokenizer(str(path))
    assert len(t) == 16512 and t.max_token_len == 24
    sample = DEMO_CORPUS[:800] + "<|im_start|>x<|reserved_special_5|>"
    assert t(sample)["input_ids"] == tok(sample)["input_ids"]
    assert t.convert_ids_to_tokens(16450) == "<|reserved_special_49|>"
    # also through from_pretrained on the single file and on a released-style folder
    assert SpikeTokenizer.from_pretrained(str(path))(sample)["input_ids"] == tok(sample)["input_ids"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "SpikeTokenizer", "model_max_length": 1e30,
        "additional_special_tokens": list(SPECIAL_LAYOUT),
        "added_tokens_decoder": {str(i): {"content": s, "special": True, "normalized": False, "lstrip": False,
                                          "rstrip": False, "single_word": False}
                                 for s, i in [("<pad>", 0), ("<unk>", 1), ("<bos>", 2), ("<eos>", 3),
                                              *SPECIAL_LAYOUT.items()]},
    }))
    folder_tok = SpikeTokenizer.from_pretrained(str(tmp_path))
    assert folder_tok(sample)["input_ids"] == tok(sample)["input_ids"] and len(folder_tok) == 16512


def _minimal_vocab() -> dict:
    vocab = {"<pad>": 0, "<unk>": 1, "<bos>": 2, "<eos>": 3}
    vocab.update({chr(b): b + 4 for b in range(256)})
    vocab["th"] = 260
    return {"vocab": vocab, "max_token_len": 24}


def _mutate(fn):
    data = _minimal_vocab()
    fn(data)
    return data


@pytest.mark.parametrize(
    "payload, match",
    [
        ("{not json", "not valid JSON"),
        ([1, 2], "expected a JSON object"),
        ({"max_token_len": 24}, "missing 'vocab'"),
        ({"model": {"type": "BPE"}, "added_tokens": []}, "tokenizers"),
        ({"vocab": {}}, "non-empty"),
        (_mutate(lambda d: d["vocab"].pop("A")), "byte tokens missing"),
        (_mutate(lambda d: d["vocab"].update({"A": 300, "th": 69})), "byte tokens missing|byte slot"),
        (_mutate(lambda d: d["vocab"].update({"he": 260})), "collide"),
        (_mutate(lambda d: d["vocab"].update({"he": 17000})), "outside"),
        (_mutate(lambda d: d["vocab"].update({"he": "261"})), "must be an integer"),
        (_mutate(lambda d: d["vocab"].update({"<|im_end|>": 16390})), "layout requires 16385"),
        (_mutate(lambda d: d["vocab"].update({"<bos>": 5000})), "layout requires 2"),
        (_mutate(lambda d: d["vocab"].update({"zz": 16450})), "reserved for"),
        (_mutate(lambda d: d["vocab"].update({"中文": 261})), "latin-1"),
        (_mutate(lambda d: d.update({"max_token_len": 0})), "max_token_len"),
        (_mutate(lambda d: d.update({"special_tokens": ["<|im_start|>", "<my_special>"]})), "unknown special"),
    ],
)
def test_malformed_vocab_files(tmp_path, payload, match):
    path = tmp_path / "spike_vocab.json"
    path.write_text(payload if isinstance(payload, str) else json.dumps(payload), encoding="utf-8")
    with pytest.raises(ValueError, match=match):
        SpikeTokenizer(str(path))


def test_minimal_vocab_is_filled_in(tmp_path):
    path = tmp_path / "v.json"
    path.write_text(json.dumps(_minimal_vocab()))
    t = SpikeTokenizer(str(path))
    assert len(t) == 16512
    assert t.encode("the<|im_end|>", add_special_tokens=False) == [260, 4 + ord("e"), IM_END_ID]
    assert t.decode([261, 16383]) == ""  # unused slots
    assert t.vocab_data["vocab"]["<|im_end|>"] == IM_END_ID


def test_bos_must_stay_id_2_but_eos_may_change(tricky_data):
    with pytest.raises(ValueError, match="bos_token"):
        SpikeTokenizer(tricky_data, bos_token="<|im_start|>")
    t = SpikeTokenizer(tricky_data, eos_token="<|im_end|>")
    assert t.eos_token_id == IM_END_ID and len(t) == 16512
    assert t.encode("<eos>", add_special_tokens=False) == [EOS_ID]  # still atomic
    assert t.decode([EOS_ID, 70], skip_special_tokens=True) == "B"


def test_no_vocab_gives_the_byte_level_tokenizer():
    """Issue 10 item 8: SpikeTokenizer() with no files is the byte-level tokenizer with the released layout."""
    t = SpikeTokenizer()
    assert len(t) == 16512
    text = "héllo 🐋 <|im_end|>"
    ids = t(text)["input_ids"]
    assert ids == [BOS_ID] + [b + 4 for b in "héllo 🐋 ".encode()] + [IM_END_ID]
    assert t.decode(ids) == "<bos>" + text
    assert t.convert_tokens_to_ids(["<|reserved_special_0|>", "<eos>"]) == [16401, EOS_ID]


def test_save_pretrained_and_load_in_fresh_subprocess(tok, tmp_path):
    save_dir = tmp_path / "saved"
    SpikeTokenizer.register_for_auto_class("AutoTokenizer")
    tok.save_pretrained(str(save_dir))
    files = set(os.listdir(save_dir))
    assert files == {"tokenizer_config.json", "chat_template.jinja", "spike_vocab.json", "tokenization_spike.py"}
    config = json.loads((save_dir / "tokenizer_config.json").read_text())
    assert config["auto_map"]["AutoTokenizer"] == ["tokenization_spike.SpikeTokenizer", None]
    assert config["tokenizer_class"] == "SpikeTokenizer" and config["model_max_length"] == 4096

    rng = random.Random(7)
    texts = [random_text(rng) for _ in range(40)] + ["<bos>hello", "", DEMO_CORPUS[:1000]]
    msgs = [{"role": "user", "content": "hi <tool_call>"}]
    (tmp_path / "texts.json").write_text(json.dumps({"texts": texts, "msgs": msgs}), encoding="utf-8")
    script = textwrap.dedent(
        """
        import json, sys
        from transformers import AutoTokenizer
        save_dir, io_dir = sys.argv[1], sys.argv[2]
        inp = json.load(open(io_dir + "/texts.json", encoding="utf-8"))
        tok = AutoTokenizer.from_pretrained(save_dir, trust_remote_code=True)
        enc = [tok(t)["input_ids"] for t in inp["texts"]]
        out = {
            "cls": type(tok).__name__, "module": type(tok).__module__, "len": len(tok),
            "padding_side": tok.padding_side, "model_max_length": tok.model_max_length,
            "ids": enc,
            "split": [tok(t, split_special_tokens=True)["input_ids"] for t in inp["texts"]],
            "dec": [tok.decode(i) for i in enc],
            "dec_skip": [tok.decode(i, skip_special_tokens=True) for i in enc],
            "chat": tok.apply_chat_template(inp["msgs"], add_generation_prompt=True)["input_ids"],
            "pad": tok(["a", "bcd efg"], padding=True)["input_ids"],
            "every": tok.decode(list(range(16512))),
        }
        json.dump(out, open(io_dir + "/out.json", "w", encoding="utf-8"))
        """
    )
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"), TRANSFORMERS_VERBOSITY="error")
    proc = subprocess.run(
        [sys.executable, "-c", script, str(save_dir), str(tmp_path)],
        cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text(encoding="utf-8"))
    assert out["cls"] == "SpikeTokenizer"
    assert out["module"].startswith("transformers_modules."), out["module"]  # the copied remote code ran
    assert out["len"] == 16512 and out["padding_side"] == "left" and out["model_max_length"] == 4096
    assert out["ids"] == [tok(t)["input_ids"] for t in texts]
    assert all(ids[0] == BOS_ID for ids in out["ids"])
    assert out["split"] == [tok(t, split_special_tokens=True)["input_ids"] for t in texts]
    assert out["dec"] == [tok.decode(i) for i in out["ids"]]
    assert out["dec_skip"] == [tok.decode(i, skip_special_tokens=True) for i in out["ids"]]
    assert out["chat"] == tok.apply_chat_template(msgs, add_generation_prompt=True)["input_ids"]
    assert out["chat"][:2] == [BOS_ID, IM_START_ID] and 16390 not in out["chat"]  # <tool_call> in content: text
    assert out["pad"] == tok(["a", "bcd efg"], padding=True)["input_ids"]
    assert out["every"] == tok.decode(list(range(16512)))


# ----------------------------------------------------------------------------------------------
# Vocab builder
# ----------------------------------------------------------------------------------------------


def test_builder_layout_and_determinism(demo_data):
    vocab = demo_data["vocab"]
    assert demo_data["vocab_size"] == 16512 and demo_data["max_token_len"] == 24
    assert demo_data["algorithm"] == "length-max" and demo_data["special_tokens"] == list(SPECIAL_LAYOUT)
    assert [vocab[s] for s in ("<pad>", "<unk>", "<bos>", "<eos>")] == [0, 1, 2, 3]
    assert all(vocab[chr(b)] == b + 4 for b in range(256))
    assert all(vocab[s] == i for s, i in SPECIAL_LAYOUT.items())
    assert all(vocab[f"<|reserved_special_{k}|>"] == 16401 + k for k in range(111))
    multi = sorted(i for i in vocab.values() if 260 <= i < 16384)
    assert multi == list(range(260, 260 + len(multi)))  # no holes before the unused tail
    assert 200 < len(multi) <= 2048 - 260
    assert all(2 <= len(t) <= 24 and all(ord(c) < 256 for c in t) for t, i in vocab.items() if 260 <= i < 16384)
    assert build_lengthmax_vocab([DEMO_CORPUS], vocab_size=2176) == demo_data
    assert build_lengthmax_vocab(DEMO_CORPUS, vocab_size=2176) == demo_data  # a bare string is one text


def test_builder_compresses_and_respects_target_size():
    corpus = DEMO_CORPUS * 3
    small = build_lengthmax_vocab([corpus], vocab_size=428)
    assert sum(1 for i in small["vocab"].values() if 260 <= i < 16384) == 40
    big = SpikeTokenizer(build_lengthmax_vocab([corpus], vocab_size=4224, max_token_len=16))
    n_bytes = len(DEMO_CORPUS.encode("utf-8"))
    n_small = len(SpikeTokenizer(small).encode_ordinary(DEMO_CORPUS))
    n_big = len(big.encode_ordinary(DEMO_CORPUS))
    assert n_big < n_small < n_bytes and n_bytes / n_big > 3
    assert max(len(t) for t in big.greedy_vocab) <= 16
    # the highest-scoring first pick saves the most tokens: it must be a frequent multi-byte string
    first = next(t for t, i in small["vocab"].items() if i == 260)
    assert corpus.encode("utf-8").decode("latin-1").count(first) >= 10


def test_builder_never_takes_special_strings():
    corpus = ("<|im_start|>user\nhello<|im_end|>\n<bos><|reserved_special_3|>" * 60)
    data = build_lengthmax_vocab([corpus], vocab_size=1128, max_ngram=12)
    regular = {t for t, i in data["vocab"].items() if 260 <= i < 16384}
    for special in ALL_SPECIAL_STRINGS:
        assert special not in regular
    # a special string picked as a regular token would leave a hole in 260.. (its key maps to the special id)
    assert sorted(i for i in data["vocab"].values() if 260 <= i < 16384) == list(range(260, 260 + len(regular)))
    assert len(regular) > 50
    t = SpikeTokenizer(data)
    assert t.decode(t.encode_ordinary(corpus)) == corpus


@pytest.mark.parametrize("kwargs", [{"vocab_size": 387}, {"vocab_size": 16513}, {"max_token_len": 1}, {"rounds": 0},
                                    {"max_token_len": 257}])
def test_builder_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        build_lengthmax_vocab(["abc"], **kwargs)


def test_build_demo_tokenizer():
    t = build_demo_tokenizer()
    assert len(t) == 16512
    text = "The whale surfaced near the harbour. 🐋"
    ids = t(text)["input_ids"]
    assert ids[0] == BOS_ID and len(ids) < len(text.encode("utf-8")) / 2
    assert t.decode(ids, skip_special_tokens=True) == text
