# Copyright 2025 The spike_whale integration authors. Apache-2.0.
"""Fast (`tokenizers`) twin of `SpikeTokenizer`: the same ids, decodes and special-token rules from a plain
``tokenizer.json`` that ``tokenizers.Tokenizer.from_file`` loads alone (`build_backend`)::

    added tokens    the specials (special, normalized=False)      split off first, at their released ids
                    the greedy tokens that are text (normalized)  leftmost-longest Aho-Corasick over the rest
    pre_tokenizer   ByteLevel, Split(piece regex)                  the rest: runs of up to 2 greedy tokens
    model           WordPiece(prefix "")                           cuts each piece again by longest match
    decoder         ByteLevel                                      bytes -> UTF-8, U+FFFD for broken sequences
    post_processor  TemplateProcessing                             "<bos> $A" (add_bos_token=True)
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from tokenizers import AddedToken as BackendAddedToken
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode  # GPT-2's byte alphabet, as ByteLevel's
from transformers.tokenization_utils_base import AddedToken, BatchEncoding, PaddingStrategy, TruncationStrategy

from .tokenization_spike import (
    BOS_TOKEN, BYTE_OFFSET, EOS_TOKEN, FIRST_MULTIBYTE_ID, LAYOUT_SPECIALS, PAD_TOKEN, SPECIAL_START_ID, UNK_ID,
    UNK_TOKEN, VOCAB_FILE_NAME, VOCAB_SIZE, SpikeTokenizer, SpikeTokenizerMixin, greedy_tokens, greedy_trie_pattern,
    load_vocab_file, normalize_vocab_data, unused_token, with_leading_space,
)

TRIE_DISPATCH = 4  # Oniguruma tries ordered alternatives one by one: lookahead-guarded groups of at most 4
PIECE_TOKENS = 2  # greedy tokens per Split piece: fewer splits, few WordPiece probes
JOINED_CHARS = 1 << 15  # rows are joined into texts of about this many characters: long enough that per-text costs
# vanish, short enough to stay in cache and to give `tokenizers`' threads several texts to share
_LATIN1_TO_BYTE_LEVEL = str.maketrans({chr(b): c for b, c in bytes_to_unicode().items()})
_BYTE_LEVEL_TO_LATIN1 = {c: chr(b) for b, c in bytes_to_unicode().items()}


def _onig_escape(ch: str) -> str:
    """Escape for Oniguruma: every ASCII character that is not a letter or digit gets a backslash."""
    return "\\" + ch if ord(ch) < 128 and not ch.isalnum() else ch


def _text(token: str) -> str | None:
    """The text of a latin-1 token, or None when its bytes are not whole UTF-8 characters."""
    try:
        return token.encode("latin-1").decode("utf-8")
    except UnicodeDecodeError:
        return None


def crosses_a_character(token: str) -> bool:
    """A token that is not UTF-8 with a character start after its first byte (b"d \xe2\x80"): unmatchable as text."""
    return _text(token) is None and any(not 0x80 <= ord(ch) < 0xC0 for ch in token[1:])


def _decodes_as_itself(text: str) -> bool:
    """The ByteLevel decoder maps a token through the byte alphabet when every character is in it, else keeps it."""
    return all(0x21 <= ord(ch) < 0x7F for ch in text) or not all(ch in _BYTE_LEVEL_TO_LATIN1 for ch in text)


def piece_pattern(greedy: list[str], vocab: Mapping[str, int]) -> str:
    """A `Split` regex matching runs of up to `PIECE_TOKENS` greedy tokens that WordPiece's longest match gives back:
    a token starting like a key greedy matching never emits (a special, one over max_token_len...) is a piece alone."""
    greedy_set = set(greedy)
    alone = {key[0] for key in vocab if key not in greedy_set and key[0] in _BYTE_LEVEL_TO_LATIN1}
    runs = [tok for tok in greedy if tok[0] not in alone]
    singles = [tok for tok in greedy if tok[0] in alone]
    alts = [f"(?:{greedy_trie_pattern(runs, _onig_escape, TRIE_DISPATCH)}){{1,{PIECE_TOKENS}}}"] if runs else []
    return "|".join(alts + ([greedy_trie_pattern(singles, _onig_escape, TRIE_DISPATCH)] if singles else []))


def build_backend(data: Mapping) -> Tokenizer:
    """The `tokenizers` pipeline of a normalised vocab, with `SpikeTokenizer`'s ids: ByteLevel, the piece regex and
    WordPiece, after the greedy tokens that are text as added tokens (leftmost-longest Aho-Corasick is greedy longest
    match while those left out, inside one character or one ByteLevel would misread, "é", never start where a matched
    one could), unless a token crosses characters (b"d \xe2\x80") or a text is spelled like another token's key."""
    vocab = {token if token in LAYOUT_SPECIALS else token.translate(_LATIN1_TO_BYTE_LEVEL): idx
             for token, idx in data["vocab"].items()}
    greedy = list(greedy_tokens(data))
    holes = sorted(set(range(FIRST_MULTIBYTE_ID, SPECIAL_START_ID)) - set(vocab.values()))
    vocab.update({unused_token(i): i for i in holes})
    texts = {tok: text for tok in greedy if (text := _text(tok)) is not None and (
        len(text) > 1 or _decodes_as_itself(text))}
    if any(map(crosses_a_character, greedy)) or any(
            text != tok.translate(_LATIN1_TO_BYTE_LEVEL) and text in vocab for tok, text in texts.items()):
        texts = {}
    matched = {text: vocab.pop(tok.translate(_LATIN1_TO_BYTE_LEVEL)) for tok, text in texts.items()}
    vocab.update(matched)
    pieces = [t.translate(_LATIN1_TO_BYTE_LEVEL) for t in greedy if t not in texts]
    backend = Tokenizer(models.WordPiece(vocab, unk_token=UNK_TOKEN, continuing_subword_prefix="",
                                         max_input_chars_per_word=PIECE_TOKENS * data["max_token_len"]))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        pre_tokenizers.Split(Regex(piece_pattern(pieces, vocab)), behavior="isolated")])
    # Unused slots decode to nothing; a matched token spelled only in the byte alphabet but not ASCII ("España") would
    # be read as bytes by the ByteLevel decoder, so it is respelled as its bytes first (a whole-token match).
    steps = [decoders.Replace(Regex("\\A\u27e8unused_[0-9]+\u27e9\\z"), "")] if holes else []
    steps += [decoders.Replace(Regex("\\A" + "".join(map(_onig_escape, text)) + "\\z"),
                               tok.translate(_LATIN1_TO_BYTE_LEVEL))
              for tok, text in texts.items() if not _decodes_as_itself(text)]
    backend.decoder = decoders.Sequence([*steps, decoders.ByteLevel()]) if steps else decoders.ByteLevel()
    backend.add_special_tokens([BackendAddedToken(tok, special=True, normalized=False) for tok in LAYOUT_SPECIALS])
    # normalized=True: matched after the specials are split off, so a special always wins, as in `SpikeTokenizer`
    backend.add_tokens([BackendAddedToken(text, special=False, normalized=True) for text in matched])
    for tok, idx in {**LAYOUT_SPECIALS, **matched}.items():
        if backend.token_to_id(tok) != idx:
            raise ValueError(f"token {tok!r} landed at id {backend.token_to_id(tok)}, the layout requires {idx}")
    return backend


