# Copyright 2025 The spike_whale integration authors. Apache-2.0.
"""Fast (`tokenizers`, Rust) twin of `SpikeTokenizer`: the same ids, decodes and special-token rules.

Greedy longest match over UTF-8 bytes as a standard `tokenizers` pipeline, saved as a plain ``tokenizer.json``
that ``tokenizers.Tokenizer.from_file`` loads alone::

    added tokens   the specials (special, normalized=False)   split off first, at their released ids
                   the greedy tokens as text (normalized=True)  leftmost-longest Aho-Corasick over the rest
    pre_tokenizer  ByteLevel(use_regex=False)        what no matched token starts -> one character per UTF-8 byte
                   Split(PIECES, "isolated")          pieces of up to 2 consecutive greedy tokens (`piece_pattern`)
    model          WordPiece(prefix "")               cuts each piece again by longest match: its greedy tokens
    decoder        ByteLevel                          bytes -> UTF-8 with U+FFFD for broken sequences
    post_processor TemplateProcessing                 "<bos> $A" (add_bos_token=True)

Added tokens: with every character starting a matched token or lying in text no matched token starts, the
matcher's leftmost-longest choice is the longest token at each greedy boundary (`matched_texts` says when).  That is
about 1.8x the pieces' encode: `tokenizers` pays per split, and its Oniguruma search costs more per token than the
automaton.  A vocab with a partial-UTF-8 token across a character boundary, such as b"d \xe2\x80" (the trainer no
longer takes one), gets no matched tokens: every token goes through the pieces, exact and slower.

PIECES repeats TRIE, `greedy_trie_pattern` over the regular tokens not matched as text (Oniguruma's ordered
alternation backs off to the longest token, as Python's `re` does; children grouped behind first-character
lookaheads), so each piece is a run of greedy tokens.  WordPiece re-finds them: at a token's start, a longer vocab
key that is a prefix of the rest of the piece would be a longer greedy token (impossible) or a key greedy matching
never emits (a special, a token over max_token_len), and a token that starts with the first character of such a
key is a piece of its own.  Two tokens a piece (`PIECE_TOKENS`) is about 1.1x one token a piece with WordLevel;
the whole text as one WordPiece word is exact too but cubic in the text length.

A folder that holds only the released vocab (``spike_vocab.json``, or a custom-format ``tokenizer.json``)
still loads: the pipeline is built from it on the fly.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence

from tokenizers import AddedToken as BackendAddedToken
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import BatchEncoding, PreTrainedTokenizerFast
from transformers.tokenization_utils_base import AddedToken, PaddingStrategy, TruncationStrategy

from .tokenization_spike import (
    BASE_SPECIAL_TOKENS,
    BOS_ID,
    BOS_TOKEN,
    BYTE_OFFSET,
    CHATML_TEMPLATE,
    EOS_TOKEN,
    FIRST_MULTIBYTE_ID,
    PAD_TOKEN,
    RESERVED_START_ID,
    RESERVED_TOKENS,
    SPECIAL_START_ID,
    SPECIAL_TOKEN_IDS,
    SPECIAL_TOKENS,
    UNK_ID,
    UNK_TOKEN,
    VOCAB_FILE_NAME,
    VOCAB_SIZE,
    SpikeTokenizer,
    apply_chat_template_safely,
    check_tokenizer_file,
    dump_vocab_data,
    greedy_tokens,
    greedy_trie_pattern,
    load_vocab_file,
    normalize_vocab_data,
    unused_token,
)

TOKENIZER_FILE_NAME = "tokenizer.json"
# Oniguruma tries ordered alternatives one by one: lookahead-guarded groups of at most 4 (`greedy_trie_pattern`).
TRIE_DISPATCH = 4
# Greedy tokens per Split piece: 2 and 3 measured alike (about 1.1x of 1), 4 back at 1 (WordPiece probes more).
PIECE_TOKENS = 2
_ALL_SPECIALS = BASE_SPECIAL_TOKENS + SPECIAL_TOKENS + RESERVED_TOKENS
_SPECIAL_IDS = {
    **{tok: i for i, tok in enumerate(BASE_SPECIAL_TOKENS)},
    **SPECIAL_TOKEN_IDS,
    **{tok: RESERVED_START_ID + i for i, tok in enumerate(RESERVED_TOKENS)},
}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet (what the ByteLevel pre-tokenizer and decoder use): byte -> one printable char."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


_BYTE_CHAR = bytes_to_unicode()
_LATIN1_TO_BYTE_LEVEL = str.maketrans({chr(b): c for b, c in _BYTE_CHAR.items()})
_BYTE_LEVEL_CHARS = frozenset(_BYTE_CHAR.values())
_PRINTABLE_ASCII = frozenset(map(chr, range(0x21, 0x7F)))
_CHAR_LATIN1 = {c: chr(b) for b, c in _BYTE_CHAR.items()}


def _to_byte_level(text: str) -> str:
    """`text` as a token of this vocab is written: its UTF-8 bytes in GPT-2's byte alphabet."""
    try:
        return text.encode("utf-8").decode("latin-1").translate(_LATIN1_TO_BYTE_LEVEL)
    except UnicodeEncodeError:
        return text


