# Copyright 2025 The spike_whale integration authors. Apache-2.0.
"""Slow (pure Python) tokenizer for the spike_whale / SpikeWhale v2 models.

The released models use a *Length-MAX* byte-level vocabulary encoded by **greedy longest match**
over the UTF-8 bytes of the text.  This file is a flat Hub code file: it imports only the Python
standard library and ``transformers`` so it can be shipped next to a checkpoint and loaded with
``AutoTokenizer.from_pretrained(repo, trust_remote_code=True)``.

Id layout (fixed; the embeddings of the released checkpoints depend on it)::

    0 <pad>   1 <unk>   2 <bos>   3 <eos>
    4 .. 259          byte b -> id b + 4, token string chr(b) (one latin-1 character)
    260 .. 16383      multi-byte Length-MAX tokens (latin-1 strings of 2..max_token_len bytes)
    16384 .. 16400    17 chat / tool / FIM specials (SPECIAL_TOKENS, in order)
    16401 .. 16511    111 reserved specials <|reserved_special_0|> .. <|reserved_special_110|>

``len(tokenizer) == tokenizer.vocab_size == 16512``.

Vocabulary file (the released format, kept as is)::

    {"vocab": {latin1_string: id, ...}, "max_token_len": 24, "vocab_size": 16512,
     "algorithm": "length-max", "special_tokens": [17 strings]}

It is saved as ``spike_vocab.json``: transformers 5 parses any file called ``tokenizer.json`` as a
``tokenizers`` (fast) file, so the released name cannot be reused inside a saved folder.  A released
``tokenizer.json`` in this custom format can still be passed directly:
``SpikeTokenizer("path/to/tokenizer.json")``.

Ids in 260..16383 that the file does not define ("holes", e.g. a vocab built from a small corpus
fills only the first few thousand multi-byte slots) get a placeholder token ``⟨unused_ID⟩`` (it
contains non-latin-1 characters, so it can never collide with a real token).  Encoding never
produces them and they decode to the empty string.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import re
import threading
from collections.abc import Iterable, Mapping

from transformers import PreTrainedTokenizer
from transformers.tokenization_utils_base import (
    AddedToken,
    BatchEncoding,
    PaddingStrategy,
    PreTrainedTokenizerBase,
    TruncationStrategy,
)


# --------------------------------------------------------------------------------------------------
# Layout constants (import these from model / generation code: `from .tokenization_spike import ...`)
# --------------------------------------------------------------------------------------------------

PAD_ID = 0
UNK_ID = 1
BOS_ID = 2
EOS_ID = 3
PAD_TOKEN = "<pad>"
UNK_TOKEN = "<unk>"
BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
BASE_SPECIAL_TOKENS = (PAD_TOKEN, UNK_TOKEN, BOS_TOKEN, EOS_TOKEN)  # ids 0..3

BYTE_OFFSET = 4  # byte b has id b + BYTE_OFFSET
FIRST_MULTIBYTE_ID = BYTE_OFFSET + 256  # 260
SPECIAL_START_ID = 16384  # first chat/tool/FIM special; also the number of "base" ids
NUM_BASE_IDS = SPECIAL_START_ID

SPECIAL_TOKENS = (
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<begin_solution>",
    "<end_solution>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|endoftext|>",
)
SPECIAL_TOKEN_IDS = {tok: SPECIAL_START_ID + i for i, tok in enumerate(SPECIAL_TOKENS)}

IM_START_ID = SPECIAL_TOKEN_IDS["<|im_start|>"]  # 16384
IM_END_ID = SPECIAL_TOKEN_IDS["<|im_end|>"]  # 16385
THINK_ID = SPECIAL_TOKEN_IDS["<think>"]  # 16386
END_THINK_ID = SPECIAL_TOKEN_IDS["</think>"]  # 16387
TOOL_CALL_ID = SPECIAL_TOKEN_IDS["<tool_call>"]  # 16390
END_TOOL_CALL_ID = SPECIAL_TOKEN_IDS["</tool_call>"]  # 16391
FIM_PREFIX_ID = SPECIAL_TOKEN_IDS["<|fim_prefix|>"]  # 16397
FIM_MIDDLE_ID = SPECIAL_TOKEN_IDS["<|fim_middle|>"]  # 16398
FIM_SUFFIX_ID = SPECIAL_TOKEN_IDS["<|fim_suffix|>"]  # 16399
ENDOFTEXT_ID = SPECIAL_TOKEN_IDS["<|endoftext|>"]  # 16400

RESERVED_START_ID = SPECIAL_START_ID + len(SPECIAL_TOKENS)  # 16401
VOCAB_SIZE = 16512
RESERVED_IDS = range(RESERVED_START_ID, VOCAB_SIZE)  # 111 ids
RESERVED_TOKENS = tuple(f"<|reserved_special_{i}|>" for i in range(len(RESERVED_IDS)))

# Every id that is not ordinary text (0..3, the 17 specials, the 111 reserved slots).
ALL_SPECIAL_IDS = tuple(range(BYTE_OFFSET)) + tuple(SPECIAL_TOKEN_IDS.values()) + tuple(RESERVED_IDS)
# Ids that end a chat turn: generation_config.eos_token_id = list(CHAT_EOS_IDS).
CHAT_EOS_IDS = (EOS_ID, IM_END_ID)

DEFAULT_MAX_TOKEN_LEN = 24
# Greedy matching compiles the tokens into a regex nested as deep as the longest token; Python's `re` parser
# recurses once per level and fails near 400, so longer tokens are refused when the vocab is read.
MAX_TOKEN_LEN_LIMIT = 256
VOCAB_FILE_NAME = "spike_vocab.json"
ALGORITHM = "length-max"

CHATML_TEMPLATE = (
    "{{- bos_token if bos_token else '' -}}\n"
    "{%- if tools -%}\n"
    "    {{- raise_exception('This chat template has no tool-calling format (the spike_whale chat models were not trained "
    "with one): pass tools=None, or a chat_template that defines one.') -}}\n"
    "{%- endif -%}\n"
    "{%- for message in messages -%}\n"
    "    {%- set i = loop.index0 -%}\n"
    "    {%- if message['role'] is not defined or message['role'] is not string -%}\n"
    "        {{- raise_exception('Message ' ~ loop.index0 ~ ' has no \\'role\\' string: every message needs one, such "
    "as {\"role\": \"user\", \"content\": \"...\"}.') -}}\n"
    "    {%- endif -%}\n"
    "    {%- if message['tool_calls'] is defined -%}\n"
    "        {{- raise_exception('Message ' ~ loop.index0 ~ ' has tool_calls, which this chat template cannot write (no "
    "tool-calling format); put the call in \\'content\\' or use a chat_template that defines one.') -}}\n"
    "    {%- endif -%}\n"
    "    {{- '<|im_start|>' + message['role'] + '\\n' -}}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{- message['content'] -}}\n"
    "    {%- elif message['content'] is not defined or message['content'] is none -%}\n"
    "    {%- elif message['content'] is iterable and message['content'] is not mapping -%}\n"
    "        {%- for part in message['content'] -%}\n"
    "            {%- if part is mapping and part['type'] == 'text' and part['text'] is string -%}\n"
    "                {{- part['text'] -}}\n"
    "            {%- else -%}\n"
    "                {{- raise_exception('Message ' ~ i ~ ': content parts must be {\"type\": \"text\", "
    "\"text\": str} (this model reads text only), got ' ~ part) -}}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{- raise_exception('Message ' ~ loop.index0 ~ ': content must be a string or a list of text parts, "
    "got ' ~ message['content']) -}}\n"
    "    {%- endif -%}\n"
    "    {{- '<|im_end|>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{- '<|im_start|>assistant\\n' -}}\n"
    "{%- endif -%}\n"
)

def chat_template_kwargs(kwargs: dict) -> dict:
    """`apply_chat_template` defaults of both spike_whale tokenizers: ``sanitize_control_tokens=True`` whenever
    transformers can honour it (tokenized output, no assistant mask), so special-token strings inside messages,
    tools and template variables are encoded as plain text while the template's own markers stay special."""
    if kwargs.get("sanitize_control_tokens") is None:
        kwargs["sanitize_control_tokens"] = bool(kwargs.get("tokenize", True)) and not kwargs.get(
            "return_assistant_tokens_mask", False)
    return kwargs


