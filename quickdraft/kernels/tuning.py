"""Kernels chosen by measurement, per machine and model.

The q8 GEMM has settings that change how it moves weights, never what it computes (every one gives
the same bits, so batch invariance and lossless speculation hold whichever runs; tests check it):

* the instruction set: the AVX2 build or the AVX-512 VNNI one (where the CPU runs it);
* per class of row counts (1 row: decode; 2-16 rows: verification; more: prefill):
  ``prefetch`` (0: the next panels are not prefetched, 1: into L1, 2: into L2, 3: L1 for 1-2 rows of
  small panels, else L2), ``ahead`` (how many panels ahead), ``runs`` (ranges of panels per thread) and
  ``tile1``, the register tile's shape for one input row (2, 4 or 8 weight rows at a time; 0: the
  build's default, 4): wider tiles load each activation vector once for more weight rows, narrower
  ones keep fewer accumulators live; which wins depends on the format and the CPU; and ``chain``
  (one input row of a K-quant or IQ4_XS weight: a panel's chunks run one after another with the
  partial sums in registers, 1, the default, or chunk by chunk through memory, 0; measured on Zen 4,
  plain decode of the 1.5B: Q4_K_M and Q3_K_M 1.05x, IQ4_XS 1.08x, Q5_K_M 1.17x faster chained; the
  32-block formats always go chunk by chunk: Q8_0 ran 0.76x chained).

Which is fastest depends on the CPU (cache sizes, prefetchers, memory latency) and the model's
shapes, so at the first start of a model on a machine (and after a kernel build change) :func:`tune`
times the candidates on the model's own weights (q8 activations of the real width): for one row the
linears of four layers spread over the stack (enough to stream from memory, as decode does), their
time weighted to all the layers, plus the output head, so a choice that helps the layers' format and
hurts the head's is weighed as a decode step weighs them; for more rows the first layer's linears
(plus the head for 2-16 rows). It alternates candidates round by round on a shared machine, and
keeps a setting only where it beats the default by more than its noise (min and median both at
least 3% faster). The choice is kept in ``<cache>/kernel_choices.json`` per (CPU, model file, kernel
build, threads) for 30 days and installed at every later start. ``QUICKDRAFT_ISA`` still forces
the instruction set; ``QUICKDRAFT_TUNE=0`` keeps the defaults.

A measurement is only as good as the machine was quiet: a race run while other programs keep the
CPUs busy (:class:`~quickdraft.hardware.LoadWatch`: more than BUSY_CORES of a core on average) or
whose timings scatter (the default's median over SPREAD times its best) is not kept; the defaults
run until a later, quiet start measures again. A kept choice is re-checked at every start (a few
rounds of it against the defaults, ~0.3 s for a 1.5B model) and measured anew where the defaults
now beat it. The start-up line says when a measurement was refused or a kept choice replaced.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
from torch import nn

from quickdraft.hardware import LoadWatch

if TYPE_CHECKING:
    from quickdraft.models.causal_lm import CausalLM
    from quickdraft.quant.ggml import GGMLLinear

MAX_AGE_DAYS = 30
FILE_NAME = "kernel_choices.json"
MIN_WEIGHT_BYTES = 32 << 20  # smaller models keep the defaults: their passes are too short to time apart
Setting = tuple[int, int, int, int, int]  # (prefetch, ahead, runs, tile1, chain)
CLASSES = (("1 row", 1), ("2-16 rows", 8), ("17+ rows", 64))  # (name, rows timed) per class 0, 1, 2
DEFAULTS: tuple[Setting, ...] = ((3, 1, 2, 0, 1), (3, 1, 4, 0, 0), (3, 1, 4, 0, 0))  # the kernels' own (ggml_cpu.cpp)
CANDIDATES: tuple[tuple[Setting, ...], ...] = (
    ((2, 1, 2, 0, 1), (1, 1, 2, 0, 1), (0, 1, 2, 0, 1), (3, 2, 2, 0, 1), (2, 2, 2, 0, 1), (3, 1, 4, 0, 1),
     (3, 1, 1, 0, 1)),
    ((2, 2, 4, 0, 0), (0, 1, 4, 0, 0), (3, 1, 2, 0, 0), (3, 1, 8, 0, 0)),
    ((0, 1, 4, 0, 0), (3, 1, 8, 0, 0)),
)
# Raced second, on top of a class's chosen (prefetch, ahead, runs): the one-row (tile1, chain) shapes.
SHAPE_CANDIDATES: tuple[tuple[tuple[int, int], ...], ...] = (((2, 1), (8, 1), (0, 0), (2, 0), (8, 0)), (), ())
SAMPLED_LAYERS = 4  # the one-row race's layers (evenly spaced; the 1.5B's 4: 0.11 GB, beyond an L3)
ROUNDS = 7  # per class; each candidate timed once per round, in rotated order
MARGIN = 0.97  # a candidate must be at least 3% faster (min and median) to replace the default
SPREAD = 1.25  # a race where the default's median time exceeds its best by this was too noisy to keep
RECHECK_ROUNDS = 6  # rounds of a kept choice against the defaults at each start (alternating)
_PREFETCH = {0: "no prefetch", 1: "prefetch into L1", 2: "prefetch into L2", 3: "prefetch L1/L2"}


@dataclass(frozen=True)
class Choice:
    """The kernels this process runs: the q8 GEMM's instruction set and a setting per class."""

    isa: str
    settings: tuple[Setting, ...]
    measured: float  # unix time of the measurement
    fresh: bool = False  # measured by this start (else kept from an earlier one)
    note: str = ""  # a measurement refused or a kept choice replaced, and why (the start-up line says it)
    keep: bool = True  # fit to keep (False: measured on a busy machine, so the defaults run for now)

    def line(self) -> str:
        parts = []
        for cls, ((name, _), setting, default) in enumerate(zip(CLASSES, self.settings, DEFAULTS, strict=True)):
            if setting == default:
                parts.append(f"{name}: default")
            else:
                prefetch, ahead, runs, tile1, chain = setting
                tile = f", {tile1}-row tiles" if tile1 else ""
                chained = "" if cls != 0 else ", chunks chained" if chain else ", chunk by chunk"  # (1 row only)
                parts.append(f"{name}: {_PREFETCH[prefetch]}, {ahead} panel(s) ahead, {runs} ranges/thread{tile}{chained}")
        when = "measured now" if self.fresh else f"kept from {time.strftime('%Y-%m-%d', time.localtime(self.measured))}"
        note = f"; {self.note}" if self.note else ""
        return f"kernels: {self.isa} q8 GEMM; {'; '.join(parts)} ({when}{note}; QUICKDRAFT_TUNE=0 keeps the defaults)"



