"""Linear layers that keep GGUF weights in their own GGML blocks.

Block formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4 (32 values per block) and Q2_K, Q3_K, Q4_K, Q5_K,
Q6_K, IQ4_XS (256 per block); F16 and BF16 matrices are kept as they are and always multiplied
with fp32 activations (the f32 kernels, 32 values at a time).

Two activation modes (per layer, :func:`set_activation_mode` for a whole model; the process
default is "q8", or whatever ``QUICKDRAFT_ACTIVATIONS=f32|q8`` says):

* ``"q8"`` (default): each input row is rounded to int8 per block before the product, as llama.cpp
  does: per 256 values for 256-value blocks (K-quants, IQ4_XS), per 32 for the others, with an fp32
  scale ``d = amax / 127`` and ``q = round_half_even(x / d)``. The weights are used exactly. The
  kernels then compute with integer dot products: decode (1 row) runs at memory bandwidth, and a
  (k+1)-row verification pass costs little more than one row. Numerically the layer computes
  ``q8(x) @ W.T``: activations carry a relative rounding error of up to 1/254 of their block's
  largest value, like llama.cpp's; logits differ slightly from the f32 mode.
* ``"f32"``: exact fp32 activations (``x @ W.T`` within fp32 accumulation error).

In both modes the result is deterministic and batch-invariant: a row's output is bitwise the same
whatever other rows share the call, so speculative greedy output equals plain greedy output (in
the same mode). Two paths compute each mode:

* the native kernels (``quickdraft.kernels``, AVX2/FMA/OpenMP): every weight block is read once per
  call and reused for all 1..T input rows; :func:`ggml_linear_multi` computes several linears of
  the same input (q/k/v, gate/up) in one call, quantizing x once;
* the pure-PyTorch reference: dequantize with torch ops (bit-exact to ``gguf.quants.dequantize``),
  in q8 mode quantize x with the kernels' exact rule (:func:`quantize_activations_reference`),
  then ``x @ w.T``. It runs wherever torch does (also on GPUs) and is used when the kernels cannot
  be built, when ``QUICKDRAFT_KERNELS=ref`` is set, or after ``set_reference_mode(True)``. It
  computes the same function up to float rounding; it is a correctness fallback: not fast, and
  (like any BLAS matmul) not batch-invariant.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from quickdraft import kernels as _kernels
from quickdraft.errors import QuickdraftError
from quickdraft.pages import PAGE_BYTES, discard_pages, weight_buffer

Q = GGMLQuantizationType
_REF_ROWS_PER_CHUNK = 4096  # the reference forward dequantizes this many output rows at a time


# --------------------------------------------------------------------------------------------
# Reference dequantization (torch ops, bit-exact to gguf.quants): blocks uint8 [nb, type_size]
# -> float32 [nb, block_size]. Same formulas and operation order as gguf.quants.
# --------------------------------------------------------------------------------------------


def _f16(blocks: torch.Tensor, off: int) -> torch.Tensor:
    """The fp16 field at byte ``off`` of every block, as float32 [nb, 1]."""
    return blocks[:, off : off + 2].contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[nb, 16] bytes -> [nb, 32]: low nibbles then high nibbles (Q4_0/Q4_1/Q5_0 order)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _dq_q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    q = _nibbles(b[:, 2:18]).to(torch.int16) - 8
    return d * q.to(torch.float32)


def _dq_q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b, 0), _f16(b, 2)
    q = _nibbles(b[:, 4:20]).to(torch.float32)
    return (d * q) + m


def _dq_q5_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    q = (_nibbles(b[:, 6:22]).to(torch.int16) | (_bits32(b[:, 2:6]) << 4)) - 16
    return d * q.to(torch.float32)


def _dq_q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    return b[:, 2:34].contiguous().view(torch.int8).to(torch.float32) * d


def _dq_q5_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b, 0), _f16(b, 2)
    hi = _bits32(b[:, 4:8])
    q = (_nibbles(b[:, 8:24]).to(torch.int16) | (hi << 4)).to(torch.float32)
    return (d * q) + m


def _bits32(qh: torch.Tensor) -> torch.Tensor:
    """[nb, 4] bytes of a little-endian u32 -> its 32 bits [nb, 32] (int16, bit e at e)."""
    word = qh.contiguous().view(torch.int32)  # [nb, 1]
    return ((word >> torch.arange(32, dtype=torch.int32, device=qh.device)) & 1).to(torch.int16)


def _k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: 12 bytes [nb, 12] -> the 8 6-bit scales and 8 mins [nb, 8] (uint8)."""
    sd, sm, smd = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([sd & 0x3F, (smd & 0x0F) | ((sd >> 2) & 0x30)], dim=-1)
    mn = torch.cat([sm & 0x3F, (smd >> 4) | ((sm >> 2) & 0x30)], dim=-1)
    return sc, mn


