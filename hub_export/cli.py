"""`spike-whale` console script (also `python -m spike_whale`): one entry point, one module per command.

Only the chosen command's module is imported (see `commands.COMMANDS`); every failure is one line on stderr and a
non-zero exit, an interrupt (Ctrl-C, SIGTERM) one line and exit 130 after the command has removed its partial
output.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import signal
import sys
import threading

from .commands import COMMANDS

ERRORS = (ValueError, FileNotFoundError, NotImplementedError, RuntimeError, OSError)
# Warnings logged on import that no command can act on: transformers imports torchao (the int8 extra, which no command
# uses) whenever it is installed, and torchao then reports its CUDA kernels missing and torch its enum registrations.
QUIET_LOGGERS = ("torchao", "torch.utils._pytree")


def version() -> str:
    from importlib import metadata

    try:
        return metadata.version("spike-whale")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def command_module(name: str):
    return importlib.import_module(f".{COMMANDS[name][0]}", __package__)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser; with `only`, just that command's module is imported (the others get a help line only)."""
    parser = argparse.ArgumentParser(
        prog="spike-whale",
        description="Tools for the spike_whale (SpikeWhale v2 / Byrne) transformers integration.",
    )
    parser.add_argument("--version", action="version", version=f"spike-whale {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        if only is None or name == only:
            command_module(name).register(sub)
        else:
            sub.add_parser(name, help=help_text, add_help=False)
    return parser


def _chosen(argv: list[str]) -> str:
    """The command named on the command line ("" if none or unknown: argparse then says so)."""
    first = next((a for a in argv if not a.startswith("-")), "")
    return first if first in COMMANDS else ""


def _terminate(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(only=_chosen(argv)).parse_args(argv)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
    try:
        return int(args.func(args) or 0)
    except ERRORS as exc:
        print(f"spike-whale {args.command}: error: {' '.join(str(exc).split()) or type(exc).__name__}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"spike-whale {args.command}: interrupted", file=sys.stderr)
        return 130
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
