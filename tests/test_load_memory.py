"""Loading leaves no second copy of a GGUF resident, and the one-time work happens at load time."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import mapping_of
from tiny import hf_to_gguf, make_tiny_hf_model

from quickdraft.api import LLM
from quickdraft.loading.gguf_file import release_pages
from quickdraft.quant.ggml import GGMLLinear, kernels_active
from quickdraft.sampling import SamplingParams


def mapped_rss_kb(path: Path) -> int:
    """Resident kB of this process's mappings of ``path`` (/proc/self/smaps)."""
    total, current = 0, ""
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and not line.startswith(("Rss", "Size")):
                current = head[5] if len(head) > 5 else ""
            elif line.startswith("Rss:") and current == str(path):
                total += int(head[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc")
def test_release_pages_drops_a_copied_slice_from_the_resident_set(tmp_path: Path) -> None:
    path = tmp_path / "blob.bin"
    data = np.random.default_rng(0).integers(0, 256, 8 << 20, dtype=np.uint8)
    data.tofile(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    view = mm[4096 : (6 << 20) + 123]  # a slice, not page aligned at its end
    copy = np.array(view)  # faults the pages in
    before = mapped_rss_kb(path)
    assert before >= 6 * 1024 - 8
    release_pages(view)
    after = mapped_rss_kb(path)
    assert after <= before - 6 * 1024 + 8
    assert np.array_equal(np.asarray(view), copy)  # still readable: the pages map back in
    assert np.array_equal(copy, data[4096 : (6 << 20) + 123])
    release_pages(np.zeros(10, dtype=np.uint8))  # not a memory map: nothing happens
    release_pages(mm[:0])
    del mm


def test_llm_warms_up_at_load(tmp_path: Path) -> None:
    """LLM() runs one token at load: quantized weights are already in the kernels' layout, the
    engine's cache is untouched, and the first answer equals a fresh engine's."""
    if not kernels_active():
        pytest.skip("the native kernels are not built on this machine")
    folder = make_tiny_hf_model(tmp_path, "qwen2", seed=5)
    gguf = hf_to_gguf(folder, tmp_path / "m.gguf", {"attn_q.weight": "Q4_0", "ffn_up.weight": "Q8_0"})
    llm = LLM(str(gguf), draft="none", max_context=128, threads=1)
    layers = [m for m in llm.target.model.modules() if isinstance(m, GGMLLinear)]
    assert layers and all(m._lanes for m in layers)  # repacked at load
    assert llm.engine.cache.length == 0
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    got = llm.generate(["def f(x):"], params)[0].token_ids
    from quickdraft.engine import Engine

    fresh = Engine(llm.target.model, llm.tokenizer)
    want = [t for s in fresh.generate(llm.encode("def f(x):"), params) for t in s.token_ids]
    assert got == want and len(got) == 12


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc")
def test_a_table_is_copied_out_of_the_map_slab_by_slab(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A block table leaves the memory map a slab of rows at a time, each slab's pages released as
    soon as it is copied (a 262k-row embedding table is never resident twice): the copy is the
    bytes, the slabs cover the rows in order, none larger than COPY_SLAB_BYTES."""
    from quickdraft.loading import gguf as gguf_io

    path = tmp_path / "table.bin"
    rows, row_bytes = 3001, 1088  # Q8_0 x 1024
    data = np.random.default_rng(1).integers(0, 256, rows * row_bytes, dtype=np.uint8)
    data.tofile(path)
    view = np.memmap(path, dtype=np.uint8, mode="r").reshape(rows, row_bytes)
    monkeypatch.setattr(gguf_io, "COPY_SLAB_BYTES", 256 << 10)
    released: list[tuple[int, int]] = []

    def record(part: np.ndarray) -> None:
        released.append((part.ctypes.data - view.ctypes.data, part.nbytes))
        release_pages(part)

    monkeypatch.setattr(gguf_io, "release_pages", record)
    copy = gguf_io.copy_out(view)
    assert np.array_equal(copy, data.reshape(rows, row_bytes)) and not isinstance(copy, np.memmap)
    assert [o for o, _ in released] == [sum(n for _, n in released[:i]) for i in range(len(released))]
    assert sum(n for _, n in released) == rows * row_bytes and max(n for _, n in released) <= 256 << 10
    assert len(released) == -(-rows // ((256 << 10) // row_bytes))
    # copying a slab maps back up to the kernel's fault-around window (64 KiB) of the slab before it
    assert mapped_rss_kb(path) <= 64 * len(released) < rows * row_bytes // 1024 // 3


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc")
def test_weight_buffers_are_advised_as_huge_pages() -> None:
    """A weight buffer of 4 MiB or more starts on a huge-page boundary in a private mapping advised as
    transparent huge pages ("hg"; shared anonymous memory would be shmem, which THP leaves alone) before
    anything touched it, takes writes, and outlives the array that made it through the tensors viewing
    it; a smaller one is a plain array."""
    from quickdraft.pages import HUGE_PAGE, weight_buffer

    big = weight_buffer((3, 4 << 20))
    assert big.shape == (3, 4 << 20) and big.dtype == np.uint8 and big.flags.writeable
    flags = mapping_of(big.ctypes.data)[1]
    assert big.ctypes.data % HUGE_PAGE == 0 and "hg" in flags and "sh" not in flags  # private: a fork copies
    t = torch.from_numpy(big)
    del big
    t[1, 5] = 7
    assert int(t[1, 5]) == 7 and "hg" in mapping_of(t.data_ptr() + t.numel() - 1)[1]
    small = weight_buffer((16, 1024))
    assert small.shape == (16, 1024) and small.dtype == np.uint8 and small.flags.writeable