def _key_to_latin1(key: str) -> str:
    """A model key as the vocab's latin-1 token: byte-level keys are mapped back, matched tokens' keys are their text
    (`matched_texts` keeps only texts that are printable ASCII, spelled alike both ways, or hold a character outside
    the byte alphabet)."""
    if all(ch in _BYTE_LEVEL_CHARS for ch in key):
        return "".join(_CHAR_LATIN1[ch] for ch in key)
    return key.encode("utf-8").decode("latin-1")


def _onig_escape(ch: str) -> str:
    """Escape for Oniguruma: every ASCII character that is not a letter or digit gets a backslash."""
    return "\\" + ch if ord(ch) < 128 and not ch.isalnum() else ch


def build_backend(data: Mapping, match_text: bool = True) -> Tokenizer:
    """The `tokenizers` pipeline for a normalised vocab (`normalize_vocab_data`): same ids as `SpikeTokenizer`.

    When `matched_texts` accepts the vocab, its greedy tokens are non-special added tokens, which `tokenizers` finds
    with its leftmost-longest Aho-Corasick automaton over the text (greedy longest match when every character starts
    a token); the rest of the text (characters no such token starts) goes through ByteLevel, the piece regex and
    WordPiece.  Otherwise (or with ``match_text=False``) every token goes through that second path."""
    max_token_len = data["max_token_len"]
    vocab: dict[str, int] = {}
    greedy: list[str] = []
    for token, idx in data["vocab"].items():
        if idx in _SPECIAL_IDS.values():
            vocab[token] = idx
            continue
        byte_level = token.translate(_LATIN1_TO_BYTE_LEVEL)
        vocab[byte_level] = idx
        if BYTE_OFFSET <= idx < SPECIAL_START_ID and len(token) <= max_token_len:
            greedy.append(token)
    defined = set(vocab.values())
    vocab.update({unused_token(i): i for i in range(FIRST_MULTIBYTE_ID, SPECIAL_START_ID) if i not in defined})

    texts = matched_texts(greedy) if match_text else None
    if texts is not None:
        for token, text in texts.items():
            byte_level = token.translate(_LATIN1_TO_BYTE_LEVEL)
            if text != byte_level and text in vocab:  # a text spelled like another key: keep the pieces path
                texts = None
                break
    matched = {}
    if texts is not None:
        for token, text in texts.items():
            matched[text] = vocab.pop(token.translate(_LATIN1_TO_BYTE_LEVEL))
        vocab.update(matched)
    pieces = [t.translate(_LATIN1_TO_BYTE_LEVEL) for t in greedy if texts is None or t not in texts]
    backend = Tokenizer(models.WordPiece(vocab, unk_token=UNK_TOKEN, continuing_subword_prefix="",
                                         max_input_chars_per_word=PIECE_TOKENS * max_token_len))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        # every model key counts for the own-piece rule: a matched text such as "Ã©" is also a byte-level spelling
        pre_tokenizers.Split(Regex(piece_pattern(pieces, vocab, PIECE_TOKENS)), behavior="isolated"),
    ])
    # A matched token spelled only in the byte alphabet but not ASCII ("España") would be read as bytes by the
    # ByteLevel decoder: it is respelled as its bytes first (whole-token match, so no other token is touched).
    respell = [decoders.Replace(Regex("\\A" + "".join(map(_onig_escape, text)) + "\\z"), _to_byte_level(text))
               for text in matched if not _decodes_as_itself(text)]
    backend.decoder = decoders.Sequence([*respell, decoders.ByteLevel()]) if respell else decoders.ByteLevel()
    backend.add_special_tokens([
        BackendAddedToken(tok, special=True, normalized=False, lstrip=False, rstrip=False, single_word=False)
        for tok in _ALL_SPECIALS
    ])
    # normalized=True: matched after the specials are split off, so a special always wins as in `SpikeTokenizer`
    backend.add_tokens([BackendAddedToken(text, special=False, normalized=True, lstrip=False, rstrip=False,
                                          single_word=False) for text in matched])
    for tok, idx in {**_SPECIAL_IDS, **matched}.items():
        if backend.token_to_id(tok) != idx:
            raise ValueError(f"token {tok!r} landed at id {backend.token_to_id(tok)}, the layout requires {idx}")
    return backend


