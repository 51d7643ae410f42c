"""FP8 (E4M3) weights: quantization, the :class:`FP8Linear` layer, and reading published FP8 checkpoints.

A weight ``W [N, K]`` is stored as ``q = round_e4m3(W / s)`` (``torch.float8_e4m3fn``, 1 byte per
weight) with fp32 scales ``s`` over rectangular blocks of ``bn x bk`` weights: per-tensor (one
block, ``[1, 1]``), per-output-channel (``bn = 1, bk = K``: ``[N, 1]``), or 2-D blocks such as
128x128 (``[ceil(N/128), ceil(K/128)]``, the DeepSeek-V3 / Qwen3 "fp8" layout). Quantization uses
``s = amax(block) / 448`` (448 is E4M3's largest finite value), so every element is rounded to
3 mantissa bits: relative error at most 2^-4, absolute at most ``s * 2^-10`` in the subnormal range.

Checkpoint layouts read here (config keys and tensor names as published; checked against the
``compressed-tensors`` sources, transformers' ``FineGrainedFP8Config`` / ``FP8Linear`` and vLLM's
``Fp8Config``, and FP8 model configs on the Hugging Face hub):

* ``quantization_config.quant_method == "compressed-tensors"`` (llm-compressor; "FP8-dynamic",
  "FP8" models): ``format`` "float-quantized" or "naive-quantized" (also per config group);
  ``config_groups.<g>.weights`` with ``num_bits: 8, type: "float", symmetric: true`` and
  ``strategy`` "tensor" | "channel" | "group" (``group_size``) | "block" (``block_structure``
  ``[bn, bk]``); ``ignore`` lists modules kept unquantized (usually ``["lm_head"]``). Tensors:
  ``X.weight`` (float8_e4m3fn) and ``X.weight_scale`` (often bf16; shape ``[N, 1]`` per channel,
  ``[1]`` per tensor, ``[N, K/g]`` per group); optional ``X.weight_zero_point`` (zeros: symmetric),
  ``X.input_scale`` / ``X.input_zero_point`` (static activation quantization) and ``k_scale`` /
  ``v_scale`` (``kv_cache_scheme``). Dequantization is ``q * weight_scale``. Older checkpoints
  name the section ``compression_config``.
* ``quant_method == "fp8"`` (DeepSeek-V3/R1, Qwen3-*-FP8; transformers' FineGrainedFP8):
  ``weight_block_size: [128, 128]``, ``activation_scheme`` "dynamic" | "static", ``fmt`` "e4m3",
  optional ``scale_fmt`` "float" | "ue8m0", ``modules_to_not_convert`` / ``ignored_layers``.
  Tensors ``X.weight`` (float8_e4m3fn) and ``X.weight_scale_inv`` (fp32 ``[ceil(N/128),
  ceil(K/128)]``; despite the name it multiplies: ``W = q * weight_scale_inv``). Without
  ``weight_block_size`` the scale is per tensor, named ``weight_scale_inv`` (transformers) or
  ``weight_scale`` (AutoFP8 / vLLM); static schemes add ``input_scale`` / ``activation_scale``.

Which modules are quantized is read from the tensors themselves (a float8 ``X.weight`` with its
scale), so ``ignore`` / ``modules_to_not_convert`` need no pattern matching: ignored modules are
simply stored in bf16. Activation quantization settings (``input_activations``,
``activation_scheme``) and static input / KV scales are not used: quickdraft multiplies the
dequantized weights with unquantized activations by default (see :class:`FP8Linear`).
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quickdraft.errors import QuickdraftError
from quickdraft.models.batch_invariance import BLOCKED_MAX_ROWS, blocked_linear, in_row_blocks

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
DEFAULT_BLOCK = (128, 128)
Block = tuple[int, int]  # (rows, columns) of weights sharing one scale

_CHUNK_ELEMS = 1 << 24  # dequantize at most this many weights at a time (64 MiB of fp32)
_MIN_AMAX = 1e-30  # all-zero blocks get a tiny positive scale instead of 0 (no 0/0)


# --------------------------------------------------------------------------------------------
# Quantize / dequantize
# --------------------------------------------------------------------------------------------


def scale_shape(shape: tuple[int, int], block: Block) -> tuple[int, int]:
    """Shape of the scale tensor for an ``[N, K]`` weight in ``bn x bk`` blocks."""
    (n, k), (bn, bk) = shape, block
    return math.ceil(n / bn), math.ceil(k / bk)


def resolve_block(shape: tuple[int, int], block: Block | None) -> Block:
    """``None`` means per output channel, ``(1, K)``."""
    if block is None:
        return 1, shape[1]
    bn, bk = int(block[0]), int(block[1])
    if bn < 1 or bk < 1:
        raise ValueError(f"block sizes must be positive, got {block}")
    return bn, bk


def expand_scale(scale: torch.Tensor, shape: tuple[int, int], block: Block) -> torch.Tensor:
    """Blocks' scales ``[nb_n, nb_k]`` -> a tensor that broadcasts against ``[N, K]``.

    Per-channel and per-tensor scales broadcast as they are; 2-D blocks are repeated over rows
    only here (``[N, nb_k]``), the column blocks are handled by :func:`_mul_blocks`.
    """
    n = shape[0]
    if scale.shape[0] == 1 or block[0] == 1:
        return scale
    return scale.repeat_interleave(block[0], dim=0)[:n]


def _mul_blocks(w: torch.Tensor, rows: torch.Tensor, bk: int) -> torch.Tensor:
    """``w [N, K] *= scale`` in place, ``rows [N or 1, nb_k]`` holding one scale per column block."""
    if rows.shape[1] == 1:
        return w.mul_(rows)
    n, k = w.shape
    full = k // bk
    if full:
        w[:, : full * bk].view(n, full, bk).mul_(rows[:, :full, None])
    if k % bk:
        w[:, full * bk :].mul_(rows[:, full:])
    return w


OBSERVERS = ("minmax", "mse")
_MSE_SHRINK = tuple(1.0 - i / 100 for i in range(21))  # candidate scales: amax/448 x 1.00 .. 0.80


def quantize_fp8(
    w: torch.Tensor, block: Block | None = None, observer: str = "minmax"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` -> (``q`` float8_e4m3fn ``[N, K]``, fp32 scales ``[ceil(N/bn), ceil(K/bk)]``).

    ``block`` None = per output channel. Observer "minmax": ``s = amax / 448`` per block, so each
    block's largest magnitude maps to exactly 448 and nothing saturates. "mse": per block, the
    scale among ``amax / 448 * (1.00, 0.99, ... 0.80)`` with the least squared error (clipping a
    few outliers can buy finer steps for the rest; llm-compressor's "mse" observer does the same
    kind of search). Rounding is to nearest even.
    """
    if observer not in OBSERVERS:
        raise QuickdraftError(f"unknown FP8 observer {observer!r}; choose one of {', '.join(OBSERVERS)}")
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(w.shape)}")
    n, k = int(w.shape[0]), int(w.shape[1])
    bn, bk = resolve_block((n, k), block)
    w = w.detach().float()
    sn, sk = scale_shape((n, k), (bn, bk))
    pad_n, pad_k = sn * bn - n, sk * bk - k
    padded = F.pad(w, (0, pad_k, 0, pad_n)) if pad_n or pad_k else w
    amax = padded.abs().view(sn, bn, sk, bk).amax(dim=(1, 3)).clamp_min(_MIN_AMAX)  # [sn, sk]
    if observer == "minmax":
        scale = amax / FP8_MAX
        return _round_to_fp8(w, scale, (bn, bk)), scale
    best_err = torch.full_like(amax, math.inf)
    scale = amax / FP8_MAX
    for shrink in _MSE_SHRINK:
        candidate = amax * shrink / FP8_MAX
        q = _round_to_fp8(padded, candidate, (bn, bk))
        err = (dequantize_fp8(q, candidate, (bn, bk)) - padded).square_().view(sn, bn, sk, bk).sum(dim=(1, 3))
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        scale = torch.where(better, candidate, scale)
    return _round_to_fp8(w, scale, (bn, bk)), scale


