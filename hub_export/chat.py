"""`spike-whale chat MODEL_DIR`: a multi-turn ChatML chat that continues each turn from the previous turn's cache.

Interactive (stdin is a terminal): type a message; `/system TEXT` sets the system prompt (and starts over),
`/reset` clears the conversation, `/save FILE` writes it as `{"messages": [...]}` (never over an existing file:
`/save! FILE` replaces one; never inside the model folder), `/quit` or Ctrl-D leaves. Ctrl-C stops the current
answer and keeps the session (the partial answer stays in the conversation).

Scripts (stdin not a terminal): each input line is `{"messages": [{"role": ..., "content": ...}, ...]}` and
the answer is one JSON line on stdout: `{"content": ..., "tokens": N, "finish_reason": "stop"|"length",
"dropped_messages": K}`.

A turn feeds only its new tokens (the end of the last answer, the user message, `<|im_start|>assistant\\n`) on
top of the loop-slot cache of the previous turn (`generate(..., cache=...)` with the whole conversation's ids),
so the history is never prefilled again; the tokens are those of a fresh run over the whole conversation. When
the conversation plus the answer would not fit the context window, the oldest turns are dropped (after asking,
in a terminal) and the rest is prefilled again. Prompts are built by `apply_chat_template(tokenize=True)`, so
control-token strings typed in a message (`<|im_end|>`, ...) stay text.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import sys
from pathlib import Path

from .output_paths import resolved, write_file


class ChatSession:
    """One conversation: its messages, its token ids (prompts and the answers as generated) and the cache."""

    def __init__(self, model, tokenizer, generate_kwargs: dict, system: str | None = None,
                 model_dir: str | None = None):
        self.model, self.tokenizer, self.generate_kwargs = model, tokenizer, generate_kwargs
        # `/save` must never write into the folder the model was loaded from.
        self.model_dir = model_dir or getattr(model, "name_or_path", None) or None
        self.limit = model.config.max_position_embeddings
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
        self.reset(system)

    def reset(self, system: str | None = None) -> None:
        self.messages = [{"role": "system", "content": system}] if system else []
        self.ids: list[int] = []
        self.cache = None

    def _encode_messages(self, messages: list[dict], with_bos: bool, generation_prompt: bool = True) -> list[int]:
        """The template's ids for `messages`, tokenized by the template itself: encoding its rendered text again
        would turn control-token strings typed in a message into real control tokens."""
        ids = list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                                      tokenize=True, return_dict=False))
        if not with_bos and ids[:1] == [self.tokenizer.bos_token_id]:
            ids = ids[1:]
        return ids

    def _new_tokens(self, message: dict) -> list[int]:
        """The ids that follow `self.ids` for one more user message: the end of the last answer (its
        `<|im_end|>` if generation stopped before it, then the newline), the message, the generation prompt."""
        if not self.ids:
            return self._encode_messages(self.messages + [message], with_bos=True)
        close = [] if self.ids[-1] == self.im_end else [self.im_end]
        return close + self.newline + self._encode_messages([message], with_bos=False)

    def max_new_tokens(self) -> int:
        return int(self.generate_kwargs.get("max_new_tokens") or self.model.generation_config.max_new_tokens or 160)

    def fits(self, n_ids: int) -> bool:
        return n_ids + self.max_new_tokens() <= self.limit

    def drop_oldest_turns(self, message: dict) -> int:
        """Drop the oldest turns (never the system prompt) until the conversation, `message` and an answer fit;
        the cache goes too, so the next turn prefills what is left. Returns the number of messages dropped.

        Each message is tokenized once and the cut is chosen from those counts, then checked by one encoding of
        what is kept: re-encoding the whole conversation after each dropped turn made long chats quadratic."""
        system = self.messages[:1] if self.messages and self.messages[0]["role"] == "system" else []
        rest = self.messages[len(system):]
        # Where the kept part may start: at a user message (a turn), or nowhere; the first message always goes.
        cuts = sorted({0, len(rest), *(i for i in range(1, len(rest)) if rest[i]["role"] == "user")})
        base = len(self._encode_messages(system + [message], with_bos=True))
        sizes = [len(self._encode_messages([m], with_bos=False, generation_prompt=False)) for m in rest]
        after = list(itertools.accumulate(reversed(sizes), initial=0))[::-1]  # after[i]: tokens of rest[i:]
        first = next((k for k, cut in enumerate(cuts) if self.fits(base + after[cut])), len(cuts) - 1)
        for cut in cuts[first:]:  # the counts add up for ChatML; the check covers a template where they do not
            needed = len(self._encode_messages(system + rest[cut:] + [message], with_bos=True))
            if self.fits(needed):
                break
        else:
            raise ValueError(
                f"the message alone ({needed} tokens with the system prompt) plus max_new_tokens="
                f"{self.max_new_tokens()} does not fit the context window ({self.limit}); shorten it or lower "
                "--max-new-tokens")
        self.messages, self.ids, self.cache = system + rest[cut:], [], None
        return cut

    def turn(self, content: str, streamer=None) -> tuple[str, str]:
        """Answer one user message; returns (answer text, finish reason). A KeyboardInterrupt stops the answer:
        what was generated stays in the conversation and the next turn prefills again."""
        import torch

        from ..generation_utils import CACHE_FIELD

        message = {"role": "user", "content": content}
        prompt = self.ids + self._new_tokens(message)
        if not self.fits(len(prompt)):
            raise ContextFull(len(prompt), self.limit, self.max_new_tokens())
        self.messages.append(message)
        collector = TokenCollector(self.tokenizer, streamer)
        ids = torch.tensor([prompt])
        interrupted = False
        try:
            with torch.no_grad():
                out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), cache=self.cache,
                                          streamer=collector, return_dict_in_generate=True, **self.generate_kwargs)
            new = out.sequences[0, len(prompt):].tolist()
            self.cache = getattr(out, CACHE_FIELD)
        except KeyboardInterrupt:
            new, interrupted = collector.ids, True
            self.cache = None
        self.ids = prompt + new
        self.last_answer_tokens = len(new)
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        self.messages.append({"role": "assistant", "content": text})
        if interrupted:
            return text, "interrupted"
        eos = self.model.generation_config.eos_token_id
        stopped = bool(new) and new[-1] in (eos if isinstance(eos, (list, tuple)) else [eos])
        return text, "stop" if stopped else "length"


class ContextFull(ValueError):
    def __init__(self, needed: int, limit: int, max_new: int):
        super().__init__(f"the conversation is {needed} tokens and an answer may take {max_new} more, over the "
                         f"context window of {limit} positions")


class TokenCollector:
    """A `generate` streamer that records the generated ids and forwards them to another streamer."""

    def __init__(self, tokenizer, inner=None):
        self.inner, self.ids, self.prompt_seen = inner, [], False

    def put(self, value) -> None:
        if self.prompt_seen:
            self.ids.extend(value.reshape(-1).tolist())
        self.prompt_seen = True
        if self.inner is not None:
            self.inner.put(value)

    def end(self) -> None:
        if self.inner is not None:
            self.inner.end()


def check_text(text: str, what: str) -> str:
    """Refuse a string no tokenizer can encode: one holding a lone surrogate (a `\\ud800` JSON escape without
    its pair, or bytes that are not UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} holds a lone surrogate ({text[exc.start]!r} at character {exc.start}), which is "
                         "not text; send valid UTF-8 (a surrogate pair such as \\ud83d\\udc33 is fine)") from None
    return text


