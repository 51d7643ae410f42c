"""The decode roofline: bytes one decode pass reads, against the bandwidth probed beside it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny import hf_to_gguf, make_tiny_hf_model

from quickdraft.loading.load import load_model
from quickdraft.quant.ggml import GGMLLinear, kernels_active
from quickdraft.roofline import (
    int8_dot_rate,
    int8_products,
    kv_read_bytes,
    pass_floor,
    read_bandwidth,
    roofline,
    weight_read_bytes,
)


def test_weight_and_kv_bytes_of_a_dense_model(tmp_path: Path) -> None:
    """fp32 tiny model: every parameter once, the (untied) embedding table not at all; K and V of
    every layer per context token in the cache's dtype."""
    loaded = load_model(str(make_tiny_hf_model(tmp_path, "qwen2")), dtype="float32", max_context=64)
    model, cfg = loaded.model, loaded.config
    params = sum(p.numel() * 4 for p in model.parameters())
    assert weight_read_bytes(model) == params - cfg.vocab_size * cfg.hidden_size * 4
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
    assert kv_read_bytes(model, 100) == 100 * per_token


@pytest.mark.skipif(not kernels_active(), reason="the native kernels are not built here")
def test_quantized_tied_model_reads_its_blocks_once(tmp_path: Path) -> None:
    """GGUF blocks count as stored (lanes: the same bytes); a tied table is read whole, once, as
    the output head."""
    folder = make_tiny_hf_model(tmp_path, "qwen2", tie_word_embeddings=True)
    path = hf_to_gguf(folder, tmp_path / "t.gguf", {"weight": "Q8_0"})
    model = load_model(str(path), max_context=64).model
    blocks = {id(m): m for m in model.modules() if isinstance(m, GGMLLinear)}
    raw = sum(m.raw.numel() + (0 if m.bias is None else m.bias.numel() * 4) for m in blocks.values())
    norms = sum(p.numel() * 4 for p in model.parameters())
    assert model.lm_head in blocks.values()
    assert weight_read_bytes(model) == raw + norms
    kv = kv_read_bytes(model, 10)
    assert kv == 10 * 2 * 2 * 2 * 16 * 2  # 2 layers, K and V, 2 kv heads of 16, fp16
    r = roofline(model, tokens_per_second=10.0, context=10)  # no probes given: one taken now
    assert r.achieved_gbs == pytest.approx((raw + norms + kv) * 10 / 1e9)
    assert len(r.probes) == 1 and r.bandwidth_gbs == r.probes[0]
    assert r.bandwidth_gbs is not None and r.fraction == pytest.approx(r.achieved_gbs / r.bandwidth_gbs)
    assert "% of this machine's read bandwidth measured beside it" in r.line() and "10.0 tok/s" in r.line()
    # probes taken before and after a run: their mean, both named; a missing one is left out
    r2 = roofline(model, tokens_per_second=10.0, context=10, probes=[20.0, None, 30.0])
    assert r2.probes == (20.0, 30.0) and r2.bandwidth_gbs == 25.0
    assert r2.fraction == pytest.approx(r2.achieved_gbs / 25.0)
    assert "25.0 GB/s (probes 20.0, 30.0 GB/s; " in r2.line() and r2.as_dict()["probes_gbs"] == [20.0, 30.0]


@pytest.mark.skipif(not kernels_active(), reason="the native kernels are not built here")
def test_bandwidth_probe_measures_now() -> None:
    """Each call measures (nothing kept): a positive, plausible GB/s for 1 thread and the default."""
    for threads in (1, None):
        gbs = read_bandwidth(threads)
        assert gbs is not None and 0.1 < gbs < 10_000
    assert torch.get_num_threads() >= 1


@pytest.mark.skipif(not kernels_active(), reason="the native kernels are not built here")
def test_pass_floor_is_memory_bound_at_one_row_and_compute_bound_at_many(tmp_path: Path) -> None:
    """A row's int8 products: in x out of every q8 linear, a tied head once, the table's lookups
    none. The floor of a pass: bytes over bandwidth or products over the dot rate, the larger."""
    folder = make_tiny_hf_model(tmp_path, "qwen2", tie_word_embeddings=True)
    path = hf_to_gguf(folder, tmp_path / "t.gguf", {"weight": "Q8_0"})
    loaded = load_model(str(path), max_context=64)
    model, c = loaded.model, loaded.config
    h, q, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * c.intermediate_size
    products = c.num_hidden_layers * per_layer + c.vocab_size * h
    assert int8_products(model) == products
    nbytes = weight_read_bytes(model) + kv_read_bytes(model, 10)
    assert pass_floor(model, 1, 10, 2.0, 1e15) == pytest.approx(nbytes / 2e9)  # memory-bound
    assert pass_floor(model, 8, 10, 1e6, 1e6) == pytest.approx(8 * products / 1e6)  # compute-bound
    with pytest.raises(ValueError, match="rows >= 1"):
        pass_floor(model, 0, 10, 2.0, 1e9)
    loaded_f32 = load_model(str(path), dtype="float32", max_context=64)
    assert int8_products(loaded_f32.model) == 0  # no int8 products without q8 blocks


@pytest.mark.skipif(not kernels_active(), reason="the native kernels are not built here")
def test_int8_dot_rate_measures_the_build_in_use() -> None:
    from quickdraft.quant.ggml import active_kernels

    mod = active_kernels()
    assert mod is not None
    before = mod.isa()
    try:
        for name in {"avx2", before}:
            mod.set_isa(name)
            rate = int8_dot_rate(1)
            assert rate is not None and 1e9 < rate < 1e13, (name, rate)
    finally:
        mod.set_isa(before)
    with pytest.raises(RuntimeError, match="at least 1"):
        mod.int8_dot_rate(0)
