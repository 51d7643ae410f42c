"""Files kept between starts under the cache folder, and the one policy for all of them.

Measurements (pass costs, kernel choices) are one JSON object per file, entries keyed by what they
depend on, each with its ``measured`` unix time (:func:`read`, :func:`write`); other kept files
(the token ranks) are written through :func:`replace` too, and prepared weights
(quickdraft.loading.prepared) follow the same rules for a folder:

* a file is replaced whole: written to a temporary file beside it (``.<name>.<random>.tmp``),
  flushed to disk and renamed over it, so a reader finds the old file or the new one, never part
  of one. A temporary file left by a process killed before its rename is never read (it has
  another name) and the next write removes it once it is older than :data:`TEMP_MAX_AGE_S`;
* a damaged file (empty, cut short, garbled, of another shape) is removed, and the reason comes
  back as one line for the caller to report before it measures again; damaged entries of a
  sound file are dropped from it;
* a folder that cannot be written (read-only, disk full) only costs the saving: one warning per
  file kind and process (:func:`warn_unkept`), never a failed start.
"""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import tempfile
import time
import warnings
from pathlib import Path
from typing import IO, Any

MAX_ENTRIES = 64  # the most recently measured are kept (tests and experiments add many)
TEMP_MAX_AGE_S = 60.0  # an older temporary file is no write in progress but a killed one's leftover

_warned: set[str] = set()  # the kinds of kept file whose write failed (warned once per process)


def read(path: Path) -> tuple[dict[str, Any], str | None]:
    """The stored entries, and where the file was damaged, why, as one line to report (None when
    fine or missing). A damaged file is removed; entries that are not objects with a ``measured``
    time are dropped (the file rewritten without them)."""
    try:
        with open(path, "rb") as fh:
            seen = os.fstat(fh.fileno())
            raw = fh.read()
    except (FileNotFoundError, NotADirectoryError):  # (nothing kept yet, or no cache folder)
        return {}, None
    except OSError as exc:
        discard(path)
        return {}, f"kept file {path} is unreadable ({one_line(exc)}); removed it"
    try:
        data = json.loads(raw.decode("utf-8"))
    except ValueError as exc:  # (JSONDecodeError, UnicodeDecodeError)
        why = "empty" if not raw.strip() else f"cut short or garbled: {one_line(exc)}"
        discard(path, seen)
        return {}, f"kept file {path} is damaged ({why}); removed it"
    if not isinstance(data, dict):
        discard(path, seen)
        return {}, f"kept file {path} is damaged (a JSON {type(data).__name__}, not an object of entries); removed it"
    good = {k: v for k, v in data.items() if _whole(v)}
    if len(good) == len(data):
        return data, None
    if not good:  # (another version's layout, or every entry garbled)
        discard(path, seen)
        what = "its one entry is not" if len(data) == 1 else f"none of its {len(data)} entries is"
        return {}, f"kept file {path} is damaged ({what} a measurement); removed it"
    dropped = len(data) - len(good)
    write(path, good)
    return good, f"kept file {path} held {dropped} damaged {'entry' if dropped == 1 else 'entries'}; dropped"


def _whole(entry: object) -> bool:
    """Whether ``entry`` has the shape every kept measurement has (an object with a finite
    ``measured`` time); what else it holds, its user checks."""
    if not isinstance(entry, dict):
        return False
    measured = entry.get("measured")
    return isinstance(measured, int | float) and not isinstance(measured, bool) and math.isfinite(measured)


def write(path: Path, entries: dict[str, Any]) -> OSError | None:
    """Store the newest MAX_ENTRIES entries with :func:`replace`; returns the error where it could
    not, having warned about it (once for this file)."""
    def age(kv: tuple[str, Any]) -> float:
        try:
            return -float(kv[1].get("measured", 0))
        except (AttributeError, TypeError, ValueError):
            return 0.0

    newest = dict(sorted(entries.items(), key=age)[:MAX_ENTRIES])
    try:
        replace(path, json.dumps(newest, indent=1).encode("utf-8"))
    except OSError as exc:
        warn_unkept(path, f"could not keep the measurements in {path} ({one_line(exc)}); they will be "
                          "measured again at the next start")
        return exc
    _warned.discard(str(path))
    return None


def replace(path: Path, data: bytes) -> None:
    """Make ``path`` hold ``data``, whole or not at all (a temporary file beside it, flushed to
    disk, renamed over it); raises OSError where the folder cannot be written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            flush_to_disk(fh)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def flush_to_disk(fh: IO[Any]) -> None:
    """Flush the open file ``fh`` to disk (before it, or its folder, is renamed into place)."""
    fh.flush()
    os.fsync(fh.fileno())


def remove_stale_temps(path: Path) -> None:
    """Remove the temporary files of earlier writes of ``path`` that were killed before their
    rename (older than TEMP_MAX_AGE_S, so not one another process is writing now)."""
    stem = glob.escape(path.stem)
    # (".<stem>.*": also what earlier versions named them; "<stem>.*.tmp<suffix>": the token ranks')
    now = time.time()
    for pattern in (f".{stem}.*", f"{stem}.*.tmp{glob.escape(path.suffix)}"):
        for tmp in path.parent.glob(pattern):
            with contextlib.suppress(OSError):
                if tmp.name != path.name and now - tmp.stat().st_mtime > TEMP_MAX_AGE_S:
                    tmp.unlink()


def discard(path: Path, seen: os.stat_result | None = None) -> None:
    """Remove the damaged file ``path`` (where it can; with ``seen``, only while it is still the
    file that was read, not one another process has written since)."""
    with contextlib.suppress(OSError):
        if seen is not None:
            now = path.stat()
            if (now.st_dev, now.st_ino, now.st_mtime_ns, now.st_size) != (
                    seen.st_dev, seen.st_ino, seen.st_mtime_ns, seen.st_size):
                return
        path.unlink()


def warn_unkept(kind: Path, message: str) -> None:
    """Warn that a kept file (of the kind ``kind`` names: its path, or its folder) could not be
    written: once per process, not at every write of it."""
    if str(kind) in _warned:
        return
    _warned.add(str(kind))
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def one_line(exc: BaseException) -> str:
    """``exc`` as one line of a report: its type and message, newlines folded."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