def matched_texts(greedy: list[str]) -> dict[str, str] | None:
    """The text of each greedy token (latin-1 string) that the added-token matcher takes, or None when one token
    makes that inexact.

    Leftmost-longest matching over the text equals greedy longest match over the bytes as long as the tokens left
    out never start at a character boundary where a matched token could: every valid UTF-8 token is matched except
    one-character ones the ByteLevel decoder would misread (``"é"``), and the others lie inside one character (a
    single byte >= 0x80, a part of one character's UTF-8 sequence).  The text runs no matched token starts are then
    whole characters, which the piece regex and WordPiece cut into the left-out tokens as greedy matching does.  A
    token that is not valid UTF-8 and crosses a character boundary (``b"d \xe2\x80"``) cannot be matched as text,
    and leaving it out would let a shorter matched token win where greedy takes it: None.
    """
    if crossing_tokens(greedy):
        return None
    texts = {}
    for token in greedy:
        try:
            text = token.encode("latin-1").decode("utf-8")
        except UnicodeDecodeError:  # inside one character: left to the pieces
            continue
        if len(text) > 1 or _decodes_as_itself(text):
            texts[token] = text
    return texts


def crossing_tokens(greedy: Iterable[str]) -> list[str]:
    """The tokens (latin-1 strings) that are not valid UTF-8 and have a character start after their first byte: part
    of a character and another one, such as b"d \xe2\x80"."""
    crossing = []
    for token in greedy:
        try:
            token.encode("latin-1").decode("utf-8")
        except UnicodeDecodeError:
            if any(not 0x80 <= ord(ch) < 0xC0 for ch in token[1:]):
                crossing.append(token)
    return crossing


def _decodes_as_itself(text: str) -> bool:
    """True when the ByteLevel decoder turns `text` into its own UTF-8 bytes: it maps a token through the byte
    alphabet when every character is in it, and keeps the token's bytes otherwise."""
    return all(ch in _PRINTABLE_ASCII for ch in text) or not all(ch in _BYTE_LEVEL_CHARS for ch in text)


def piece_pattern(greedy: list[str], vocab: Mapping[str, int], tokens_per_piece: int) -> str:
    """A `Split` regex whose successive matches are runs of up to `tokens_per_piece` greedy tokens (byte-level), cut
    so that WordPiece's longest match over `vocab` gives back exactly those tokens.

    Keys of `vocab` that greedy matching never emits (specials, tokens over max_token_len) could win WordPiece's
    longest match at a token's start; a token starting with the first character of such a key is therefore always
    a piece of its own, where the longest key that is a prefix of the piece is the piece.  Each repetition matches
    the greedy token at its position (every first character belongs to exactly one of the two tries, and all 256
    bytes are tokens), and nothing follows the repetition, so the engine never backtracks into it.
    """
    greedy_set, alphabet = set(greedy), set(_BYTE_CHAR.values())
    alone = {key[0] for key in vocab if key not in greedy_set and key[0] in alphabet}
    runs = [tok for tok in greedy if tok[0] not in alone]
    singles = [tok for tok in greedy if tok[0] in alone]
    alts = []
    if runs:
        trie = greedy_trie_pattern(runs, escape=_onig_escape, dispatch=TRIE_DISPATCH)
        alts.append(f"(?:{trie}){{1,{tokens_per_piece}}}")
    if singles:
        alts.append(greedy_trie_pattern(singles, escape=_onig_escape, dispatch=TRIE_DISPATCH))
    return "|".join(alts)


