"""Kernels chosen by measurement: every candidate computes the same bits; the choice is kept per
machine and model, re-measured when stale, and QUICKDRAFT_TUNE=0 keeps the defaults."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import BLOCK_FORMATS, random_raw

from quickdraft import kernels
from quickdraft.hardware import LoadWatch
from quickdraft.kernels import tuning
from quickdraft.loading.load import load_model
from quickdraft.quant.ggml import GGMLLinear, active_kernels, ggml_linear_multi

pytestmark = pytest.mark.skipif(active_kernels() is None, reason="the native kernels are not built here")
DATA = Path(__file__).parent / "data"


@pytest.fixture()
def restore_tuning():
    mod = active_kernels()
    saved = [mod.tuning(c) for c in range(3)], kernels.isa()
    yield mod
    for c, s in enumerate(saved[0]):
        mod.set_tuning(c, *s)
    kernels.set_isa(saved[1])


@pytest.mark.parametrize("qtype", BLOCK_FORMATS, ids=lambda q: q.name)
def test_every_candidate_setting_gives_the_same_bits(qtype, restore_tuning) -> None:
    """Every (prefetch, ahead, runs, one-row tile shape, one-row chaining) the tuner may pick, for
    every class of row counts, and every instruction set this CPU runs: bitwise the defaults' output
    (N spans several panels and runs, with a partial last panel; the 1-row remainder tile of the
    65-row class takes the tile shapes too; K = 512 chains two chunks)."""
    mod = restore_tuning
    n, k = 203, 512
    lins = [GGMLLinear(qtype, torch.from_numpy(random_raw(qtype, n, k, seed=s)), k) for s in (1, 2)]
    isas = ["avx2", *(["avx512vnni"] if kernels.cpu_runs("avx512vnni") else [])]
    g = torch.Generator().manual_seed(0)
    for cls, (_, rows) in enumerate(tuning.CLASSES):
        x = torch.randn(rows + (cls == 2), k, generator=g)  # (65 rows: a second 64-row block)
        mod.set_tuning(cls, *tuning.DEFAULTS[cls])
        kernels.set_isa("avx2")
        want = ggml_linear_multi(lins, x)
        for isa in isas:
            kernels.set_isa(isa)
            tiles = {(*s[:3], t, c) for s in tuning.CANDIDATES[cls] for t in (0, 2, 4, 8) for c in (0, 1)}
            for setting in {*tiles, *[s for c in tuning.CANDIDATES for s in c]}:
                mod.set_tuning(cls, *setting)
                got = ggml_linear_multi(lins, x)
                assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), (cls, isa, setting)


def test_set_tuning_validates_and_reports(restore_tuning) -> None:
    mod = restore_tuning
    prev = mod.set_tuning(0, 2, 2, 3, 8, 1)
    assert mod.tuning(0) == (2, 2, 3, 8, 1) and mod.set_tuning(0, *prev) == (2, 2, 3, 8, 1)
    for bad in ((3, 3, 1, 2, 0, 0), (0, 4, 1, 2, 0, 0), (0, 1, 0, 2, 0, 0), (0, 1, 5, 2, 0, 0), (0, 1, 1, 17, 0, 0),
                (0, 1, 1, 2, 3, 0), (0, 1, 1, 2, 0, 2)):
        with pytest.raises(RuntimeError, match="must be"):
            mod.set_tuning(*bad)
        if bad[0] < 3:  # (the rest: the setting, named by the kernels' one check, also for kept choices)
            assert "must be" in mod.tuning_problem(*bad[1:])
    assert all(mod.tuning_problem(*s) == "" for c in (tuning.DEFAULTS, *tuning.CANDIDATES) for s in c)


@pytest.fixture()
def quiet(monkeypatch):
    """Timings without scatter (a tiny model's microsecond passes scatter), a tiny model tuned."""
    monkeypatch.setattr(tuning, "SPREAD", float("inf"))
    monkeypatch.setattr(tuning, "ROUNDS", 2)
    monkeypatch.setattr(tuning, "MIN_WEIGHT_BYTES", 0)  # (a tiny model: normally too small to tune)
    monkeypatch.delenv("QUICKDRAFT_TUNE", raising=False)


def test_choice_is_measured_kept_and_remeasured(tmp_path: Path, monkeypatch, restore_tuning, quiet) -> None:
    mod = restore_tuning
    monkeypatch.setattr(tuning, "recheck", lambda *_a: None)  # (the re-check: its own test)
    model_path = DATA / "tiny-qwen2-256-Q5_K.gguf"
    model = load_model(str(model_path), max_context=64).model
    store, said = tmp_path / "choices.json", []
    first = tuning.tune(model, model_path, said.append, store)
    assert first is not None and first.fresh and said and "choosing" in said[0]
    assert first.isa == kernels.isa() and [mod.tuning(c) for c in range(3)] == list(first.settings)
    assert "kernels: " in first.line() and "measured now" in first.line()
    # kept: a second start installs the stored choice without measuring
    entries = json.loads(store.read_text())
    (key,) = entries
    entries[key]["settings"] = [[0, 2, 3, 8, 1], [2, 2, 4, 0, 0], [3, 1, 8, 0, 0]]
    store.write_text(json.dumps(entries))
    said.clear()
    kept = tuning.tune(model, model_path, said.append, store)
    assert kept is not None and not kept.fresh and not said
    assert [mod.tuning(c) for c in range(3)] == [(0, 2, 3, 8, 1), (2, 2, 4, 0, 0), (3, 1, 8, 0, 0)]
    assert "no prefetch, 2 panel(s) ahead, 3 ranges/thread, 8-row tiles, chunks chained" in kept.line()
    assert "kept from" in kept.line()
    # an entry of an older build (3 or 4 numbers per class) or out of the kernels' ranges: measured again
    for old in ([[0, 2, 3], [2, 2, 4], [3, 1, 8]], [[0, 2, 3, 8], [2, 2, 4, 0], [3, 1, 8, 0]],
                [[0, 2, 3, 5, 0], [2, 2, 4, 0, 0], [3, 1, 8, 0, 0]], [[0, 2, 3, 8, 2], [2, 2, 4, 0, 0], [3, 1, 8, 0, 0]]):
        entries[key]["settings"] = old
        store.write_text(json.dumps(entries))
        assert tuning.tune(model, model_path, said.append, store).fresh  # type: ignore[union-attr]
        entries = json.loads(store.read_text())
    # stale or damaged: measured again
    entries[key]["measured"] = time.time() - 31 * 86400
    store.write_text(json.dumps(entries))
    assert tuning.tune(model, model_path, said.append, store).fresh  # type: ignore[union-attr]
    store.write_text("{broken")
    assert tuning.tune(model, model_path, said.append, store).fresh  # type: ignore[union-attr]
    # QUICKDRAFT_TUNE=0, or a model too small to time: nothing measured or installed
    monkeypatch.setenv("QUICKDRAFT_TUNE", "0")
    assert tuning.tune(model, model_path, said.append, tmp_path / "other.json") is None
    monkeypatch.delenv("QUICKDRAFT_TUNE")
    monkeypatch.setattr(tuning, "MIN_WEIGHT_BYTES", 32 << 20)
    assert tuning.tune(model, model_path, said.append, tmp_path / "other.json") is None
    assert not (tmp_path / "other.json").exists()


def test_better_needs_a_clear_margin() -> None:
    base = {"a": [1.0, 1.1, 1.2], "b": [0.99, 1.0, 1.3], "c": [0.9, 0.95, 1.0]}
    assert tuning._better({"a": base["a"], "b": base["b"]}, "a") == "a"  # within noise: the default
    assert tuning._better(base, "a") == "c"
    assert np.isclose(min(base["c"]), 0.9)


def test_one_row_race_covers_layers_spread_over_the_stack_weighted_to_all() -> None:
    """The race's linears: n layers evenly spaced from the first (all of them where n is larger),
    their time scaled to the whole stack; the head only where asked."""
    model = load_model(str(DATA / "tiny-qwen2-256-Q5_K.gguf"), max_context=64).model
    stack = model.get_submodule("model.layers")
    assert len(stack) >= 2

    def layer_of(m: GGMLLinear) -> int:
        return next(i for i, layer in enumerate(stack) if any(m is x for x in layer.modules()))

    first = tuning._timed(model, 1, with_head=True)
    assert first is not None and first.scale == len(stack)
    assert {layer_of(m) for g in first.layer_groups for m in g} == {0}
    assert first.head is model.lm_head  # (a q8 head: timed once, unscaled)
    every = tuning._timed(model, len(stack) + 3, with_head=False)
    assert every is not None and every.scale == 1 and every.head is None
    q8 = {id(m) for m in stack.modules() if isinstance(m, GGMLLinear) and m.activation_mode == "q8"}
    assert sorted(id(m) for g in every.layer_groups for m in g) == sorted(q8)
    timer = tuning._timer(model, 1, len(stack), with_head=True)
    assert timer is not None and timer() > 0


def _noisy_timer(monkeypatch) -> None:
    """Every race timer runs on a machine another program loads now and then: 1 round in 3 takes
    1.5-3x as long, whatever the setting (a fake clock that adds load)."""
    real = tuning._timer
    gen = np.random.default_rng(0)

    def timer(*args, **kwargs):
        run = real(*args, **kwargs)
        if run is None:
            return None
        return lambda: run() * (gen.uniform(1.5, 3.0) if gen.random() < 0.5 else 1.0)

    monkeypatch.setattr(tuning, "_timer", timer)


def _default_isa() -> str:
    """The kernels' ISA a start runs before any choice is installed: QUICKDRAFT_ISA's, else the best
    this CPU runs (so the suite passes under ``QUICKDRAFT_ISA=avx2`` too)."""
    return kernels.env_isa() or ("avx512vnni" if kernels.cpu_runs("avx512vnni") else "avx2")


def test_a_busy_machine_keeps_the_defaults_and_says_so(tmp_path: Path, monkeypatch, restore_tuning, quiet,
                                                        machine_load) -> None:
    """Others keeping the CPUs busy during the race, or timings that scatter: the defaults run,
    nothing is kept, the start-up line says why; the next quiet start measures and keeps."""
    mod = restore_tuning
    model_path = DATA / "tiny-qwen2-256-Q5_K.gguf"
    model = load_model(str(model_path), max_context=64).model
    store = tmp_path / "choices.json"
    isa_default = _default_isa()
    for cls in range(3):  # (something other than the defaults installed before)
        mod.set_tuning(cls, *tuning.CANDIDATES[cls][0])
    machine_load.others = 1.2
    busy = tuning.tune(model, model_path, lambda _m: None, store)
    assert busy is not None and busy.fresh and not busy.keep
    assert busy.settings == tuning.DEFAULTS and busy.isa == isa_default == kernels.isa()
    assert [mod.tuning(c) for c in range(3)] == list(tuning.DEFAULTS)
    assert "not kept: other programs kept 1.20 of 2 cores busy" in busy.line()
    assert not store.exists()
    machine_load.others = 0.0  # quiet again, but the timer scatters
    monkeypatch.setattr(tuning, "SPREAD", 1.25)
    monkeypatch.setattr(tuning, "ROUNDS", 7)
    _noisy_timer(monkeypatch)
    noisy = tuning.tune(model, model_path, lambda _m: None, store)
    assert noisy is not None and not noisy.keep and "timings scattered" in noisy.line()
    assert noisy.settings == tuning.DEFAULTS and not store.exists()
    monkeypatch.setattr(tuning, "SPREAD", float("inf"))
    quiet_start = tuning.tune(model, model_path, lambda _m: None, store)
    assert quiet_start is not None and quiet_start.keep and store.exists()


def test_load_watch_counts_other_processes_not_its_own() -> None:
    """This process spinning is its own time; a child process spinning beside it is another's."""
    import subprocess
    import sys

    watch = LoadWatch().start()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.4:
        pass
    alone = watch.load()
    child = subprocess.Popen([sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<1.0: pass"])
    time.sleep(0.3)  # (the child's start-up)
    watch = LoadWatch().start()
    time.sleep(0.6)
    beside = watch.load()
    child.wait()
    assert beside.others > alone.others and beside.others > 0.5, (alone, beside)


def test_a_kept_choice_worse_than_the_defaults_now_is_replaced(tmp_path: Path, monkeypatch, restore_tuning,
                                                                 quiet, machine_load) -> None:
    """At each start the kept choice runs a few rounds against the defaults; where the defaults
    are clearly faster now, the choice is measured anew and the line says it was replaced. A
    choice that holds (or a busy re-check, which cannot tell) is installed as kept."""
    mod = restore_tuning
    model_path = DATA / "tiny-qwen2-256-Q5_K.gguf"
    model = load_model(str(model_path), max_context=64).model
    store = tmp_path / "choices.json"
    isa_default = _default_isa()
    slow = ((0, 1, 1, 2, 0), tuning.DEFAULTS[1], tuning.DEFAULTS[2])
    store.write_text(json.dumps({tuning.tuning_key(model_path): {
        "measured": time.time() - 86400, "isa": isa_default, "settings": [list(s) for s in slow]}}))
    real = tuning._timer

    def timer(*args, **kwargs):  # the kept setting now runs 20% slower than the defaults
        run = real(*args, **kwargs)
        return None if run is None else lambda: 1e-3 * (1.2 if mod.tuning(0) == slow[0] else 1.0) + 0 * run()

    monkeypatch.setattr(tuning, "_timer", timer)
    monkeypatch.setattr(tuning, "measure", lambda *_a: tuning.Choice(isa_default, tuning.DEFAULTS, time.time(),
                                                                      fresh=True))
    replaced = tuning.tune(model, model_path, lambda _m: None, store)
    assert replaced is not None and replaced.fresh and replaced.settings == tuning.DEFAULTS
    assert "replaced the choice kept from" in replaced.line() and "20% slower than the defaults" in replaced.line()
    assert json.loads(store.read_text())[tuning.tuning_key(model_path)]["settings"][0] == list(tuning.DEFAULTS[0])
    # a kept choice that holds its lead is installed as kept, and so is one a busy re-check cannot judge
    good = ((0, 1, 1, 2, 0), *tuning.DEFAULTS[1:])
    monkeypatch.setattr(tuning, "_timer", lambda *a, **k: (lambda: 1e-3 * (0.8 if mod.tuning(0) == good[0] else 1.0)))
    for others in (0.0, 1.5):
        store.write_text(json.dumps({tuning.tuning_key(model_path): {
            "measured": time.time(), "isa": isa_default, "settings": [list(s) for s in good]}}))
        machine_load.others = others
        held = tuning.tune(model, model_path, lambda _m: None, store)
        assert held is not None and not held.fresh and held.settings == good and mod.tuning(0) == good[0]
