"""Kernels chosen by measurement: every candidate computes the same bits; the choice is kept per
machine and model, re-measured when stale, and QUICKDRAFT_TUNE=0 keeps the defaults."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from test_kernels import BLOCK_FORMATS, random_raw

from quickdraft import kernels
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


def test_choice_is_measured_kept_and_remeasured(tmp_path: Path, monkeypatch, restore_tuning) -> None:
    mod = restore_tuning
    monkeypatch.setattr(tuning, "ROUNDS", 2)
    monkeypatch.setattr(tuning, "MIN_WEIGHT_BYTES", 0)  # (a tiny model: normally too small to tune)
    monkeypatch.delenv("QUICKDRAFT_TUNE", raising=False)
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