def _vocab_data_from_backend(backend: Tokenizer) -> dict:
    """The released vocab format recovered from a saved `tokenizer.json` (for `save_vocabulary`)."""
    vocab = {}
    for token, idx in backend.get_vocab(with_added_tokens=False).items():
        if BYTE_OFFSET <= idx < SPECIAL_START_ID and token != unused_token(idx):
            vocab[_key_to_latin1(token)] = idx
    # The file does not record max_token_len: the longest regular token is the best bound it implies.
    max_len = max(len(t) for i, t in ((i, t) for t, i in vocab.items()) if i >= FIRST_MULTIBYTE_ID) if len(
        vocab) > 256 else 1
    return normalize_vocab_data({"vocab": vocab, "max_token_len": max_len}, source="tokenizer.json")


class SpikeTokenizerFast(PreTrainedTokenizerFast):
    """Greedy longest-match byte tokenizer over a Length-MAX vocabulary, on the `tokenizers` library.

    Same arguments and behaviour as `SpikeTokenizer` (ids, decodes, ``add_bos_token``, specials, chat template),
    plus offsets (``return_offsets_mapping=True``) and Rust batching.

    Args:
        vocab_file (`str`, `os.PathLike` or `dict`, *optional*):
            ``spike_vocab.json`` (or a released custom-format ``tokenizer.json``) or a vocab dict; used when
            there is no `tokenizers` file to load.
        tokenizer_file (`str`, *optional*): a ``tokenizer.json`` written by this class.
        add_bos_token (`bool`, defaults to `True`): prepend ``<bos>`` (id 2), never twice.
    """

    vocab_files_names = {"vocab_file": VOCAB_FILE_NAME, "tokenizer_file": TOKENIZER_FILE_NAME}
    model_input_names = ["input_ids", "attention_mask"]
    padding_side = "left"
    slow_tokenizer_class = SpikeTokenizer
    _auto_class = "AutoTokenizer"

    def __init__(
        self,
        vocab_file=None,
        tokenizer_file=None,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        pad_token=PAD_TOKEN,
        add_bos_token: bool = True,
        **kwargs,
    ):
        backend = kwargs.pop("tokenizer_object", None)
        if backend is None and tokenizer_file is not None and _is_backend_file(tokenizer_file):
            backend = Tokenizer.from_file(os.fspath(tokenizer_file))
        if backend is None:  # only the released vocab: build the pipeline from it
            source = vocab_file if vocab_file is not None else tokenizer_file
            if source is None:
                source = {"vocab": {chr(b): b + BYTE_OFFSET for b in range(256)}}
            data = (normalize_vocab_data(source, source="vocab dict") if isinstance(source, Mapping)
                    else load_vocab_file(source))
            backend = build_backend(data)
        else:
            data = load_vocab_file(vocab_file) if isinstance(vocab_file, (str, os.PathLike)) and os.path.isfile(
                vocab_file) else _vocab_data_from_backend(backend)
        self._vocab_data = data
        self.vocab_file = os.fspath(vocab_file) if isinstance(vocab_file, (str, os.PathLike)) else None
        defined = set(data["vocab"].values())
        self._unused_ids = frozenset(i for i in range(FIRST_MULTIBYTE_ID, SPECIAL_START_ID) if i not in defined)
        self._words_pre_tokenizer = None
        self._words_backend = None
        self._pieces = None
        # greedy tokens found by the added-token matcher (`build_backend`), not by the piece regex
        self._matched_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items()
                                      if not t.special and i < SPECIAL_START_ID)
        self._matches_text = bool(self._matched_ids)

        kwargs.pop("special_tokens_pattern", None)
        kwargs.setdefault("chat_template", CHATML_TEMPLATE)
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        extra = kwargs.pop("extra_special_tokens", None) or kwargs.pop("additional_special_tokens", None) or []
        if isinstance(extra, Mapping):
            kwargs["model_specific_special_tokens"] = {**dict(kwargs.get("model_specific_special_tokens") or {}),
                                                       **dict(extra)}
            extra = []
        named = {str(t) for t in (bos_token, eos_token, unk_token, pad_token) if t is not None}
        ours = [_special(tok) for tok in SPECIAL_TOKENS + RESERVED_TOKENS]
        ours += [_special(tok) for tok in BASE_SPECIAL_TOKENS if tok not in named]
        kwargs["extra_special_tokens"] = ours + [tok for tok in extra if str(tok) not in set(_ALL_SPECIALS)]
        self._tokenizer = backend  # used as is (passing it as tokenizer_object would deep-copy it)
        super().__init__(
            bos_token=_special(bos_token),
            eos_token=_special(eos_token),
            unk_token=_special(unk_token),
            pad_token=_special(pad_token),
            add_bos_token=bool(add_bos_token),
            **kwargs,
        )
        if self.bos_token_id != BOS_ID:
            raise ValueError(f"bos_token resolves to id {self.bos_token_id}, the spike_whale layout requires {BOS_ID}")
        for token, idx in _SPECIAL_IDS.items():
            if self.convert_tokens_to_ids(token) != idx:
                raise ValueError(f"special token {token!r} resolved to id {self.convert_tokens_to_ids(token)}, the "
                                 f"spike_whale layout requires {idx}")

    @classmethod
    def _from_pretrained(cls, resolved_vocab_files, *args, **kwargs):
        check_tokenizer_file(resolved_vocab_files.get("tokenizer_file"), need_model=True)
        return super()._from_pretrained(resolved_vocab_files, *args, **kwargs)

    @classmethod
    def convert_to_native_format(cls, trust_remote_code=False, **kwargs):
        # `__init__` loads tokenizer.json itself (or builds from the vocab); transformers' generic rebuild from
        # vocab/merges would drop the Split/WordPiece pipeline.
        return kwargs

    @classmethod
    def from_slow(cls, tokenizer: SpikeTokenizer, **kwargs) -> "SpikeTokenizerFast":
        """The fast twin of a slow `SpikeTokenizer` (same vocab, add_bos_token, model_max_length, padding side)."""
        kwargs.setdefault("add_bos_token", tokenizer.add_bos_token)
        kwargs.setdefault("model_max_length", tokenizer.model_max_length)
        kwargs.setdefault("padding_side", tokenizer.padding_side)
        kwargs.setdefault("chat_template", tokenizer.chat_template)
        return cls(tokenizer.vocab_data, **kwargs)

    # ---- vocab ----------------------------------------------------------------------------------------

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

    def _save_pretrained(self, save_directory, file_names, legacy_format=None, filename_prefix=None):
        # Both files: tokenizer.json for this class (and any `tokenizers` user), spike_vocab.json for the slow one.
        files = super()._save_pretrained(save_directory, file_names, legacy_format=False,
                                         filename_prefix=filename_prefix)
        return tuple(files) + self.save_vocabulary(str(save_directory), filename_prefix)

    def save_chat_templates(self, save_directory, tokenizer_config: dict, filename_prefix, save_jinja_files):
        tokenizer_config["add_bos_token"] = self._add_bos_token  # as SpikeTokenizer: keep the flag on disk
        return super().save_chat_templates(save_directory, tokenizer_config, filename_prefix, save_jinja_files)

    @property
    def added_tokens_decoder(self) -> dict[int, AddedToken]:
        """The added tokens as transformers means them (specials, tokens a user added): the vocab's own greedy tokens
        that `build_backend` gives the added-token matcher are ordinary vocabulary, not listed here."""
        return {i: t for i, t in self._tokenizer.get_added_tokens_decoder().items() if i not in self._matched_ids}

    _added_tokens_decoder = added_tokens_decoder

    @property
    def added_tokens_encoder(self) -> dict[str, int]:
        return {t.content: i for i, t in sorted(self.added_tokens_decoder.items())}

    _added_tokens_encoder = added_tokens_encoder

    def get_added_vocab(self) -> dict[str, int]:
        return self.added_tokens_encoder

    # ---- encode ---------------------------------------------------------------------------------------

    def _encode_plus(self, text, text_pair=None, add_special_tokens: bool = True, *args,
                     is_split_into_words: bool = False, split_special_tokens=None, **kwargs):
        split = self.split_special_tokens if split_special_tokens is None else split_special_tokens
        # Never add <bos> twice, as `SpikeTokenizer.prepare_for_model`: a text that starts with the special
        # "<bos>" is encoded without it (the post-processor adds it back) and its offsets are shifted back.
        stripped = None
        if add_special_tokens and self.add_bos_token and not split and not is_split_into_words:
            text, text_pair, stripped = _strip_leading_bos(text, text_pair)
        if not args and text_pair is None and not is_split_into_words and _offsets_unused(text, kwargs):
            return self._encode_without_offsets(text, add_special_tokens, split, **kwargs)
        backend = self._tokenizer
        plain = backend.pre_tokenizer
        if is_split_into_words and self._matches_text:
            self._tokenizer = self._backend_for_words()
        elif is_split_into_words:
            backend.pre_tokenizer = self._pre_tokenizer_for_words()
        try:
            if stripped is None:
                return super()._encode_plus(text, text_pair, add_special_tokens, *args,
                                            is_split_into_words=is_split_into_words, split_special_tokens=split,
                                            **kwargs)
            return_tensors = kwargs.pop("return_tensors", None)
            out = super()._encode_plus(text, text_pair, add_special_tokens, *args, split_special_tokens=split,
                                       **kwargs)
        finally:
            self._tokenizer = backend
            backend.pre_tokenizer = plain
        if "offset_mapping" in out:
            batched = not isinstance(text, str)
            rows = out["offset_mapping"] if batched else [out["offset_mapping"]]
            for row, encoding, shifted in zip(rows, out.encodings, stripped):
                for j, seq in enumerate(encoding.sequence_ids):
                    if seq is not None and shifted[seq]:
                        start, end = row[j]
                        row[j] = (start + len(BOS_TOKEN), end + len(BOS_TOKEN))
        out.convert_to_tensors(return_tensors)
        return out

    def _encode_without_offsets(
        self,
        text,
        add_special_tokens: bool,
        split_special_tokens: bool,
        padding_strategy=PaddingStrategy.DO_NOT_PAD,
        truncation_strategy=TruncationStrategy.DO_NOT_TRUNCATE,
        max_length=None,
        stride: int = 0,
        pad_to_multiple_of=None,
        padding_side=None,
        return_tensors=None,
        return_attention_mask=None,
        return_special_tokens_mask: bool = False,
        return_length: bool = False,
        verbose: bool = True,
        **_unused,
    ) -> BatchEncoding:
        """`_encode_plus` when no offsets are returned: `encode_batch_fast` (no character offsets, about 1.3x the
        throughput), with the `tokenizers.Encoding`s of `BatchEncoding.encodings` made on first read."""
        batched = not isinstance(text, str)
        batch = list(text) if batched else [text]
        self.set_truncation_and_padding(padding_strategy=padding_strategy, truncation_strategy=truncation_strategy,
                                        max_length=max_length, stride=stride, pad_to_multiple_of=pad_to_multiple_of,
                                        padding_side=padding_side)
        backend = self._tokenizer
        if backend.encode_special_tokens != split_special_tokens:
            backend.encode_special_tokens = split_special_tokens
        encodings = backend.encode_batch_fast(batch, add_special_tokens=add_special_tokens)
        data = {"input_ids": [e.ids for e in encodings]}
        if return_attention_mask if return_attention_mask is not None else "attention_mask" in self.model_input_names:
            # unpadded rows are all ones: a Python list is cheaper than converting the backend's (serial work)
            data["attention_mask"] = ([e.attention_mask for e in encodings] if backend.padding is not None
                                      else [[1] * len(ids) for ids in data["input_ids"]])
        if return_special_tokens_mask:
            data["special_tokens_mask"] = [e.special_tokens_mask for e in encodings]
        if return_length:
            data["length"] = [len(ids) for ids in data["input_ids"]]
        for ids in data["input_ids"]:
            self._eventual_warn_about_too_long_sequence(ids, max_length, verbose)
        on_demand = EncodingsOnDemand(backend, batch, add_special_tokens, encodings)
        if not batched and return_tensors is None:
            data = {key: value[0] if isinstance(value[0], list) else value for key, value in data.items()}
        return BatchEncoding(data, on_demand, tensor_type=return_tensors, n_sequences=1)

    def _piece_pipeline(self) -> Tokenizer:
        """This vocab's piece pipeline alone (`build_backend` with ``match_text=False``), built on first use."""
        if self._pieces is None:
            self._pieces = build_backend(self._vocab_data, match_text=False)
        return self._pieces

    def _encode_without_added_tokens(self, text: str) -> list[int]:
        # transformers' chat sanitizing encodes a control token's text without the added tokens; here the greedy
        # tokens are added tokens too, so that is the piece pipeline's pre-tokenizer and model
        if not self._matches_text:
            return super()._encode_without_added_tokens(text)
        pieces = self._piece_pipeline()
        return [t.id for split, _ in pieces.pre_tokenizer.pre_tokenize_str(text) for t in pieces.model.tokenize(split)]

    def _backend_for_words(self) -> Tokenizer:
        """Pretokenized input when the added-token matcher finds the greedy tokens: it runs before any pre-tokenizer
        could give each stretch of text its leading space, so these calls take the piece pipeline (`build_backend`
        with ``match_text=False``) with ByteLevel's add_prefix_space, this tokenizer's post-processor and any
        tokens added since."""
        if self._words_backend is None:
            spec = json.loads(self._piece_pipeline().to_str())
            spec["pre_tokenizer"]["pretokenizers"][0]["add_prefix_space"] = True
            self._words_backend = Tokenizer.from_str(json.dumps(spec))
        words = self._words_backend
        words.post_processor = self._tokenizer.post_processor
        words.add_tokens([t for i, t in self._tokenizer.get_added_tokens_decoder().items() if i >= VOCAB_SIZE])
        return words

    def _pre_tokenizer_for_words(self):
        """Pretokenized input: each word gets a leading space unless it has one (GPT-2/RoBERTa convention)."""
        if self._words_pre_tokenizer is None:
            spec = json.loads(self._tokenizer.to_str())
            spec["pre_tokenizer"]["pretokenizers"][0]["add_prefix_space"] = True
            self._words_pre_tokenizer = Tokenizer.from_str(json.dumps(spec)).pre_tokenizer
        return self._words_pre_tokenizer

    def _convert_token_to_id_with_added_voc(self, token: str) -> int:
        # A token may also be given as text (" the" for "Ġthe"), as the slow tokenizer's tokens are written:
        # transformers' token healing looks up " " this way to find the space token.
        index = self._tokenizer.token_to_id(token)
        if index is None:
            index = self._tokenizer.token_to_id(_to_byte_level(token))
        if index is None and all(ch in _BYTE_LEVEL_CHARS for ch in token):  # a matched token in byte-level spelling
            try:
                index = self._tokenizer.token_to_id(_key_to_latin1(token).encode("latin-1").decode("utf-8"))
            except UnicodeDecodeError:
                pass
        return self.unk_token_id if index is None else index

    def apply_chat_template(self, conversation, **kwargs):
        """As `SpikeTokenizer.apply_chat_template`: control tokens inside messages are encoded as text by default."""
        return apply_chat_template_safely(self, super().apply_chat_template, conversation, kwargs)

    # ---- decode ---------------------------------------------------------------------------------------

    def _decode(self, token_ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces=None, **kwargs):
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        # As the slow tokenizer: unused slots decode to nothing, ids outside the vocabulary to <unk>.
        unused = self._unused_ids
        token_ids = [i if 0 <= i < VOCAB_SIZE else UNK_ID for i in map(int, token_ids) if i not in unused]
        return super()._decode(token_ids, skip_special_tokens=skip_special_tokens,
                               clean_up_tokenization_spaces=clean_up_tokenization_spaces, **kwargs)


