"""The `spike-whale` subcommands, one module each (each exposes `register(subparsers)`)."""

from . import convert, from_gguf, generate_text, init_tiny, push, to_gguf, verify_cache, widen

MODULES = [init_tiny, generate_text, convert, to_gguf, from_gguf, widen, push, verify_cache]
