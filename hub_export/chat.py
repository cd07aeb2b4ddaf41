"""`spike-whale chat MODEL_DIR`: a multi-turn ChatML chat that continues each turn from the previous turn's cache.

Interactive (stdin is a terminal): type a message; `/system TEXT` sets the system prompt (and starts over),
`/reset` clears the conversation, `/save FILE` writes it as `{"messages": [...]}`, `/quit` or Ctrl-D leaves.
Ctrl-C stops the current answer and keeps the session (the partial answer stays in the conversation).

Scripts (stdin not a terminal): each input line is `{"messages": [{"role": ..., "content": ...}, ...]}` and
the answer is one JSON line on stdout: `{"content": ..., "tokens": N, "finish_reason": "stop"|"length",
"dropped_messages": K}`.

A turn feeds only its new tokens (the end of the last answer, the user message, `<|im_start|>assistant\\n`) on
top of the loop-slot cache of the previous turn (`generate(..., cache=...)` with the whole conversation's ids),
so the history is never prefilled again; the tokens are those of a fresh run over the whole conversation. When
the conversation plus the answer would not fit the context window, the oldest turns are dropped (after asking,
in a terminal) and the rest is prefilled again.
"""

from __future__ import annotations

import json
import sys


class ChatSession:
    """One conversation: its messages, its token ids (prompts and the answers as generated) and the cache."""

    def __init__(self, model, tokenizer, generate_kwargs: dict, system: str | None = None):
        self.model, self.tokenizer, self.generate_kwargs = model, tokenizer, generate_kwargs
        self.limit = model.config.max_position_embeddings
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.reset(system)

    def reset(self, system: str | None = None) -> None:
        self.messages = [{"role": "system", "content": system}] if system else []
        self.ids: list[int] = []
        self.cache = None

    def _encode_messages(self, messages: list[dict], with_bos: bool) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        bos = self.tokenizer.bos_token or ""
        if not with_bos and bos and text.startswith(bos):
            text = text[len(bos):]
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _new_tokens(self, message: dict) -> list[int]:
        """The ids that follow `self.ids` for one more user message: the end of the last answer (its
        `<|im_end|>` if generation stopped before it, then the newline), the message, the generation prompt."""
        if not self.ids:
            return self._encode_messages(self.messages + [message], with_bos=True)
        close = [] if self.ids[-1] == self.im_end else [self.im_end]
        return close + self.tokenizer("\n", add_special_tokens=False)["input_ids"] + \
            self._encode_messages([message], with_bos=False)

    def max_new_tokens(self) -> int:
        return int(self.generate_kwargs.get("max_new_tokens") or self.model.generation_config.max_new_tokens or 160)

    def fits(self, n_ids: int) -> bool:
        return n_ids + self.max_new_tokens() <= self.limit

    def drop_oldest_turns(self, message: dict) -> int:
        """Drop the oldest turns (never the system prompt) until the conversation, `message` and an answer fit;
        the cache goes too, so the next turn prefills what is left. Returns the number of messages dropped."""
        system = self.messages[:1] if self.messages and self.messages[0]["role"] == "system" else []
        rest = self.messages[len(system):]

        def needed() -> int:
            return len(self._encode_messages(system + rest + [message], with_bos=True))

        while rest and not self.fits(needed()):
            rest = rest[1:]
            while rest and rest[0]["role"] != "user":
                rest = rest[1:]
        if not self.fits(needed()):
            raise ValueError(
                f"the message alone ({needed()} tokens with the system prompt) plus max_new_tokens="
                f"{self.max_new_tokens()} does not fit the context window ({self.limit}); shorten it or lower "
                "--max-new-tokens")
        dropped = len(self.messages) - len(system) - len(rest)
        self.messages, self.ids, self.cache = system + rest, [], None
        return dropped

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


HELP = "commands: /system TEXT (set the system prompt, start over), /reset, /save FILE, /quit"


def save_conversation(session: ChatSession, path: str) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump({"messages": session.messages}, handle, ensure_ascii=False, indent=2)
        handle.write("\n")


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
        line = line.strip()
        if not line:
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
            elif name == "/save":
                if not rest.strip():
                    write("usage: /save FILE")
                    continue
                try:
                    save_conversation(session, rest.strip())
                    write(f"(saved {len(session.messages)} messages to {rest.strip()})")
                except OSError as exc:
                    write(f"cannot save: {exc}")
            else:
                write(f"unknown command {name!r}; {HELP}")
            continue
        streamer = TextStreamer(session.tokenizer, skip_prompt=True, skip_special_tokens=True)
        try:
            _, reason = session.turn(line, streamer)
        except ContextFull as exc:
            answer = read(f"({exc}. Drop the oldest turns and continue? [y/N] ")
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
    session = ChatSession(model, tokenizer, kwargs, system=args.system)
    if sys.stdin.isatty():
        return interactive(session)
    return scripted(session, sys.stdin)


def register(sub) -> None:
    from .generate_text import add_sampling_arguments

    p = sub.add_parser("chat", help="multi-turn chat in the terminal, or JSON lines on stdin (scripts)",
                       description=__doc__.split("\n\n", 1)[1].strip(),
                       formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    p.add_argument("model_dir")
    p.add_argument("--system", help="system prompt")
    add_sampling_arguments(p)
    p.set_defaults(func=run)
