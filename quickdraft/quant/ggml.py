"""Linear layers that keep GGUF weights in their own GGML blocks (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K).

Two paths compute the same thing:

* the native kernels (``quickdraft.kernels``, AVX2/FMA/OpenMP): every weight block is read once per
  call and reused for all 1..T input rows, and a row's result is bitwise identical whatever T is
  (batch invariance, so speculative verification reproduces plain decoding exactly);
* the pure-PyTorch reference: dequantize with torch ops (bit-exact to ``gguf.quants.dequantize``),
  then ``x @ w.T``. It runs wherever torch does (also on GPUs) and is used when the kernels cannot
  be built, when ``QUICKDRAFT_KERNELS=ref`` is set, or after ``set_reference_mode(True)``. It is a
  correctness fallback: not fast, and (like any BLAS matmul) not batch-invariant.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from types import ModuleType

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from quickdraft import kernels as _kernels

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
    qh = b[:, 2:6].contiguous().view(torch.int32)  # [nb, 1], little-endian
    hi = ((qh >> torch.arange(32, dtype=torch.int32, device=b.device)) & 1).to(torch.int16)
    q = (_nibbles(b[:, 6:22]).to(torch.int16) | (hi << 4)) - 16
    return d * q.to(torch.float32)


def _dq_q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    return b[:, 2:34].contiguous().view(torch.int8).to(torch.float32) * d


def _dq_q4_k(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    s = b[:, 4:16]
    sd, sm, smd = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([sd & 0x3F, (smd & 0x0F) | ((sd >> 2) & 0x30)], dim=-1)
    mn = torch.cat([sm & 0x3F, (smd >> 4) | ((sm >> 2) & 0x30)], dim=-1)
    dl = (d * sc.to(torch.float32)).reshape(nb, 8, 1)
    ml = (dmin * mn.to(torch.float32)).reshape(nb, 8, 1)
    qs = b[:, 16:144].reshape(nb, 4, 1, 32)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(nb, 8, 32).to(torch.float32)
    return (dl * q - ml).reshape(nb, 256)


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
    Q.Q8_0: _dq_q8_0,
    Q.Q4_K: _dq_q4_k,
    Q.Q6_K: _dq_q6_k,
}
SUPPORTED_TYPES: tuple[GGMLQuantizationType, ...] = tuple(_DEQUANT)


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


def kernels_active() -> bool:
    """True if GGMLLinear on CPU tensors would run the native kernels right now."""
    return _active_kernels() is not None


# --------------------------------------------------------------------------------------------
# The layer
# --------------------------------------------------------------------------------------------


class GGMLLinear(nn.Module):
    """``y = x @ W.T + b`` with W kept as raw GGML blocks (a buffer: ``.to(device)`` moves it).

    ``forward`` takes float32 (or bf16/fp16, upcast) ``[..., in_features]`` and returns float32
    ``[..., out_features]``.
    """

    raw: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self,
        qtype: GGMLQuantizationType | int,
        raw: torch.Tensor,
        in_features: int,
        bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.qtype = _qtype(qtype)
        self._qt = int(self.qtype)
        bs, ts = GGML_QUANT_SIZES[self.qtype]
        if not isinstance(raw, torch.Tensor):
            raw = torch.as_tensor(raw)
        if raw.dtype != torch.uint8:
            raise TypeError(f"raw must be uint8 bytes, got {raw.dtype}")
        if in_features <= 0 or in_features % bs:
            raise ValueError(
                f"in_features {in_features} is not a multiple of the {self.qtype.name} block size {bs}"
            )
        row_bytes = in_features // bs * ts
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

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"qtype={self.qtype.name}, bias={self.bias is not None}"
        )

    @property
    def weight_bytes(self) -> int:
        return self.raw.numel()

    def cache_reference_weight(self, enabled: bool = True) -> None:
        """Keep the dequantized fp32 weight for the reference path (tests; costs 4 bytes/weight)."""
        self._cache_ref = enabled
        if not enabled:
            self._ref_weight = None

    def dequantize(self) -> torch.Tensor:
        """The weight as float32 [out_features, in_features], bit-exact to gguf's dequantization."""
        mod = _active_kernels()
        if mod is not None and self.raw.device.type == "cpu":
            return mod.dequantize(int(self.qtype), self.raw, self.in_features)
        return dequantize_reference(self.qtype, self.raw, self.in_features)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the weight, dequantized: [*ids.shape, in_features] float32."""
        rows = self.raw.index_select(
            0, ids.reshape(-1).to(device=self.raw.device, dtype=torch.long)
        )
        mod = _active_kernels()
        if mod is not None and rows.device.type == "cpu":
            out = mod.dequantize(int(self.qtype), rows, self.in_features)
        else:
            out = dequantize_reference(self.qtype, rows, self.in_features)
        return out.reshape(*ids.shape, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mod = _active_kernels()
        if mod is not None and x.is_cpu and self.raw.is_cpu:
            if x.dtype != torch.float32:
                x = x.float()
            if x.dim() == 2:  # the decode / verify fast path: [T, K] -> [T, N]
                return mod.linear(self._qt, self.raw, x.contiguous(), self.in_features, self.bias)
            y = mod.linear(
                self._qt,
                self.raw,
                x.reshape(-1, self.in_features).contiguous(),
                self.in_features,
                self.bias,
            )
            return y.reshape(*x.shape[:-1], self.out_features)
        y = self._reference_forward(x.reshape(-1, self.in_features).float())
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
