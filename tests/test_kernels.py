"""Quantized GGML linear layers: reference dequantization, native kernels, batch invariance.

The pure-PyTorch dequantization must match ``gguf.quants.dequantize`` bit for bit (random blocks
and real tensors of the shipped models). In f32 mode the native kernels must match
``x @ dequant.T`` within fp32 accumulation error; in q8 mode they must quantize x bit for bit like
the torch reference and match ``q8(x) @ dequant.T`` within float rounding. Either way a row's
result must be bitwise the same whatever rows come with it.
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
from helpers import BLOCK_FORMATS, E8M0_FIELDS, FLOAT_FORMATS, FORMATS, FP16_FIELDS, random_raw

from quickdraft import kernels
from quickdraft.errors import QuickdraftError
from quickdraft.quant import (
    SUPPORTED_TYPES,
    GGMLLinear,
    dequantize_reference,
    kernels_active,
    kernels_available,
    reference_mode,
    set_reference_mode,
)
from quickdraft.quant.ggml import (
    LANES_ID,
    activation_block_size,
    default_activation_mode,
    ggml_linear_grouped,
    ggml_linear_multi,
    q8_activations_reference,
    quantize_activations_reference,
    repack_lanes_reference,
    set_activation_mode,
    set_default_activation_mode,
)

Q = GGMLQuantizationType
UNSUPPORTED = Q.IQ2_XXS  # a GGML type without a kernel (66 bytes per 256 values)
ROWS = [1, 2, 3, 4, 7, 8, 9, 16, 31, 32, 33, 100]


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


def f32_linear(*args, **kwargs) -> GGMLLinear:
    """A GGMLLinear in the exact fp32-activation mode."""
    return GGMLLinear(*args, activations="f32", **kwargs)


# Byte offset of the fp16 min field (Q4_1: m, Q4_K: dmin): the part of w that is not scale * q.
MIN_FIELD = {Q.Q4_1: 2, Q.Q5_1: 2, Q.Q4_K: 2, Q.Q5_K: 2, Q.Q2_K: 82}
# Formats whose values are summed as q and an offset in separate terms (w = s * (q - OFF), q >= 0).
OFFSET = {Q.Q6_K: 32, Q.Q3_K: 4}


# Bytes that set every value of a block to OFF + 1 (so the block dequantizes to its scales).
UNIT_BYTES = {Q.Q6_K: ((0, 128, 0x11), (128, 192, 0xAA)), Q.Q3_K: ((0, 32, 0xFF), (32, 96, 0x55))}


def weight_magnitude(raw: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """|scale * q| + |min| per weight: what the q8 kernels' partial sums are made of. (A Q4_K
    weight d*sc*q - dmin*m is summed as two separate terms, so their sizes, not the size of
    their difference, bound the rounding; Q6_K's (q - 32) is summed as q and 32 in different
    accumulator lanes, so |q| + 32 <= |q - 32| + 64 counts; Q3_K's (q - 4) likewise.)"""
    w = gguf_dequantize(raw, qtype)
    if qtype in FLOAT_FORMATS:
        return np.abs(w)
    bs, ts = GGML_QUANT_SIZES[qtype]
    if qtype in OFFSET:
        blocks = raw.reshape(-1, ts).copy()
        for a, b, v in UNIT_BYTES[qtype]:
            blocks[:, a:b] = v
        unit = gguf_dequantize(blocks.reshape(raw.shape), qtype)  # each weight's scale
        return np.abs(w) + 2 * OFFSET[qtype] * np.abs(unit)
    if qtype not in MIN_FIELD:
        return np.abs(w)
    blocks = raw.reshape(-1, ts).copy()
    blocks[:, MIN_FIELD[qtype] : MIN_FIELD[qtype] + 2] = 0  # fp16 +0: the min term vanishes
    w0 = gguf_dequantize(blocks.reshape(raw.shape), qtype)
    return np.abs(w0) + np.abs(w0 - w)


def q8_ref(x: torch.Tensor, raw: np.ndarray, qtype: GGMLQuantizationType, bias=None):
    """(exact q8-mode answer in fp64, error bound): q8(x) @ dequant(W).T (+ bias)."""
    bs = activation_block_size(qtype)
    q, d, _ = quantize_activations_reference(x, bs)
    t, k = x.shape
    xq = (q.double().reshape(t, -1, bs) * d.double().unsqueeze(-1)).reshape(t, k)
    w = torch.from_numpy(gguf_dequantize(raw, qtype)).double()
    y = xq @ w.T
    if bias is not None:
        y = y + bias.double()
    mag = xq.abs() @ torch.from_numpy(weight_magnitude(raw, qtype)).double().T
    blocks = k // bs
    # per block: the scale product, two fused multiply-adds and the int -> float conversion
    # round; the 8-lane accumulator sums the blocks; the horizontal sum and the bias add 4 more
    tol = (4 * blocks + 8) * 2**-24 * mag + (
        2**-24 * bias.double().abs() if bias is not None else 0
    )
    return y, tol + 1e-30


def assert_close_q8(y: torch.Tensor, x: torch.Tensor, raw: np.ndarray, qtype, bias=None) -> None:
    exact, tol = q8_ref(x, raw, qtype, bias)
    err = (y.double() - exact).abs()
    assert y.dtype == torch.float32
    assert torch.all(err <= tol), (
        f"{qtype.name}: max err {err.max().item():.3g}, max err/tol {(err / tol).max().item():.3g}"
    )


@pytest.fixture(autouse=True)
def _follow_env():
    """Every test starts and ends with the default path selection and activation mode."""
    set_reference_mode(None)
    set_default_activation_mode(None)
    yield
    set_reference_mode(None)
    set_default_activation_mode(None)


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


