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

import json
import os
import re
import threading
from collections import Counter
from collections.abc import Iterable, Mapping

from transformers import PreTrainedTokenizer
from transformers.tokenization_utils_base import AddedToken


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
VOCAB_FILE_NAME = "spike_vocab.json"
ALGORITHM = "length-max"

CHATML_TEMPLATE = (
    "{{- bos_token if bos_token else '' -}}\n"
    "{%- for message in messages -%}\n"
    "    {{- '<|im_start|>' + message['role'] + '\\n' -}}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{- message['content'] -}}\n"
    "    {%- elif message['content'] is not none -%}\n"
    "        {%- for part in message['content'] if part['type'] == 'text' -%}{{- part['text'] -}}{%- endfor -%}\n"
    "    {%- endif -%}\n"
    "    {{- '<|im_end|>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{- '<|im_start|>assistant\\n' -}}\n"
    "{%- endif -%}\n"
)

_RESERVED_SET = frozenset(RESERVED_TOKENS)
_NON_TEXT_TOKENS = frozenset(BASE_SPECIAL_TOKENS) | frozenset(SPECIAL_TOKENS) | _RESERVED_SET


# Set while `prepare_for_model` runs (it has already removed a leading <bos>), so the base class's
# `build_inputs_with_special_tokens` call adds it unconditionally.  Module level, not an attribute:
# tokenizers get pickled for multiprocessing and thread-locals cannot be.
_BOS_STATE = threading.local()


def _unused_token(index: int) -> str:
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


def compile_greedy_regex(tokens: Iterable[str]) -> re.Pattern:
    """Compile `tokens` into a regex whose successive matches are the greedy longest-match segmentation.

    Each trie node becomes ``(?:child_1...|child_2...|...|)``: children are tried first and the empty
    "stop here" alternative, present only on nodes that are tokens, comes last.  Python's backtracking
    engine walks the single trie path that matches the text and backs off to the deepest terminal, i.e.
    the longest token that is a prefix of the remaining text.  Children start with distinct characters,
    so their order only affects speed (larger subtrees first).  All 256 single bytes must be in `tokens`
    for `findall` to cover every input without gaps.
    """
    root: dict = {}
    end = ""  # key marking "a token ends here" ("" is never a character key)
    for tok in tokens:
        if not tok:
            continue
        node = root
        for ch in tok:
            node = node.setdefault(ch, {})
        node[end] = True

    sizes: dict[int, int] = {}

    def size(node: dict) -> int:
        key = id(node)
        if key not in sizes:
            sizes[key] = 1 + sum(size(child) for ch, child in node.items() if ch != end)
        return sizes[key]

    def emit(node: dict) -> str:
        children = [(ch, child) for ch, child in node.items() if ch != end]
        leaves = sorted(ch for ch, child in children if len(child) == 1 and end in child)
        inner = sorted(
            ((ch, child) for ch, child in children if not (len(child) == 1 and end in child)),
            key=lambda item: (-size(item[1]), item[0]),
        )
        alts = [re.escape(ch) + emit(child) for ch, child in inner]
        if len(leaves) == 1:
            alts.append(re.escape(leaves[0]))
        elif leaves:
            alts.append("[" + "".join(re.escape(ch) for ch in leaves) + "]")
        if end in node:
            alts.append("")
        if len(alts) == 1:
            return alts[0]
        return "(?:" + "|".join(alts) + ")"

    if not root:
        raise ValueError("cannot compile an empty token set")
    return re.compile(emit(root))


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