def answer_json_line(session: ChatSession, line: str) -> dict:
    """Answer one `{"messages": [...]}` line (every message before the last, a user one, is the history)."""
    try:
        request = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"input line is not JSON ({exc.msg} at column {exc.colno})") from None
    messages = request.get("messages") if isinstance(request, dict) else None
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise ValueError('each input line must be {"messages": [{"role": ..., "content": ...}, ...]}')
    for i, m in enumerate(messages):
        check_text(m["role"], f"message {i}'s role")
        check_text(m["content"], f"message {i}'s content")
    if messages[-1]["role"] != "user":
        raise ValueError(f"the last message must be the user's, got role {messages[-1]['role']!r}")
    session.reset()
    session.messages = list(messages[:-1])
    dropped = 0
    try:
        text, reason = session.turn(messages[-1]["content"])
    except ContextFull:
        dropped = session.drop_oldest_turns(messages[-1])
        text, reason = session.turn(messages[-1]["content"])
    return {"content": text, "tokens": session.last_answer_tokens, "finish_reason": reason,
            "dropped_messages": dropped}


HELP = ("commands: /system TEXT (set the system prompt, start over), /reset, /save FILE (/save! FILE replaces "
        "an existing file), /quit")


def save_conversation(session: ChatSession, path: str, force: bool = False) -> None:
    """Write the conversation as `{"messages": [...]}`. An existing file is replaced only with `force` (`/save!`),
    nothing inside the model folder ever is, and the file is written under a staging name and renamed into place
    (`write_file`), so a failed save leaves what was there."""
    out = Path(os.path.expanduser(path))
    target = resolved(out)
    model_dir = session.model_dir if session.model_dir and os.path.isdir(session.model_dir) else None
    if model_dir and resolved(model_dir) in (target, *target.parents):
        raise ValueError(f"{path} is inside the model folder {model_dir}; save the conversation elsewhere")
    if out.is_dir():
        raise ValueError(f"{path} is a folder; give the path of the file to write")
    if os.path.lexists(out) and not force:
        raise ValueError(f"{path} exists; /save! {path} replaces it")
    write_file(out, json.dumps({"messages": session.messages}, ensure_ascii=False, indent=2) + "\n")


