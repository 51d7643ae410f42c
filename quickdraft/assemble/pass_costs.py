"""The cost model's start-up measurements, kept per (machine, model file, kernel build, threads).

Measuring a model's 1..16-row pass costs takes a few seconds per model at every start (the
target and a draft model: ~1/3 of a cold start to the first token). They depend on the machine,
the model file, the kernel build and the thread count, not on the request, so they are measured
once and kept in ``<cache>/pass_costs.json``; the cost model still tracks them online from there.
An entry older than MAX_AGE_DAYS, or one that cannot be read, is measured again (and the CLI
says why). A measurement taken while other programs kept the CPUs busy is used for that start
only, not kept. A cache folder that cannot be written only costs the saving, with a warning.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

import torch

from quickdraft import kept, zoo
from quickdraft.hardware import LoadWatch, cpu_model
from quickdraft.loading.load import LoadedModel
from quickdraft.speculative.policy import (
    TargetCost,
    measure_attention_per_key,
    measure_pass_seconds,
)

MAX_AGE_DAYS = 30
FILE_NAME = "pass_costs.json"


def cost_key(loaded: LoadedModel, rows: tuple[int, ...], variant: str = "") -> str:
    """What the measurement depends on, as one string (``variant``: e.g. a cut output head)."""
    from quickdraft import kernels
    from quickdraft.quant.ggml import active_kernels

    path = Path(loaded.path)
    try:
        st = path.stat()
        ident = f"{path.resolve()}:{st.st_size}:{int(st.st_mtime)}"
    except OSError:
        ident = str(path)
    build = f"{kernels.build_name()}/{kernels.isa()}" if active_kernels() is not None else "reference"
    device = loaded.model.device
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()
    kv = loaded.model.kv_dtype or loaded.model.dtype
    return "|".join([where, ident, build, f"threads={torch.get_num_threads()}", str(loaded.model.dtype), f"kv={kv}",
                     f"rows={','.join(map(str, rows))}", variant])


def _valid(entry: object, rows: tuple[int, ...]) -> tuple[dict[int, float], tuple[float, float]] | None:
    if not isinstance(entry, dict) or not isinstance(entry.get("seconds"), dict):
        return None
    per_key = entry.get("per_key")  # entries from before context-length costs have none
    if (not isinstance(per_key, list) or len(per_key) != 2
            or not all(isinstance(x, int | float) and math.isfinite(x) and x >= 0 for x in per_key)):
        return None
    if time.time() - float(entry.get("measured", 0)) > MAX_AGE_DAYS * 86400:
        return None
    try:
        out = {int(r): float(s) for r, s in entry["seconds"].items()}
    except (TypeError, ValueError):
        return None
    if sorted(out) != sorted(rows) or not all(math.isfinite(s) and s > 0 for s in out.values()):
        return None
    return out, (float(per_key[0]), float(per_key[1]))


def pass_seconds(
    loaded: LoadedModel, rows: tuple[int, ...], say: Callable[[str], None], variant: str = "",
    path: Path | None = None,
) -> dict[int, float]:
    """``loaded``'s pass seconds by row count over a short context (see :func:`pass_cost_model`)."""
    return _kept_or_measured(loaded, rows, say, variant, path)[0]


def pass_cost_model(
    loaded: LoadedModel, rows: tuple[int, ...], say: Callable[[str], None], variant: str = "",
    path: Path | None = None,
) -> TargetCost:
    """``loaded``'s pass costs by row count and context length: kept from an earlier start, else
    measured now."""
    seconds, per_key = _kept_or_measured(loaded, rows, say, variant, path)
    return TargetCost(seconds, per_key)


def _kept_or_measured(
    loaded: LoadedModel, rows: tuple[int, ...], say: Callable[[str], None], variant: str, path: Path | None
) -> tuple[dict[int, float], tuple[float, float]]:
    path = path or zoo.cache_dir() / FILE_NAME
    key = cost_key(loaded, rows, variant)
    entries, problem = kept.read(path)  # (a damaged file: removed; said in one line, here or below)
    stored = _valid(entries.get(key), rows)
    if stored is not None:
        if problem:  # (other entries were damaged and dropped)
            say(problem)
        return stored
    why = problem or ("the kept one is stale or damaged" if key in entries else
                      "first run of this model with this machine, kernel build and thread count")
    say(f"measuring the pass costs of {Path(loaded.path).name} for the speculation policy ({why}) ...")
    watch = LoadWatch().start()
    seconds = measure_pass_seconds(loaded.model, rows=rows)
    per_key = measure_attention_per_key(loaded.model)
    load = watch.load()
    if load.busy:
        # Used for now (the cost model follows the passes it observes from here), never kept: a
        # busy start's costs would mislead every later start.
        say(f"pass costs of {Path(loaded.path).name} not kept: {load.describe()} while they were measured; "
            "measured again at the next start")
        return seconds, per_key
    entries[key] = {"measured": time.time(), "seconds": {str(r): s for r, s in seconds.items()},
                    "per_key": list(per_key)}
    _write(path, entries)
    return seconds, per_key


def _write(path: Path, entries: dict[str, dict]) -> None:
    kept.write(path, entries)  # (where it cannot: warned once, measured again at the next start)
