# Copyright 2025 The spike_whale integration authors. Apache-2.0.
"""Slow (pure Python) tokenizer of the spike_whale models: greedy longest match over the UTF-8 bytes of the text
against a Length-MAX vocabulary. A flat Hub file: it imports only the standard library and ``transformers``.

The id layout (the constants below) is fixed: the released embeddings depend on it. Tokens are latin-1 strings, one
character per UTF-8 byte. The vocab file is ``spike_vocab.json`` (format: `normalize_vocab_data`), since transformers
reads any ``tokenizer.json`` as a `tokenizers` file."""

from __future__ import annotations

import inspect
import json
import math
import os
import re
import threading
from collections.abc import Iterable, Mapping

from transformers import PreTrainedTokenizer
from transformers.tokenization_utils_base import (AddedToken, BatchEncoding, PaddingStrategy, PreTrainedTokenizerBase,
                                                  TruncationStrategy)

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
PAD_TOKEN, UNK_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<unk>", "<bos>", "<eos>"
BASE_SPECIAL_TOKENS = (PAD_TOKEN, UNK_TOKEN, BOS_TOKEN, EOS_TOKEN)  # ids 0..3
BYTE_OFFSET = 4  # byte b has id b + BYTE_OFFSET
FIRST_MULTIBYTE_ID = BYTE_OFFSET + 256  # 260
SPECIAL_START_ID = NUM_BASE_IDS = 16384  # the first chat/tool/FIM special
SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<think>", "</think>", "<begin_solution>", "<end_solution>",
                  "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<|system|>", "<|user|>",
                  "<|assistant|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|endoftext|>")
SPECIAL_TOKEN_IDS = {tok: SPECIAL_START_ID + i for i, tok in enumerate(SPECIAL_TOKENS)}
IM_START_ID, IM_END_ID = SPECIAL_TOKEN_IDS["<|im_start|>"], SPECIAL_TOKEN_IDS["<|im_end|>"]
RESERVED_START_ID = SPECIAL_START_ID + len(SPECIAL_TOKENS)  # 16401
VOCAB_SIZE = 16512
RESERVED_IDS = range(RESERVED_START_ID, VOCAB_SIZE)
RESERVED_TOKENS = tuple(f"<|reserved_special_{i}|>" for i in range(len(RESERVED_IDS)))
# Every id that is not text, and its token: 0..3, the 17 specials, the 111 reserved ids.
ALL_SPECIAL_IDS = tuple(range(BYTE_OFFSET)) + tuple(SPECIAL_TOKEN_IDS.values()) + tuple(RESERVED_IDS)
LAYOUT_SPECIALS = dict(zip(BASE_SPECIAL_TOKENS + SPECIAL_TOKENS + RESERVED_TOKENS, ALL_SPECIAL_IDS))
CHAT_EOS_IDS = (EOS_ID, IM_END_ID)  # ids that end a chat turn (generation_config.eos_token_id)

DEFAULT_MAX_TOKEN_LEN = 24
MAX_TOKEN_LEN_LIMIT = 256  # the trie regex nests as deep as the longest token; `re` fails near 400 levels
VOCAB_FILE_NAME = "spike_vocab.json"
ALGORITHM = "length-max"

CHATML_TEMPLATE = (
    "{{- bos_token if bos_token else '' -}}\n"
    "{%- if tools -%}\n"
    "    {{- raise_exception('This chat template has no tool-calling format (the spike_whale chat models were not "
    "trained with one): pass tools=None, or a chat_template that defines one.') -}}\n"
    "{%- endif -%}\n"
    "{%- for message in messages -%}\n"
    "    {%- set i = loop.index0 -%}\n"
    "    {%- if message['role'] is not defined or message['role'] is not string -%}\n"
    "        {{- raise_exception('Message ' ~ loop.index0 ~ ' has no \\'role\\' string: every message needs one, such "
    "as {\"role\": \"user\", \"content\": \"...\"}.') -}}\n"
    "    {%- endif -%}\n"
    "    {%- if message['tool_calls'] is defined -%}\n"
    "        {{- raise_exception('Message ' ~ loop.index0 ~ ' has tool_calls, which this chat template cannot write "
    "(no tool-calling format); put the call in \\'content\\' or use a chat_template that defines one.') -}}\n"
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
    "{%- endif -%}\n")