def interactive(session: ChatSession, read=input, write=print) -> int:
    """The terminal loop (`read` and `write` are `input` and `print`, replaceable for tests)."""
    from transformers import TextStreamer

    write(f"spike-whale chat: {HELP}")
    while True:
        try:
            line = read("> ")
        except EOFError:
            write("")
            return 0
        except KeyboardInterrupt:
            write("")
            continue
        except UnicodeDecodeError as exc:
            write(f"(the line is not UTF-8 text: {exc.reason} at byte {exc.start}; nothing sent)")
            continue
        line = line.strip()
        if not line:
            continue
        try:
            check_text(line, "the line")
        except ValueError as exc:
            write(f"({exc}; nothing sent)")
            continue
        if line.startswith("/"):
            name, _, rest = line.partition(" ")
            if name == "/quit":
                return 0
            if name == "/reset":
                session.reset(session.messages[0]["content"] if session.messages[:1] and
                              session.messages[0]["role"] == "system" else None)
                write("(conversation cleared)")
            elif name == "/system":
                session.reset(rest.strip() or None)
                write("(system prompt set; conversation cleared)" if rest.strip() else "(system prompt removed)")
            elif name in ("/save", "/save!"):
                if not rest.strip():
                    write(f"usage: {name} FILE")
                    continue
                try:
                    save_conversation(session, rest.strip(), force=name == "/save!")
                    write(f"(saved {len(session.messages)} messages to {rest.strip()})")
                except (OSError, ValueError) as exc:
                    write(f"cannot save: {exc}")
            else:
                write(f"unknown command {name!r}; {HELP}")
            continue
        streamer = TextStreamer(session.tokenizer, skip_prompt=True, skip_special_tokens=True)
        try:
            _, reason = session.turn(line, streamer)
        except ContextFull as exc:
            try:
                answer = read(f"({exc}. Drop the oldest turns and continue? [y/N] ")
            except (EOFError, KeyboardInterrupt):  # Ctrl-D / Ctrl-C here mean "no", not "leave"
                write("")
                answer = ""
            if answer.strip().lower() not in ("y", "yes"):
                write("(nothing sent; /reset starts over)")
                continue
            try:
                dropped = session.drop_oldest_turns({"role": "user", "content": line})
            except ValueError as too_long:
                write(f"({too_long})")
                continue
            write(f"(dropped {dropped} messages; prefilling the rest)")
            _, reason = session.turn(line, streamer)
        if reason == "interrupted":
            write("\n(stopped)")
        elif reason == "length":
            write("\n(answer cut at --max-new-tokens)")


def scripted(session: ChatSession, lines, out=sys.stdout) -> int:
    """One JSON answer line per JSON input line; a bad line gets `{"error": ...}` and the rest go on."""
    failed = 0
    for line in lines:
        if not line.strip():
            continue
        try:
            reply = answer_json_line(session, line)
        except ValueError as exc:
            reply, failed = {"error": str(exc)}, failed + 1
        out.write(json.dumps(reply, ensure_ascii=False) + "\n")
        out.flush()
    return 1 if failed else 0


def run(args) -> int:
    import torch

    from .generate_text import load, sampling_kwargs

    kwargs = sampling_kwargs(args)
    tokenizer, model = load(args)
    if args.seed is not None:
        torch.manual_seed(args.seed)
    session = ChatSession(model, tokenizer, kwargs, system=args.system, model_dir=args.model_dir)
    if sys.stdin.isatty():
        return interactive(session)
    # JSON is UTF-8; bytes that are not come through as lone surrogates, and that line alone gets an error.
    return scripted(session, io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8", errors="surrogateescape"))


def register(sub) -> None:
    from .generate_text import add_sampling_arguments

    p = sub.add_parser("chat", help="multi-turn chat in the terminal, or JSON lines on stdin (scripts)",
                       description=__doc__.split("\n\n", 1)[1].strip(),
                       formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    p.add_argument("model_dir")
    p.add_argument("--system", help="system prompt")
    add_sampling_arguments(p)
    p.set_defaults(func=run)