def _round_to_fp8(w: torch.Tensor, scale: torch.Tensor, block: Block) -> torch.Tensor:
    """``w / scale`` (block-wise), saturated to +-448 and rounded to float8_e4m3fn."""
    inv = 1.0 / scale
    q = _mul_blocks(w.clone(), expand_scale(inv, (int(w.shape[0]), int(w.shape[1])), block), block[1])
    return q.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def fp8_to_float(q: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn -> float32, exactly (NaN codes excepted), several times faster on CPU than
    ``q.float()``: the 7 exponent/mantissa bits are moved into a float16 (whose hardware
    conversion also handles the subnormals) and the exponent bias difference is a factor 2^8."""
    return _fp8_to_half_bits(q).float().mul_(256.0)


def _fp8_to_half_bits(q: torch.Tensor) -> torch.Tensor:
    """The float16 whose value is ``q / 256``: ``s eeee mmm`` -> ``s 0 eeee mmm 0000000``."""
    h = q.view(torch.uint8).to(torch.int16)
    return (((h << 8) >> 1) & -16385).view(torch.float16)  # arithmetic shift, then clear bit 14


def dequantize_fp8(
    q: torch.Tensor, scale: torch.Tensor, block: Block | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``q * scale`` (computed in fp32, then cast to ``dtype``): the weight the checkpoint means."""
    n, k = int(q.shape[0]), int(q.shape[1])
    bn, bk = resolve_block((n, k), block)
    w = _fp8_to_half_bits(q).float()
    w = _mul_blocks(w, expand_scale(scale.float() * 256.0, (n, k), (bn, bk)), bk)
    return w if dtype == torch.float32 else w.to(dtype)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token activation quantization: ``x [M, K]`` -> (fp8 ``[M, K]``, fp32 ``[M, 1]``).

    Each row gets its own scale, so a row's result never depends on the rows beside it.
    """
    xf = x.float()
    scale = xf.abs().amax(dim=1, keepdim=True).clamp_min(_MIN_AMAX) / FP8_MAX
    return (xf / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


# --------------------------------------------------------------------------------------------
# Activation mode: weight-only (dequantize) or FP8 x FP8 matmuls
# --------------------------------------------------------------------------------------------

ACTIVATION_MODES = ("auto", "weight-only", "fp8")
_ENV_MODE = "QUICKDRAFT_FP8_ACTIVATIONS"


def _env_mode() -> str:
    mode = os.environ.get(_ENV_MODE, "auto").strip().lower() or "auto"
    if mode not in ACTIVATION_MODES:
        raise QuickdraftError(f"{_ENV_MODE}={mode!r} is not one of {', '.join(ACTIVATION_MODES)}")
    return mode


_mode: str | None = None  # None: follow the environment variable


def set_activation_mode(mode: str | None) -> None:
    """How :class:`FP8Linear` multiplies.

    "auto" (default): FP8 x FP8 ``torch._scaled_mm`` with dynamic per-token activation scales on
    CUDA GPUs of compute capability >= 8.9 for bf16 activations and per-channel / per-tensor
    weight scales; everything else (CPU, fp32 reference mode, block scales) dequantizes the
    weight and multiplies in the activation dtype. "weight-only": always dequantize.
    "fp8": use ``_scaled_mm`` wherever torch runs it (the CPU too; for measuring its accuracy).
    None: follow ``QUICKDRAFT_FP8_ACTIVATIONS`` (default "auto").
    """
    global _mode
    if mode is not None and mode not in ACTIVATION_MODES:
        raise QuickdraftError(f"FP8 activation mode {mode!r} is not one of {', '.join(ACTIVATION_MODES)}")
    _mode = mode


def activation_mode() -> str:
    return _mode if _mode is not None else _env_mode()


@contextlib.contextmanager
def using_activation_mode(mode: str) -> Iterator[None]:
    """``with using_activation_mode("weight-only"): ...`` sets the mode inside the block."""
    global _mode
    prev = _mode
    set_activation_mode(mode)
    try:
        yield
    finally:
        _mode = prev


_CUDA_FP8: dict[int, bool] = {}


def _cuda_fp8_capable(device: torch.device) -> bool:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CUDA_FP8:
        _CUDA_FP8[index] = torch.cuda.get_device_capability(index) >= (8, 9)
    return _CUDA_FP8[index]


# --------------------------------------------------------------------------------------------
# The layer
# --------------------------------------------------------------------------------------------


class FP8Linear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` kept as float8_e4m3fn ``weight [N, K]`` and fp32
    ``weight_scale`` (buffers, so ``.to(device)`` moves them and ``state_dict`` names them as
    compressed-tensors does).

    The default path dequantizes ``W`` (in row chunks of at most 16M weights, in fp32, then the
    activation dtype) and multiplies with :func:`~quickdraft.models.batch_invariance.blocked_linear`, the
    batch-invariant matmul of quickdraft's ``Linear``: a row's output is bitwise the same whatever
    rows come with it, so speculative verification reproduces plain decoding. Nothing is cached
    (the weight stays 1 byte per parameter); :meth:`cache_dequantized` trades memory for speed.
    On FP8-capable GPUs see :func:`set_activation_mode`.
    """

    weight: torch.Tensor
    weight_scale: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool | torch.Tensor | None = False,
        block: Block | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.block = resolve_block((self.out_features, self.in_features), block)
        shape = (self.out_features, self.in_features)
        self.register_buffer("weight", torch.zeros(shape, dtype=FP8_DTYPE, device=device))
        self.register_buffer("weight_scale", torch.ones(scale_shape(shape, self.block), device=device))
        if isinstance(bias, torch.Tensor):
            if bias.numel() != self.out_features:
                raise ValueError(f"bias has {bias.numel()} elements, expected {self.out_features}")
            # Keep the very Parameter (a loader may fill it after this layer replaced its Linear).
            self.bias = bias if isinstance(bias, nn.Parameter) else nn.Parameter(bias, requires_grad=False)
        elif bias:
            self.bias = nn.Parameter(torch.zeros(self.out_features, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        self._cache: torch.Tensor | None = None
        self._cache_enabled = False
        self._scaled_mm_failed = False

    @classmethod
    def from_quantized(
        cls,
        weight: torch.Tensor,
        scale: torch.Tensor,
        block: Block | None = None,
        bias: torch.Tensor | None = None,
    ) -> FP8Linear:
        """Wrap an already quantized weight (float8_e4m3fn ``[N, K]``) and its block scales."""
        if weight.dtype != FP8_DTYPE or weight.dim() != 2:
            raise ValueError(f"weight must be a 2-D float8_e4m3fn tensor, got {weight.dtype} {tuple(weight.shape)}")
        n, k = int(weight.shape[0]), int(weight.shape[1])
        layer = cls(k, n, bias=bias, block=block, device="meta")
        expected = scale_shape((n, k), layer.block)
        if scale.numel() != expected[0] * expected[1]:
            raise ValueError(f"scale has shape {tuple(scale.shape)}, blocks {layer.block} of [{n}, {k}] need {expected}")
        layer.weight = weight.contiguous()
        layer.weight_scale = scale.detach().reshape(expected).to(device=weight.device, dtype=torch.float32).contiguous()
        return layer

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, block: Block | None = None) -> FP8Linear:
        """Quantize a float weight ``[N, K]`` (per output channel unless ``block`` is given)."""
        q, scale = quantize_fp8(weight, block)
        shape = int(weight.shape[0]), int(weight.shape[1])
        return cls.from_quantized(q, scale, resolve_block(shape, block), bias)

    @property
    def scheme(self) -> str:
        """"tensor", "channel" or "block" (any other block shape, groups included)."""
        n, k = self.out_features, self.in_features
        if self.weight_scale.numel() == 1:
            return "tensor"
        if self.block == (1, k) or self.weight_scale.shape == (n, 1):
            return "channel"
        return "block"

    @property
    def weight_bytes(self) -> int:
        return self.weight.numel() + 4 * self.weight_scale.numel()

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"scheme={self.scheme}, block={self.block}, bias={self.bias is not None}"
        )

    def dequantize(self, dtype: torch.dtype = torch.float32, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Output rows ``start:stop`` of the weight, ``[rows, K]`` in ``dtype``."""
        stop = self.out_features if stop is None else stop
        bn = self.block[0]
        if start == 0 and stop == self.out_features:
            return dequantize_fp8(self.weight, self.weight_scale, self.block, dtype)
        if bn == 1 or self.weight_scale.shape[0] == 1:
            scale = self.weight_scale if self.weight_scale.shape[0] == 1 else self.weight_scale[start:stop]
            return dequantize_fp8(self.weight[start:stop], scale, (1, self.block[1]), dtype)
        if start % bn:
            raise ValueError(f"row chunks of a {self.block} block layer must start at a multiple of {bn}")
        scale = self.weight_scale[start // bn : math.ceil(stop / bn)]
        return dequantize_fp8(self.weight[start:stop], scale, self.block, dtype)

    def cache_dequantized(self, enabled: bool = True) -> None:
        """Keep the dequantized weight (in the activation dtype of the next call) for later calls:
        faster on CPU, but the layer then holds 2-4 extra bytes per weight. Off by default."""
        self._cache_enabled = enabled
        if not enabled:
            self._cache = None

    # ---------------------------------------------------------------------------- forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self._use_scaled_mm(x2):
            y = self._forward_scaled_mm(x2)
        else:
            y = self._forward_dequantized(x2)
        return y.reshape(*lead, self.out_features)

    def _bias_for(self, x: torch.Tensor, start: int = 0, stop: int | None = None) -> torch.Tensor | None:
        if self.bias is None:
            return None
        b = self.bias[start:stop]
        return b if b.dtype == x.dtype else b.to(x.dtype)

    def _forward_dequantized(self, x: torch.Tensor) -> torch.Tensor:
        if self._cache_enabled:
            if self._cache is None or self._cache.dtype != x.dtype or self._cache.device != x.device:
                self._cache = self.dequantize(x.dtype)
            return blocked_linear(x, self._cache, self._bias_for(x))
        n, k = self.out_features, self.in_features
        if n * k <= _CHUNK_ELEMS:
            return blocked_linear(x, self.dequantize(x.dtype), self._bias_for(x))
        rows = max(1, _CHUNK_ELEMS // k)
        if self.block[0] > 1 and self.weight_scale.shape[0] > 1:
            rows = max(self.block[0], rows // self.block[0] * self.block[0])  # whole row blocks
        parts = [
            blocked_linear(x, self.dequantize(x.dtype, r0, min(n, r0 + rows)), self._bias_for(x, r0, min(n, r0 + rows)))
            for r0 in range(0, n, rows)
        ]
        return torch.cat(parts, dim=1)

    # ------------------------------------------------------------------- FP8 x FP8 matmul

    def _use_scaled_mm(self, x: torch.Tensor) -> bool:
        mode = activation_mode()
        if mode == "weight-only" or self._scaled_mm_failed or self.scheme == "block":
            return False
        if self.in_features % 16 or self.out_features % 16:  # _scaled_mm's shape rule
            return False
        if mode == "fp8":
            return True
        return x.is_cuda and x.dtype == torch.bfloat16 and _cuda_fp8_capable(x.device)

    def _forward_scaled_mm(self, x: torch.Tensor) -> torch.Tensor:
        """Per-token activation scales times per-channel (or per-tensor) weight scales.

        Short passes go in fixed blocks of rows (``in_row_blocks``), like ``blocked_linear``, so each row
        always meets the same kernel (batch invariance); long prefills in one call.
        """
        scale_b = self.weight_scale.reshape(1, -1).expand(1, self.out_features).contiguous()
        wt = self.weight.t()  # [K, N], column-major as _scaled_mm wants

        def mm(rows: torch.Tensor) -> torch.Tensor:
            q, scale_a = quantize_rows(rows)
            out = torch._scaled_mm(q, wt, scale_a=scale_a, scale_b=scale_b, out_dtype=x.dtype)
            return out[0] if isinstance(out, tuple) else out

        t = x.shape[0]
        try:
            y = mm(x) if t > BLOCKED_MAX_ROWS else in_row_blocks(x, mm)
        except RuntimeError as exc:  # a GPU / torch build without this _scaled_mm variant
            warnings.warn(f"FP8 matmul unavailable ({exc}); dequantizing FP8 weights instead", stacklevel=2)
            self._scaled_mm_failed = True
            return self._forward_dequantized(x)
        b = self._bias_for(y)
        return y + b if b is not None else y


def cache_dequantized_weights(model: nn.Module, enabled: bool = True) -> int:
    """Turn :meth:`FP8Linear.cache_dequantized` on (or off) for every FP8 layer; returns their count."""
    layers = [m for m in model.modules() if isinstance(m, FP8Linear)]
    for m in layers:
        m.cache_dequantized(enabled)
    return len(layers)


# --------------------------------------------------------------------------------------------
# Checkpoints: which quantization_config, and pairing weights with their scales
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FP8Format:
    """What a checkpoint's ``quantization_config`` says about its FP8 tensors."""

    method: str  # "compressed-tensors" or "fp8"
    blocks: tuple[Block, ...]  # block shapes the config names (besides per-tensor / per-channel)
    scale_names: tuple[str, ...]  # tensor suffixes that hold weight scales
    ue8m0_scales: bool = False  # "fp8" with scale_fmt "ue8m0": scales are powers of two in a byte


@dataclass(frozen=True)
class FP8Tensor:
    """A weight read from an FP8 checkpoint: ``weight`` float8_e4m3fn ``[N, K]``, fp32 ``scale``."""

    weight: torch.Tensor
    scale: torch.Tensor
    block: Block

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.weight.shape[0]), int(self.weight.shape[1])


SUPPORTED_METHODS = ("compressed-tensors", "fp8")

# Tensors an FP8 checkpoint may carry that the weight-only path does not use.
_UNUSED_SUFFIXES = (
    "input_scale", "input_zero_point", "output_scale", "output_zero_point",
    "activation_scale", "k_scale", "v_scale", "q_scale",
)
_UNSUPPORTED_SUFFIXES = ("weight_g_idx", "weight_global_scale", "weight_packed", "weight_shape")


def quantization_section(hf_config: Mapping[str, Any]) -> dict[str, Any] | None:
    """``quantization_config`` (or the older ``compression_config``) of a config.json, if any."""
    section = hf_config.get("quantization_config") or hf_config.get("compression_config")
    return dict(section) if isinstance(section, Mapping) else None


def fp8_format(hf_config: Mapping[str, Any]) -> FP8Format | None:
    """The FP8 layout a Hugging Face config declares; None for an unquantized model.

    Raises :class:`QuickdraftError` for quantization quickdraft cannot load (AWQ, GPTQ, int8,
    4-bit, sparse ...), naming what it found.
    """
    qc = quantization_section(hf_config)
    if qc is None:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return _compressed_tensors_format(qc)
    if method == "fp8":
        return _fp8_method_format(qc)
    raise _unsupported(f"quant_method {method or '(missing)'!r}")


def _unsupported(what: str) -> QuickdraftError:
    return QuickdraftError(
        f"this checkpoint is quantized with {what}, which quickdraft cannot load; it reads FP8 "
        "(E4M3) weights saved as compressed-tensors (float-quantized) or quant_method 'fp8'. "
        "Use the unquantized model, a GGUF file, or make an FP8 copy with `quickdraft quantize --fp8 MODEL --out DIR`"
    )


def _compressed_tensors_format(qc: Mapping[str, Any]) -> FP8Format:
    formats = {"float-quantized", "naive-quantized"}
    fmt = qc.get("format")
    if fmt is not None and fmt not in formats and fmt != "mixed-precision":
        raise _unsupported(f"compressed-tensors format {fmt!r}")
    sparsity = qc.get("sparsity_config") or {}
    if isinstance(sparsity, Mapping) and sparsity.get("format") not in (None, "dense"):
        raise _unsupported(f"compressed-tensors sparsity {sparsity.get('format')!r}")
    if qc.get("transform_config"):
        raise _unsupported("compressed-tensors transforms (transform_config)")
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, Mapping) or not groups:
        raise _unsupported("compressed-tensors without config_groups")
    blocks: list[Block] = []
    for name, group in groups.items():
        gfmt = group.get("format") or fmt
        if gfmt is not None and gfmt not in formats:
            raise _unsupported(f"compressed-tensors format {gfmt!r} (group {name})")
        w = group.get("weights")
        if not isinstance(w, Mapping):
            raise _unsupported(f"compressed-tensors group {name} without weight quantization")
        if w.get("type") != "float" or int(w.get("num_bits", 0)) != 8:
            raise _unsupported(f"compressed-tensors {w.get('type')}{w.get('num_bits')} weights (group {name})")
        if w.get("symmetric") is False:
            raise _unsupported(f"asymmetric FP8 weights (group {name})")
        strategy = w.get("strategy")
        if strategy == "block":
            structure = w.get("block_structure")
            if isinstance(structure, str):  # older releases wrote "128x128"
                structure = [int(v) for v in structure.lower().split("x")]
            if not isinstance(structure, list | tuple) or len(structure) != 2:
                raise _unsupported(f"FP8 block strategy with block_structure {structure!r}")
            blocks.append((int(structure[0]), int(structure[1])))
        elif strategy == "group":
            blocks.append((1, int(w["group_size"])))
        elif strategy not in ("tensor", "channel"):
            raise _unsupported(f"FP8 weight strategy {strategy!r}")
    return FP8Format("compressed-tensors", tuple(blocks), ("weight_scale",))