def _dq_q4_k(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scale_min(b[:, 4:16])
    dl = (d * sc.to(torch.float32)).reshape(nb, 8, 1)
    ml = (dmin * mn.to(torch.float32)).reshape(nb, 8, 1)
    qs = b[:, 16:144].reshape(nb, 4, 1, 32)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(nb, 8, 32).to(torch.float32)
    return (dl * q - ml).reshape(nb, 256)


def _dq_q5_k(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scale_min(b[:, 4:16])
    dl = (d * sc.to(torch.float32)).reshape(nb, 8, 1)
    ml = (dmin * mn.to(torch.float32)).reshape(nb, 8, 1)
    qh = b[:, 16:48].reshape(nb, 1, 1, 32)
    qs = b[:, 48:176].reshape(nb, 4, 1, 32)
    lo = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(nb, 8, 32)
    hi = torch.cat([(qh >> i) & 1 for i in range(8)], dim=2).reshape(nb, 8, 32)
    q = (lo | (hi << 4)).to(torch.float32)
    return (dl * q - ml).reshape(nb, 256)


def _two_bit_fields(qs: torch.Tensor) -> torch.Tensor:
    """Q2_K / Q3_K low bits: [nb, 64] bytes -> [nb, 16, 16] (element e: byte 32(e/128) + e%32,
    bits 2((e%128)/32))."""
    nb = qs.shape[0]
    q = qs.reshape(nb, 2, 1, 32)
    return torch.cat([(q >> s) & 3 for s in (0, 2, 4, 6)], dim=2).reshape(nb, 16, 16)


def _dq_q2_k(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    sc = b[:, 0:16]
    d, dmin = _f16(b, 80), _f16(b, 82)
    dl = (d * (sc & 0x0F).to(torch.float32)).reshape(nb, 16, 1)
    ml = (dmin * (sc >> 4).to(torch.float32)).reshape(nb, 16, 1)
    q = _two_bit_fields(b[:, 16:80]).to(torch.float32)
    return (dl * q - ml).reshape(nb, 256)


def _dq_q3_k(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    s, d = b[:, 96:108], _f16(b, 108)
    lo = torch.cat([s[:, 0:8] & 0x0F, s[:, 0:8] >> 4], dim=1)  # scale i: byte i % 8, nibble i / 8
    hi = torch.cat([(s[:, 8:12] >> sh) & 3 for sh in (0, 2, 4, 6)], dim=1)  # byte 8 + i % 4, field i / 4
    scales = (lo | (hi << 4)).to(torch.int16) - 32
    dl = (d * scales.to(torch.float32)).reshape(nb, 16, 1)
    hm = b[:, 0:32].reshape(nb, 1, 1, 32)
    hb = torch.cat([(hm >> i) & 1 for i in range(8)], dim=2).reshape(nb, 16, 16)
    q = _two_bit_fields(b[:, 32:96]).to(torch.int16) - ((hb ^ 1) << 2).to(torch.int16)
    return (dl * q.to(torch.float32)).reshape(nb, 256)


# llama.cpp's kvalues_iq4nl: the 16 values an IQ4_NL / IQ4_XS nibble indexes
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _iq4(idx: torch.Tensor) -> torch.Tensor:
    return torch.tensor(IQ4_VALUES, dtype=torch.float32, device=idx.device)[idx.long()]


def _dq_iq4_nl(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * _iq4(_nibbles(b[:, 2:18]))


def _dq_iq4_xs(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    d = _f16(b, 0)
    sh = b[:, 2:4].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF  # [nb, 1]
    sl = b[:, 4:8]
    lo = torch.stack([sl & 0x0F, sl >> 4], dim=2).reshape(nb, 8).to(torch.int32)
    hi = (sh >> (2 * torch.arange(8, dtype=torch.int32, device=b.device))) & 3
    dl = (d * ((lo | (hi << 4)) - 32).to(torch.float32)).reshape(nb, 8, 1)
    qs = b[:, 8:136].reshape(nb, 8, 16)
    return (dl * _iq4(torch.cat([qs & 0x0F, qs >> 4], dim=2))).reshape(nb, 256)


# llama.cpp's kvalues_mxfp4: the 16 FP4 (E2M1) values doubled, which a 2^(e - 128) scale undoes
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def _dq_mxfp4(b: torch.Tensor) -> torch.Tensor:
    e = b[:, 0:1].to(torch.int32)
    bits = torch.where(e < 2, torch.bitwise_left_shift(torch.full_like(e, 0x00200000), e), (e - 1) << 23)
    d = bits.view(torch.float32)  # 2^(e - 128): ggml_e8m0_to_fp32_half
    values = torch.tensor(MXFP4_VALUES, dtype=torch.float32, device=b.device)
    return d * values[_nibbles(b[:, 1:17]).long()]


def _dq_f16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).to(torch.float32)


def _dq_bf16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.bfloat16).to(torch.float32)


def _dq_q6_k(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    ql = b[:, 0:128].reshape(nb, 2, 1, 64)
    ql = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(nb, 8, 32)
    qh = b[:, 128:192].reshape(nb, 2, 1, 32)
    qh = torch.cat([(qh >> s) & 0x03 for s in (0, 2, 4, 6)], dim=2).reshape(nb, 8, 32)
    q = ((ql | (qh << 4)).to(torch.int16) - 32).reshape(nb, 16, 16).to(torch.float32)
    scales = b[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
    d = _f16(b, 208)
    return ((d * scales).reshape(nb, 16, 1) * q).reshape(nb, 256)


_DEQUANT: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.Q4_0: _dq_q4_0,
    Q.Q4_1: _dq_q4_1,
    Q.Q5_0: _dq_q5_0,
    Q.Q5_1: _dq_q5_1,
    Q.Q8_0: _dq_q8_0,
    Q.IQ4_NL: _dq_iq4_nl,
    Q.Q2_K: _dq_q2_k,
    Q.Q3_K: _dq_q3_k,
    Q.Q4_K: _dq_q4_k,
    Q.Q5_K: _dq_q5_k,
    Q.Q6_K: _dq_q6_k,
    Q.IQ4_XS: _dq_iq4_xs,
    Q.MXFP4: _dq_mxfp4,
    Q.F16: _dq_f16,
    Q.BF16: _dq_bf16,
}
SUPPORTED_TYPES: tuple[GGMLQuantizationType, ...] = tuple(_DEQUANT)
FLOAT_TYPES: tuple[GGMLQuantizationType, ...] = (Q.F16, Q.BF16)  # kept as they are; fp32 activations
FLOAT_BLOCK = 32  # the kernels read F16 / BF16 rows 32 values at a time: in_features must divide


def ggml_row_bytes(qtype: GGMLQuantizationType, in_features: int) -> int:
    """Bytes of one row of ``in_features`` values in the GGML layout."""
    bs, ts = GGML_QUANT_SIZES[qtype]
    return in_features // bs * ts


def block_size(qtype: GGMLQuantizationType) -> int:
    """Values per block as the kernels read them (F16 / BF16: 32, else GGML's block size)."""
    return FLOAT_BLOCK if qtype in FLOAT_TYPES else GGML_QUANT_SIZES[qtype][0]


# --------------------------------------------------------------------------------------------
# The lane layout (the q8 kernels' own; see LANES in kernels/ggml_q8.h): the same values moved so
# that lane j of every 32-byte vector holds 4 values of 32-group j (Q4_K, Q6_K: within each block;
# 32-block formats: 8 blocks per super-block of 256, a partial last one padded with zero blocks).
# GGMLLinear repacks into it on the first q8 kernel call and back for everything else.
# --------------------------------------------------------------------------------------------

LANE_TYPES: tuple[GGMLQuantizationType, ...] = tuple(t for t in SUPPORTED_TYPES if t not in FLOAT_TYPES)
LANES_ID = 1000  # the kernels' id of a lane layout: GGML type id + LANES_ID


def lanes_row_bytes(qtype: GGMLQuantizationType, in_features: int) -> int:
    """Bytes per row in the lane layout: the GGML row for 256-value blocks (K-quants, IQ4_XS); for
    the 32-block formats ceil(K / 256) super-blocks of 8 blocks (a partial last one padded)."""
    bs, ts = GGML_QUANT_SIZES[qtype]
    if bs == 256:
        return in_features // bs * ts
    return -(-in_features // 256) * 8 * ts


def _lane_parts(qtype: GGMLQuantizationType) -> list[tuple[list[int], list[int], list[int], list[int], int]]:
    """Per bit field of the 256 values: (GGML byte, GGML shift, lanes byte, lanes shift, mask)."""
    lane_b, lane_v = [], []
    for e in range(256):
        j, t = divmod(e, 32)
        lane_v.append(t // 4)
        lane_b.append(4 * j + t % 4)
    if qtype == Q.Q4_K:
        nat = [(16 + 32 * (e // 64) + e % 32, 4 * (e % 64 >= 32)) for e in range(256)]
        lanes = [(16 + 32 * (v // 2) + b, 4 * (v % 2)) for v, b in zip(lane_v, lane_b, strict=True)]
        return [([n[0] for n in nat], [n[1] for n in nat], [x[0] for x in lanes], [x[1] for x in lanes], 0x0F)]
    lo = [(64 * (e // 128) + e % 64, 4 * (e % 128 >= 64)) for e in range(256)]
    hi = [(128 + 32 * (e // 128) + e % 32, 2 * (e % 128 // 32)) for e in range(256)]
    lane_lo = [(32 * (v // 2) + b, 4 * (v % 2)) for v, b in zip(lane_v, lane_b, strict=True)]
    lane_hi = [(128 + 32 * (v // 4) + b, 2 * (v % 4)) for v, b in zip(lane_v, lane_b, strict=True)]
    return [
        ([x[0] for x in lo], [x[1] for x in lo], [x[0] for x in lane_lo], [x[1] for x in lane_lo], 0x0F),
        ([x[0] for x in hi], [x[1] for x in hi], [x[0] for x in lane_hi], [x[1] for x in lane_hi], 0x03),
    ]


def repack_lanes_reference(
    qtype: GGMLQuantizationType | int, raw: torch.Tensor, to_lanes: bool
) -> torch.Tensor:
    """A copy of Q4_K / Q6_K rows [N, row_bytes] in the lane layout (``to_lanes``: values moved within
    each block, rows interleaved per panel) or back in GGML's (torch ops)."""
    qt = _qtype(qtype)
    if qt not in (Q.Q4_K, Q.Q6_K):
        raise ValueError(f"the torch lane layout covers Q4_K and Q6_K, not {qt.name}")
    ts = GGML_QUANT_SIZES[qt][1]
    blocks = raw.reshape(-1, ts)
    if not to_lanes:
        blocks = interleave_panels_reference(raw, ts, False).reshape(-1, ts)
        return _repack_blocks(qt, blocks, False).reshape(raw.shape)
    return interleave_panels_reference(_repack_blocks(qt, blocks, True).reshape(raw.shape), ts, True)


def _repack_blocks(qt: GGMLQuantizationType, blocks: torch.Tensor, to_lanes: bool) -> torch.Tensor:
    """Q4_K / Q6_K blocks [nb, ts] with their values moved to the lane positions (or back)."""
    ts = blocks.shape[1]
    q0, q1 = (16, 144) if qt == Q.Q4_K else (0, 192)  # the bytes the values live in
    packed = torch.zeros(blocks.shape[0], ts, dtype=torch.int32, device=blocks.device)
    dev = blocks.device
    for nat_b, nat_s, lane_b, lane_s, mask in _lane_parts(qt):
        src_b, src_s, dst_b, dst_s = (nat_b, nat_s, lane_b, lane_s) if to_lanes else (lane_b, lane_s, nat_b, nat_s)
        vals = (blocks[:, torch.tensor(src_b, device=dev)].to(torch.int32)
                >> torch.tensor(src_s, dtype=torch.int32, device=dev)) & mask
        vals = vals << torch.tensor(dst_s, dtype=torch.int32, device=dev)
        packed.scatter_add_(1, torch.tensor(dst_b, device=dev).expand_as(vals), vals)  # disjoint bits
    out = blocks.clone()
    out[:, q0:q1] = packed[:, q0:q1].to(torch.uint8)
    return out


PANEL_ROWS = 8  # the q8 kernels' panel (NP): lanes rows are stored interleaved per panel
REPACK_SLAB_ROWS = 4096  # whole panels: a slab's panels sit where the whole matrix's do


def interleave_panels_reference(raw: torch.Tensor, block_bytes: int, to_panels: bool) -> torch.Tensor:
    """rows [N, row_bytes] of lanes blocks -> panels of PANEL_ROWS rows stored chunk by chunk (block c
    of row 8p + j at byte 8p * row_bytes + (c * nn + j) * block_bytes, nn = the panel's rows), or
    back. The kernels' layout (``interleave_panels`` in kernels/ggml_q8.h), in torch ops."""
    n, row_bytes = raw.shape
    nb = row_bytes // block_bytes
    out = torch.empty_like(raw)
    for p0 in range(0, n, PANEL_ROWS):
        nn = min(PANEL_ROWS, n - p0)
        part = raw[p0 : p0 + nn]
        if to_panels:
            out[p0 : p0 + nn] = part.reshape(nn, nb, block_bytes).transpose(0, 1).reshape(nn, row_bytes)
        else:
            out[p0 : p0 + nn] = part.reshape(nb, nn, block_bytes).transpose(0, 1).reshape(nn, row_bytes)
    return out


def _qtype(qtype: GGMLQuantizationType | int) -> GGMLQuantizationType:
    qt = GGMLQuantizationType(int(qtype))
    if qt not in _DEQUANT:
        names = ", ".join(t.name for t in SUPPORTED_TYPES)
        raise ValueError(
            f"GGML type {qt.name} is not supported by quickdraft.quant (supported: {names})"
        )
    return qt


def dequantize_reference(
    qtype: GGMLQuantizationType | int, raw: torch.Tensor, in_features: int
) -> torch.Tensor:
    """Pure-PyTorch dequantization of raw rows uint8 [N, row_bytes] -> float32 [N, in_features].

    Bit-exact to ``gguf.quants.dequantize``; runs on the tensor's device.
    """
    qt = _qtype(qtype)
    bs, ts = GGML_QUANT_SIZES[qt]
    n = raw.shape[0]
    if raw.dim() != 2 or in_features % bs or raw.shape[1] != in_features // bs * ts:
        raise ValueError(
            f"raw {tuple(raw.shape)} does not hold {qt.name} rows of {in_features} elements"
        )
    out = torch.empty(n, in_features, dtype=torch.float32, device=raw.device)
    fn = _DEQUANT[qt]
    for r0 in range(0, n, _REF_ROWS_PER_CHUNK):  # bounded temporaries for huge tensors
        r1 = min(n, r0 + _REF_ROWS_PER_CHUNK)
        blocks = raw[r0:r1].reshape(-1, ts)
        out[r0:r1] = fn(blocks).reshape(r1 - r0, in_features)
    return out


# --------------------------------------------------------------------------------------------
# Activation quantization (the "q8" mode): the kernels' rule, reproduced bit for bit in torch
# --------------------------------------------------------------------------------------------

ACTIVATION_MODES = ("q8", "f32")


def activation_block_size(qtype: GGMLQuantizationType | int) -> int | None:
    """Values per activation scale in q8 mode: 256 for 256-value weight blocks ("Q8_K"), 32 for
    32-value ones, None for F16 / BF16 weights (their activations stay fp32 in either mode)."""
    qt = _qtype(qtype)
    if qt in FLOAT_TYPES:
        return None
    return 256 if GGML_QUANT_SIZES[qt][0] == 256 else 32


def quantize_activations_reference(
    x: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x float32 [T, K] -> (q int8 [T, K], d float32 [T, K/bs], sums), as the kernels quantize.

    Per block of ``block_size`` values: ``d = amax / 127`` (amax = max |x|, float32),
    ``id = 1 / d`` (0 where d is 0), ``q = round_half_even(x * id)``. ``sums`` holds the sums
    of q per 16 values (int16 [T, K/16]) for block size 256, per 32 values (int32 [T, K/32])
    for 32. Bit-exact to the kernels' ``quantize_activations``.
    """
    if block_size not in (32, 256):
        raise ValueError(f"block_size must be 32 or 256, got {block_size}")
    t, k = x.shape
    if k % block_size:
        raise ValueError(f"{k} values per row is not a multiple of the block size {block_size}")
    xb = x.to(torch.float32).reshape(t, k // block_size, block_size)
    d = xb.abs().amax(dim=-1) / 127.0
    inv = torch.where(d != 0, torch.div(torch.ones_like(d), d), torch.zeros_like(d))
    q = torch.round(xb * inv.unsqueeze(-1)).to(torch.int8).reshape(t, k)
    group = 16 if block_size == 256 else 32
    sums = q.reshape(t, k // group, group).sum(dim=-1, dtype=torch.int32)
    return q, d, sums.to(torch.int16) if group == 16 else sums


def q8_activations_reference(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """The values the q8 mode multiplies with: ``q * d`` per block, float32 [T, K]."""
    q, d, _ = quantize_activations_reference(x, block_size)
    t, k = x.shape
    return (q.to(torch.float32).reshape(t, -1, block_size) * d.unsqueeze(-1)).reshape(t, k)


def _env_activation_mode() -> str:
    value = os.environ.get("QUICKDRAFT_ACTIVATIONS", "").strip().lower()
    if value in ("", "q8", "int8"):
        return "q8"
    if value in ("f32", "fp32", "float32", "exact"):
        return "f32"
    raise QuickdraftError(
        f"QUICKDRAFT_ACTIVATIONS={value!r} is not an activation mode; set it to q8 (the default: "
        "activations rounded to int8 per block, like llama.cpp) or f32 (exact fp32 activations)"
    )


_default_mode: str | None = None  # resolved from QUICKDRAFT_ACTIVATIONS on first use
_epoch = 0  # bumped whenever a layer's weight tensor, layout or mode may have changed


def layout_epoch() -> int:
    """A counter that changes whenever any GGMLLinear's weight tensor, layout or activation mode
    (or the process default, or the path) may have changed: holders of raw tensors (the native
    decoder stack) rebuild when it moves."""
    return _epoch


def _bump_epoch() -> None:
    global _epoch
    _epoch += 1


def default_activation_mode() -> str:
    """The mode of GGMLLinear modules without their own: QUICKDRAFT_ACTIVATIONS, else "q8"."""
    global _default_mode
    if _default_mode is None:
        _default_mode = _env_activation_mode()
    return _default_mode


def set_default_activation_mode(mode: str | None) -> None:
    """Set the process-wide default mode ("q8" or "f32"); None re-reads QUICKDRAFT_ACTIVATIONS."""
    global _default_mode
    _default_mode = None if mode is None else _check_mode(mode)
    _bump_epoch()
    if mode is None:
        default_activation_mode()


def _check_mode(mode: str) -> str:
    if mode not in ACTIVATION_MODES:
        raise QuickdraftError(
            f"activation mode {mode!r} is not one of {', '.join(ACTIVATION_MODES)} "
            "(q8: int8 activations per block, fast; f32: exact fp32 activations)"
        )
    return mode


def set_activation_mode(module: nn.Module, mode: str | None) -> int:
    """Set the activation mode of every GGMLLinear in ``module`` (itself included).

    ``mode``: "q8", "f32", or None (follow the process default again). Returns how many layers
    were set. A model must use one mode for all its passes: speculative verification reproduces
    plain decoding bit for bit only when both run in the same mode.
    """
    if mode is not None:
        _check_mode(mode)
    n = 0
    for m in module.modules():
        if isinstance(m, GGMLLinear):
            m.activations = mode
            n += 1
    return n


# --------------------------------------------------------------------------------------------
# Path selection
# --------------------------------------------------------------------------------------------


def kernels_available() -> bool:
    """True if the native CPU kernels are built (building them on first call)."""
    return _kernels.load() is not None


# Whether the reference path is forced: None follows QUICKDRAFT_KERNELS (read once, here and on
# set_reference_mode(None)), True/False is set_reference_mode's override.
_forced: bool | None = None
_env_reference = _kernels.disabled_by_env()


def set_reference_mode(enabled: bool | None) -> None:
    """Force the pure-PyTorch reference path (True), the kernels where they build (False), or
    follow ``QUICKDRAFT_KERNELS`` again (None; re-reads the environment variable)."""
    global _forced, _env_reference
    _bump_epoch()
    _forced = None if enabled is None else bool(enabled)
    if enabled is None:
        _env_reference = _kernels.disabled_by_env()


@contextlib.contextmanager
def reference_mode(enabled: bool = True) -> Iterator[None]:
    """``with reference_mode(): ...`` runs GGMLLinear on the reference path inside the block."""
    global _forced
    prev = _forced
    _forced = bool(enabled)
    try:
        yield
    finally:
        _forced = prev


def reference_forced() -> bool:
    """True if the reference path is forced (``set_reference_mode`` or ``QUICKDRAFT_KERNELS=ref``)."""
    return _env_reference if _forced is None else _forced


def _active_kernels() -> ModuleType | None:
    if _env_reference if _forced is None else _forced:
        return None
    return _kernels.load()  # two global reads once the first call has built or failed


def active_kernels() -> ModuleType | None:
    """The native kernel module when it is built and not disabled (reference mode), else None."""
    return _active_kernels()


def kernels_active() -> bool:
    """True if GGMLLinear on CPU tensors would run the native kernels right now."""
    return _active_kernels() is not None


# --------------------------------------------------------------------------------------------
# The layer
# --------------------------------------------------------------------------------------------


class GGMLLinear(nn.Module):
    """``y = x @ W.T + b`` with W kept as raw GGML blocks (a buffer: ``.to(device)`` moves it).

    ``forward`` takes float32 (or bf16/fp16, upcast) ``[..., in_features]`` and returns float32
    ``[..., out_features]``. ``activations``: "q8" (x rounded to int8 per block, integer dot
    products), "f32" (exact fp32 activations), or None (the process default,
    :func:`default_activation_mode`); see :func:`set_activation_mode`.
    """

    raw: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self,
        qtype: GGMLQuantizationType | int,
        raw: torch.Tensor,
        in_features: int,
        bias: torch.Tensor | None = None,
        activations: str | None = None,
        lanes: bool = False,
        owns_raw: bool = False,
    ) -> None:
        """``raw`` holds GGML blocks, or with ``lanes`` the q8 kernels' lane layout of them
        (prepared weights: :mod:`quickdraft.loading.prepared`). ``owns_raw``: nothing else reads
        ``raw`` (a loader's copy), so a change of layout may write over it; otherwise it repacks a copy
        and the caller's tensor is left as it was."""
        super().__init__()
        self._activations = None if activations is None else _check_mode(activations)
        self.qtype = _qtype(qtype)
        self._qt = int(self.qtype)
        if lanes and self.qtype not in LANE_TYPES:
            raise ValueError(f"{self.qtype.name} has no lane layout")
        bs = block_size(self.qtype)
        if not isinstance(raw, torch.Tensor):
            raw = torch.as_tensor(raw)
        if raw.dtype != torch.uint8:
            raise TypeError(f"raw must be uint8 bytes, got {raw.dtype}")
        if in_features <= 0 or in_features % bs:
            raise ValueError(
                f"in_features {in_features} is not a multiple of the {self.qtype.name} block size {bs}"
            )
        row_bytes = lanes_row_bytes(self.qtype, in_features) if lanes else ggml_row_bytes(self.qtype, in_features)
        if raw.dim() == 1:
            raw = raw.reshape(-1, row_bytes)
        if raw.dim() != 2 or raw.shape[1] != row_bytes:
            raise ValueError(
                f"raw {tuple(raw.shape)} is not [out_features, {row_bytes}] for {self.qtype.name} x {in_features}"
            )
        self.in_features = int(in_features)
        self.out_features = int(raw.shape[0])
        self.register_buffer("raw", raw.contiguous())
        if bias is not None:
            if bias.numel() != self.out_features:
                raise ValueError(f"bias has {bias.numel()} elements, expected {self.out_features}")
            bias = bias.detach().reshape(-1).to(torch.float32).contiguous()
        self.register_buffer("bias", bias)
        self._ref_weight: torch.Tensor | None = None
        self._cache_ref = False
        self._act_block = activation_block_size(self.qtype)
        self._lanes = lanes  # raw holds the lane layout (after a q8 kernel call, or prepared)
        self._owns_raw = owns_raw

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   qtype: GGMLQuantizationType = GGMLQuantizationType.Q8_0) -> GGMLLinear:
        """A float ``weight`` [out, in] quantized to ``qtype`` blocks (gguf's quantizer: llama.cpp's
        rounding), e.g. a drafter shipped in bf16 that runs on the q8 kernels (a drafter's weights
        change only what it proposes, never the output)."""
        from gguf import quants

        raw = quants.quantize(weight.detach().float().cpu().numpy(), qtype)
        return cls(qtype, torch.from_numpy(raw), int(weight.shape[1]), bias=bias)

    @property
    def activations(self) -> str | None:
        """This layer's own activation mode ("q8", "f32"), or None: the process default."""
        return self._activations

    @activations.setter
    def activations(self, mode: str | None) -> None:
        self._activations = None if mode is None else _check_mode(mode)
        _bump_epoch()

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 (.to(), .cuda(), ...: new tensors)
        _bump_epoch()
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"qtype={self.qtype.name}, bias={self.bias is not None}, "
            f"activations={self.activations or 'default'}"
        )

    @property
    def activation_mode(self) -> str:
        """The mode forward uses now: its own, or the process default; always "f32" for F16 / BF16
        weights (there is nothing to gain from rounding activations for them)."""
        if self._act_block is None:
            return "f32"
        return self.activations or _default_mode or default_activation_mode()

    @property
    def weight_bytes(self) -> int:
        return self.raw.numel()

    def cache_reference_weight(self, enabled: bool = True) -> None:
        """Keep the dequantized fp32 weight for the reference path (tests; costs 4 bytes/weight)."""
        self._cache_ref = enabled
        if not enabled:
            self._ref_weight = None

    def _repack(self, raw: torch.Tensor, to_lanes: bool) -> torch.Tensor:
        mod = _kernels.load()  # (also in reference mode: lanes were made by the kernels)
        if mod is not None:
            out = mod.repack_lanes(self._qt, raw.cpu().contiguous(), self.in_features, to_lanes)
            return out.to(raw.device)
        if self.qtype in (Q.Q4_K, Q.Q6_K):
            return repack_lanes_reference(self.qtype, raw, to_lanes)
        raise QuickdraftError(f"{self.qtype.name} lanes need the native kernels to repack")  # (never made without)

    def _repack_own(self, raw: torch.Tensor, to_lanes: bool) -> torch.Tensor:
        """:meth:`_repack` for the layer's own ``raw``. A raw the layer owns is repacked a slab of whole
        panels at a time, so no matrix is held twice (a 262k-row output head; the experts of a layer,
        views of one stacked tensor that stays until the last of them is done): written back over
        itself where both layouts take the same bytes per row, else into a new tensor while the pages
        of each slab done are given back."""
        mod = _kernels.load()
        if not self._owns_raw or mod is None or not raw.is_cpu:
            return self._repack(raw, to_lanes)
        lanes, ggml = lanes_row_bytes(self.qtype, self.in_features), ggml_row_bytes(self.qtype, self.in_features)
        out = raw if lanes == ggml else torch.from_numpy(weight_buffer((raw.shape[0], lanes if to_lanes else ggml)))
        flat, row = raw.view(-1), raw.shape[1]
        for r0 in range(0, raw.shape[0], REPACK_SLAB_ROWS):
            slab = raw[r0 : r0 + REPACK_SLAB_ROWS]
            out[r0 : r0 + REPACK_SLAB_ROWS] = mod.repack_lanes(self._qt, slab, self.in_features, to_lanes)
            if out is not raw:  # this slab's pages, and the one it shares with the slab before (done)
                discard_pages(flat[max(0, r0 * row - PAGE_BYTES) : (r0 + slab.shape[0]) * row])
        return out

    def _set_layout(self, lanes: bool) -> int:
        """Puts raw in the lane layout (q8 kernels) or the GGML one; returns the kernels' type id."""
        if self.qtype not in LANE_TYPES:
            return self._qt
        if self._lanes != lanes:
            self.raw = self._repack_own(self.raw, lanes)
            self._lanes = lanes
            _bump_epoch()
        return self._qt + LANES_ID if lanes else self._qt

    def select_rows(self, ids: torch.Tensor) -> GGMLLinear:
        """A new layer computing only output rows ``ids`` (in that order), sharing nothing with this
        one; its blocks in the GGML layout (repacked for the kernels at its first q8 pass)."""
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.raw.device)
        bias = None if self.bias is None else self.bias.index_select(0, ids)
        return GGMLLinear(self.qtype, self._ggml_rows(ids), self.in_features, bias=bias,
                          activations=self._activations)

    def _ggml_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (long [n]) of the weight in the GGML layout [n, row_bytes]."""
        if not self._lanes:
            return self.raw.index_select(0, ids)
        mod = _kernels.load()  # lanes are made by the kernels only
        if mod is None:
            raise QuickdraftError(f"{self.qtype.name} lanes need the native kernels to read")  # (never made without)
        return mod.lanes_rows(self._qt, self.raw.cpu(), self.in_features, ids.cpu()).to(self.raw.device)

    def ggml_raw(self) -> torch.Tensor:
        """The weight's blocks in the GGML layout (raw itself, or a copy when raw holds lanes)."""
        return self._repack(self.raw, False) if self._lanes else self.raw

    def dequantize(self) -> torch.Tensor:
        """The weight as float32 [out_features, in_features], bit-exact to gguf's dequantization."""
        mod = _active_kernels()
        raw = self.ggml_raw()
        if mod is not None and raw.device.type == "cpu":
            return mod.dequantize(self._qt, raw, self.in_features)
        return dequantize_reference(self.qtype, raw, self.in_features)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the weight, dequantized: [*ids.shape, in_features] float32."""
        rows = self._ggml_rows(ids.reshape(-1).to(device=self.raw.device, dtype=torch.long))
        mod = _active_kernels()
        if mod is not None and rows.device.type == "cpu":
            out = mod.dequantize(int(self.qtype), rows, self.in_features)
        else:
            out = dequantize_reference(self.qtype, rows, self.in_features)
        return out.reshape(*ids.shape, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mod = _active_kernels()
        q8 = self.activation_mode == "q8"
        if mod is not None and x.is_cpu and self.raw.is_cpu:
            if x.dtype != torch.float32:
                x = x.float()
            fn = mod.linear_q8 if q8 else mod.linear
            qt = self._set_layout(q8)
            if x.dim() == 2:  # the decode / verify fast path: [T, K] -> [T, N]
                return fn(qt, self.raw, x.contiguous(), self.in_features, self.bias)
            y = fn(
                qt,
                self.raw,
                x.reshape(-1, self.in_features).contiguous(),
                self.in_features,
                self.bias,
            )
            return y.reshape(*x.shape[:-1], self.out_features)
        self._set_layout(False)
        x2 = x.reshape(-1, self.in_features).float()
        if q8:
            assert self._act_block is not None  # (q8 mode implies a block format)
            x2 = q8_activations_reference(x2, self._act_block)
        y = self._reference_forward(x2)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._cache_ref:
            if self._ref_weight is None or self._ref_weight.device != self.raw.device:
                self._ref_weight = dequantize_reference(self.qtype, self.raw, self.in_features)
            y = x @ self._ref_weight.T
        else:
            y = x.new_empty(x.shape[0], self.out_features)
            for n0 in range(0, self.out_features, _REF_ROWS_PER_CHUNK):
                n1 = min(self.out_features, n0 + _REF_ROWS_PER_CHUNK)
                w = dequantize_reference(self.qtype, self.raw[n0:n1], self.in_features)
                y[:, n0:n1] = x @ w.T
        if self.bias is not None:
            y = y + self.bias
        return y


def ggml_linear_multi(modules: Sequence[nn.Module], x: torch.Tensor) -> list[torch.Tensor]:
    """``[m(x) for m in modules]``, in one kernel call where it can be.

    For linears that share their input (q/k/v, gate/up): when every module is a GGMLLinear in
    q8 mode with the same in_features and the kernels run on CPU tensors, x is quantized once
    and all products are computed in one parallel region (one thread wake-up, one Python call).
    Otherwise (other module types, f32 mode, the reference path) each module is called; the
    results are the same bits either way.
    """
    mod = _active_kernels()
    if (
        mod is None
        or not x.is_cpu
        or len(modules) < 2
        or not all(
            isinstance(m, GGMLLinear)
            and m.raw.is_cpu
            and m.in_features == x.shape[-1]
            and m.activation_mode == "q8"
            for m in modules
        )
    ):
        return [m(x) for m in modules]
    lins: list[GGMLLinear] = list(modules)  # type: ignore[arg-type]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.dtype != torch.float32:
        x2 = x2.float()
    specs = [(m._set_layout(True), m.raw, m.in_features, m.bias) for m in lins]
    ys = mod.linear_multi(x2.contiguous(), specs)
    if x.dim() == 2:
        return list(ys)
    return [y.reshape(*x.shape[:-1], m.out_features) for y, m in zip(ys, lins, strict=True)]


def ggml_linear_grouped(groups: Sequence[Sequence[nn.Module]], x: torch.Tensor,
                        counts: Sequence[int]) -> list[list[torch.Tensor]]:
    """``[[m(rows_g) for m in groups[g]] for g]``, rows_g the g-th of ``x``'s consecutive groups of
    ``counts[g]`` rows (a pass's rows grouped by routed expert, each expert's projections on its
    rows), in one kernel call where every module is a GGMLLinear in q8 mode on CPU tensors: each
    row quantized alone, each weight's panels over its group's rows as in its own call, so the same
    bits either way."""
    mod = _active_kernels()
    flat = [m for g in groups for m in g]
    lins = [m for m in flat if isinstance(m, GGMLLinear) and m.raw.is_cpu and m.activation_mode == "q8"
            and m.in_features == x.shape[-1]]
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + int(c))
    if mod is None or not x.is_cpu or x.dim() != 2 or len(lins) != len(flat) or len(lins) < 2:
        return [[m(x[starts[g] : starts[g + 1]]) for m in ms] for g, ms in enumerate(groups)]
    specs = [(m._set_layout(True), m.raw, m.in_features, m.bias) for m in lins]
    which = [g for g, ms in enumerate(groups) for _ in ms]
    ys = iter(mod.linear_grouped(x.float().contiguous(), [int(c) for c in counts], specs, which))
    return [[next(ys) for _ in ms] for ms in groups]