def load_vocab_file(path: str | os.PathLike) -> dict:
    """Read and validate a Length-MAX vocab file (``spike_vocab.json`` or a released ``tokenizer.json``)."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from err
    return normalize_vocab_data(data, source=path)


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
            Path to ``spike_vocab.json`` or to a released custom-format ``tokenizer.json``; a vocab dict
            (as returned by `build_lengthmax_vocab`) is also accepted.
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
        if source is None:
            raise ValueError(
                "SpikeTokenizer needs a vocabulary: pass the path of spike_vocab.json (or of a released "
                "custom-format tokenizer.json) or a vocab dict from build_lengthmax_vocab()."
            )
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
                placeholder = _unused_token(idx)
                id_to_token[idx] = placeholder
                self._unused_tokens[placeholder] = idx
        self._id_to_token = id_to_token
        self._token_to_id = {tok: i for i, tok in enumerate(id_to_token)}
        # Tokens the greedy encoder may emit: bytes and multi-byte tokens up to max_token_len.  Longer
        # tokens stay decodable but are never produced (the released encoder never tried them).
        self._greedy = {
            tok: idx
            for tok, idx in vocab.items()
            if BYTE_OFFSET <= idx < SPECIAL_START_ID and len(tok) <= self.max_token_len
        }
        self._regex = None

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
        if not (add_special_tokens and self._add_bos_token):
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
        """The compiled trie regex (compiled on first use: a 16K vocab takes ~1-3 s)."""
        if self._regex is None:
            self._regex = compile_greedy_regex(self._greedy)
        return self._regex

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        if not text:
            return []
        return self.greedy_regex.findall(_to_latin1(text))

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
    def from_texts(cls, texts, *, target_size: int = NUM_BASE_IDS, max_token_len: int = DEFAULT_MAX_TOKEN_LEN,
                   rounds: int = 6, max_ngram: int = 8, min_freq: int = 2, **tokenizer_kwargs) -> "SpikeTokenizer":
        """Train a Length-MAX vocab on `texts` with `build_lengthmax_vocab` and return a tokenizer over it."""
        data = build_lengthmax_vocab(
            texts, target_size=target_size, max_token_len=max_token_len, rounds=rounds, max_ngram=max_ngram,
            min_freq=min_freq,
        )
        return cls(data, **tokenizer_kwargs)


# --------------------------------------------------------------------------------------------------
# Length-MAX vocab builder (demo / tests; no released vocab is available offline)
# --------------------------------------------------------------------------------------------------


def build_lengthmax_vocab(
    texts,
    target_size: int = NUM_BASE_IDS,
    max_token_len: int = DEFAULT_MAX_TOKEN_LEN,
    rounds: int = 6,
    max_ngram: int = 8,
    min_freq: int = 2,
) -> dict:
    """Build a vocab in the released file format with a simple batched Length-MAX greedy.

    Each round segments the corpus with the *current* vocab (greedy longest match, as the tokenizer
    does), counts every run of 2..`max_ngram` consecutive tokens whose bytes fit in `max_token_len`,
    scores each byte string by the tokens it would save, ``sum (n - 1)`` over its occurrences
    (about ``(len - 1) * freq`` for the paper's ``freq * len`` objective), and adds the best new strings
    seen at least `min_freq` times.  Every round adds an equal share of the remaining slots, so later
    rounds can build longer tokens from earlier ones.  Pure Python: ~100 KB of text takes a few seconds.

    Layout of the result: ids 0..3 base specials, 4..259 the 256 bytes, multi-byte tokens at
    260, 261, ... with no holes, the 17 specials at 16384.. and the 111 reserved slots.  ``target_size``
    bounds the multi-byte ids (``< target_size <= 16384``).  A small corpus may run out of candidates;
    the ids between the last multi-byte token and 16383 are then simply absent from ``vocab`` (the
    tokenizer still reports 16,512 ids; those decode to the empty string and are never produced).
    """
    if isinstance(texts, str):
        texts = [texts]
    if not FIRST_MULTIBYTE_ID <= target_size <= NUM_BASE_IDS:
        raise ValueError(f"target_size must be in {FIRST_MULTIBYTE_ID}..{NUM_BASE_IDS}, got {target_size}")
    if not _is_int(max_token_len) or max_token_len < 2:
        raise ValueError(f"max_token_len must be an integer >= 2, got {max_token_len!r}")
    if rounds < 1 or max_ngram < 2 or min_freq < 1:
        raise ValueError("rounds >= 1, max_ngram >= 2 and min_freq >= 1 are required")

    docs = [_to_latin1(t) for t in texts if t]
    known = {chr(b) for b in range(256)}
    forbidden = set(_NON_TEXT_TOKENS)
    selected: list[str] = []
    capacity = target_size - FIRST_MULTIBYTE_ID

    for round_idx in range(rounds):
        remaining = capacity - len(selected)
        if remaining <= 0 or not docs:
            break
        regex = compile_greedy_regex(known)
        score: Counter = Counter()
        freq: Counter = Counter()
        for doc in docs:
            seg = regex.findall(doc)
            n_seg = len(seg)
            for i in range(n_seg - 1):
                piece = seg[i]
                for n in range(2, max_ngram + 1):
                    if i + n > n_seg:
                        break
                    piece += seg[i + n - 1]
                    if len(piece) > max_token_len:
                        break
                    score[piece] += n - 1
                    freq[piece] += 1
        candidates = [
            (s, piece)
            for piece, s in score.items()
            if freq[piece] >= min_freq and piece not in known and piece not in forbidden
        ]
        if not candidates:
            break
        candidates.sort(key=lambda item: (-item[0], item[1]))
        take = -(-remaining // (rounds - round_idx))  # ceil
        for _, piece in candidates[:take]:
            selected.append(piece)
            known.add(piece)

    vocab = {tok: i for i, tok in enumerate(BASE_SPECIAL_TOKENS)}
    vocab.update({chr(b): b + BYTE_OFFSET for b in range(256)})
    vocab.update({tok: FIRST_MULTIBYTE_ID + i for i, tok in enumerate(selected)})
    vocab.update(SPECIAL_TOKEN_IDS)
    vocab.update({tok: RESERVED_START_ID + i for i, tok in enumerate(RESERVED_TOKENS)})
    return {
        "vocab": vocab,
        "max_token_len": max_token_len,
        "vocab_size": VOCAB_SIZE,
        "algorithm": ALGORITHM,
        "special_tokens": list(SPECIAL_TOKENS),
    }


DEMO_CORPUS = r'''
The harbour was quiet before dawn. Fishing boats rocked against the pier, their ropes creaking in
the cold wind, and a single gull walked along the railing as if it owned the whole town. By six
o'clock the first trucks arrived, the market opened its shutters, and the smell of coffee and
diesel filled the narrow streets. Nobody noticed the whale until the tide turned.

It surfaced twice near the breakwater, a long grey back and a spout of mist that hung in the air
for a moment before the wind took it. Children ran to the end of the pier. Their parents followed,
phones raised, arguing about whether it was a humpback or a minke. The harbour master, who had seen
both, said it was neither: it was a young fin whale, lost and hungry, following the herring that
had crowded into the bay that week.

"Keep the boats in," she said. "Give it room. It will find its way out when the water rises."

## Notes on the model

The spike_whale models are small decoder-only language models. They read text as bytes, group
the bytes with a Length-MAX vocabulary, and run the same stack of layers several times (a looped
decoder). A longer token means fewer steps per sentence, so the vocabulary favours long, frequent
strings such as " the ", "tion", "    return ", or "self.".

- Tokens are chosen to maximise frequency times length.
- Encoding is greedy: at each position take the longest token that matches.
- Every byte has its own token, so any input can be encoded and decoded exactly.

def greedy_segment(text, vocab, max_len=24):
    """Split text into the longest vocabulary tokens, left to right."""
    tokens = []
    i = 0
    while i < len(text):
        for length in range(min(max_len, len(text) - i), 0, -1):
            piece = text[i:i + length]
            if piece in vocab:
                tokens.append(piece)
                i += length
                break
    return tokens


class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, key, value=1):
        self.counts[key] = self.counts.get(key, 0) + value
        return self.counts[key]

    def most_common(self, n=10):
        return sorted(self.counts.items(), key=lambda kv: -kv[1])[:n]


for step in range(3):
    loss = train_one_epoch(model, loader, optimizer)
    print(f"epoch {step}: loss={loss:.4f}")
    if loss < best_loss:
        best_loss = loss
        torch.save(model.state_dict(), "best.pt")

{"role": "user", "content": "What is the capital of France?"}
{"role": "assistant", "content": "The capital of France is Paris."}
{"role": "user", "content": "And of Japan?"}
{"role": "assistant", "content": "The capital of Japan is Tokyo."}

SELECT name, count(*) AS n FROM boats WHERE harbour = 'north' GROUP BY name ORDER BY n DESC;

Weather report: winds from the north-west at 20 knots, gusting 35. Sea state moderate to rough.
Visibility good, occasionally poor in showers. Water temperature 11 degrees. High tide at 14:32,
low tide at 20:47. Small craft should remain in harbour until the wind eases in the evening.

Le port était calme avant l'aube. Les bateaux de pêche se balançaient contre la jetée.
Der Hafen war ruhig vor der Dämmerung, und die Möwen schliefen noch auf dem Dach der Halle.
El puerto estaba tranquilo antes del amanecer; nadie había visto la ballena todavía.
港は夜明け前は静かだった。クジラが湾に入ってきた。
鲸鱼在港口附近浮出水面两次，孩子们跑到码头尽头去看。
Кит всплыл дважды у волнолома. 🐋🌊 Emoji are bytes too: 👍🏽 ❤️ 🇫🇷

The whale stayed for three days. On the fourth morning the tide came in high and fast, the
herring moved out past the point, and the whale went with them. The children waited on the pier
until noon, and then they went home for lunch, and the harbour was quiet again.
'''


def build_demo_tokenizer(target_size: int = 2048, **tokenizer_kwargs) -> SpikeTokenizer:
    """A tokenizer over a vocab trained on the built-in `DEMO_CORPUS` (no files or network needed).

    The demo vocab has only a few hundred multi-byte tokens; every other multi-byte id is an unused
    slot.  The id layout (bytes, specials, reserved ids, 16,512 ids in total) is the real one.
    """
    return SpikeTokenizer.from_texts([DEMO_CORPUS], target_size=target_size, **tokenizer_kwargs)


__all__ = [
    "SpikeTokenizer",
    "build_lengthmax_vocab",
    "build_demo_tokenizer",
    "compile_greedy_regex",
    "load_vocab_file",
    "normalize_vocab_data",
    "dump_vocab_data",
    "DEMO_CORPUS",
    "CHATML_TEMPLATE",
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
]