def _fp8_method_format(qc: Mapping[str, Any]) -> FP8Format:
    if str(qc.get("fmt", "e4m3")).lower() != "e4m3":
        raise _unsupported(f"fp8 format {qc.get('fmt')!r} (only e4m3)")
    if str(qc.get("expert_dtype", "fp8")) != "fp8":
        raise _unsupported(f"fp8 with expert_dtype {qc.get('expert_dtype')!r}")
    scale_fmt = str(qc.get("scale_fmt") or "float")
    if scale_fmt not in ("float", "ue8m0"):
        raise _unsupported(f"fp8 scale_fmt {scale_fmt!r}")
    size = qc.get("weight_block_size")
    blocks: tuple[Block, ...] = ()
    if size is not None:
        if not isinstance(size, list | tuple) or len(size) != 2 or min(int(v) for v in size) < 1:
            raise _unsupported(f"fp8 weight_block_size {size!r}")
        blocks = ((int(size[0]), int(size[1])),)
    return FP8Format("fp8", blocks, ("weight_scale_inv", "weight_scale"), ue8m0_scales=scale_fmt == "ue8m0")


def fp8_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]], fmt: FP8Format
) -> Iterator[tuple[str, torch.Tensor | FP8Tensor]]:
    """Pair every float8 ``X.weight`` with its scale into an :class:`FP8Tensor`; pass other
    tensors through; drop the activation / KV-cache scales the weight-only path does not use.

    Weights and scales may come in any order (shards); a weight waits for its scale (1 byte per
    weight). A weight without a scale, or a scale without an FP8 weight, is an error.
    """
    weights: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, t in tensors:
        prefix, _, leaf = name.rpartition(".")
        if leaf == "weight" and t.dtype == FP8_DTYPE:
            if prefix in scales:
                yield name, _fp8_tensor(prefix, t, scales.pop(prefix), fmt)
            else:
                weights[prefix] = t
        elif leaf in fmt.scale_names:
            if prefix in weights:
                yield f"{prefix}.weight", _fp8_tensor(prefix, weights.pop(prefix), t, fmt)
            else:
                scales[prefix] = t
        elif leaf == "weight_zero_point":
            if bool((t.float() != 0).any()):
                raise _unsupported(f"asymmetric FP8 weights ({name} is not zero)")
        elif leaf in _UNUSED_SUFFIXES:
            continue
        elif leaf in _UNSUPPORTED_SUFFIXES:
            raise _unsupported(f"tensors like {name}")
        else:
            yield name, t
    if weights:
        prefix = sorted(weights)[0]
        raise QuickdraftError(
            f"FP8 weight {prefix}.weight has no scale tensor ({' or '.join(f'{prefix}.{s}' for s in fmt.scale_names)}); "
            "the checkpoint is incomplete or not in a layout quickdraft reads: download it again"
        )
    if scales:
        name = sorted(scales)[0]
        raise QuickdraftError(
            f"scale tensor {name} belongs to no float8_e4m3fn weight; the checkpoint's weights and "
            "scales do not match"
        )


