"""Prepared weights (quickdraft/loading/prepared.py): a later start maps what the first one built,
and computes bitwise what a load from the GGUF computes; damaged, stale or unwritable caches are
rebuilt or warned about, never trusted."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
from helpers import mapping_of
from tiny import hf_to_gguf, make_tiny_hf_model

from quickdraft.loading import gguf as gguf_io
from quickdraft.loading import prepared
from quickdraft.loading.load import load_model
from quickdraft.quant.ggml import GGMLLinear, kernels_active

pytestmark = pytest.mark.skipif(not kernels_active(), reason="prepared weights are for the native kernels")

PROMPT = "def add(a, b):\n    return a + b  # éè 汉字 🙂"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache folder, and every GGUF worth preparing."""
    monkeypatch.setenv("QUICKDRAFT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("QUICKDRAFT_PREPARED", raising=False)
    monkeypatch.setattr(prepared, "MIN_BYTES", 0)
    return tmp_path / "cache"


@pytest.fixture
def gguf(tmp_path: Path) -> Path:
    folder = make_tiny_hf_model(tmp_path, "qwen2", seed=3, tie_word_embeddings=True)
    return hf_to_gguf(folder, tmp_path / "m.gguf", {"attn_q.weight": "Q4_0", "ffn_up.weight": "Q8_0",
                                                     "ffn_down.weight": "Q5_0", "token_embd.weight": "Q8_0"})


def folders(cache: Path) -> list[Path]:
    root = cache / "prepared"
    return sorted(p for p in root.iterdir()) if root.is_dir() else []


def logits(loaded, ids: list[int]) -> torch.Tensor:  # noqa: ANN001
    model = loaded.model
    with torch.no_grad():
        out, _ = model(torch.tensor(ids), model.make_cache(64))
    return out


def same_load(a, b) -> None:  # noqa: ANN001
    """Two loads of one file: equal config, tokenizer and logits (bitwise)."""
    assert a.config == b.config
    ids = a.tokenizer.encode(PROMPT)
    assert b.tokenizer.encode(PROMPT) == ids and b.tokenizer.decode(ids) == a.tokenizer.decode(ids)
    assert b.tokenizer.fingerprint() == a.tokenizer.fingerprint()
    assert (b.tokenizer.eos_ids, b.tokenizer.bos_id, b.tokenizer.chat_template) == (
        a.tokenizer.eos_ids, a.tokenizer.bos_id, a.tokenizer.chat_template)
    msgs = [{"role": "user", "content": "hi"}]
    if a.tokenizer.chat_template:
        assert b.tokenizer.encode_chat(msgs) == a.tokenizer.encode_chat(msgs)
    assert torch.equal(logits(a, ids[:20]), logits(b, ids[:20]))


def test_second_load_maps_the_prepared_weights_and_computes_the_same(
    cache: Path, gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = load_model(str(gguf))
    [where] = folders(cache)
    assert {p.name for p in where.iterdir()} == {"index.json", "tokenizer.json", "weights.bin"}

    def no_gguf(*args: object) -> None:
        raise AssertionError("the GGUF was read again")

    monkeypatch.setattr(gguf_io, "open_gguf", no_gguf)
    second = load_model(str(gguf))
    layers = [m for m in second.model.modules() if isinstance(m, GGMLLinear)]
    assert all(m._lanes for m in layers)  # kept in the kernels' layout: no repack at start
    same_load(first, second)
    assert folders(cache) == [where]


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc")
def test_prepared_matrices_are_copied_into_huge_pages(cache: Path, smollm2_gguf: Path) -> None:
    """A prepared load copies each block matrix out of the map (the file's pages are not what a decode
    step streams) into private memory, advised as huge pages from 4 MiB on."""
    from quickdraft.pages import MIN_HUGE_BYTES

    load_model(str(smollm2_gguf))
    loaded = load_model(str(smollm2_gguf))  # (from the prepared folder)
    weights = str(folders(cache)[0] / "weights.bin")
    layers = [m for m in loaded.model.modules() if isinstance(m, GGMLLinear)]
    big = [m for m in layers if m.raw.numel() >= MIN_HUGE_BYTES]
    assert big and len(big) < len(layers)
    for m in layers:
        path, flags = mapping_of(m.raw.data_ptr())
        assert path != weights and "sh" not in flags
        if m.raw.numel() >= MIN_HUGE_BYTES:  # (a small one may land in memory numpy advised before)
            assert "hg" in flags, (m.raw.shape, flags)


def test_real_model_prepared_equals_gguf(cache: Path, smollm2_gguf: Path) -> None:
    first = load_model(str(smollm2_gguf))
    assert len(folders(cache)) == 1
    second = load_model(str(smollm2_gguf))
    same_load(first, second)


def test_damaged_prepared_folder_is_rebuilt(cache: Path, gguf: Path, capfd: pytest.CaptureFixture[str]) -> None:
    want = load_model(str(gguf))
    [where] = folders(cache)
    with open(where / "weights.bin", "r+b") as f:
        f.truncate(100)
    got = load_model(str(gguf))
    err = capfd.readouterr().err
    assert "unusable" in err and "weights.bin has 100 bytes" in err and "rebuilding" in err
    same_load(want, got)
    (where / "index.json").write_text("{not json")
    got = load_model(str(gguf))
    assert "unusable" in capfd.readouterr().err
    same_load(want, got)
    assert load_model(str(gguf)) is not None and folders(cache) == [where]  # rebuilt, usable again
    assert "unusable" not in capfd.readouterr().err


def test_replaced_gguf_gets_a_new_prepared_copy(cache: Path, gguf: Path, tmp_path: Path) -> None:
    load_model(str(gguf))
    [old] = folders(cache)
    other = make_tiny_hf_model(tmp_path / "b", "qwen2", seed=4, tie_word_embeddings=True)
    hf_to_gguf(other, gguf, {"attn_q.weight": "Q4_0"})
    st = gguf.stat()
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    fresh = load_model(str(gguf))
    [new] = folders(cache)
    assert new != old  # the stale copy is gone, not read
    same_load(fresh, load_model(str(gguf)))


def test_unwritable_cache_warns_and_loads(tmp_path: Path, gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("QUICKDRAFT_CACHE", str(blocker))  # mkdir under a file fails
    monkeypatch.setattr(prepared, "MIN_BYTES", 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_model(str(gguf))
    assert any("could not keep prepared weights" in str(w.message) for w in caught)
    assert loaded.model is not None


def test_off_switch_and_small_files(cache: Path, gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUICKDRAFT_PREPARED", "0")
    load_model(str(gguf))
    assert folders(cache) == []
    monkeypatch.delenv("QUICKDRAFT_PREPARED")
    monkeypatch.setattr(prepared, "MIN_BYTES", gguf.stat().st_size + 1)
    load_model(str(gguf))
    assert folders(cache) == []


def test_least_recently_used_copies_go_first(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prepared, "MAX_ENTRIES", 2)
    folder = make_tiny_hf_model(tmp_path, "qwen2", seed=3)
    files = [hf_to_gguf(folder, tmp_path / f"m{i}.gguf", {"attn_q.weight": "Q4_0"}) for i in range(3)]
    load_model(str(files[0]))
    load_model(str(files[1]))
    for p, used in zip(folders(cache), (2000, 1000), strict=True):  # m0 used last, m1 before it
        os.utime(p / "index.json", (used, used))
    load_model(str(files[2]))
    assert sorted(p.name.split("-")[0] for p in folders(cache)) == ["m0", "m2"]