# transformers added `apply_chat_template(..., sanitize_control_tokens=...)` after 5.0; before, the control tokens in
# the inputs are marked here and encoded as text (`SpikeTokenizerMixin.apply_chat_template`).
_HAS_SANITIZE = "sanitize_control_tokens" in inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
_MARK_START, _MARK_END = "\U000f0000", "\U000f0001"  # private use: removed from user strings before marking


def unused_token(index: int) -> str:
    """Placeholder token for an id in 260..16383 that the vocab file leaves undefined."""
    return f"\u27e8unused_{index}\u27e9"


def _latin1_to_bytes(text: str) -> bytes:
    try:
        return text.encode("latin-1")
    except UnicodeEncodeError:  # a hand-made token string that is not a vocab entry
        return b"".join(c.encode("latin-1") if ord(c) < 256 else c.encode("utf-8") for c in text)


def with_leading_space(words):
    """Pretokenized input (``is_split_into_words=True``): each word with a leading space unless it has one, the
    byte-level convention of GPT-2 and RoBERTa (``["hello", "world"]`` reads ``" hello world"``); nested as given."""
    if isinstance(words, str):
        return words if words.startswith(" ") else " " + words
    return words if words is None else type(words)(map(with_leading_space, words))


def greedy_trie_pattern(tokens: Iterable[str], escape=re.escape, dispatch: int = 0) -> str:
    """A regex whose successive matches are the greedy longest-match segmentation (all 256 bytes must be tokens): each
    trie node becomes ``(?:child_1...|child_2...|)``, the empty "stop here" alternative (on token nodes) last, so a
    backtracking engine (``re``, Oniguruma) backs off to the longest token prefixing the rest. ``dispatch=k`` (k >= 2)
    guards over k children with lookaheads on their first characters, so Oniguruma skips a group with one test."""
    if dispatch == 1 or dispatch < 0:
        raise ValueError(f"dispatch must be 0 (off) or at least 2, got {dispatch}")
    root: dict = {}
    end = ""  # key marking "a token ends here" ("" is never a character key)
    for tok in filter(None, tokens):
        node = root
        for ch in tok:
            node = node.setdefault(ch, {})
        node[end] = True
    if not root:
        raise ValueError("cannot compile an empty token set")
    sizes, patterns = {}, {}  # subtree sizes and patterns by id(node)
    stack = [(root, False)]
    while stack:  # post-order without recursion: children before their parent
        node, children_done = stack.pop()
        children = [(ch, child) for ch, child in node.items() if ch != end]
        if not children_done:
            stack.append((node, True))
            stack.extend((child, False) for _, child in children)
            continue
        sizes[id(node)] = 1 + sum(sizes[id(child)] for _, child in children)
        leaves = sorted(ch for ch, child in children if len(child) == 1 and end in child)
        inner = sorted(((ch, child) for ch, child in children if not (len(child) == 1 and end in child)),
                       key=lambda item: (-sizes[id(item[1])], item[0]))  # larger subtrees first: speed only
        alts = [escape(ch) + patterns.pop(id(child)) for ch, child in inner]
        if dispatch and len(alts) > dispatch:
            alts = _dispatch_groups([ch for ch, _ in inner], alts, dispatch, escape)
        if leaves:
            alts.append(escape(leaves[0]) if len(leaves) == 1 else "[" + "".join(map(escape, leaves)) + "]")
        if end in node:
            alts.append("")
        patterns[id(node)] = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
    return patterns[id(root)]