class EncodingsOnDemand(Sequence):
    """`BatchEncoding.encodings` of a call that returned no offsets: the rows encoded again with character offsets
    (`encode_batch`, under the call's truncation, padding and special-token settings) when one is first read, so
    ``char_to_token``, ``word_ids``, ``tokens`` and the `tokenizers.Encoding`s are those of a plain fast call.
    If the tokenizer has changed since (added tokens), the ids would differ: that raises instead."""

    def __init__(self, backend: Tokenizer, batch: list[str], add_special_tokens: bool, without_offsets: list):
        self._backend = backend
        self._batch = batch
        self._add_special_tokens = add_special_tokens
        self._without_offsets = without_offsets
        self._settings = (backend.truncation, backend.padding, backend.encode_special_tokens)
        self._encodings = None

    @property
    def computed(self) -> bool:
        return self._encodings is not None

    def _all(self) -> list:
        if self._encodings is None:
            backend = self._backend
            saved = (backend.truncation, backend.padding, backend.encode_special_tokens)
            _configure(backend, *self._settings)
            try:
                encodings = backend.encode_batch(self._batch, add_special_tokens=self._add_special_tokens)
            finally:
                _configure(backend, *saved)
            if [e.ids for e in encodings] != [e.ids for e in self._without_offsets]:
                raise RuntimeError("the tokenizer changed (added tokens?) after this call, so its `encodings` can no "
                                   "longer be made to match its input_ids: call the tokenizer again")
            self._encodings, self._without_offsets = encodings, None
        return self._encodings

    def __len__(self) -> int:
        return len(self._batch)

    def __getitem__(self, index):
        return self._all()[index]

    def __reduce__(self):
        return list, (self._all(),)


