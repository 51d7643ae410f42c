"""Quantized GGML linear layers: reference dequantization, native kernels, batch invariance.

The pure-PyTorch dequantization must match ``gguf.quants.dequantize`` bit for bit (random blocks
and real tensors of the shipped models). The native kernels must match ``x @ dequant.T`` within
fp32 accumulation error, and give a row bitwise the same result whatever rows come with it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize as gguf_dequantize

from quickdraft import kernels
from quickdraft.quant import (
    SUPPORTED_TYPES,
    GGMLLinear,
    dequantize_reference,
    kernels_active,
    kernels_available,
    reference_mode,
    set_reference_mode,
)

Q = GGMLQuantizationType
FORMATS = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q6_K]
# Byte offsets of the fp16 fields (scales, mins) inside each block.
FP16_FIELDS = {Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q8_0: [0], Q.Q4_K: [0, 2], Q.Q6_K: [208]}
ROWS = [1, 2, 3, 4, 7, 8, 9, 16, 31, 32, 33, 100]


def random_raw(
    qtype: GGMLQuantizationType, n: int, k: int, seed: int = 0, scale: float = 0.02
) -> np.ndarray:
    """Random valid blocks: random bytes, with finite fp16 values in the scale fields."""
    rng = np.random.default_rng(seed)
    bs, ts = GGML_QUANT_SIZES[qtype]
    nb = n * (k // bs)
    raw = rng.integers(0, 256, size=(nb, ts), dtype=np.uint8)
    for off in FP16_FIELDS[qtype]:
        vals = np.clip(rng.standard_normal(nb) * scale, -65000, 65000).astype(np.float16)  # finite
        raw[:, off : off + 2] = vals.view(np.uint8).reshape(nb, 2)
    return raw.reshape(n, k // bs * ts)


def bits(a: np.ndarray | torch.Tensor) -> np.ndarray:
    arr = a.numpy() if isinstance(a, torch.Tensor) else a
    return np.ascontiguousarray(arr, dtype=np.float32).view(np.uint32)


def ref_linear(x: torch.Tensor, w: np.ndarray, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (+ bias) in fp64: the exact answer the fp32 kernels are compared with."""
    y = x.double() @ torch.from_numpy(w).double().T
    return y if bias is None else y + bias.double()


def assert_close_fp32(y: torch.Tensor, exact: torch.Tensor, x: torch.Tensor, w: np.ndarray) -> None:
    """Within fp32 accumulation error: |err| <= 2 K u sum_k |x_k w_k| (u = 2^-24; + tiny absolute)."""
    k = x.shape[-1]
    mag = x.double().abs() @ torch.from_numpy(np.abs(w)).double().T
    tol = 2 * k * 2**-24 * mag + 1e-30
    err = (y.double() - exact).abs()
    assert y.dtype == torch.float32
    assert torch.all(err <= tol), (
        f"max err {err.max().item():.3g}, max err/tol {(err / tol).max().item():.3g}"
    )


@pytest.fixture(autouse=True)
def _follow_env():
    """Every test starts and ends with the default path selection."""
    set_reference_mode(None)
    yield
    set_reference_mode(None)


requires_kernels = pytest.mark.skipif(
    not kernels_available(), reason=f"native kernels cannot be built here: {kernels.load_error()}"
)


# ------------------------------------------------------------------------------------------------
# Reference dequantization: bit-exact to gguf
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_reference_dequant_bit_exact_random(qtype):
    bs, _ = GGML_QUANT_SIZES[qtype]
    # scales: typical, large, near the fp16 maximum, and fp16 subnormals
    for seed, scale in [(0, 0.02), (1, 1.0), (2, 60000.0), (3, 1e-7)]:
        raw = random_raw(qtype, 37, 4 * max(bs, 256), seed=seed, scale=scale)
        expected = gguf_dequantize(raw, qtype)
        got = dequantize_reference(
            qtype, torch.from_numpy(raw), raw.shape[1] // GGML_QUANT_SIZES[qtype][1] * bs
        )
        assert got.dtype == torch.float32 and got.shape == expected.shape
        assert np.array_equal(bits(got), bits(expected)), f"{qtype.name} seed {seed}"