def _fp8_tensor(prefix: str, weight: torch.Tensor, scale: torch.Tensor, fmt: FP8Format) -> FP8Tensor:
    if weight.dim() != 2:
        raise QuickdraftError(f"FP8 weight {prefix}.weight has shape {tuple(weight.shape)}; only 2-D matrices are supported")
    if fmt.ue8m0_scales and scale.dtype == torch.uint8:
        scale = scale.view(torch.float8_e8m0fnu)
    scale = scale.float()
    if not bool(torch.isfinite(scale).all()):
        raise QuickdraftError(f"scale of {prefix}.weight holds inf or NaN; the checkpoint is damaged")
    if bool(((weight.view(torch.uint8) & 0x7F) == 0x7F).any()):
        raise QuickdraftError(f"FP8 weight {prefix}.weight holds NaN values; the checkpoint is damaged")
    shape = int(weight.shape[0]), int(weight.shape[1])
    block = _infer_block(prefix, shape, tuple(scale.shape), fmt.blocks)
    return FP8Tensor(weight, scale.reshape(scale_shape(shape, block)).contiguous(), block)


def _infer_block(prefix: str, shape: tuple[int, int], sshape: tuple[int, ...], blocks: tuple[Block, ...]) -> Block:
    """Which blocking a scale's shape means: per tensor, per channel, or a block the config names."""
    n, k = shape
    if math.prod(sshape) == 1:
        return n, k
    if sshape in ((n,), (n, 1)):
        return 1, k
    for block in blocks:
        if sshape == scale_shape(shape, block):
            return block
    named = ", ".join(f"{b[0]}x{b[1]}" for b in blocks) or "none"
    raise QuickdraftError(
        f"scale of {prefix}.weight {list(shape)} has shape {list(sshape)}, which matches no "
        f"blocking the config declares (per tensor, per channel, blocks: {named}); is config.json right?"
    )


def install_fp8_linear(model: nn.Module, name: str, t: FP8Tensor) -> FP8Linear:
    """Replace the ``nn.Linear`` that owns parameter ``name`` with an :class:`FP8Linear` holding ``t``."""
    parent_name, _, attr = name.removesuffix(".weight").rpartition(".")
    parent = model.get_submodule(parent_name)
    old = getattr(parent, attr)
    if not isinstance(old, nn.Linear):
        raise QuickdraftError(f"tensor {name} holds FP8 weights, but its layer ({type(old).__name__}) cannot use them")
    device = old.weight.device
    layer = FP8Linear.from_quantized(t.weight.to(device), t.scale.to(device), t.block, bias=old.bias)
    setattr(parent, attr, layer)
    return layer