# transformers added `apply_chat_template(..., sanitize_control_tokens=...)` after 5.0; on older releases the same
# marking is done by `_apply_marked_chat_template`.
_HAS_SANITIZE = "sanitize_control_tokens" in inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
_MARK_START, _MARK_END = "\U000f0000", "\U000f0001"  # private use: removed from user strings before marking


def apply_chat_template_safely(tokenizer, apply, conversation, kwargs: dict):
    """`apply` (the base class's apply_chat_template) with `chat_template_kwargs` defaults on any transformers 5."""
    kwargs = chat_template_kwargs(kwargs)
    if _HAS_SANITIZE:
        return apply(conversation, **kwargs)
    if not kwargs.pop("sanitize_control_tokens"):
        return apply(conversation, **kwargs)
    return _apply_marked_chat_template(tokenizer, apply, conversation, kwargs)


def _apply_marked_chat_template(tokenizer, apply, conversation, kwargs: dict):
    opts = {k: kwargs.pop(k, default) for k, default in (("padding", False), ("truncation", False),
                                                          ("max_length", None), ("return_tensors", None),
                                                          ("return_dict", True), ("tokenizer_kwargs", None))}
    kwargs.pop("tokenize", None)
    controls = sorted(tokenizer.all_special_tokens, key=len, reverse=True)
    control_re = re.compile("|".join(map(re.escape, controls)))

    def mark(obj):
        if isinstance(obj, str):
            obj = obj.replace(_MARK_START, "").replace(_MARK_END, "")
            return control_re.sub(lambda m: _MARK_START + m.group(0) + _MARK_END, obj)
        if isinstance(obj, Mapping):
            return {key: mark(value) for key, value in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [mark(value) for value in obj]
        return obj

    for key in ("tools", "documents"):
        if kwargs.get(key) is not None:
            kwargs[key] = mark(kwargs[key])
    rendered = apply(mark(conversation), tokenize=False, **kwargs)
    split_re = re.compile(re.escape(_MARK_START) + "(.*?)" + re.escape(_MARK_END), re.S)

    def encode(chat: str) -> list[int]:
        ids: list[int] = []
        for i, piece in enumerate(split_re.split(chat)):
            if piece:
                ids += tokenizer.encode(piece, add_special_tokens=False, split_special_tokens=bool(i % 2))
        return ids

    batched = not isinstance(rendered, str)
    ids = [encode(chat) for chat in (rendered if batched else [rendered])]
    if opts["truncation"] and opts["max_length"] is not None:
        keep = opts["max_length"]
        ids = [row[:keep] if tokenizer.truncation_side == "right" else row[-keep:] for row in ids]
    out = tokenizer.pad({"input_ids": ids if batched else ids[0]}, padding=opts["padding"],
                        max_length=opts["max_length"])
    out = BatchEncoding(dict(out), tensor_type=opts["return_tensors"], prepend_batch_axis=not batched)
    return out if opts["return_dict"] else out["input_ids"]


# `_encode_plus` arguments the plain path (`SpikeTokenizer._encode_plain`) handles; any other goes to the base class.
_PLAIN_CALL_KEYS = frozenset({
    "add_special_tokens", "padding_strategy", "truncation_strategy", "max_length", "stride", "pad_to_multiple_of",
    "padding_side", "return_tensors", "return_token_type_ids", "return_attention_mask", "return_overflowing_tokens",
    "return_special_tokens_mask", "return_length", "verbose", "split_special_tokens", "sanitize_control_tokens",
})
_UNSUPPORTED_BY_PLAIN_CALL = ("stride", "return_token_type_ids", "return_overflowing_tokens",
                              "return_special_tokens_mask", "return_length", "sanitize_control_tokens")
_RESERVED_SET = frozenset(RESERVED_TOKENS)
_NON_TEXT_TOKENS = frozenset(BASE_SPECIAL_TOKENS) | frozenset(SPECIAL_TOKENS) | _RESERVED_SET


# Set while `prepare_for_model` runs (it has already removed a leading <bos>), so the base class's
# `build_inputs_with_special_tokens` call adds it unconditionally.  Module level, not an attribute:
# tokenizers get pickled for multiprocessing and thread-locals cannot be.
_BOS_STATE = threading.local()


def unused_token(index: int) -> str:
    """Placeholder token for an id in 260..16383 that the vocab file leaves undefined."""
    return f"\u27e8unused_{index}\u27e9"


def _to_latin1(text: str) -> str:
    """UTF-8 bytes of `text`, one latin-1 character per byte (strict: lone surrogates raise)."""
    return text.encode("utf-8").decode("latin-1")


def _latin1_to_bytes(text: str) -> bytes:
    try:
        return text.encode("latin-1")
    except UnicodeEncodeError:  # only for hand-made token strings that are not vocab entries
        return b"".join(c.encode("latin-1") if ord(c) < 256 else c.encode("utf-8") for c in text)


# --------------------------------------------------------------------------------------------------
# Greedy longest match: a trie compiled to an ordered-alternation regular expression
# --------------------------------------------------------------------------------------------------


def greedy_trie_pattern(tokens: Iterable[str], escape=re.escape, dispatch: int = 0) -> str:
    """An ordered-alternation regex whose successive matches are the greedy longest-match segmentation.

    Each trie node becomes ``(?:child_1...|child_2...|...|)``: children are tried first and the empty
    "stop here" alternative, present only on nodes that are tokens, comes last.  A backtracking engine
    (Python's ``re``, Oniguruma in `tokenizers`) walks the single trie path that matches the text and backs
    off to the deepest terminal, i.e. the longest token that is a prefix of the remaining text.  Children
    start with distinct characters, so their order only affects speed (larger subtrees first).  All 256
    single bytes must be in `tokens` for the matches to cover every input without gaps.  Built without
    recursion; the nesting depth is at most the longest token's length (see `MAX_TOKEN_LEN_LIMIT`).

    ``dispatch=k`` (k >= 2) groups a node's children, when it has more than k, behind lookaheads on their first
    characters, ``(?=[abc])(?:a...|b...|c...)|(?=[def])(?:...)``, recursively, so the engine skips a whole group
    with one class test instead of trying its alternatives one by one.  The groups start with disjoint
    characters and stay in the same order, so the matches are the same; Oniguruma runs about 1.4x faster with
    ``dispatch=4``, Python's ``re`` (which already skips a literal alternative cheaply) does not gain.
    """
    if dispatch == 1 or dispatch < 0:
        raise ValueError(f"dispatch must be 0 (off) or at least 2, got {dispatch}")
    root: dict = {}
    end = ""  # key marking "a token ends here" ("" is never a character key)
    for tok in tokens:
        if not tok:
            continue
        node = root
        for ch in tok:
            node = node.setdefault(ch, {})
        node[end] = True
    if not root:
        raise ValueError("cannot compile an empty token set")

    sizes: dict[int, int] = {}
    patterns: dict[int, str] = {}
    stack = [(root, False)]
    while stack:  # post-order: children are emitted before their parent
        node, children_done = stack.pop()
        children = [(ch, child) for ch, child in node.items() if ch != end]
        if not children_done:
            stack.append((node, True))
            stack.extend((child, False) for _, child in children)
            continue
        sizes[id(node)] = 1 + sum(sizes[id(child)] for _, child in children)
        leaves = sorted(ch for ch, child in children if len(child) == 1 and end in child)
        inner = sorted(
            ((ch, child) for ch, child in children if not (len(child) == 1 and end in child)),
            key=lambda item: (-sizes[id(item[1])], item[0]),
        )
        alts = [escape(ch) + patterns.pop(id(child)) for ch, child in inner]
        for ch, child in children:
            patterns.pop(id(child), None)
        if dispatch and len(alts) > dispatch:
            alts = _dispatch_groups([ch for ch, _ in inner], alts, dispatch, escape)
        if len(leaves) == 1:
            alts.append(escape(leaves[0]))
        elif leaves:
            alts.append("[" + "".join(escape(ch) for ch in leaves) + "]")
        if end in node:
            alts.append("")
        patterns[id(node)] = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
    return patterns[id(root)]


def _dispatch_groups(first_chars: list[str], alts: list[str], size: int, escape) -> list[str]:
    """`alts` (each starting with its character in `first_chars`) as about sqrt(n) lookahead-guarded groups,
    split again until no alternation holds more than `size` alternatives."""
    if len(alts) <= size:
        return alts
    step = -(-len(alts) // max(2, math.isqrt(len(alts) - 1) + 1))
    groups = []
    for start in range(0, len(alts), step):
        chars, inner = first_chars[start:start + step], alts[start:start + step]
        inner = _dispatch_groups(chars, inner, size, escape)
        body = inner[0] if len(inner) == 1 else "(?:" + "|".join(inner) + ")"
        groups.append("(?=[" + "".join(escape(ch) for ch in chars) + "])" + body)
    return groups


def compile_greedy_regex(tokens: Iterable[str]) -> re.Pattern:
    """`greedy_trie_pattern` compiled with Python's ``re`` (the slow tokenizer's matcher)."""
    return re.compile(greedy_trie_pattern(tokens))


# --------------------------------------------------------------------------------------------------
# Vocab file parsing / validation
# --------------------------------------------------------------------------------------------------


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def normalize_vocab_data(data, source: str = "vocab") -> dict:
    """Validate a Length-MAX vocab object and return it completed to the full 16,512-id layout.

    Missing base specials (ids 0..3), chat specials (16384..16400) and reserved slots (16401..16511)
    are filled in.  Raises `ValueError` with an explanation for anything that contradicts the layout.
    The returned dict has the file format, with ``vocab`` ordered by id.
    """
    if not isinstance(data, Mapping):
        raise ValueError(f"{source}: expected a JSON object with a 'vocab' key, got {type(data).__name__}")
    if "model" in data and "vocab" not in data:
        raise ValueError(
            f"{source}: this looks like a `tokenizers` (fast) tokenizer.json, not a Length-MAX vocab file "
            "({'vocab': {...}, 'max_token_len': ..., ...})"
        )
    if "vocab" not in data:
        raise ValueError(f"{source}: missing 'vocab' (expected {{'vocab': {{latin1_string: id}}, ...}})")
    raw = data["vocab"]
    if not isinstance(raw, Mapping) or not raw:
        raise ValueError(f"{source}: 'vocab' must be a non-empty JSON object mapping token strings to ids")

    max_token_len = data.get("max_token_len", DEFAULT_MAX_TOKEN_LEN)
    if max_token_len is None:
        max_token_len = DEFAULT_MAX_TOKEN_LEN
    if not _is_int(max_token_len) or max_token_len < 1:
        raise ValueError(f"{source}: 'max_token_len' must be a positive integer, got {max_token_len!r}")
    if max_token_len > MAX_TOKEN_LEN_LIMIT:
        raise ValueError(
            f"{source}: 'max_token_len' is {max_token_len}, at most {MAX_TOKEN_LEN_LIMIT} is supported (greedy "
            "matching compiles the tokens into a regular expression nested as deep as the longest token); "
            f"set it to {MAX_TOKEN_LEN_LIMIT} or less: longer tokens are then kept for decoding but never produced"
        )

    listed = data.get("special_tokens")
    if listed is not None:
        if not isinstance(listed, (list, tuple)) or not all(isinstance(t, str) for t in listed):
            raise ValueError(f"{source}: 'special_tokens' must be a list of strings")
        unknown = [t for t in listed if t not in SPECIAL_TOKEN_IDS]
        if unknown:
            raise ValueError(
                f"{source}: unknown special tokens {unknown[:5]}; the spike_whale layout has exactly "
                f"{list(SPECIAL_TOKENS)} at ids {SPECIAL_START_ID}..{RESERVED_START_ID - 1}"
            )

    by_id: dict[int, str] = {}
    for token, idx in raw.items():
        if not isinstance(token, str) or token == "":
            raise ValueError(f"{source}: vocab keys must be non-empty strings, got {token!r}")
        if not _is_int(idx):
            raise ValueError(f"{source}: id of token {token!r} must be an integer, got {idx!r}")
        if not 0 <= idx < VOCAB_SIZE:
            raise ValueError(f"{source}: id {idx} of token {token!r} is outside 0..{VOCAB_SIZE - 1}")
        if idx in by_id:
            raise ValueError(f"{source}: ids collide: {by_id[idx]!r} and {token!r} both have id {idx}")
        by_id[idx] = token

    expected_fixed = {i: tok for i, tok in enumerate(BASE_SPECIAL_TOKENS)}
    expected_fixed.update({i: tok for tok, i in SPECIAL_TOKEN_IDS.items()})
    expected_fixed.update({RESERVED_START_ID + i: tok for i, tok in enumerate(RESERVED_TOKENS)})

    # Fixed (special) tokens must be at their id or absent; their ids may hold nothing else.
    for token, idx in raw.items():
        if token in _NON_TEXT_TOKENS and expected_fixed.get(idx) != token:
            want = [i for i, t in expected_fixed.items() if t == token][0]
            raise ValueError(f"{source}: special token {token!r} has id {idx}, the layout requires {want}")
    for idx, token in expected_fixed.items():
        if idx in by_id and by_id[idx] != token:
            raise ValueError(f"{source}: id {idx} is reserved for {token!r} but holds {by_id[idx]!r}")

    # Byte fallback: byte b must be the token chr(b) at id b + 4.
    missing = [b for b in range(256) if raw.get(chr(b)) != b + BYTE_OFFSET]
    if missing:
        b = missing[0]
        got = raw.get(chr(b))
        detail = "missing" if got is None else f"has id {got}"
        raise ValueError(
            f"{source}: byte tokens missing or misplaced ({len(missing)} of 256): byte 0x{b:02x} "
            f"(token {chr(b)!r}) must have id {b + BYTE_OFFSET}, {detail}"
        )

    # Multi-byte tokens: latin-1 strings of >= 2 characters in 260..16383.
    for idx, token in by_id.items():
        if FIRST_MULTIBYTE_ID <= idx < SPECIAL_START_ID:
            if len(token) < 2:
                raise ValueError(f"{source}: multi-byte id {idx} holds a single character {token!r}")
            bad = next((c for c in token if ord(c) > 255), None)
            if bad is not None:
                raise ValueError(
                    f"{source}: token {token!r} (id {idx}) contains {bad!r} (U+{ord(bad):04X}); regular tokens "
                    "must be latin-1 strings, one character per UTF-8 byte"
                )
        elif BYTE_OFFSET <= idx < FIRST_MULTIBYTE_ID and len(token) != 1:
            raise ValueError(f"{source}: id {idx} is a byte slot but holds {token!r}")

    full = dict(by_id)
    full.update(expected_fixed)
    vocab = {full[i]: i for i in sorted(full)}
    out = {
        "vocab": vocab,
        "max_token_len": max_token_len,
        "vocab_size": VOCAB_SIZE,
        "algorithm": data.get("algorithm", ALGORITHM),
        "special_tokens": list(SPECIAL_TOKENS),
    }
    for key, value in data.items():  # keep unknown metadata so files round-trip
        if key not in out:
            out[key] = value
    return out


def greedy_tokens(data: Mapping) -> dict[str, int]:
    """The tokens greedy matching may emit (latin-1 string -> id) of a normalised vocab: bytes and multi-byte tokens
    up to max_token_len (longer ones stay decodable but the released encoder never tried them)."""
    return {tok: idx for tok, idx in data["vocab"].items()
            if BYTE_OFFSET <= idx < SPECIAL_START_ID and len(tok) <= data["max_token_len"]}


def load_vocab_file(path: str | os.PathLike) -> dict:
    """Read and validate a Length-MAX vocab file (``spike_vocab.json`` or a released ``tokenizer.json``)."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from err
    return normalize_vocab_data(data, source=path)


def check_tokenizer_file(path, need_model: bool = False) -> None:
    """One clear error naming a folder's ``tokenizer.json`` when it cannot load: transformers parses it before either
    class sees it (a bare JSONDecodeError), and `tokenizers` says only "Model missing" for one without "model"."""
    if path is None or not os.path.isfile(path):
        return
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err}): the file is truncated or damaged; copy it again or "
                         "re-save the tokenizer with save_pretrained") from None
    if need_model and isinstance(data, Mapping) and "model" not in data and "vocab" not in data:
        raise ValueError(f"{path} has no 'model', which a `tokenizers` file needs: the file is damaged; copy it again, "
                         "re-save the tokenizer with save_pretrained, or delete it to build it from spike_vocab.json")


def dump_vocab_data(data: Mapping) -> str:
    """Serialise vocab data in the released style (``ensure_ascii`` escapes, ``vocab`` ordered by id)."""
    data = dict(data)
    data["vocab"] = dict(sorted(data["vocab"].items(), key=lambda kv: kv[1]))
    return json.dumps(data, ensure_ascii=True)


# --------------------------------------------------------------------------------------------------
# The tokenizer
# --------------------------------------------------------------------------------------------------


class SpikeTokenizer(PreTrainedTokenizer):
    """Greedy longest-match byte tokenizer over a Length-MAX vocabulary (slow / pure Python).

    Args:
        vocab_file (`str`, `os.PathLike` or `dict`, *optional*):
            Path to ``spike_vocab.json`` or to a released custom-format ``tokenizer.json``; a vocab dict in the
            same format is also accepted.  Without one, the tokenizer is byte-level: the 256 byte tokens and the
            released specials at their ids (every text still encodes, one token per UTF-8 byte).
        add_bos_token (`bool`, defaults to `True`):
            Prepend ``<bos>`` (id 2) when ``add_special_tokens=True`` (the default of ``__call__``), never
            twice: input that already starts with ``<bos>`` is left alone.  No ``<eos>`` is appended.
        model_max_length (`int`, *optional*): the model context; the exporter passes it.

    Notes:
        * Special-token strings in the text (``<|im_start|>``, ``<bos>``, ...) are atomic.  Use
          ``split_special_tokens=True`` (or `encode_ordinary`) to encode such text as plain bytes.
        * Decoding joins the bytes of ordinary tokens and decodes them as UTF-8 with ``errors="replace"``;
          special tokens are written literally unless ``skip_special_tokens=True``.
        * ``add_bos_token`` is saved in ``tokenizer_config.json`` (transformers leaves it out; see
          `save_chat_templates`), so ``False`` survives ``save_pretrained`` / ``from_pretrained``.
        * ``padding_side`` defaults to ``"left"`` (decoder-only generation).
    """

    vocab_files_names = {"vocab_file": VOCAB_FILE_NAME}
    model_input_names = ["input_ids", "attention_mask"]
    padding_side = "left"
    _auto_class = "AutoTokenizer"  # save_pretrained writes auto_map and copies this file

    def __init__(
        self,
        vocab_file=None,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        pad_token=PAD_TOKEN,
        add_bos_token: bool = True,
        **kwargs,
    ):
        # `from_pretrained` on a folder holding a released custom-format tokenizer.json (and no
        # spike_vocab.json) passes it as `tokenizer_file`; never record it in the saved config.
        tokenizer_file = kwargs.pop("tokenizer_file", None)
        source = vocab_file if vocab_file is not None else tokenizer_file
        if source is None:  # the byte-level tokenizer: 256 bytes and the released specials, no multi-byte tokens
            source = {"vocab": {chr(b): b + BYTE_OFFSET for b in range(256)}}
        if isinstance(source, Mapping):
            data = normalize_vocab_data(source, source="vocab dict")
            self.vocab_file = None
        else:
            data = load_vocab_file(source)
            self.vocab_file = os.fspath(source)
        self._set_vocab_data(data)

        self._add_bos_token = bool(add_bos_token)
        # transformers pops `special_tokens_pattern` before saving the init kwargs, so it is set here on
        # every construction (and kept in sync by the `add_bos_token` setter).
        kwargs.pop("special_tokens_pattern", None)
        kwargs["special_tokens_pattern"] = "bos" if self._add_bos_token else "none"
        kwargs.setdefault("chat_template", CHATML_TEMPLATE)
        kwargs.setdefault("clean_up_tokenization_spaces", False)

        # The 17 chat/tool/FIM specials and the 111 reserved slots are special added tokens, so the base
        # class trie splits them out before `_tokenize` and `skip_special_tokens` drops them.
        extra = kwargs.pop("extra_special_tokens", None)
        legacy_extra = kwargs.pop("additional_special_tokens", None)
        if extra is None:
            extra = legacy_extra or []
        if isinstance(extra, Mapping):  # named model-specific tokens: keep them as such
            kwargs["model_specific_special_tokens"] = {
                **dict(kwargs.get("model_specific_special_tokens") or {}),
                **dict(extra),
            }
            extra = []
        ours = [
            AddedToken(tok, special=True, normalized=False, lstrip=False, rstrip=False)
            for tok in SPECIAL_TOKENS + RESERVED_TOKENS
        ]
        # <pad>/<unk>/<bos>/<eos> stay atomic special tokens even if the user re-points eos/pad/unk.
        named = {str(t) for t in (bos_token, eos_token, unk_token, pad_token) if t is not None}
        ours += [
            AddedToken(tok, special=True, normalized=False, lstrip=False, rstrip=False)
            for tok in BASE_SPECIAL_TOKENS
            if tok not in named
        ]
        known = set(SPECIAL_TOKENS) | _RESERVED_SET | set(BASE_SPECIAL_TOKENS)
        kwargs["extra_special_tokens"] = ours + [tok for tok in extra if str(tok) not in known]
        # A folder saved by the fast twin: transformers hands over tokenizer.json's added tokens, where the vocab's
        # own greedy tokens may be (its Aho-Corasick matcher); as added tokens here they would be split out before
        # the specials ("Z <bos>" -> " <", "bo", ...).  Ids below the specials are the vocab's, never added.
        added = kwargs.get("added_tokens_decoder")
        if added:
            kwargs["added_tokens_decoder"] = {i: t for i, t in added.items()
                                              if not BYTE_OFFSET <= int(i) < SPECIAL_START_ID}
        kwargs.pop("backend", None)  # "tokenizers" in a config the fast twin wrote; this class is "custom"

        super().__init__(
            bos_token=bos_token,
            eos_token=eos_token,
            unk_token=unk_token,
            pad_token=pad_token,
            add_bos_token=self._add_bos_token,
            **kwargs,
        )
        self._check_layout()

    # ---- vocab ------------------------------------------------------------------------------------

    def _set_vocab_data(self, data: dict) -> None:
        self._vocab_data = data
        self.max_token_len = data["max_token_len"]
        vocab = data["vocab"]
        id_to_token = [None] * VOCAB_SIZE
        for token, idx in vocab.items():
            id_to_token[idx] = token
        self._unused_tokens = {}
        for idx in range(FIRST_MULTIBYTE_ID, SPECIAL_START_ID):
            if id_to_token[idx] is None:
                placeholder = unused_token(idx)
                id_to_token[idx] = placeholder
                self._unused_tokens[placeholder] = idx
        self._id_to_token = id_to_token
        self._token_to_id = {tok: i for i, tok in enumerate(id_to_token)}
        self._greedy = greedy_tokens(data)
        self._regex = None
        self._added_split = None

    def _check_layout(self) -> None:
        # Every sequence was trained to start with <bos> (id 2); eos/pad/unk may be re-pointed by the user
        # (e.g. eos_token="<|im_end|>" for a chat export).
        if self.bos_token_id != BOS_ID:
            raise ValueError(f"bos_token resolves to id {self.bos_token_id}, the spike_whale layout requires {BOS_ID}")
        expected = {tok: i for i, tok in enumerate(BASE_SPECIAL_TOKENS)}
        expected.update(SPECIAL_TOKEN_IDS)
        expected.update({tok: RESERVED_START_ID + i for i, tok in enumerate(RESERVED_TOKENS)})
        for token, idx in expected.items():
            got = self._added_tokens_encoder.get(token)
            if got != idx:
                raise ValueError(
                    f"special token {token!r} resolved to id {got}, the spike_whale layout requires {idx} "
                    "(a stale added_tokens_decoder in tokenizer_config.json?)"
                )

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZE

    def get_vocab(self) -> dict[str, int]:
        vocab = dict(self._token_to_id)
        vocab.update(self._added_tokens_encoder)
        return vocab

    @property
    def greedy_vocab(self) -> dict[str, int]:
        """The tokens greedy matching may emit (latin-1 string -> id); a copy."""
        return dict(self._greedy)

    @property
    def vocab_data(self) -> dict:
        """The vocab in file format (what `save_vocabulary` writes); a copy."""
        return json.loads(dump_vocab_data(self._vocab_data))

    # ---- BOS handling -------------------------------------------------------------------------------

    @property
    def add_bos_token(self) -> bool:
        return self._add_bos_token

    @add_bos_token.setter
    def add_bos_token(self, value: bool) -> None:
        self._add_bos_token = bool(value)
        self.special_tokens_pattern = "bos" if self._add_bos_token else "none"

    def _with_bos(self, ids: list[int]) -> list[int]:
        ids = list(ids)
        if self._add_bos_token and (getattr(_BOS_STATE, "force", False) or not ids or ids[0] != BOS_ID):
            return [BOS_ID] + ids
        return ids

    def build_inputs_with_special_tokens(self, token_ids_0, token_ids_1=None):
        """``[<bos>] + ids`` (or ids unchanged when ``add_bos_token=False`` or they already start with <bos>)."""
        if token_ids_1 is None:
            return self._with_bos(token_ids_0)
        return self._with_bos(token_ids_0) + self._with_bos(token_ids_1)

    def get_special_tokens_mask(self, token_ids_0, token_ids_1=None, already_has_special_tokens=False):
        if already_has_special_tokens:
            return super().get_special_tokens_mask(token_ids_0, token_ids_1, already_has_special_tokens=True)

        def one(ids):
            mask = [0] * len(self._with_bos(ids))
            if self._add_bos_token:
                mask[0] = 1
            return mask

        return one(token_ids_0) if token_ids_1 is None else one(token_ids_0) + one(token_ids_1)

    def prepare_for_model(self, ids, pair_ids=None, add_special_tokens=True, **kwargs):
        # Never add <bos> twice: drop one leading <bos> the text already had and let the base class add it
        # back (so truncation lengths and the special-tokens mask stay exact); "<bos><bos>x" keeps both.
        # Pretokenized words are taken literally (a word "<bos>" stays a token), as the fast twin does.
        if not (add_special_tokens and self._add_bos_token) or getattr(_BOS_STATE, "words", False):
            return super().prepare_for_model(ids, pair_ids=pair_ids, add_special_tokens=add_special_tokens, **kwargs)
        if ids and ids[0] == BOS_ID:
            ids = ids[1:]
        if pair_ids and pair_ids[0] == BOS_ID:
            pair_ids = pair_ids[1:]
        previous = getattr(_BOS_STATE, "force", False)
        _BOS_STATE.force = True
        try:
            return super().prepare_for_model(ids, pair_ids=pair_ids, add_special_tokens=True, **kwargs)
        finally:
            _BOS_STATE.force = previous

    # ---- encode -------------------------------------------------------------------------------------

    @property
    def greedy_regex(self) -> re.Pattern:
        """The compiled trie regex (compiled on first use: seconds for a 16K vocabulary)."""
        if self._regex is None:
            self._regex = compile_greedy_regex(self._greedy)
        return self._regex

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        if not text:
            return []
        return self.greedy_regex.findall(_to_latin1(text))

    def _split_added_tokens(self, text: str) -> list[str] | None:
        """`text` cut into added tokens and the text between them (leftmost-longest, as the base class's trie),
        or None where an added token has lstrip/rstrip/single_word (then the base class handles it)."""
        if self._added_split is None:
            tokens = self._added_tokens_decoder.values()
            if any(t.lstrip or t.rstrip or t.single_word for t in tokens):
                return None
            contents = sorted((t.content for t in tokens), key=len, reverse=True)
            self._added_split = re.compile("(" + "|".join(map(re.escape, contents)) + ")")
        return self._added_split.split(text)

    def _update_trie(self, unique_no_split_tokens=None):
        self._added_split = None  # rebuilt on next use, with the new added tokens
        super()._update_trie(unique_no_split_tokens)

    def tokenize(self, text: str, **kwargs) -> list[str]:
        """Tokens of `text`: added tokens split out first, greedy longest match in between.

        With ``is_split_into_words=True`` (one word of pretokenized input) every stretch of text gets a
        leading space unless it has one, the convention of transformers' byte-level tokenizers (GPT-2,
        RoBERTa): ``["hello", "world"]`` encodes as ``" hello world"``.
        """
        split_special_tokens = kwargs.pop("split_special_tokens", self.split_special_tokens)
        as_word = kwargs.pop("is_split_into_words", False)
        pieces = [text] if split_special_tokens else self._split_added_tokens(text)
        if pieces is None:
            return super().tokenize(text, split_special_tokens=split_special_tokens, **kwargs)
        out: list[str] = []
        findall = self.greedy_regex.findall
        for i, piece in enumerate(pieces):
            if i % 2:  # odd pieces are the separators: added tokens
                out.append(piece)
            elif piece:
                if as_word and not piece.startswith(" "):
                    piece = " " + piece
                out.extend(findall(_to_latin1(piece)))
        return out

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            return super().convert_tokens_to_ids(tokens)
        # One dict lookup per token: added tokens (the specials) are in `_added_tokens_encoder`, every other
        # token this tokenizer produces is in `_token_to_id`.
        added, regular = self._added_tokens_encoder, self._token_to_id
        return [added[t] if t in added else regular.get(t, UNK_ID) for t in tokens]

    def _encode_plus(self, text, text_pair=None, *args, is_split_into_words: bool = False, **kwargs):
        if kwargs.pop("return_offsets_mapping", False):
            raise NotImplementedError(
                "SpikeTokenizer (the slow, pure-Python tokenizer) does not compute offsets: use SpikeTokenizerFast "
                "(what AutoTokenizer returns by default) for return_offsets_mapping=True"
            )
        if not is_split_into_words and text_pair is None and not args and kwargs.keys() <= _PLAIN_CALL_KEYS and not any(
                kwargs.get(k) for k in _UNSUPPORTED_BY_PLAIN_CALL) and kwargs.get(
                "truncation_strategy", TruncationStrategy.DO_NOT_TRUNCATE) == TruncationStrategy.DO_NOT_TRUNCATE:
            rows = [text] if isinstance(text, str) else text
            if isinstance(rows, (list, tuple)) and rows and all(isinstance(t, str) for t in rows):
                return self._encode_plain(text, rows, **kwargs)
        if is_split_into_words:  # encoded word by word here; the base class then sees ids
            split = kwargs.get("split_special_tokens")
            opts = {} if split is None else {"split_special_tokens": split}

            def ids_of(words):
                if words is None:
                    return None
                if isinstance(words, str):  # a one-word sequence, unwrapped by the batch loop
                    words = [words]
                if isinstance(words, tuple) and len(words) == 2 and not isinstance(words[0], str):
                    return ids_of(words[0]), ids_of(words[1])  # a (words, words) pair in a batch
                if words and not isinstance(words[0], str):  # a batch of sequences
                    return [ids_of(row) for row in words]
                return self.convert_tokens_to_ids(
                    [t for word in words for t in self.tokenize(word, is_split_into_words=True, **opts)]
                )

            previous = getattr(_BOS_STATE, "words", False)
            _BOS_STATE.words = True
            try:
                return super()._encode_plus(ids_of(text), ids_of(text_pair), *args, **kwargs)
            finally:
                _BOS_STATE.words = previous
        return super()._encode_plus(text, text_pair, *args, is_split_into_words=is_split_into_words, **kwargs)

    def _encode_plain(self, text, rows: list[str], add_special_tokens: bool = True, padding_strategy=None,
                      max_length=None, pad_to_multiple_of=None, padding_side=None, return_tensors=None,
                      return_attention_mask=None, verbose: bool = True, split_special_tokens=None, **_):
        """`__call__` on texts without truncation, pairs or extra outputs: the same result as the base class's
        per-text `prepare_for_model`, computed with one regex pass and one dict lookup per token."""
        split = self.split_special_tokens if split_special_tokens is None else split_special_tokens
        ids = [self._text_ids(t, split) for t in rows]
        if add_special_tokens and self._add_bos_token:  # never twice, as in `prepare_for_model`
            ids = [row if row[:1] == [BOS_ID] else [BOS_ID] + row for row in ids]
        for row in ids:
            self._eventual_warn_about_too_long_sequence(row, max_length, verbose)
        batched = not isinstance(text, str)
        if padding_strategy is None or padding_strategy == PaddingStrategy.DO_NOT_PAD:
            out = {"input_ids": ids}
            if return_attention_mask or (return_attention_mask is None and "attention_mask" in self.model_input_names):
                out["attention_mask"] = [[1] * len(row) for row in ids]
            if not batched:
                out = {key: value[0] for key, value in out.items()}
        else:
            out = self.pad({"input_ids": ids if batched else ids[0]}, padding=padding_strategy.value,
                           max_length=max_length, pad_to_multiple_of=pad_to_multiple_of, padding_side=padding_side,
                           return_attention_mask=return_attention_mask)
        return BatchEncoding(dict(out), tensor_type=return_tensors, prepend_batch_axis=not batched)

    def _text_ids(self, text: str, split_special_tokens: bool) -> list[int]:
        pieces = [text] if split_special_tokens else self._split_added_tokens(text)
        if pieces is None:
            return self.convert_tokens_to_ids(self.tokenize(text, split_special_tokens=split_special_tokens))
        greedy, added, findall = self._greedy, self._added_tokens_encoder, self.greedy_regex.findall
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            if i % 2:
                ids.append(added[piece])
            elif piece:
                ids += [greedy[t] for t in findall(_to_latin1(piece))]
        return ids

    def encode_ordinary(self, text: str) -> list[int]:
        """Greedy ids of `text` with no special-token handling and no <bos> (fast path for data prep).

        Equal to ``encode(text, add_special_tokens=False, split_special_tokens=True)``.
        """
        if not text:
            return []
        greedy = self._greedy
        return [greedy[t] for t in self.greedy_regex.findall(_to_latin1(text))]

    def _convert_token_to_id(self, token: str) -> int:
        return self._token_to_id.get(token, UNK_ID)

    # ---- decode -------------------------------------------------------------------------------------

    def _convert_id_to_token(self, index: int) -> str:
        if 0 <= index < VOCAB_SIZE:
            return self._id_to_token[index]
        return UNK_TOKEN  # out of range (e.g. -100 labels): visible, never raises

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        literal = self._added_tokens_encoder  # specials / added tokens: written as is (dict, O(1) lookups)
        unused = self._unused_tokens
        out: list[str] = []
        run: list[str] = []
        for token in tokens:
            if token in literal:
                if run:
                    out.append(_latin1_to_bytes("".join(run)).decode("utf-8", errors="replace"))
                    run = []
                out.append(token)
            elif token in unused:
                continue
            else:
                run.append(token)
        if run:
            out.append(_latin1_to_bytes("".join(run)).decode("utf-8", errors="replace"))
        return "".join(out)

    def apply_chat_template(self, conversation, **kwargs):
        """transformers' `apply_chat_template`, with ``sanitize_control_tokens=True`` by default (see
        `chat_template_kwargs`): a user message cannot inject ``<|im_start|>system``.  Pass
        ``sanitize_control_tokens=False`` for the raw behaviour; ``tokenize=False`` returns the rendered string,
        which cannot mark the difference (encode it with ``split_special_tokens`` as needed)."""
        return apply_chat_template_safely(self, super().apply_chat_template, conversation, kwargs)

    # ---- save ---------------------------------------------------------------------------------------

    def save_chat_templates(self, save_directory, tokenizer_config: dict, filename_prefix, save_jinja_files):
        # `save_pretrained` pops `add_bos_token` from the config it writes and calls this right after: put the
        # flag back, or a tokenizer saved with add_bos_token=False would reload prepending <bos>.
        tokenizer_config["add_bos_token"] = self._add_bos_token
        return super().save_chat_templates(save_directory, tokenizer_config, filename_prefix, save_jinja_files)

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str, ...]:
        if not os.path.isdir(save_directory):
            raise ValueError(f"Vocabulary path ({save_directory}) should be a directory")
        name = (filename_prefix + "-" if filename_prefix else "") + VOCAB_FILE_NAME
        path = os.path.join(save_directory, name)
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(dump_vocab_data(self._vocab_data))
        return (path,)

    # ---- construction helpers -------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *init_inputs, **kwargs):
        """Also accepts the path of a single vocab file (``spike_vocab.json`` or a released ``tokenizer.json``).

        transformers would treat a lone ``tokenizer.json`` as a `tokenizers` file; load it directly instead.
        """
        path = pretrained_model_name_or_path
        if isinstance(path, (str, os.PathLike)) and os.path.isfile(path):
            for hub_only in ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder",
                             "trust_remote_code", "proxies", "user_agent", "_from_pipeline", "_from_auto",
                             "_commit_hash"):
                kwargs.pop(hub_only, None)
            kwargs.setdefault("name_or_path", os.fspath(path))
            return cls(path, *init_inputs, **kwargs)
        return super().from_pretrained(pretrained_model_name_or_path, *init_inputs, **kwargs)

    @classmethod
    def _from_pretrained(cls, resolved_vocab_files, *args, **kwargs):
        check_tokenizer_file(resolved_vocab_files.get("tokenizer_file"))
        return super()._from_pretrained(resolved_vocab_files, *args, **kwargs)



__all__ = [
    "SpikeTokenizer",
    "compile_greedy_regex",
    "load_vocab_file",
    "normalize_vocab_data",
    "dump_vocab_data",
    "CHATML_TEMPLATE",
    "apply_chat_template_safely",
    "PAD_ID",
    "UNK_ID",
    "BOS_ID",
    "EOS_ID",
    "IM_START_ID",
    "IM_END_ID",
    "THINK_ID",
    "END_THINK_ID",
    "ENDOFTEXT_ID",
    "SPECIAL_TOKENS",
    "SPECIAL_TOKEN_IDS",
    "RESERVED_IDS",
    "RESERVED_TOKENS",
    "ALL_SPECIAL_IDS",
    "CHAT_EOS_IDS",
    "VOCAB_SIZE",
    "NUM_BASE_IDS",
    "FIRST_MULTIBYTE_ID",
    "BYTE_OFFSET",
    "DEFAULT_MAX_TOKEN_LEN",
    "VOCAB_FILE_NAME",
    "greedy_trie_pattern",
    "unused_token",
]