@requires_kernels
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_kernel_dequant_bit_exact_random(qtype):
    bs, ts = GGML_QUANT_SIZES[qtype]
    for seed, scale in [(0, 0.02), (2, 60000.0), (3, 1e-7)]:
        raw = random_raw(qtype, 21, 3 * max(bs, 256), seed=seed, scale=scale)
        lin = GGMLLinear(qtype, torch.from_numpy(raw), raw.shape[1] // ts * bs)
        assert np.array_equal(bits(lin.dequantize()), bits(gguf_dequantize(raw, qtype)))


def _real_tensors(path: Path, want: dict[GGMLQuantizationType, int]) -> list:
    """Up to want[type] tensors of each wanted type (2-D, smallest first, at most 4096 rows)."""
    reader = GGUFReader(path)
    found: dict[GGMLQuantizationType, list] = {}
    for t in sorted(reader.tensors, key=lambda t: t.n_bytes):
        if (
            t.tensor_type in want
            and len(t.data.shape) == 2
            and len(found.get(t.tensor_type, [])) < want[t.tensor_type]
        ):
            found.setdefault(t.tensor_type, []).append(t)
    missing = [q.name for q in want if q not in found]
    assert not missing, f"{path.name} has no {missing} tensors"
    return [t for ts in found.values() for t in ts]


def _check_real(tensors) -> None:
    for t in tensors:
        raw = np.array(t.data[:4096])  # off the memmap; big vocab tensors: their first rows
        k = int(t.shape[0])
        expected = gguf_dequantize(raw, t.tensor_type)
        got = dequantize_reference(t.tensor_type, torch.from_numpy(raw), k)
        assert np.array_equal(bits(got), bits(expected)), t.name
        if kernels_available():
            lin = GGMLLinear(t.tensor_type, torch.from_numpy(raw), k)
            assert np.array_equal(bits(lin.dequantize()), bits(expected)), t.name
            x = torch.randn(5, k, generator=torch.Generator().manual_seed(0))
            assert_close_fp32(lin(x), ref_linear(x, expected), x, expected)


@pytest.mark.slow
def test_real_tensors_smollm2(smollm2_gguf):
    _check_real(_real_tensors(smollm2_gguf, {Q.Q4_1: 2, Q.Q8_0: 1}))


@pytest.mark.slow
def test_real_tensors_qwen05(qwen05_gguf):
    _check_real(_real_tensors(qwen05_gguf, {Q.Q5_0: 2, Q.Q4_K: 2, Q.Q6_K: 2, Q.Q8_0: 2}))


# ------------------------------------------------------------------------------------------------
# Kernels: accuracy, batch invariance, bias, embedding
# ------------------------------------------------------------------------------------------------


@requires_kernels
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_kernel_matches_reference_all_row_counts(qtype):
    bs, ts = GGML_QUANT_SIZES[qtype]
    # odd N; for 32-blocks a K that is not a multiple of the kernels' 256-element chunk
    n, k = 61, 2 * max(bs, 256) + (bs if bs == 32 else 0)
    raw = random_raw(qtype, n, k, seed=5)
    w = gguf_dequantize(raw, qtype)
    lin = GGMLLinear(qtype, torch.from_numpy(raw), k)
    g = torch.Generator().manual_seed(1)
    for t in ROWS:
        x = torch.randn(t, k, generator=g)
        y = lin(x)
        assert y.shape == (t, n)
        assert_close_fp32(y, ref_linear(x, w), x, w)


@requires_kernels
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_batch_invariance(qtype):
    """Row i of a T-row call is bitwise the row computed alone, whatever the other rows are."""
    bs, _ = GGML_QUANT_SIZES[qtype]
    n, k = 45, 2 * max(bs, 256)
    lin = GGMLLinear(qtype, torch.from_numpy(random_raw(qtype, n, k, seed=7)), k)
    g = torch.Generator().manual_seed(2)
    probe = torch.randn(3, k, generator=g)
    alone = [lin(probe[i : i + 1]) for i in range(3)]
    for t in [1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 17, 31, 32, 33, 63, 64]:
        x = torch.randn(t, k, generator=g) * 3
        for i in range(3):
            pos = (i * 7 + t) % t
            x[pos] = probe[i]
            y = lin(x)
            assert torch.equal(y[pos : pos + 1], alone[i]), f"T={t} row {pos}"


@requires_kernels
def test_long_prefill_matches_and_is_batch_invariant():
    """A prefill long enough to take the kernels' per-call (not kept) x buffer."""
    qtype, n, k = Q.Q8_0, 24, 4096
    raw = random_raw(qtype, n, k, seed=13)
    w = gguf_dequantize(raw, qtype)
    lin = GGMLLinear(qtype, torch.from_numpy(raw), k)
    x = torch.randn(1100, k, generator=torch.Generator().manual_seed(4))
    y = lin(x)
    assert_close_fp32(y, ref_linear(x, w), x, w)
    for i in (0, 555, 1099):
        assert torch.equal(y[i : i + 1], lin(x[i : i + 1]))


@requires_kernels
def test_batch_invariance_across_threads():
    """The thread count changes which thread computes a row, never its bits."""
    qtype, n, k = Q.Q4_K, 203, 512
    lin = GGMLLinear(qtype, torch.from_numpy(random_raw(qtype, n, k, seed=8)), k)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(3))
    threads = torch.get_num_threads()
    try:
        outs = []
        for nt in (1, 2, 3):
            torch.set_num_threads(nt)
            outs.append(lin(x))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@requires_kernels
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0], ids=lambda q: q.name)
def test_bias_and_shapes(qtype):
    bs, _ = GGML_QUANT_SIZES[qtype]
    n, k = 19, max(bs, 256)
    raw = random_raw(qtype, n, k, seed=9)
    w = gguf_dequantize(raw, qtype)
    bias = torch.randn(n)
    lin = GGMLLinear(qtype, torch.from_numpy(raw), k, bias=bias)
    assert (lin.in_features, lin.out_features) == (k, n)
    x = torch.randn(4, k)
    assert_close_fp32(lin(x), ref_linear(x, w, bias), x, w)
    # leading dims, bf16 input (upcast), zero rows
    x3 = torch.randn(2, 3, k)
    assert lin(x3).shape == (2, 3, n) and torch.equal(lin(x3).reshape(6, n), lin(x3.reshape(6, k)))
    xb = x.to(torch.bfloat16)
    assert torch.equal(lin(xb), lin(xb.float()))
    assert lin(torch.zeros(0, k)).shape == (0, n)
    with reference_mode():
        assert_close_fp32(lin(x), ref_linear(x, w, bias), x, w)


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_embedding_rows_equal_dequantized_rows(qtype):
    bs, ts = GGML_QUANT_SIZES[qtype]
    n, k = 50, max(bs, 256)
    raw = random_raw(qtype, n, k, seed=11)
    w = gguf_dequantize(raw, qtype)
    lin = GGMLLinear(qtype, torch.from_numpy(raw), k)
    ids = torch.tensor([3, 0, 49, 3, 17])
    for ref in (False, True):
        with reference_mode(ref):
            e = lin.embedding(ids)
            assert e.shape == (5, k) and np.array_equal(bits(e), bits(w[ids.numpy()]))
            assert lin.embedding(ids.reshape(1, 5)).shape == (1, 5, k)