def apply(mod: Any, choice: Choice) -> None:
    mod.set_isa(choice.isa)
    for cls, setting in enumerate(choice.settings):
        mod.set_tuning(cls, *setting)


def _q8(m: object) -> TypeGuard[GGMLLinear]:
    from quickdraft.quant.ggml import GGMLLinear

    return isinstance(m, GGMLLinear) and m.activation_mode == "q8"


@dataclass(frozen=True)
class _Timed:
    """What a race times: the q8 linears of some layers, grouped as the native stack calls them,
    standing for ``scale`` times as many (all the layers), and the output head (None: not timed)."""

    layer_groups: list[list[GGMLLinear]]
    scale: float
    head: GGMLLinear | None


def _timed(model: CausalLM, layers: int, with_head: bool) -> _Timed | None:
    """``layers`` layers evenly spaced over the model's stack (the first among them) and the head;
    None where the model is not a decoder stack of the usual shape or none of it runs the q8 GEMM."""
    try:
        stack = model.get_submodule("model.layers")
    except AttributeError:  # not a decoder stack of the usual shape: nothing to time
        return None
    if not isinstance(stack, nn.ModuleList) or len(stack) == 0:
        return None
    picks = sorted({i * len(stack) // min(layers, len(stack)) for i in range(min(layers, len(stack)))})
    groups: list[list[GGMLLinear]] = []
    for layer in (stack[i] for i in picks):
        seen: set[int] = set()
        for names in (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",)):
            found = [getattr(getattr(layer, sub, None), n, None) for sub in ("self_attn", "mlp") for n in names]
            mods = [m for m in found if _q8(m)]
            if mods and len({m.in_features for m in mods}) == 1:
                groups.append(mods)
                seen |= {id(m) for m in mods}
        groups += [[m] for m in layer.modules() if _q8(m) and id(m) not in seen]
    timed_head = model.lm_head if with_head and _q8(model.lm_head) else None
    if not groups and timed_head is None:
        return None
    return _Timed(groups, len(stack) / len(picks), timed_head)


def _timer(model: CausalLM, rows: int, layers: int, with_head: bool) -> Callable[[], float] | None:
    """A function timing one round of the model's linears at ``rows`` rows: the sampled layers'
    seconds times their scale (the whole stack's share of a pass) plus the head's."""
    from quickdraft.quant.ggml import ggml_linear_multi

    timed = _timed(model, layers, with_head)
    if timed is None:
        return None
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(rows, g[0].in_features, generator=gen) for g in timed.layer_groups]
    head_input = None if timed.head is None else torch.randn(rows, timed.head.in_features, generator=gen)

    def run() -> float:
        t0 = time.perf_counter()
        for g, x in zip(timed.layer_groups, inputs, strict=True):
            ggml_linear_multi(g, x)
        t1 = time.perf_counter()
        if timed.head is not None and head_input is not None:
            ggml_linear_multi([timed.head], head_input)
        return (t1 - t0) * timed.scale + time.perf_counter() - t1

    run()  # repacks into lanes on the first call
    return run


def _race(mod: Any, cls: int, timer: Callable[[], float], settings: list[Setting]) -> dict[Setting, list[float]]:
    """Each setting timed once per round, rounds rotating the order; seconds per setting."""
    times: dict[Setting, list[float]] = {s: [] for s in settings}
    for r in range(ROUNDS):
        for i in range(len(settings)):
            s = settings[(i + r) % len(settings)]
            mod.set_tuning(cls, *s)
            times[s].append(timer())
    return times


def _better(times: dict[Any, list[float]], default: Any) -> Any:
    """The fastest entry where it beats ``default`` clearly (min and median by MARGIN), else default."""
    def key(s: Any) -> tuple[float, float]:
        return min(times[s]), statistics.median(times[s])

    best = min(times, key=lambda s: key(s)[0])
    b, d = key(best), key(default)
    return best if b[0] <= MARGIN * d[0] and b[1] <= MARGIN * d[1] else default


def _timers(model: CausalLM) -> list[Callable[[], float] | None]:
    """Each class's timer (None where the class runs no q8 linear)."""
    return [_timer(model, rows, SAMPLED_LAYERS if cls == 0 else 1, with_head=cls < 2)
            for cls, (_, rows) in enumerate(CLASSES)]


def _spread(times: dict[Any, list[float]], setting: Any) -> float:
    """How far ``setting``'s median time lies above its best (1.0: no scatter)."""
    return statistics.median(times[setting]) / min(times[setting])


def measure(model: CausalLM, isas: list[str], say: Callable[[str], None]) -> Choice:
    """Time the candidates on ``model``'s weights and return the fastest clear choice; where the
    machine was busy or the timings scattered, the defaults (``isas[0]``) with ``keep`` False."""
    from quickdraft.quant.ggml import active_kernels

    mod = active_kernels()
    assert mod is not None
    say("choosing this machine's kernels for the model (none kept for this model, machine and kernel build) ...")
    watch = LoadWatch().start()
    timers = _timers(model)
    for cls, default in enumerate(DEFAULTS):
        mod.set_tuning(cls, *default)
    isa = isas[0]
    spread = 1.0
    if len(isas) > 1 and timers[0] is not None:  # decode and verification decide the build
        totals: dict[str, list[float]] = {i: [] for i in isas}
        for r in range(ROUNDS):
            for i in (isas if r % 2 == 0 else isas[::-1]):
                mod.set_isa(i)
                totals[i].append(sum(t() for t in timers[:2] if t is not None))
        isa = _better(totals, isas[0])
        spread = _spread(totals, isas[0])
    mod.set_isa(isa)
    settings = []
    for cls, (default, candidates) in enumerate(zip(DEFAULTS, CANDIDATES, strict=True)):
        timer = timers[cls]
        if timer is None:
            settings.append(default)
            continue
        times = _race(mod, cls, timer, [default, *candidates])
        spread = max(spread, _spread(times, default))
        chosen = _better(times, default)
        if SHAPE_CANDIDATES[cls]:  # the tile shapes, on top of the chosen data movement
            shapes = [chosen, *((*chosen[:3], tile1, chain) for tile1, chain in SHAPE_CANDIDATES[cls])]
            chosen = _better(_race(mod, cls, timer, shapes), chosen)
        mod.set_tuning(cls, *chosen)
        settings.append(chosen)
    load = watch.load()
    if load.busy or spread > SPREAD:
        why = load.describe() if load.busy else f"timings scattered {spread - 1:.0%} above their best"
        defaults = Choice(isas[0], DEFAULTS, time.time(), fresh=True, keep=False,
                          note=f"not kept: {why}; the defaults run until a quiet start measures again")
        apply(mod, defaults)
        return defaults
    return Choice(isa, tuple(settings), time.time(), fresh=True)


def recheck(model: CausalLM, choice: Choice, default_isa: str) -> str | None:
    """Time the kept ``choice`` against the defaults, alternating, on decode and verification
    passes: why it must be measured anew (the defaults now clearly faster), or None (it holds, or
    the machine was too busy to tell). Leaves ``choice`` installed."""
    from quickdraft.quant.ggml import active_kernels

    mod = active_kernels()
    assert mod is not None
    defaults = Choice(default_isa, DEFAULTS, 0.0)
    if choice.isa == defaults.isa and choice.settings[:2] == DEFAULTS[:2]:
        return None
    timers = [t for t in _timers(model)[:2] if t is not None]
    watch = LoadWatch().start()
    times: dict[int, list[float]] = {0: [], 1: []}
    for r in range(RECHECK_ROUNDS):
        for i in ((0, 1) if r % 2 == 0 else (1, 0)):
            apply(mod, (choice, defaults)[i])
            times[i].append(sum(t() for t in timers))
    apply(mod, choice)
    if watch.load().busy or _spread(times, 0) > SPREAD or _better(times, 0) == 0:
        return None
    slower = statistics.median(times[0]) / statistics.median(times[1]) - 1
    return f"the kept choice ran {slower:.0%} slower than the defaults now"


def tuning_key(path: Path) -> str:
    """What a choice depends on: the CPU, the model file, the kernel build and the thread count."""
    from quickdraft import kernels
    from quickdraft.hardware import cpu_model

    try:
        st = path.stat()
        ident = f"{path.resolve()}:{st.st_size}:{int(st.st_mtime)}"
    except OSError:
        ident = str(path)
    return "|".join([cpu_model(), ident, kernels.build_name(), f"threads={torch.get_num_threads()}",
                     f"isa={os.environ.get('QUICKDRAFT_ISA', '').strip().lower() or 'auto'}"])


def _kept(entry: object, isas: list[str], mod: Any) -> Choice | None:
    """The kept choice in ``entry`` where it is whole, fresh, for an instruction set this process
    may run and made of settings the kernels ``mod`` take; else None (measure again)."""
    try:
        assert isinstance(entry, dict)
        measured = float(entry["measured"])
        settings = tuple(tuple(int(v) for v in s) for s in entry["settings"])
        isa = str(entry["isa"])
    except (AssertionError, KeyError, TypeError, ValueError):
        return None
    if (time.time() - measured > MAX_AGE_DAYS * 86400 or isa not in isas or len(settings) != len(DEFAULTS)
            or not all(len(s) == 5 and not mod.tuning_problem(*s) for s in settings) or not math.isfinite(measured)):
        return None
    return Choice(isa, settings, measured)  # type: ignore[arg-type]


def tune(model: CausalLM, model_path: Path, say: Callable[[str], None], path: Path | None = None) -> Choice | None:
    """Install this machine's kernel choice for ``model`` (kept and re-checked, or measured now and
    kept where the machine was quiet); None where the q8 kernels do not run the model or
    QUICKDRAFT_TUNE=0 says to keep the defaults."""
    from quickdraft import kept, kernels, zoo
    from quickdraft.quant.ggml import active_kernels
    from quickdraft.roofline import weight_read_bytes

    mod = active_kernels()
    if (mod is None or os.environ.get("QUICKDRAFT_TUNE", "").strip() in ("0", "off", "no")
            or _timed(model, 1, with_head=True) is None or weight_read_bytes(model) < MIN_WEIGHT_BYTES):
        return None
    forced = kernels.env_isa()
    # the kernels' own default (the best this CPU runs) first: it is what runs untuned
    isas = [forced] if forced else [*(["avx512vnni"] if kernels.cpu_runs("avx512vnni") else []), "avx2"]
    path = path or zoo.cache_dir() / FILE_NAME
    key = tuning_key(model_path)
    entries, problem = kept.read(path)  # (a damaged file: removed, said here in one line)
    if problem:
        say(problem)
    choice = _kept(entries.get(key), isas, mod)
    unfit = choice is None and key in entries  # (dropped from the file below, even if not replaced)
    if unfit:
        say(f"the kernel choice kept in {path} for this model is stale or damaged; measuring it again")
    replaced = ""
    if choice is not None:
        apply(mod, choice)
        why = recheck(model, choice, isas[0])
        if why is None:
            return choice
        replaced = f"replaced the choice kept from {time.strftime('%Y-%m-%d', time.localtime(choice.measured))}: {why}"
    choice = measure(model, isas, say)
    if choice.keep:
        entries[key] = {"measured": choice.measured, "isa": choice.isa, "settings": [list(s) for s in choice.settings]}
    else:
        entries.pop(key, None)
    if choice.keep or replaced or unfit:
        kept.write(path, entries)  # (where it cannot: warned once, measured again at the next start)
    if replaced:
        choice = dataclasses.replace(choice, note="; ".join(filter(None, (replaced, choice.note))))
    apply(mod, choice)
    return choice
