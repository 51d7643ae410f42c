"""Entry point of the ``quickdraft`` command.

Each subcommand lives in its own module of this package and exposes
``register(subparsers: argparse._SubParsersAction) -> None``; the parser it adds sets
``func=run`` where ``run(args: argparse.Namespace) -> int`` returns the exit code.
A :class:`QuickdraftError` is printed as ``error: ...`` on stderr (exit 2), never as a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from quickdraft import __version__
from quickdraft.errors import QuickdraftError

SUBCOMMANDS = ("generate", "chat", "models", "selftest", "bench", "serve", "train-eagle3", "quantize")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="quickdraft",
        description="Fast, lossless LLM inference with speculative decoding, built for speed per user.",
    )
    parser.add_argument("--version", action="version", version=f"quickdraft {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"quickdraft.cli.{name.replace('-', '_')}")
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args))
    except QuickdraftError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