# ------------------------------------------------------------------------------------------------
# Path selection and module behaviour
# ------------------------------------------------------------------------------------------------


@requires_kernels
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_reference_path_agrees_with_kernels(qtype):
    n, k = 33, 512
    raw = random_raw(qtype, n, k, seed=12)
    w = gguf_dequantize(raw, qtype)
    lin = GGMLLinear(qtype, torch.from_numpy(raw), k)
    x = torch.randn(6, k)
    assert kernels_active()
    y_kernel = lin(x)
    set_reference_mode(True)
    assert not kernels_active()
    y_ref = lin(x)
    lin.cache_reference_weight()
    y_cached = lin(x)
    assert lin._ref_weight is not None and np.array_equal(bits(lin._ref_weight), bits(w))
    set_reference_mode(None)
    assert kernels_active()
    for y in (y_kernel, y_ref, y_cached):
        assert_close_fp32(y, ref_linear(x, w), x, w)


def test_env_var_selects_reference_path():
    """QUICKDRAFT_KERNELS=ref: the reference path, without building or loading the extension."""
    code = (
        "import torch, quickdraft.quant as q, quickdraft.kernels as k\n"
        "from gguf import GGMLQuantizationType as Q\n"
        "lin = q.GGMLLinear(Q.Q8_0, torch.zeros(4, 34, dtype=torch.uint8), 32)\n"
        "assert lin(torch.ones(2, 32)).shape == (2, 4)\n"
        "assert not q.kernels_active() and q.reference_forced() and not k._tried\n"
        "print('ok')\n"
    )
    env = {**os.environ, "QUICKDRAFT_KERNELS": "ref"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_set_reference_mode_rereads_env(monkeypatch):
    monkeypatch.setenv("QUICKDRAFT_KERNELS", "ref")
    set_reference_mode(None)
    assert not kernels_active()
    monkeypatch.delenv("QUICKDRAFT_KERNELS")
    set_reference_mode(None)
    assert kernels_active() == kernels_available()


def test_module_buffers_and_validation():
    raw = torch.from_numpy(random_raw(Q.Q4_K, 8, 256))
    lin = GGMLLinear(int(Q.Q4_K), raw, 256, bias=torch.zeros(8, dtype=torch.float64))
    assert lin.qtype is Q.Q4_K and lin.raw.dtype == torch.uint8
    assert lin.bias is not None and lin.bias.dtype == torch.float32
    assert set(dict(lin.named_buffers())) == {"raw", "bias"}
    assert lin.raw.data_ptr() == raw.data_ptr()  # the model's own bytes, not a copy
    assert "Q4_K" in repr(lin)
    assert set(SUPPORTED_TYPES) == set(FORMATS)
    with pytest.raises(ValueError, match="not supported"):
        GGMLLinear(Q.Q2_K, torch.zeros(1, 84, dtype=torch.uint8), 256)
    with pytest.raises(ValueError, match="multiple"):
        GGMLLinear(Q.Q4_K, raw, 100)
    with pytest.raises(ValueError):
        GGMLLinear(Q.Q4_K, raw[:, :100], 256)
    with pytest.raises(TypeError):
        GGMLLinear(Q.Q4_K, raw.float(), 256)


def test_kernels_build_where_they_can():
    """Kernel tests may only skip where the extension truly cannot build: not on an x86-64 CPU
    with AVX2/FMA/F16C and a C++ compiler (a build or load-time self-check failure fails here)."""
    import shutil

    if kernels._cpu_unsupported() is not None:
        pytest.skip(f"CPU cannot run the kernels: {kernels._cpu_unsupported()}")
    if not (shutil.which("c++") or shutil.which("g++")):
        pytest.skip("no C++ compiler")
    assert kernels_available(), f"the kernels should build here but did not: {kernels.load_error()}"


@requires_kernels
def test_extension_builds_from_package_sources():
    """The kernels build from the files shipped in the package (package data: .cpp and .h)."""
    root = Path(kernels.__file__).parent
    assert all(p.is_file() and p.parent == root for p in kernels.SOURCES + kernels.HEADERS)
    mod = kernels.load()
    assert mod is not None and mod.__name__ == kernels.build_name()