def _vocab_data_from_backend(backend: Tokenizer) -> dict:
    """The released vocab format recovered from a `tokenizer.json` without its spike_vocab.json."""
    matched = {t.content for t in backend.get_added_tokens_decoder().values() if not t.special}
    vocab = {}
    for key, idx in backend.get_vocab(with_added_tokens=False).items():
        if BYTE_OFFSET <= idx < SPECIAL_START_ID and key != unused_token(idx):
            spelled = key.encode().decode("latin-1") if key in matched else "".join(map(_BYTE_LEVEL_TO_LATIN1.get, key))
            vocab[spelled] = idx
    # The file does not record max_token_len: the longest token is the bound it implies.
    return normalize_vocab_data({"vocab": vocab, "max_token_len": max(map(len, vocab))}, source="tokenizer.json")


class SpikeTokenizerFast(SpikeTokenizerMixin, PreTrainedTokenizerFast):
    """`SpikeTokenizer` on `tokenizers` (its arguments, ids, decodes and specials; offsets and batching in Rust).
    `tokenizer_file`: a ``tokenizer.json`` this class wrote; without one the pipeline is built from the vocab."""

    vocab_files_names = {"vocab_file": VOCAB_FILE_NAME, "tokenizer_file": "tokenizer.json"}
    slow_tokenizer_class = SpikeTokenizer

    def __init__(self, vocab_file=None, tokenizer_file=None, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN,
                 unk_token=UNK_TOKEN, pad_token=PAD_TOKEN, add_bos_token: bool = True, **kwargs):
        backend = kwargs.pop("tokenizer_object", None)
        if backend is None and tokenizer_file is not None and os.path.isfile(tokenizer_file):
            with open(tokenizer_file, encoding="utf-8") as handle:
                head = handle.read(256)
            # a `tokenizers` file, not a released custom-format one ({"vocab": ...})
            if '"version"' in head and not head.lstrip().startswith('{"vocab"'):
                backend = Tokenizer.from_file(os.fspath(tokenizer_file))
        if backend is None:  # only the released vocab: build the pipeline from it
            self._vocab_data = load_vocab_file(vocab_file if vocab_file is not None else tokenizer_file)
            backend = build_backend(self._vocab_data)
        elif isinstance(vocab_file, (str, os.PathLike)) and os.path.isfile(vocab_file):
            self._vocab_data = load_vocab_file(vocab_file)
        else:
            self._vocab_data = _vocab_data_from_backend(backend)
        self.vocab_file = os.fspath(vocab_file) if isinstance(vocab_file, (str, os.PathLike)) else None
        # the vocab's greedy tokens the matcher finds: vocabulary, not added tokens in transformers' sense
        self._matched_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items()
                                      if not t.special and i < SPECIAL_START_ID)
        self._tokenizer = backend  # used as is (passing it as tokenizer_object would deep-copy it)
        super().__init__(bos_token, eos_token, unk_token, pad_token, add_bos_token, **kwargs)

    @classmethod
    def convert_to_native_format(cls, trust_remote_code=False, **kwargs):
        # `__init__` loads tokenizer.json itself: transformers' rebuild from vocab/merges would drop the pipeline
        return kwargs

    def _save_pretrained(self, save_directory, file_names, legacy_format=None, filename_prefix=None):
        # tokenizer.json for this class (and any `tokenizers` user), spike_vocab.json for the slow one
        files = super()._save_pretrained(save_directory, file_names, legacy_format=False,
                                         filename_prefix=filename_prefix)
        return tuple(files) + self.save_vocabulary(str(save_directory), filename_prefix)

    @property
    def added_tokens_decoder(self) -> dict[int, AddedToken]:
        """The specials and the tokens a user added; not the vocab's greedy tokens the backend matches as text."""
        return {i: t for i, t in self._tokenizer.get_added_tokens_decoder().items() if i not in self._matched_ids}

    _added_tokens_decoder = added_tokens_decoder  # the base class's added_tokens_encoder and get_added_vocab read it

    def _encode_plus(self, text, text_pair=None, add_special_tokens: bool = True, *args,
                     is_split_into_words: bool = False, split_special_tokens=None, **kwargs):
        split = self.split_special_tokens if split_special_tokens is None else split_special_tokens
        if is_split_into_words:  # as SpikeTokenizer: each word with a leading space
            return super()._encode_plus(with_leading_space(text), with_leading_space(text_pair), add_special_tokens,
                                        *args, is_split_into_words=True, split_special_tokens=split, **kwargs)
        # Never <bos> twice, as SpikeTokenizer: a leading "<bos>" goes (the post-processor adds one), offsets shift
        stripped = None
        if add_special_tokens and self.add_bos_token and not split:
            text, text_pair, stripped = _strip_leading_bos(text, text_pair)
        # plain text (a string or a non-empty list of them) in a call without offsets, overflow or type ids
        plain = isinstance(text, str) or bool(text) and isinstance(text, (list, tuple)) and all(
            isinstance(t, str) for t in text)
        no_offsets = not any(kwargs.get(key) for key in ("return_offsets_mapping", "return_overflowing_tokens",
                                                         "return_token_type_ids", "sanitize_control_tokens"))
        if not args and text_pair is None and plain and no_offsets:
            return self._encode_without_offsets(text, add_special_tokens, split, **kwargs)
        if not stripped:
            return super()._encode_plus(text, text_pair, add_special_tokens, *args, split_special_tokens=split,
                                        **kwargs)
        return_tensors = kwargs.pop("return_tensors", None)
        out = super()._encode_plus(text, text_pair, add_special_tokens, *args, split_special_tokens=split, **kwargs)
        batched = isinstance(text, (list, tuple))
        if "offset_mapping" in out:
            for row, encoding, shifted in zip(out["offset_mapping"] if batched else [out["offset_mapping"]],
                                              out.encodings, stripped):
                for j, seq in enumerate(encoding.sequence_ids):
                    if seq is not None and shifted[seq]:
                        row[j] = (row[j][0] + len(BOS_TOKEN), row[j][1] + len(BOS_TOKEN))
        out.convert_to_tensors(return_tensors, prepend_batch_axis=not batched)
        return out

    def _encode_without_offsets(self, text, add_special_tokens, split_special_tokens,
                                padding_strategy=PaddingStrategy.DO_NOT_PAD,
                                truncation_strategy=TruncationStrategy.DO_NOT_TRUNCATE, max_length=None, stride=0,
                                pad_to_multiple_of=None, padding_side=None, return_tensors=None,
                                return_attention_mask=None, return_special_tokens_mask=False, return_length=False,
                                verbose=True, **_):
        """`_encode_plus` of a call needing no character offsets, by `encode_batch_fast`, which skips them (most of
        `encode_batch`'s time); the `Encoding`s (``char_to_token``, ``word_ids``...) are made on first read."""
        batch = [text] if isinstance(text, str) else list(text)
        self.set_truncation_and_padding(padding_strategy=padding_strategy, truncation_strategy=truncation_strategy,
                                        max_length=max_length, stride=stride, pad_to_multiple_of=pad_to_multiple_of,
                                        padding_side=padding_side)
        backend = self._tokenizer
        backend.encode_special_tokens = split_special_tokens
        remake = None
        if len(batch) > 1 and backend.truncation is None and not return_special_tokens_mask:
            remake = self._encode_joined(batch, add_special_tokens)
        if remake is None:
            encodings = backend.encode_batch_fast(batch, add_special_tokens=add_special_tokens)
            data = {"input_ids": [e.ids for e in encodings]}
            masks = [e.attention_mask for e in encodings] if backend.padding else None

            def remake():
                return [e.ids for e in encodings]
        else:
            data = {"input_ids": remake()}
            masks = _pad(data["input_ids"], backend.padding) if backend.padding else None
        if return_attention_mask or return_attention_mask is None and "attention_mask" in self.model_input_names:
            # unpadded rows are all ones: cheaper than converting the backend's masks
            data["attention_mask"] = masks if masks is not None else [[1] * len(ids) for ids in data["input_ids"]]
        if return_special_tokens_mask:
            data["special_tokens_mask"] = [e.special_tokens_mask for e in encodings]
        if return_length:
            data["length"] = list(map(len, data["input_ids"]))
        for ids in data["input_ids"]:
            self._eventual_warn_about_too_long_sequence(ids, max_length, verbose)
        lazy = EncodingsOnDemand(backend, batch, add_special_tokens, remake)
        if isinstance(text, str) and return_tensors is None:
            data = {key: value[0] if isinstance(value[0], list) else value for key, value in data.items()}
        return BatchEncoding(data, lazy, tensor_type=return_tensors, n_sequences=1)

    def _encode_joined(self, batch: list[str], add_special_tokens: bool):
        """`batch` encoded as texts of about `JOINED_CHARS`, each of rows joined by a separator that no token but
        its own holds (greedy matching cannot cross it): `tokenizers`' per-text costs dominate short rows. Returns a
        function giving the rows' ids (new lists, split at the separator's id), or None when the vocabulary has no
        such separator or a row holds it."""
        backend = self._tokenizer
        saved = EncodingsOnDemand._configure(backend, None, None, backend.encode_special_tokens)  # pad rows, not texts
        try:
            if getattr(self, "_joiner", False) is False:  # found again after tokens are added (`_add_tokens`)
                self._joiner = _separator(backend)
            if self._joiner is None:
                return None
            sep, sep_id = self._joiner
            cuts, size = [0], 0
            for i, row in enumerate(batch, 1):
                size += len(row)
                if size >= JOINED_CHARS or i == len(batch):
                    cuts.append(i)
                    size = 0
            texts = [sep.join(batch[a:b]) for a, b in zip(cuts, cuts[1:])]
            if any(t.count(sep) != b - a - 1 for t, a, b in zip(texts, cuts, cuts[1:])):
                return None
            probe = backend.encode(sep, add_special_tokens=add_special_tokens).ids  # the post-processor's ids
            encodings = backend.encode_batch_fast(texts, add_special_tokens=False)
        finally:
            EncodingsOnDemand._configure(backend, *saved)
        head, tail = probe[:probe.index(sep_id)], probe[probe.index(sep_id) + 1:]

        def rows() -> list[list[int]]:
            out = []
            for encoding in encodings:
                ids, start = encoding.ids, 0
                for _ in range(ids.count(sep_id)):
                    end = ids.index(sep_id, start)
                    out.append(head + ids[start:end] + tail)
                    start = end + 1
                out.append(head + ids[start:] + tail)
            return out

        return rows

    def _add_tokens(self, new_tokens, special_tokens: bool = False) -> int:
        self._joiner = False  # a new token may hold the separator
        return super()._add_tokens(new_tokens, special_tokens)

    def _encode_without_added_tokens(self, text: str) -> list[int]:
        # chat sanitizing encodes a control token's text as text; the greedy tokens may be added tokens of the backend
        return self.encode(text, add_special_tokens=False, split_special_tokens=True)

    def _convert_token_to_id_with_added_voc(self, token: str) -> int:
        # A token may also be given as the slow class writes it (its bytes as latin-1), as its text (" é"), or as the
        # byte-level spelling of a matched token ("fÃ¼r" for "für").
        try:
            utf8 = token.encode("utf-8").decode("latin-1")
        except UnicodeEncodeError:  # a lone surrogate (no UTF-8 bytes) is in no vocabulary: <unk>, as in the slow class
            return self.unk_token_id
        spellings = [token, token.translate(_LATIN1_TO_BYTE_LEVEL), utf8.translate(_LATIN1_TO_BYTE_LEVEL)]
        if all(ch in _BYTE_LEVEL_TO_LATIN1 for ch in token):
            spellings.append(_text("".join(map(_BYTE_LEVEL_TO_LATIN1.get, token))))
        for key in spellings:
            if key is not None and (index := self._tokenizer.token_to_id(key)) is not None:
                return index
        return self.unk_token_id

    def _decode(self, token_ids, **kwargs):
        # as the slow class: ids outside the vocabulary (such as -100 labels) decode to <unk>
        ids = [token_ids] if isinstance(token_ids, int) else token_ids
        return super()._decode([i if 0 <= i < VOCAB_SIZE else UNK_ID for i in map(int, ids)], **kwargs)


