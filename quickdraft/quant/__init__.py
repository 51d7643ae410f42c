"""Quantized weights kept in their GGUF block formats, with native CPU kernels (see ``ggml``)."""

from quickdraft.quant.ggml import (
    SUPPORTED_TYPES,
    GGMLLinear,
    dequantize_reference,
    kernels_active,
    kernels_available,
    reference_forced,
    reference_mode,
    set_reference_mode,
)

__all__ = [
    "SUPPORTED_TYPES",
    "GGMLLinear",
    "dequantize_reference",
    "kernels_active",
    "kernels_available",
    "reference_forced",
    "reference_mode",
    "set_reference_mode",
]
