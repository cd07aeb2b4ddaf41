"""The `spike-whale` subcommands, one module each (each exposes `register(subparsers)`)."""

from . import generate_text, init_tiny

MODULES = [init_tiny, generate_text]