def _configure(backend: Tokenizer, truncation, padding, encode_special_tokens: bool) -> None:
    if truncation is None:
        backend.no_truncation()
    else:
        backend.enable_truncation(**truncation)
    if padding is None:
        backend.no_padding()
    else:
        backend.enable_padding(**padding)
    backend.encode_special_tokens = encode_special_tokens


def _offsets_unused(text, kwargs) -> bool:
    """True when a call returns nothing that needs character offsets or `tokenizers` overflow/type ids."""
    if isinstance(text, (list, tuple)):
        if not text or not all(isinstance(t, str) for t in text):
            return False
    elif not isinstance(text, str):
        return False
    return not any(kwargs.get(key) for key in ("return_offsets_mapping", "return_overflowing_tokens",
                                                "return_token_type_ids", "sanitize_control_tokens"))


def _special(token):
    if token is None or isinstance(token, AddedToken):
        return token
    return AddedToken(str(token), special=True, normalized=False, lstrip=False, rstrip=False, single_word=False)


def _strip_leading_bos(text, text_pair):
    """Texts with one leading "<bos>" removed, and per row which of (text, pair) lost it; None if none did."""

    def strip(t):
        if isinstance(t, str) and t.startswith(BOS_TOKEN):
            return t[len(BOS_TOKEN):], True
        return t, False

    if isinstance(text, str):
        (a, sa), (b, sb) = strip(text), strip(text_pair)
        return (a, b, [(sa, sb)]) if sa or sb else (text, text_pair, None)
    if not isinstance(text, (list, tuple)) or not text or not isinstance(text[0], str):
        return text, text_pair, None
    firsts = [strip(t) for t in text]
    seconds = [strip(t) for t in text_pair] if isinstance(text_pair, (list, tuple)) else [(None, False)] * len(text)
    flags = [(sa, sb) for (_, sa), (_, sb) in zip(firsts, seconds)]
    if not any(sa or sb for sa, sb in flags):
        return text, text_pair, None
    pairs = [b for b, _ in seconds] if isinstance(text_pair, (list, tuple)) else text_pair
    return [a for a, _ in firsts], pairs, flags


def _is_backend_file(path) -> bool:
    """True for a `tokenizers` tokenizer.json, False for a released custom-format one (``{"vocab": ...}``)."""
    if not os.path.isfile(path):
        return False
    with open(path, encoding="utf-8") as handle:
        head = handle.read(256)
    return '"version"' in head and not head.lstrip().startswith('{"vocab"')


__all__ = ["SpikeTokenizerFast", "build_backend", "bytes_to_unicode", "piece_pattern", "TOKENIZER_FILE_NAME"]