def _dispatch_groups(first_chars: list[str], alts: list[str], size: int, escape) -> list[str]:
    """`alts` as about sqrt(n) lookahead-guarded groups, split again until none holds more than `size`."""
    if len(alts) <= size:
        return alts
    step = -(-len(alts) // max(2, math.isqrt(len(alts) - 1) + 1))
    groups = []
    for start in range(0, len(alts), step):
        chars = first_chars[start:start + step]
        inner = _dispatch_groups(chars, alts[start:start + step], size, escape)
        body = inner[0] if len(inner) == 1 else "(?:" + "|".join(inner) + ")"
        groups.append("(?=[" + "".join(map(escape, chars)) + "])" + body)
    return groups


def normalize_vocab_data(data, source: str = "vocab") -> dict:
    """A Length-MAX vocab object validated and completed to the 16,512-id layout (specials and reserved slots filled
    in, ``vocab`` ordered by id, unknown keys kept); a contradiction raises `ValueError` naming `source` and the fix."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{source}: expected a JSON object with a 'vocab' key, got {type(data).__name__}")
    if "model" in data and "vocab" not in data:
        raise ValueError(f"{source}: this looks like a `tokenizers` (fast) tokenizer.json, not a Length-MAX vocab file "
                         "({'vocab': {...}, 'max_token_len': ..., ...})")
    if "vocab" not in data:
        raise ValueError(f"{source}: missing 'vocab' (expected {{'vocab': {{latin1_string: id}}, ...}})")
    raw = data["vocab"]
    if not isinstance(raw, Mapping) or not raw:
        raise ValueError(f"{source}: 'vocab' must be a non-empty JSON object mapping token strings to ids")
    max_token_len = DEFAULT_MAX_TOKEN_LEN if data.get("max_token_len") is None else data["max_token_len"]
    if not isinstance(max_token_len, int) or isinstance(max_token_len, bool) or max_token_len < 1:
        raise ValueError(f"{source}: 'max_token_len' must be a positive integer, got {max_token_len!r}")
    if max_token_len > MAX_TOKEN_LEN_LIMIT:
        raise ValueError(
            f"{source}: 'max_token_len' is {max_token_len}, at most {MAX_TOKEN_LEN_LIMIT} is supported (greedy "
            "matching compiles the tokens into a regular expression nested as deep as the longest token); "
            f"set it to {MAX_TOKEN_LEN_LIMIT} or less: longer tokens are then kept for decoding but never produced")
    listed = data.get("special_tokens")
    if listed is not None and (not isinstance(listed, (list, tuple)) or not all(isinstance(t, str) for t in listed)):
        raise ValueError(f"{source}: 'special_tokens' must be a list of strings")
    unknown = [t for t in listed or () if t not in SPECIAL_TOKEN_IDS]
    if unknown:
        raise ValueError(f"{source}: unknown special tokens {unknown[:5]}; the spike_whale layout has exactly "
                         f"{list(SPECIAL_TOKENS)} at ids {SPECIAL_START_ID}..{RESERVED_START_ID - 1}")
    by_id: dict[int, str] = {}
    for token, idx in raw.items():
        if not isinstance(token, str) or token == "":
            raise ValueError(f"{source}: vocab keys must be non-empty strings, got {token!r}")
        if not isinstance(idx, int) or isinstance(idx, bool):
            raise ValueError(f"{source}: id of token {token!r} must be an integer, got {idx!r}")
        if not 0 <= idx < VOCAB_SIZE:
            raise ValueError(f"{source}: id {idx} of token {token!r} is outside 0..{VOCAB_SIZE - 1}")
        if idx in by_id:
            raise ValueError(f"{source}: ids collide: {by_id[idx]!r} and {token!r} both have id {idx}")
        by_id[idx] = token
        if token in LAYOUT_SPECIALS and LAYOUT_SPECIALS[token] != idx:
            raise ValueError(f"{source}: special token {token!r} has id {idx}, the layout requires "
                             f"{LAYOUT_SPECIALS[token]}")
    for token, idx in LAYOUT_SPECIALS.items():
        if idx in by_id and by_id[idx] != token:
            raise ValueError(f"{source}: id {idx} is reserved for {token!r} but holds {by_id[idx]!r}")
    missing = [b for b in range(256) if raw.get(chr(b)) != b + BYTE_OFFSET]
    if missing:
        b, got = missing[0], raw.get(chr(missing[0]))
        raise ValueError(f"{source}: byte tokens missing or misplaced ({len(missing)} of 256): byte 0x{b:02x} (token "
                         f"{chr(b)!r}) must have id {b + BYTE_OFFSET}, {'missing' if got is None else f'has id {got}'}")
    for idx, token in by_id.items():
        if FIRST_MULTIBYTE_ID <= idx < SPECIAL_START_ID:
            if len(token) < 2:
                raise ValueError(f"{source}: multi-byte id {idx} holds a single character {token!r}")
            bad = next((c for c in token if ord(c) > 255), None)
            if bad is not None:
                raise ValueError(f"{source}: token {token!r} (id {idx}) contains {bad!r} (U+{ord(bad):04X}); regular "
                                 "tokens must be latin-1 strings, one character per UTF-8 byte")
    full = {**by_id, **{idx: tok for tok, idx in LAYOUT_SPECIALS.items()}}
    out = {"vocab": {full[i]: i for i in sorted(full)}, "max_token_len": max_token_len, "vocab_size": VOCAB_SIZE,
           "algorithm": data.get("algorithm", ALGORITHM), "special_tokens": list(SPECIAL_TOKENS)}
    return {**out, **{key: value for key, value in data.items() if key not in out}}  # unknown metadata round-trips


def greedy_tokens(data: Mapping) -> dict[str, int]:
    """The tokens greedy matching emits (latin-1 string -> id): the bytes and multi-byte tokens up to max_token_len."""
    return {tok: idx for tok, idx in data["vocab"].items()
            if BYTE_OFFSET <= idx < SPECIAL_START_ID and len(tok) <= data["max_token_len"]}


def load_vocab_file(source) -> dict:
    """The validated vocab of a Length-MAX file (or a released tokenizer.json), a vocab dict, or None (bytes only)."""
    if source is None:
        source = {"vocab": {chr(b): b + BYTE_OFFSET for b in range(256)}}
    if isinstance(source, Mapping):
        return normalize_vocab_data(source, source="vocab dict")
    path = os.fspath(source)
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from err
    return normalize_vocab_data(data, source=path)


def dump_vocab_data(data: Mapping) -> str:
    """Vocab data in the released style (``ensure_ascii`` escapes, ``vocab`` ordered by id)."""
    return json.dumps({**data, "vocab": dict(sorted(data["vocab"].items(), key=lambda kv: kv[1]))}, ensure_ascii=True)


def special_token(token):
    """`token` as an atomic special token (a string is wrapped; None and AddedToken pass as they are)."""
    if token is None or isinstance(token, AddedToken):
        return token
    return AddedToken(str(token), special=True, normalized=False, lstrip=False, rstrip=False, single_word=False)


class SpikeTokenizerMixin:
    """What both tokenizer classes share: layout specials, the vocab file, the chat template, ``add_bos_token``."""

    model_input_names = ["input_ids", "attention_mask"]
    padding_side = "left"
    _auto_class = "AutoTokenizer"  # save_pretrained writes auto_map and copies the class's file

    def __init__(self, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN, unk_token=UNK_TOKEN, pad_token=PAD_TOKEN,
                 add_bos_token: bool = True, **kwargs):
        """The base `__init__` with every layout special atomic (the four base ones special wherever eos/pad/unk point),
        the ChatML template and no clean-up by default; then each layout id is checked."""
        kwargs.pop("special_tokens_pattern", None)
        kwargs.pop("backend", None)  # "tokenizers" in a config the fast class wrote
        kwargs.setdefault("chat_template", CHATML_TEMPLATE)
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        extra, legacy = kwargs.pop("extra_special_tokens", None), kwargs.pop("additional_special_tokens", None)
        extra = (legacy if extra is None else extra) or []
        if isinstance(extra, Mapping):
            kwargs["model_specific_special_tokens"] = {**(kwargs.get("model_specific_special_tokens") or {}), **extra}
            extra = []
        named = {"bos_token": bos_token, "eos_token": eos_token, "unk_token": unk_token, "pad_token": pad_token}
        kept = {str(t) for t in named.values() if t is not None}
        ours = SPECIAL_TOKENS + RESERVED_TOKENS + tuple(t for t in BASE_SPECIAL_TOKENS if t not in kept)
        kwargs["extra_special_tokens"] = [*map(special_token, ours),
                                          *(t for t in extra if str(t) not in LAYOUT_SPECIALS)]
        kwargs.update((key, special_token(token)) for key, token in named.items())
        super().__init__(add_bos_token=bool(add_bos_token), **kwargs)
        if self.bos_token_id != BOS_ID:  # every sequence was trained to start with <bos>, id 2
            raise ValueError(f"bos_token resolves to id {self.bos_token_id}, the spike_whale layout requires {BOS_ID}")
        for token, idx in LAYOUT_SPECIALS.items():
            if (got := self.convert_tokens_to_ids(token)) != idx:
                raise ValueError(f"special token {token!r} resolved to id {got}, the spike_whale layout requires "
                                 f"{idx} (a stale added_tokens_decoder in tokenizer_config.json?)")

    @classmethod
    def _from_pretrained(cls, resolved_vocab_files, *args, **kwargs):
        # One clear error naming a damaged tokenizer.json: transformers parses it before either class sees it and
        # raises a bare JSONDecodeError; `tokenizers` says only "Model missing" without "model".
        path = resolved_vocab_files.get("tokenizer_file")
        if path is not None and os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as handle:
                    data = json.load(handle)
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise ValueError(f"{path} is not valid JSON ({err}): the file is truncated or damaged; copy it again "
                                 "or re-save the tokenizer with save_pretrained") from None
            fast = "tokenizer_file" in cls.vocab_files_names  # it reads a `tokenizers` file, which needs a "model"
            if fast and isinstance(data, Mapping) and "model" not in data and "vocab" not in data:
                raise ValueError(f"{path} has no 'model', which a `tokenizers` file needs: the file is damaged; copy "
                                 "it again, re-save the tokenizer with save_pretrained, or delete it to build it from "
                                 "spike_vocab.json")
        return super()._from_pretrained(resolved_vocab_files, *args, **kwargs)

    @property
    def vocab_data(self) -> dict:
        """The vocab in the released file format (what `save_vocabulary` writes); a copy."""
        return json.loads(dump_vocab_data(self._vocab_data))

    @property
    def max_token_len(self) -> int:
        return self._vocab_data["max_token_len"]

    @property
    def greedy_vocab(self) -> dict[str, int]:
        """The tokens greedy matching may emit (latin-1 string -> id); a copy."""
        return greedy_tokens(self._vocab_data)

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str, ...]:
        if not os.path.isdir(save_directory):
            raise ValueError(f"Vocabulary path ({save_directory}) should be a directory")
        path = os.path.join(save_directory, (filename_prefix + "-" if filename_prefix else "") + VOCAB_FILE_NAME)
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(dump_vocab_data(self._vocab_data))
        return (path,)

    def save_chat_templates(self, save_directory, tokenizer_config: dict, filename_prefix, save_jinja_files):
        # `save_pretrained` pops add_bos_token from the config it writes and calls this right after: put it back, or
        # a tokenizer saved with add_bos_token=False would reload prepending <bos>.
        tokenizer_config["add_bos_token"] = self.add_bos_token
        return super().save_chat_templates(save_directory, tokenizer_config, filename_prefix, save_jinja_files)

    def apply_chat_template(self, conversation, **kwargs):
        """``sanitize_control_tokens=True`` by default when tokenizing without an assistant mask: special-token strings
        in messages, tools and documents are encoded as text (the template's own stay special), so a user message
        cannot open a system turn; ``tokenize=False`` returns the plain string, which cannot carry the difference."""
        sanitize = kwargs.pop("sanitize_control_tokens", None)
        if sanitize is None:
            sanitize = bool(kwargs.get("tokenize", True)) and not kwargs.get("return_assistant_tokens_mask", False)
        if _HAS_SANITIZE or not sanitize:
            extra = {"sanitize_control_tokens": sanitize} if _HAS_SANITIZE else {}
            return super().apply_chat_template(conversation, **kwargs, **extra)
        defaults = {"padding": False, "truncation": False, "max_length": None, "return_tensors": None,
                    "return_dict": True, "tokenizer_kwargs": None, "tokenize": None}
        opts = {key: kwargs.pop(key, default) for key, default in defaults.items()}
        control_re = re.compile("|".join(map(re.escape, sorted(self.all_special_tokens, key=len, reverse=True))))

        def mark(obj):
            if isinstance(obj, str):
                obj = obj.replace(_MARK_START, "").replace(_MARK_END, "")
                return control_re.sub(lambda m: _MARK_START + m.group(0) + _MARK_END, obj)
            if isinstance(obj, Mapping):
                return {key: mark(value) for key, value in obj.items()}
            return [mark(value) for value in obj] if isinstance(obj, (list, tuple)) else obj

        kwargs.update({key: mark(kwargs.get(key)) for key in ("tools", "documents")})  # None stays None
        rendered = super().apply_chat_template(mark(conversation), tokenize=False, **kwargs)
        split_re = re.compile(re.escape(_MARK_START) + "(.*?)" + re.escape(_MARK_END), re.S)
        batched = not isinstance(rendered, str)
        ids = [[i for n, piece in enumerate(split_re.split(chat)) if piece
                for i in self.encode(piece, add_special_tokens=False, split_special_tokens=bool(n % 2))]
               for chat in (rendered if batched else [rendered])]
        keep = opts["max_length"]
        if opts["truncation"] and keep is not None:
            ids = [row[:keep] if self.truncation_side == "right" else row[-keep:] for row in ids]
        out = self.pad({"input_ids": ids if batched else ids[0]}, padding=opts["padding"], max_length=keep)
        out = BatchEncoding(dict(out), tensor_type=opts["return_tensors"], prepend_batch_axis=not batched)
        return out if opts["return_dict"] else out["input_ids"]


# `_encode_plus` arguments `SpikeTokenizer._encode_plain` handles; a call with any other set goes to the base class.
_PLAIN_CALL_KEYS = frozenset({"add_special_tokens", "padding_strategy", "truncation_strategy", "max_length",
                              "pad_to_multiple_of", "padding_side", "return_tensors", "return_attention_mask",
                              "verbose", "split_special_tokens"})
# Set while `prepare_for_model` runs (it has removed one leading <bos>), so `build_inputs_with_special_tokens` adds
# <bos> even before a second one. Module level: tokenizers are pickled, thread-locals cannot be.
_BOS_STATE = threading.local()


class SpikeTokenizer(SpikeTokenizerMixin, PreTrainedTokenizer):
    """The reference tokenizer (slow, pure Python): `greedy_trie_pattern` over the UTF-8 bytes, special-token strings
    atomic unless ``split_special_tokens=True``. `vocab_file`: ``spike_vocab.json``, a released ``tokenizer.json`` or
    a vocab dict (none: bytes and specials only). `add_bos_token`: prepend ``<bos>``, never twice, and no ``<eos>``."""

    vocab_files_names = {"vocab_file": VOCAB_FILE_NAME}

    def __init__(self, vocab_file=None, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN, unk_token=UNK_TOKEN,
                 pad_token=PAD_TOKEN, add_bos_token: bool = True, **kwargs):
        tokenizer_file = kwargs.pop("tokenizer_file", None)  # released tokenizer.json, no spike_vocab.json (not saved)
        source = vocab_file if vocab_file is not None else tokenizer_file
        self.vocab_file = None if source is None or isinstance(source, Mapping) else os.fspath(source)
        self._vocab_data = load_vocab_file(source)
        by_id = {idx: token for token, idx in self._vocab_data["vocab"].items()}
        # multi-byte ids the vocab leaves undefined get a placeholder, never produced and decoded to nothing
        self._id_to_token = [by_id.get(i) or unused_token(i) for i in range(VOCAB_SIZE)]
        self._unused_tokens = {unused_token(i) for i in range(VOCAB_SIZE) if i not in by_id}
        self._token_to_id = {tok: i for i, tok in enumerate(self._id_to_token)}
        self._greedy = greedy_tokens(self._vocab_data)
        self._regex = self._added_split = None  # built on first use
        self._add_bos_token = bool(add_bos_token)
        # A folder saved by the fast class: tokenizer.json's added tokens may hold the vocab's own greedy tokens (its
        # matcher); added here they would be split out before the specials. Ids below the specials are the vocab's.
        if kwargs.get("added_tokens_decoder"):
            kwargs["added_tokens_decoder"] = {i: t for i, t in kwargs["added_tokens_decoder"].items()
                                              if not BYTE_OFFSET <= int(i) < SPECIAL_START_ID}
        super().__init__(bos_token, eos_token, unk_token, pad_token, add_bos_token, **kwargs)
        self.add_bos_token = add_bos_token  # sets special_tokens_pattern, unsaved and reset by transformers' `__init__`

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZE

    def get_vocab(self) -> dict[str, int]:
        return {**self._token_to_id, **self._added_tokens_encoder}

    @property
    def add_bos_token(self) -> bool:
        return self._add_bos_token

    @add_bos_token.setter
    def add_bos_token(self, value: bool) -> None:
        self._add_bos_token = bool(value)
        self.special_tokens_pattern = "bos" if self._add_bos_token else "none"

    def _with_bos(self, ids: list[int]) -> list[int]:
        ids = list(ids)
        add = self._add_bos_token and (getattr(_BOS_STATE, "force", False) or ids[:1] != [BOS_ID])
        return [BOS_ID] + ids if add else ids

    def build_inputs_with_special_tokens(self, token_ids_0, token_ids_1=None):
        """``[<bos>] + ids`` (ids unchanged when ``add_bos_token=False`` or they already start with <bos>)."""
        return self._with_bos(token_ids_0) + ([] if token_ids_1 is None else self._with_bos(token_ids_1))

    def get_special_tokens_mask(self, token_ids_0, token_ids_1=None, already_has_special_tokens=False):
        if already_has_special_tokens:
            return super().get_special_tokens_mask(token_ids_0, token_ids_1, already_has_special_tokens=True)
        rows = [token_ids_0] if token_ids_1 is None else [token_ids_0, token_ids_1]
        return [int(self._add_bos_token and i == 0) for ids in rows for i in range(len(self._with_bos(ids)))]

    def prepare_for_model(self, ids, pair_ids=None, add_special_tokens=True, **kwargs):
        # Never <bos> twice: drop one leading <bos> the text had and let the base class add it back (so truncation
        # lengths and the special-tokens mask stay exact); "<bos><bos>x" keeps both.
        if not (add_special_tokens and self._add_bos_token):
            return super().prepare_for_model(ids, pair_ids=pair_ids, add_special_tokens=add_special_tokens, **kwargs)
        ids = ids[1:] if ids[:1] == [BOS_ID] else ids
        pair_ids = pair_ids[1:] if pair_ids and pair_ids[0] == BOS_ID else pair_ids
        previous, _BOS_STATE.force = getattr(_BOS_STATE, "force", False), True
        try:
            return super().prepare_for_model(ids, pair_ids=pair_ids, add_special_tokens=True, **kwargs)
        finally:
            _BOS_STATE.force = previous

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        if self._regex is None:  # compiled on first use: seconds for a 16K vocabulary
            self._regex = re.compile(greedy_trie_pattern(self._greedy))
        # the UTF-8 bytes, one latin-1 character per byte (strict: lone surrogates raise)
        return self._regex.findall(text.encode("utf-8").decode("latin-1")) if text else []

    def _split_added_tokens(self, text: str) -> list[str] | None:
        """`text` cut into the text between added tokens (even items) and the added tokens (odd), leftmost-longest as
        the base class's trie; None where an added token has lstrip/rstrip/single_word (the base class handles it)."""
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
        """Added tokens split out first (unless ``split_special_tokens``), greedy longest match in between."""
        split = kwargs.pop("split_special_tokens", self.split_special_tokens)
        if kwargs.pop("is_split_into_words", False):
            text = with_leading_space(text)
        pieces = [text] if split else self._split_added_tokens(text)
        if pieces is None:
            return super().tokenize(text, split_special_tokens=split, **kwargs)
        return [t for i, piece in enumerate(pieces) for t in ([piece] if i % 2 else self._tokenize(piece))]

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            return super().convert_tokens_to_ids(tokens)
        added, regular = self._added_tokens_encoder, self._token_to_id  # one dict lookup per token
        return [added[t] if t in added else regular.get(t, UNK_ID) for t in tokens]

    def _encode_plus(self, text, text_pair=None, *args, is_split_into_words: bool = False, **kwargs):
        if kwargs.pop("return_offsets_mapping", False):
            raise NotImplementedError(
                "SpikeTokenizer (the slow, pure-Python tokenizer) does not compute offsets: use SpikeTokenizerFast "
                "(what AutoTokenizer returns by default) for return_offsets_mapping=True")
        if is_split_into_words:  # each word spaced and encoded here; the base class then sees ids
            split = kwargs.get("split_special_tokens")
            split = self.split_special_tokens if split is None else split

            def ids_of(words):
                if words is None or isinstance(words, str):
                    return None if words is None else self._text_ids(with_leading_space(words), split)
                if isinstance(words, tuple) and len(words) == 2 and not isinstance(words[0], str):
                    return ids_of(words[0]), ids_of(words[1])  # a (words, words) pair in a batch
                if words and not isinstance(words[0], str):  # a batch of sequences
                    return [ids_of(row) for row in words]
                return [i for word in words for i in ids_of(word)]

            return super()._encode_plus(ids_of(text), ids_of(text_pair), *args, **kwargs)
        if text_pair is None and not args and all(key in _PLAIN_CALL_KEYS or not value for key, value in kwargs.items(
                )) and kwargs.get("truncation_strategy", "do_not_truncate") == TruncationStrategy.DO_NOT_TRUNCATE:
            rows = [text] if isinstance(text, str) else text
            if isinstance(rows, (list, tuple)) and rows and all(isinstance(t, str) for t in rows):
                return self._encode_plain(text, rows, **kwargs)
        return super()._encode_plus(text, text_pair, *args, **kwargs)

    def _encode_plain(self, text, rows: list[str], add_special_tokens: bool = True, padding_strategy=None,
                      max_length=None, pad_to_multiple_of=None, padding_side=None, return_tensors=None,
                      return_attention_mask=None, verbose: bool = True, split_special_tokens=None, **_):
        """`__call__` on texts without truncation, pairs or extra outputs: what the base class's per-text
        `prepare_for_model` gives, with one regex pass and one dict lookup per token."""
        split = self.split_special_tokens if split_special_tokens is None else split_special_tokens
        ids = [self._text_ids(t, split) for t in rows]
        if add_special_tokens:
            ids = [self._with_bos(row) for row in ids]
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
        greedy, added = self._greedy, self._added_tokens_encoder
        return [i for n, piece in enumerate(pieces)
                for i in ([added[piece]] if n % 2 else [greedy[t] for t in self._tokenize(piece)])]

    def encode_ordinary(self, text: str) -> list[int]:
        """``encode(text, add_special_tokens=False, split_special_tokens=True)``: greedy ids of `text` alone."""
        return [self._greedy[t] for t in self._tokenize(text)]

    def _convert_token_to_id(self, token: str) -> int:
        return self._token_to_id.get(token, UNK_ID)

    def _convert_id_to_token(self, index: int) -> str:
        return self._id_to_token[index] if 0 <= index < VOCAB_SIZE else UNK_TOKEN  # e.g. -100 labels: visible

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        literal, out, run = self._added_tokens_encoder, [], []
        for token in [*tokens, None]:
            if token is None or token in literal:  # specials and added tokens are written as they are
                out += [_latin1_to_bytes("".join(run)).decode("utf-8", errors="replace"), token or ""]
                run = []
            elif token not in self._unused_tokens:
                run.append(token)
        return "".join(out)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *init_inputs, **kwargs):
        """Also accepts the path of one vocab file (``spike_vocab.json`` or a released ``tokenizer.json``), which
        transformers would read as a `tokenizers` file."""
        path = pretrained_model_name_or_path
        if isinstance(path, (str, os.PathLike)) and os.path.isfile(path):
            for hub_only in ("cache_dir", "force_download", "local_files_only", "trust_remote_code", "_from_pipeline",
                             "token", "revision", "subfolder", "proxies", "user_agent", "_from_auto", "_commit_hash"):
                kwargs.pop(hub_only, None)
            kwargs.setdefault("name_or_path", os.fspath(path))
            return cls(path, *init_inputs, **kwargs)
        return super().from_pretrained(pretrained_model_name_or_path, *init_inputs, **kwargs)