def _separator(backend: Tokenizer) -> tuple[str, int] | None:
    """A control character that is one token and inside no other token (in the byte alphabet or as text)."""
    keys = [key for key in backend.get_vocab(with_added_tokens=True) if len(key) > 1]
    for code in range(0x20):
        sep = chr(code)
        ids = backend.encode(sep, add_special_tokens=False).ids
        spellings = {sep, sep.translate(_LATIN1_TO_BYTE_LEVEL)}
        if len(ids) == 1 and not any(ch in key for key in keys for ch in spellings):
            return sep, ids[0]
    return None


def _pad(rows: list[list[int]], padding: dict) -> list[list[int]]:
    """Pad `rows` in place as a `tokenizers` padding setting would; return the attention masks."""
    multiple, left = padding["pad_to_multiple_of"] or 1, padding["direction"] == "left"
    length = -(-(padding["length"] or max(map(len, rows))) // multiple) * multiple
    masks = [[0] * (length - len(row)) + [1] * len(row) if left else [1] * len(row) + [0] * (length - len(row))
             for row in rows]
    for row in rows:
        pads = [padding["pad_id"]] * (length - len(row))
        if left:
            row[:0] = pads
        else:
            row += pads
    return masks


class EncodingsOnDemand(Sequence):
    """`BatchEncoding.encodings` of a call without offsets: on first read, `encode_batch` of its rows under its
    truncation, padding and split_special_tokens; tokens added since would change the ids, so that raises."""

    def __init__(self, backend: Tokenizer, batch: list[str], add_special_tokens: bool, remake):
        # remake(): the call's ids, padded again as the call padded them
        settings = backend.truncation, backend.padding, backend.encode_special_tokens
        self._args = backend, batch, add_special_tokens, remake, settings
        self._made = None

    def _all(self) -> list:
        if self._made is None:
            backend, batch, add_special_tokens, remake, settings = self._args
            saved = self._configure(backend, *settings)
            try:
                made = backend.encode_batch(batch, add_special_tokens=add_special_tokens)
            finally:
                self._configure(backend, *saved)
            ids = remake()
            if settings[1] is not None:
                _pad(ids, settings[1])
            if [e.ids for e in made] != ids:
                raise RuntimeError("the tokenizer changed (added tokens?) since this call, so its encodings can no "
                                   "longer match its input_ids: call it again")
            self._made, self._args = made, None
        return self._made

    def __len__(self) -> int:
        return len(self._made if self._made is not None else self._args[1])

    def __getitem__(self, index):
        return self._all()[index]

    def __reduce__(self):  # pickled as the list of encodings
        return list, (self._all(),)

    @staticmethod
    def _configure(backend: Tokenizer, truncation, padding, encode_special_tokens: bool) -> tuple:
        """Set the backend's truncation, padding and encode_special_tokens; return the ones it had."""
        saved = backend.truncation, backend.padding, backend.encode_special_tokens
        backend.no_truncation() if truncation is None else backend.enable_truncation(**truncation)
        backend.no_padding() if padding is None else backend.enable_padding(**padding)
        backend.encode_special_tokens = encode_special_tokens
        return saved


def _strip_leading_bos(text, text_pair):
    """The texts with one leading "<bos>" removed, and per row which of (text, pair) lost it; None if none did."""
    batched = isinstance(text, (list, tuple))
    if batched and not all(isinstance(t, str) for t in text):
        return text, text_pair, None
    pairs_batched = batched and isinstance(text_pair, (list, tuple))
    firsts = list(text) if batched else [text]
    seconds = list(text_pair) if pairs_batched else [text_pair] * len(firsts)
    flags = [tuple(isinstance(t, str) and t.startswith(BOS_TOKEN) for t in row) for row in zip(firsts, seconds)]
    if not any(map(any, flags)):
        return text, text_pair, None
    firsts, seconds = ([t[len(BOS_TOKEN):] if f[k] else t for t, f in zip(rows, flags)]
                       for k, rows in enumerate((firsts, seconds)))
    return (firsts, seconds if pairs_batched else text_pair, flags) if batched else (firsts[0], seconds[0], flags)
