"""Loading leaves no second copy of a GGUF resident, and the one-time work happens at load time."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
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
