"""`spike-whale` console script (also `python -m spike_whale`): one entry point, one module per command."""

from __future__ import annotations

import argparse
import sys

from . import commands

COMMAND_MODULES = commands.MODULES


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spike-whale",
        description="Tools for the spike_whale (SpikeWhale v2 / Byrne) transformers integration.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMAND_MODULES:
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, NotImplementedError, RuntimeError, OSError) as exc:
        print(f"spike-whale {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
