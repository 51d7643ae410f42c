"""Measurements kept between starts: one JSON object per file under the cache folder, entries keyed
by what they depend on, each with its ``measured`` unix time (pass costs, kernel choices, the
bandwidth probe). A missing or damaged file reads as empty; writes are atomic and keep the newest
entries only; a folder that cannot be written only costs the saving."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

MAX_ENTRIES = 64  # the most recently measured are kept (tests and experiments add many)


def read(path: Path) -> tuple[dict[str, Any], str | None]:
    """The stored entries, and where the file is unusable, why (None when fine or missing)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}, None
    except (OSError, ValueError) as exc:
        return {}, f"{path} is unreadable ({type(exc).__name__})"
    if not isinstance(data, dict):
        return {}, f"{path} does not hold a JSON object"
    return data, None


def write(path: Path, entries: dict[str, Any]) -> OSError | None:
    """Store the newest MAX_ENTRIES entries atomically; returns the error where it could not."""
    def age(kv: tuple[str, Any]) -> float:
        try:
            return -float(kv[1].get("measured", 0))
        except (AttributeError, TypeError, ValueError):
            return 0.0

    newest = dict(sorted(entries.items(), key=age)[:MAX_ENTRIES])
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.")
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(newest, fh, indent=1)
        os.replace(tmp, path)
    except OSError as exc:
        return exc
    return None