@pytest.mark.filterwarnings("ignore:overflow encountered")
def test_mxfp4_every_scale_byte_and_value_bit_exact():
    """Every E8M0 scale byte (0 and 1: fp32 subnormals 2^-128, 2^-127; 255: 2^127) with every FP4
    nibble dequantizes as gguf does, in the torch reference and in the kernels, and equals the
    format's definition 2^(e - 128) * kvalues_mxfp4 (the E2M1 values doubled)."""
    ts = GGML_QUANT_SIZES[Q.MXFP4][1]
    blocks = np.zeros((256, ts), dtype=np.uint8)
    blocks[:, 0] = np.arange(256)
    blocks[:, 1:] = np.array([0x10 * (i % 16) + (15 - i % 16) for i in range(16)], dtype=np.uint8)
    raw = blocks.reshape(16, -1)
    want = gguf_dequantize(raw, Q.MXFP4)
    e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    nibbles = [15 - i % 16 for i in range(16)] + [i % 16 for i in range(16)]
    exact = np.array([[np.ldexp(e2m1[q], e - 127) for q in nibbles] for e in range(256)], dtype=np.float64)
    with np.errstate(over="ignore"):  # (2^127 * 6 is past fp32's range: inf, as in gguf)
        assert np.array_equal(want.reshape(256, 32), exact.astype(np.float32))
    assert np.array_equal(bits(dequantize_reference(Q.MXFP4, torch.from_numpy(raw), 16 * 32)), bits(want))
    if kernels_available():
        assert np.array_equal(bits(GGMLLinear(Q.MXFP4, torch.from_numpy(raw), 16 * 32).dequantize()), bits(want))


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
            lin = f32_linear(t.tensor_type, torch.from_numpy(raw), k)
            assert np.array_equal(bits(lin.dequantize()), bits(expected)), t.name
            x = torch.randn(5, k, generator=torch.Generator().manual_seed(0))
            assert_close_fp32(lin(x), ref_linear(x, expected), x, expected)
            lin.activations = "q8"
            assert_close_q8(lin(x), x, raw, t.tensor_type)


@pytest.mark.slow
def test_real_tensors_smollm2(smollm2_gguf):
    _check_real(_real_tensors(smollm2_gguf, {Q.Q4_1: 2, Q.Q8_0: 1}))


@pytest.mark.slow
def test_real_tensors_qwen05(qwen05_gguf):
    _check_real(_real_tensors(qwen05_gguf, {Q.Q5_0: 2, Q.Q4_K: 2, Q.Q6_K: 2, Q.Q8_0: 2}))


DATA = Path(__file__).parent / "data"  # tiny models quantized by llama.cpp's llama-quantize (make_quantized.py)
LLAMACPP_TYPES = [Q.Q2_K, Q.Q3_K, Q.Q5_K, Q.IQ4_XS, Q.IQ4_NL]


@requires_kernels
@pytest.mark.parametrize("qtype", LLAMACPP_TYPES, ids=lambda q: q.name)
def test_llamacpp_quantized_tensors(qtype):
    """Blocks written by llama.cpp's own quantizer: dequantization bit-exact to gguf's, both
    activation modes within their bounds of the dequantized product, and a row alone bitwise
    the same row in a 17-row pass."""
    reader = GGUFReader(DATA / f"tiny-qwen2-256-{qtype.name}.gguf")
    tensors = [t for t in reader.tensors if len(t.data.shape) == 2 and t.name.startswith("blk.0.")]
    assert tensors and all(t.tensor_type == qtype for t in tensors)
    g = torch.Generator().manual_seed(0)
    for t in tensors:
        raw, k = np.array(t.data), int(t.shape[0])
        expected = gguf_dequantize(raw, qtype)
        assert np.array_equal(bits(dequantize_reference(qtype, torch.from_numpy(raw), k)), bits(expected))
        lin = f32_linear(qtype, torch.from_numpy(raw), k)
        assert np.array_equal(bits(lin.dequantize()), bits(expected)), t.name
        x = torch.randn(17, k, generator=g)
        assert_close_fp32(lin(x), ref_linear(x, expected), x, expected)
        lin.activations = "q8"
        y = lin(x)
        assert_close_q8(y, x, raw, qtype)
        for i in (0, 9, 16):
            assert torch.equal(lin(x[i : i + 1]), y[i : i + 1]), (t.name, i)


# ------------------------------------------------------------------------------------------------
# Kernels, f32 activations: accuracy, batch invariance, bias, embedding
# ------------------------------------------------------------------------------------------------


@requires_kernels
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_kernel_matches_reference_all_row_counts(qtype):
    bs, ts = GGML_QUANT_SIZES[qtype]
    # odd N; for 32-blocks a K that is not a multiple of the kernels' 256-element chunk
    n, k = 61, 2 * max(bs, 256) + (bs if bs == 32 else 0)
    raw = random_raw(qtype, n, k, seed=5)
    w = gguf_dequantize(raw, qtype)
    lin = f32_linear(qtype, torch.from_numpy(raw), k)
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
    lin = f32_linear(qtype, torch.from_numpy(random_raw(qtype, n, k, seed=7)), k)
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
    lin = f32_linear(qtype, torch.from_numpy(raw), k)
    x = torch.randn(1100, k, generator=torch.Generator().manual_seed(4))
    y = lin(x)
    assert_close_fp32(y, ref_linear(x, w), x, w)
    for i in (0, 555, 1099):
        assert torch.equal(y[i : i + 1], lin(x[i : i + 1]))


@requires_kernels
def test_batch_invariance_across_threads():
    """The thread count changes which thread computes a row, never its bits."""
    qtype, n, k = Q.Q4_K, 203, 512
    lin = f32_linear(qtype, torch.from_numpy(random_raw(qtype, n, k, seed=8)), k)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(3))
    threads = torch.get_num_threads()
    try:
        for mode in ("f32", "q8"):
            lin.activations = mode
            outs = []
            for nt in (1, 2, 3):
                torch.set_num_threads(nt)
                outs.append(lin(x))
            assert all(torch.equal(outs[0], o) for o in outs[1:]), mode
    finally:
        torch.set_num_threads(threads)


@requires_kernels
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0], ids=lambda q: q.name)
def test_bias_and_shapes(qtype):
    bs, _ = GGML_QUANT_SIZES[qtype]
    n, k = 19, max(bs, 256)
    raw = random_raw(qtype, n, k, seed=9)
    w = gguf_dequantize(raw, qtype)
    bias = torch.randn(n)
    lin = f32_linear(qtype, torch.from_numpy(raw), k, bias=bias)
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
# Kernels, q8 activations: quantization, accuracy, batch invariance, linear_multi
# ------------------------------------------------------------------------------------------------


def _activation_samples(k: int) -> torch.Tensor:
    """Rows that exercise the quantizer: normal, wide-range, an all-zero block, exact ties."""
    g = torch.Generator().manual_seed(21)
    x = torch.randn(6, k, generator=g)
    x[1] *= torch.exp(torch.randn(k, generator=g) * 4)  # magnitudes over many octaves
    x[2, :256] = 0  # d = 0: q = 0 (and no division by zero)
    x[3] = torch.randn(k, generator=g) * 1e-30  # tiny (subnormal products)
    x[4] = torch.randn(k, generator=g) * 1e30
    # amax 127 -> d = 1, id = 1: x * id lands exactly on .5 ties, which round to even
    ties = torch.tensor([127.0, 2.5, -2.5, 3.5, 0.5, -0.5, 1.5, -126.5])
    x[5] = ties.repeat(k // 8)
    return x


@requires_kernels
@pytest.mark.parametrize("bs", [32, 256])
def test_activation_quantization_bit_exact(bs):
    k = 1024
    x = _activation_samples(k)
    q, d, sums = kernels.load().quantize_activations(x, bs)  # type: ignore[union-attr]
    rq, rd, rsums = quantize_activations_reference(x, bs)
    assert q.dtype == rq.dtype == torch.int8 and torch.equal(q, rq)
    assert np.array_equal(bits(d), bits(rd))
    assert sums.dtype == rsums.dtype and torch.equal(sums, rsums)
    # the rule itself: d = amax / 127, |q| <= 127, ties to even, zero blocks all zero
    assert torch.equal(rd, x.reshape(6, -1, bs).abs().amax(-1) / 127.0)
    assert q.abs().max() <= 127 and torch.all(q[2, :256] == 0) and torch.all(d[2, : 256 // bs] == 0)
    assert q[5, :8].tolist() == [127, 2, -2, 4, 0, 0, 2, -126]
    group = 16 if bs == 256 else 32
    assert torch.equal(sums.long(), q.reshape(6, -1, group).long().sum(-1))


@requires_kernels
@pytest.mark.parametrize("qtype", BLOCK_FORMATS, ids=lambda q: q.name)
def test_q8_matches_reference_all_row_counts(qtype):
    bs, _ = GGML_QUANT_SIZES[qtype]
    n, k = 61, 2 * max(bs, 256) + (bs if bs == 32 else 0)  # odd N; 32-blocks: a partial chunk
    raw = random_raw(qtype, n, k, seed=5)
    lin = GGMLLinear(qtype, torch.from_numpy(raw), k)
    assert lin.activation_mode == "q8"  # the default
    g = torch.Generator().manual_seed(1)
    for t in ROWS:
        x = torch.randn(t, k, generator=g) * 3
        y = lin(x)
        assert y.shape == (t, n)
        assert_close_q8(y, x, raw, qtype)
    x = _activation_samples(k)[:5]  # ties, zero block, extreme magnitudes
    assert_close_q8(lin(x), x, raw, qtype)


@requires_kernels
@pytest.mark.parametrize("qtype", BLOCK_FORMATS, ids=lambda q: q.name)
def test_q8_extreme_blocks_do_not_saturate(qtype):
    """All weight bytes at their largest magnitude and |x| at the quantizer's 127: the integer
    pair sums reach their bound (Q8_0: 2 * 128 * 127) and must not saturate int16."""
    bs, ts = GGML_QUANT_SIZES[qtype]
    n, k = 9, 512
    raw = random_raw(qtype, n, k, seed=3, scale=1.0)
    blocks = raw.reshape(-1, ts)
    fp16 = set(E8M0_FIELDS.get(qtype, []))  # (scale bytes keep their value)
    for off in FP16_FIELDS[qtype]:
        fp16 |= {off, off + 1}
    # Q8_0: -128; IQ4: index 0 = -127 (and IQ4_XS scales -32); others: all bits set
    fill = {Q.Q8_0: 0x80, Q.IQ4_NL: 0x00, Q.IQ4_XS: 0x00}.get(qtype, 0xFF)
    for col in range(ts):
        if col not in fp16:
            blocks[:, col] = fill
    if qtype == Q.Q6_K:
        blocks[:, 192:208] = 0x80  # scales -128, the largest |scale|
    raw = blocks.reshape(n, -1)
    lin = GGMLLinear(qtype, torch.from_numpy(raw), k)
    x = torch.ones(4, k)
    x[1] = -1
    x[2, ::2] = -1
    x[3] = torch.randn(k)
    assert_close_q8(lin(x), x, raw, qtype)


@requires_kernels
@pytest.mark.parametrize("qtype", BLOCK_FORMATS, ids=lambda q: q.name)
def test_q8_batch_invariance(qtype):
    """Row i of a T-row call is bitwise the row computed alone, for T = 1..33 and 100."""
    bs, _ = GGML_QUANT_SIZES[qtype]
    n, k = 21, 2 * max(bs, 256)  # 21: two full panels of 8 and a partial one
    bias = torch.randn(n)
    lin = GGMLLinear(qtype, torch.from_numpy(random_raw(qtype, n, k, seed=7)), k, bias=bias)
    g = torch.Generator().manual_seed(2)
    probe = torch.randn(2, k, generator=g)
    alone = [lin(probe[i : i + 1]) for i in range(2)]
    for t in [*range(1, 34), 100]:
        x = torch.randn(t, k, generator=g) * 3
        pos = [(t * 5) % t, t - 1]
        x[pos[0]] = probe[0]
        x[pos[1]] = probe[1]
        y = lin(x)
        for i in range(2):
            if pos[1] == pos[0] and i == 0:
                continue  # T = 1: one slot, holding probe 1
            assert torch.equal(y[pos[i] : pos[i] + 1], alone[i]), f"T={t} row {pos[i]}"


@requires_kernels
def test_q8_long_prefill_matches_and_is_batch_invariant():
    """Long inputs: several 64-row blocks and a quantized x too big for the kept buffer."""
    qtype, n, k = Q.Q4_K, 24, 8192
    raw = random_raw(qtype, n, k, seed=13)
    lin = GGMLLinear(qtype, torch.from_numpy(raw), k)
    x = torch.randn(1100, k, generator=torch.Generator().manual_seed(4))
    y = lin(x)
    assert_close_q8(y, x, raw, qtype)
    for i in (0, 63, 64, 555, 1099):
        assert torch.equal(y[i : i + 1], lin(x[i : i + 1]))


@requires_kernels
def test_q8_bias_shapes_and_zero_input():
    qtype, n, k = Q.Q6_K, 19, 256
    raw = random_raw(qtype, n, k, seed=9)
    bias = torch.randn(n)
    lin = GGMLLinear(qtype, torch.from_numpy(raw), k, bias=bias)
    x = torch.randn(4, k)
    assert_close_q8(lin(x), x, raw, qtype, bias)
    assert torch.equal(lin(torch.zeros(3, k)), bias.expand(3, n))  # d = 0: exactly the bias
    x3 = torch.randn(2, 3, k)
    assert lin(x3).shape == (2, 3, n) and torch.equal(lin(x3).reshape(6, n), lin(x3.reshape(6, k)))
    xb = x.to(torch.bfloat16)
    assert torch.equal(lin(xb), lin(xb.float()))
    assert lin(torch.zeros(0, k)).shape == (0, n)
    assert torch.isnan(lin(torch.full((1, k), float("nan")))).all()  # NaN in, NaN out


def _multi_layers() -> tuple[list[GGMLLinear], list[np.ndarray]]:
    """Linears sharing K = 512: K-quant and 32-block formats (both quantizations of x), biases,
    N not a multiple of the 8-row panel."""
    specs = [(Q.Q4_K, 40, True), (Q.Q6_K, 13, False), (Q.Q8_0, 27, True), (Q.Q4_1, 9, False)]
    mods, raws = [], []
    for i, (qt, n, has_bias) in enumerate(specs):
        raw = random_raw(qt, n, 512, seed=30 + i)
        bias = torch.randn(n) if has_bias else None
        mods.append(GGMLLinear(qt, torch.from_numpy(raw), 512, bias=bias))
        raws.append(raw)
    return mods, raws


# ------------------------------------------------------------------------------------------------
# The lane layout of Q4_K / Q6_K (the q8 kernels' own)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_lanes_reference_layout_and_roundtrip(qtype):
    """The torch repack puts value 32j + 4v + r of a block at vector v, byte 4j + r (Q4_K: nibble
    v % 2 of byte 32 * (v // 2) + 4j + r after the 16 header bytes), stores each panel of 8 rows
    block by block (row 8p + j's block c at 8p * row_bytes + (8c + j) * ts; a last panel of nn rows
    likewise with nn), and back again, losslessly."""
    n, k = 11, 512  # one full panel and one of 3 rows
    raw = torch.from_numpy(random_raw(qtype, n, k, seed=31))
    lanes = repack_lanes_reference(qtype, raw, True)
    assert lanes.shape == raw.shape and not torch.equal(lanes, raw)
    assert torch.equal(repack_lanes_reference(qtype, lanes, False), raw)
    _, ts = GGML_QUANT_SIZES[qtype]
    flat, row_bytes = lanes.reshape(-1), raw.shape[1]
    for row, c in ((0, 0), (7, 1), (8, 0), (10, 1)):  # block c of a row: where the panels put it
        p0, nn = row // 8 * 8, min(8, n - row // 8 * 8)
        at = p0 * row_bytes + (c * nn + row - p0) * ts
        blocks = repack_lanes_reference(qtype, raw[row : row + 1], True)  # a 1-row panel: rows as they are
        assert torch.equal(flat[at : at + ts], blocks.reshape(-1, ts)[c])
    by_row = blocks = repack_lanes_reference(qtype, raw[:1], True)
    head = slice(0, 16) if qtype == Q.Q4_K else slice(192, 210)
    assert torch.equal(by_row.reshape(-1, ts)[:, head], raw[:1].reshape(-1, ts)[:, head])  # scales stay
    if qtype == Q.Q4_K:  # spot checks against the definition
        blk, nat = by_row.reshape(-1, ts)[0], raw.reshape(-1, ts)[0]
        for e in (0, 5, 37, 100, 255):
            j, t = divmod(e, 32)
            v, b = t // 4, 4 * j + t % 4
            want = (int(nat[16 + 32 * (e // 64) + e % 32]) >> (4 * (e % 64 >= 32))) & 15
            assert (int(blk[16 + 32 * (v // 2) + b]) >> (4 * (v % 2))) & 15 == want
    with pytest.raises(ValueError, match="lane layout covers"):
        repack_lanes_reference(Q.Q8_0, torch.zeros(1, 34, dtype=torch.uint8), True)


@requires_kernels
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_lanes_kernel_repack_equals_reference(qtype):
    mod = kernels.load()
    n, k = 17, 768
    raw = torch.from_numpy(random_raw(qtype, n, k, seed=32))
    lanes = mod.repack_lanes(int(qtype), raw, k, True)  # type: ignore[union-attr]
    assert torch.equal(lanes, repack_lanes_reference(qtype, raw, True))
    assert torch.equal(mod.repack_lanes(int(qtype), lanes, k, False), raw)  # type: ignore[union-attr]
    assert mod.lanes_id() == LANES_ID  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="lane layout"):
        mod.linear_q8(int(qtype), raw, torch.randn(2, k), k)  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="no lane layout"):
        mod.repack_lanes(int(UNSUPPORTED), torch.zeros(1, 66, dtype=torch.uint8), 256, True)  # type: ignore[union-attr]


@requires_kernels
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0, Q.IQ4_XS], ids=lambda q: q.name)
def test_repack_of_a_matrix_taller_than_one_slab(qtype):
    """repack_lanes works in slabs of 4096 rows (whole panels; a load never holds a big output head
    three times): a 8203-row matrix (two slabs and a partial last panel) repacks to what the same
    rows give panel by panel, back to the same bytes, and its rows read back as GGML blocks."""
    mod = kernels.load()
    n, k = 8203, 256
    raw = torch.from_numpy(random_raw(qtype, n, k, seed=34))
    lanes = mod.repack_lanes(int(qtype), raw, k, True)  # type: ignore[union-attr]
    assert torch.equal(mod.repack_lanes(int(qtype), lanes, k, False), raw)  # type: ignore[union-attr]
    for r0 in (0, 4096, 8192):  # panels never straddle a slab: each slab alone repacks the same
        part = raw[r0:r0 + 4096].contiguous()
        assert torch.equal(lanes[r0:r0 + 4096], mod.repack_lanes(int(qtype), part, k, True))  # type: ignore[union-attr]
    ids = torch.tensor([0, 4095, 4096, 4100, 8191, 8202])
    assert torch.equal(mod.lanes_rows(int(qtype), lanes, k, ids), raw[ids])  # type: ignore[union-attr]


@requires_kernels
@pytest.mark.parametrize(("qtype", "k", "n"), [(Q.Q8_0, 256, 8203), (Q.Q4_K, 256, 8203), (Q.IQ4_NL, 256, 8203),
                                             (Q.Q8_0, 288, 8203), (Q.Q8_0, 256, 20), (Q.MXFP4, 288, 20)],
                         ids=["Q8_0", "Q4_K", "IQ4_NL", "Q8_0-padded", "Q8_0-small", "MXFP4-small-padded"])
def test_a_loaded_matrix_is_repacked_slab_by_slab(qtype, k, n):
    """A layer that owns its blocks (a loader's copy) switches layout a slab of 4096 rows at a time
    (a load holds a 262k-row head once, not twice): over its own memory where both layouts take the
    same bytes per row, else into a new tensor (288 = 9 blocks: lanes pad to 16); the same bytes as
    a repacked copy, the same outputs and GGML rows. A layer that does not own its blocks leaves
    the caller's tensor as it was."""
    raw_np = random_raw(qtype, n, k, seed=35)
    mine, theirs = torch.from_numpy(raw_np.copy()), torch.from_numpy(raw_np.copy())
    owner, borrower = GGMLLinear(qtype, mine, k, owns_raw=True), GGMLLinear(qtype, theirs, k)
    over_itself = k % 256 == 0
    x = torch.randn(3, k)
    assert torch.equal(owner(x), borrower(x))
    assert owner._lanes and borrower._lanes
    assert (owner.raw.data_ptr() == mine.data_ptr()) == over_itself and torch.equal(owner.raw, borrower.raw)
    assert torch.equal(theirs, torch.from_numpy(raw_np)) and borrower.raw.data_ptr() != theirs.data_ptr()
    if not over_itself and sys.platform == "linux":  # the old blocks' pages were given back (zeros) but
        assert int(mine.count_nonzero()) <= 2 * 4096  # a part-page at either end
    ids = torch.tensor([0, 4095, 4096, 8202] if n > 4096 else [0, 7, 8, n - 1])
    assert torch.equal(owner.embedding(ids), borrower.embedding(ids))
    lanes = owner.raw
    set_activation_mode(owner, "f32")  # back to GGML blocks, the same way
    assert torch.equal(owner(x), GGMLLinear(qtype, torch.from_numpy(raw_np.copy()), k, activations="f32")(x))
    assert not owner._lanes and (owner.raw.data_ptr() == lanes.data_ptr()) == over_itself
    assert torch.equal(owner.raw, torch.from_numpy(raw_np))


@requires_kernels
@pytest.mark.parametrize("qtype", BLOCK_FORMATS, ids=lambda q: q.name)
def test_lanes_layout_switches_with_the_path(qtype):
    """A q8 kernel call repacks the module's weight into lanes (a copy: the caller's tensor is left
    alone; 32-block formats: super-blocks of 8, the last one padded); dequantize, embedding, the f32
    kernels, the reference path and tensor-parallel slices see the GGML values as before."""
    from quickdraft.parallel.tp import slice_cols, slice_rows

    n, k = 24, 512 if GGML_QUANT_SIZES[qtype][0] == 256 else 544  # 544 = 2 super-blocks + 1 block
    raw_np = random_raw(qtype, n, k, seed=33)
    raw = torch.from_numpy(raw_np.copy())
    lin = GGMLLinear(qtype, raw, k)
    want_w = torch.from_numpy(gguf_dequantize(raw_np.reshape(-1), qtype).reshape(n, k).astype(np.float32))
    x = torch.randn(3, k)
    y_q8 = lin(x)
    assert lin._lanes and torch.equal(raw, torch.from_numpy(raw_np))  # repacked a copy
    assert torch.equal(lin.dequantize(), want_w) and lin._lanes
    ids = torch.tensor([[5, 0], [23, 5]])
    assert torch.equal(lin.embedding(ids), want_w[ids])
    assert torch.equal(lin.ggml_raw(), raw)
    for part in (slice_rows(lin, 8, 16), slice_cols(lin, 256, 512, keep_bias=False)):
        assert isinstance(part, GGMLLinear) and not part._lanes
    assert torch.equal(slice_rows(lin, 8, 16).dequantize(), want_w[8:16])
    assert torch.equal(slice_cols(lin, 256, 512, keep_bias=False).dequantize(), want_w[:, 256:512])
    if GGML_QUANT_SIZES[qtype][0] == 32:
        assert lin.raw.shape == (n, 3 * 8 * GGML_QUANT_SIZES[qtype][1])  # padded to 3 super-blocks
    set_activation_mode(lin, "f32")
    y_f32 = lin(x)
    assert not lin._lanes and torch.equal(lin.raw, raw)
    assert torch.equal(y_f32, GGMLLinear(qtype, raw, k, activations="f32")(x))
    set_activation_mode(lin, "q8")
    assert torch.equal(lin(x), y_q8) and lin._lanes
    with reference_mode():
        y_ref = lin(x)
    assert not lin._lanes
    assert_close_q8(y_ref, x, raw_np, qtype)


@requires_kernels
@pytest.mark.parametrize("qtype", BLOCK_FORMATS, ids=lambda q: q.name)
def test_select_rows_copies_the_rows_and_their_outputs(qtype):
    """select_rows (a draft model's cut output head) copies the rows out of the panels of the lane
    layout as GGML blocks (repacked at its first q8 pass), and each kept row's output is bitwise
    the full layer's."""
    n, k = 20, 512 if GGML_QUANT_SIZES[qtype][0] == 256 else 544
    raw_np = random_raw(qtype, n, k, seed=41)
    lin = GGMLLinear(qtype, torch.from_numpy(raw_np.copy()), k)
    x = torch.randn(3, k)
    full = lin(x)
    assert lin._lanes
    ids = torch.tensor([19, 0, 7, 8])
    sub = lin.select_rows(ids)
    assert not sub._lanes and sub.out_features == 4 and sub.raw.data_ptr() != lin.raw.data_ptr()
    assert torch.equal(sub.raw, torch.from_numpy(raw_np)[ids])
    assert torch.equal(sub(x), full[:, ids]) and sub._lanes
    assert torch.equal(sub.ggml_raw(), torch.from_numpy(raw_np)[ids])
    plain = GGMLLinear(qtype, torch.from_numpy(raw_np.copy()), k).select_rows(ids)  # GGML layout
    assert not plain._lanes and torch.equal(plain(x), full[:, ids])


@requires_kernels
def test_linear_multi_equals_separate_calls_bitwise():
    mods, raws = _multi_layers()
    for t in (1, 3, 8, 9, 40, 70):
        x = torch.randn(t, 512) * 2
        ys = ggml_linear_multi(mods, x)
        assert len(ys) == len(mods)
        for y, m, raw in zip(ys, mods, raws, strict=True):
            assert torch.equal(y, m(x)), (t, m.qtype.name)
            assert_close_q8(y, x, raw, m.qtype, m.bias)
        specs = [(m._set_layout(True), m.raw, 512, m.bias) for m in mods]
        direct = kernels.load().linear_multi(x, specs)  # type: ignore[union-attr]
        assert all(torch.equal(a, b) for a, b in zip(direct, ys, strict=True))
    x3 = torch.randn(2, 5, 512)  # leading dims
    for y, m in zip(ggml_linear_multi(mods, x3), mods, strict=True):
        assert y.shape == (2, 5, m.out_features) and torch.equal(y, m(x3))


@requires_kernels
def test_linear_grouped_is_each_weight_on_its_groups_rows_bitwise():
    """Groups of rows of different sizes (a pass's rows by routed expert), each weight on its
    group's rows, in one call: bitwise each weight's own call on those rows, for K-quant and
    32-block formats, biases, empty groups, 1-70 rows."""
    mods, raws = _multi_layers()
    gen = torch.Generator().manual_seed(7)
    for counts in ([1, 1, 1, 1], [3, 0, 5, 1], [17, 2, 40, 11], [70, 1, 1, 1]):
        x = torch.randn(sum(counts), 512, generator=gen) * 2
        groups = [[mods[g], mods[(g + 1) % len(mods)]] for g in range(len(counts))]  # two weights a group
        ys = ggml_linear_grouped(groups, x, counts)
        start = 0
        for g, c in enumerate(counts):
            rows = x[start : start + c]
            for y, m in zip(ys[g], groups[g], strict=True):
                assert y.shape == (c, m.out_features) and torch.equal(y, m(rows)), (counts, g, m.qtype.name)
            start += c
    x = torch.randn(4, 512)
    assert_close_q8(ggml_linear_grouped([[mods[0]], [mods[0]]], x, [1, 3])[1][0], x[1:], raws[0], mods[0].qtype,
                    mods[0].bias)
    mod = kernels.load()
    assert mod is not None
    specs = [(m._set_layout(True), m.raw, 512, m.bias) for m in mods[:2]]
    with pytest.raises(RuntimeError, match="add up to"):
        mod.linear_grouped(x, [1, 2], specs, [0, 1])
    with pytest.raises(RuntimeError, match="one of the 2 groups"):
        mod.linear_grouped(x, [1, 3], specs, [0, 2])
    set_activation_mode(mods[1], "f32")  # one f32 layer: each module on its own path
    ys = ggml_linear_grouped([[mods[0]], [mods[1]]], x, [1, 3])
    assert torch.equal(ys[0][0], mods[0](x[:1])) and torch.equal(ys[1][0], mods[1](x[1:]))


@requires_kernels
def test_linear_multi_residual_is_the_sum_torch_makes_bitwise():
    """A residual added as the GEMM stores (the native stack's x + o(att), x + down(h)) gives the
    bits of adding it after: with and without a bias, N not a multiple of the panel, 1 and many rows."""
    mods, _ = _multi_layers()
    mod = kernels.load()
    assert mod is not None
    for m in mods:
        spec = (m._set_layout(True), m.raw, 512, m.bias)
        for t in (1, 3, 9):
            x = torch.randn(t, 512) * 2
            res = torch.randn(t, m.out_features) * 100  # large: the rounding of the sum shows
            y = mod.linear_multi(x, [spec], residual=res)[0]
            assert torch.equal(y, res + mod.linear_multi(x, [spec])[0]), (m.qtype.name, t)
    x = torch.randn(2, 512)
    specs = [(m._set_layout(True), m.raw, 512, m.bias) for m in mods[:2]]
    with pytest.raises(RuntimeError, match="one weight"):
        mod.linear_multi(x, specs, residual=torch.zeros(2, mods[0].out_features))
    with pytest.raises(RuntimeError, match=r"residual must be .*\[T, out_features\]"):
        mod.linear_multi(x, specs[:1], residual=torch.zeros(3, mods[0].out_features))


@requires_kernels
def test_linear_multi_falls_back_to_separate_calls():
    mods, _ = _multi_layers()
    x = torch.randn(4, 512)
    set_activation_mode(mods[1], "f32")  # one f32 layer: every module is called on its own path
    ys = ggml_linear_multi(mods, x)
    assert all(torch.equal(y, m(x)) for y, m in zip(ys, mods, strict=True))
    plain = torch.nn.Linear(512, 6)
    y_plain = ggml_linear_multi([mods[0], plain], x)[1]  # not a GGMLLinear: called as it is
    assert torch.equal(y_plain, plain(x))
    with reference_mode():
        ys_ref = ggml_linear_multi(mods, x)
        assert all(torch.equal(y, m(x)) for y, m in zip(ys_ref, mods, strict=True))
    with pytest.raises(RuntimeError, match="in_features"):
        kernels.load().linear_multi(x, [(mods[0]._qt, mods[0].raw, 256, None)])  # type: ignore[union-attr]


@requires_kernels
@pytest.mark.parametrize("qtype", BLOCK_FORMATS, ids=lambda q: q.name)
def test_reference_q8_path_agrees_with_kernels(qtype):
    """Without the kernels (reference path) the q8 mode computes the same function."""
    n, k = 33, 512
    raw = random_raw(qtype, n, k, seed=12)
    lin = GGMLLinear(qtype, torch.from_numpy(raw), k)
    x = torch.randn(6, k)
    y_kernel = lin(x)
    with reference_mode():
        y_ref = lin(x)
    assert_close_q8(y_kernel, x, raw, qtype)
    # the reference rounds q * d to fp32 and accumulates in fp32 (BLAS): a little looser
    exact, tol = q8_ref(x, raw, qtype)
    assert torch.all(
        (y_ref.double() - exact).abs() <= 4 * tol + 2 * k * 2**-24 * (exact.abs() + 1e-3)
    )
    xq = q8_activations_reference(x, activation_block_size(qtype))
    assert torch.equal(y_ref, f32_linear(qtype, torch.from_numpy(raw), k)._reference_forward(xq))


@requires_kernels
def test_activation_mode_switching():
    qtype, n, k = Q.Q4_K, 16, 512
    raw = torch.from_numpy(random_raw(qtype, n, k, seed=14))
    model = torch.nn.Sequential(
        GGMLLinear(qtype, raw, k), torch.nn.Sequential(GGMLLinear(qtype, raw, k))
    )
    x = torch.randn(3, k)
    mod = kernels.load()
    assert mod is not None
    y_q8 = mod.linear_q8(int(qtype) + LANES_ID, mod.repack_lanes(int(qtype), raw, k, True), x, k)
    y_f32 = mod.linear(int(qtype), raw, x, k)
    assert not torch.equal(y_q8, y_f32)  # the modes really differ (x is rounded to int8)
    assert all(torch.equal(m(x), y_q8) for m in (model[0], model[1][0]))
    assert set_activation_mode(model, "f32") == 2
    assert model[0].activation_mode == "f32" and "activations=f32" in repr(model[0])
    assert all(torch.equal(m(x), y_f32) for m in (model[0], model[1][0]))
    set_activation_mode(model, None)  # back to the process default
    set_default_activation_mode("f32")
    assert default_activation_mode() == "f32" and torch.equal(model[0](x), y_f32)
    set_default_activation_mode("q8")
    assert torch.equal(model[0](x), y_q8)
    with pytest.raises(QuickdraftError, match="q8"):
        set_activation_mode(model, "int4")
    with pytest.raises(QuickdraftError, match="f32"):
        GGMLLinear(qtype, raw, k, activations="fp16")


def test_activation_mode_env_var():
    """QUICKDRAFT_ACTIVATIONS=f32 makes the exact path the default; a bad value says what to use."""
    code = (
        "import quickdraft.quant.ggml as g\n"
        "from quickdraft.errors import QuickdraftError\n"
        "print(g.default_activation_mode())\n"
    )
    check_env_var(code, "QUICKDRAFT_ACTIVATIONS", (("f32", "f32"), ("Q8", "q8"), ("", "q8")), "int4")


def check_env_var(code: str, var: str, good: tuple[tuple[str, str], ...], bad: str) -> None:
    """``code`` prints the expected value under each good setting of ``var``; a bad setting
    fails with a message naming it."""
    for value, expected in good:
        env = {**os.environ, var: value}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0 and out.stdout.strip() == expected, out.stderr
    env = {**os.environ, var: bad}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode != 0 and f"{var}={bad!r}" in out.stderr


# ------------------------------------------------------------------------------------------------
# Path selection and module behaviour
# ------------------------------------------------------------------------------------------------


@requires_kernels
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_reference_path_agrees_with_kernels(qtype):
    n, k = 33, 512
    raw = random_raw(qtype, n, k, seed=12)
    w = gguf_dequantize(raw, qtype)
    lin = f32_linear(qtype, torch.from_numpy(raw), k)
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
        GGMLLinear(UNSUPPORTED, torch.zeros(1, 66, dtype=torch.uint8), 256)
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


# ------------------------------------------------------------------------------------------------
# The two builds of the q8 GEMM (AVX2 and AVX-512 VNNI)
# ------------------------------------------------------------------------------------------------


@requires_kernels
@pytest.mark.parametrize("qtype", BLOCK_FORMATS, ids=lambda q: q.name)
def test_q8_isas_bitwise_equal(qtype):
    """The AVX-512 VNNI build computes the same integer sums and float steps as the AVX2 build:
    bitwise-equal outputs for every format, row count and tile shape (random and extreme blocks).
    On a CPU without AVX-512 VNNI, asking for it is refused with a clear error."""
    mod = kernels.load()
    assert mod is not None
    if not _cpu_has_avx512vnni():
        with pytest.raises(RuntimeError, match="does not run AVX-512 VNNI"):
            kernels.set_isa("avx512vnni")
        assert kernels.isa() == "avx2"
        return
    bs, ts = GGML_QUANT_SIZES[qtype]
    n, k = 21, 2 * max(bs, 256)
    raw = random_raw(qtype, n, k, seed=21)
    extreme = raw.reshape(-1, ts).copy()
    fp16 = {b for off in FP16_FIELDS[qtype] for b in (off, off + 1)} | set(E8M0_FIELDS.get(qtype, []))
    extreme[:, [c for c in range(ts) if c not in fp16]] = {Q.Q8_0: 0x80, Q.IQ4_NL: 0, Q.IQ4_XS: 0}.get(qtype, 0xFF)
    bias = torch.randn(n)
    g = torch.Generator().manual_seed(5)
    prev = kernels.set_isa("auto")
    try:
        for w in (raw, extreme.reshape(n, -1)):
            lin = GGMLLinear(qtype, torch.from_numpy(w), k, bias=bias)
            for t in (1, 2, 3, 4, 5, 8, 9, 13, 33, 70):
                x = torch.randn(t, k, generator=g) * 4
                out = {}
                for isa in ("avx2", "avx512vnni"):
                    kernels.set_isa(isa)
                    assert kernels.isa() == isa
                    out[isa] = lin(x)
                assert torch.equal(out["avx2"], out["avx512vnni"]), (qtype.name, t)
        assert_close_q8(out["avx512vnni"], x, extreme.reshape(n, -1), qtype, bias)
    finally:
        kernels.set_isa(prev)


def _cpu_has_avx512vnni() -> bool:
    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    return all(f in flags for f in ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni"))


@requires_kernels
def test_isa_selection_and_env_var():
    """auto picks the best build; bad names are refused; QUICKDRAFT_ISA=avx2 forces AVX2 and a bad
    value says what to set."""
    best = "avx512vnni" if _cpu_has_avx512vnni() else "avx2"
    prev = kernels.set_isa("auto")
    try:
        assert kernels.isa() == best
        with pytest.raises(RuntimeError, match="unknown instruction set 'sse2'"):
            kernels.set_isa("sse2")
        assert kernels.set_isa("avx2") == best and kernels.isa() == "avx2"
    finally:
        kernels.set_isa(prev)
    code = "from quickdraft import kernels\nprint(kernels.isa())\n"
    check_env_var(code, "QUICKDRAFT_ISA", (("avx2", "avx2"), ("AUTO", best), ("", best)), "avx9000")
