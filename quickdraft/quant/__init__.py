"""Quantized weights kept in their GGUF block formats, with native CPU kernels (see ``ggml``)."""

from quickdraft.quant.ggml import (
    ACTIVATION_MODES,
    SUPPORTED_TYPES,
    GGMLLinear,
    activation_block_size,
    default_activation_mode,
    dequantize_reference,
    ggml_linear_multi,
    kernels_active,
    kernels_available,
    q8_activations_reference,
    quantize_activations_reference,
    reference_forced,
    reference_mode,
    set_activation_mode,
    set_default_activation_mode,
    set_reference_mode,
)

__all__ = [
    "ACTIVATION_MODES",
    "SUPPORTED_TYPES",
    "GGMLLinear",
    "activation_block_size",
    "default_activation_mode",
    "dequantize_reference",
    "ggml_linear_multi",
    "kernels_active",
    "kernels_available",
    "q8_activations_reference",
    "quantize_activations_reference",
    "reference_forced",
    "reference_mode",
    "set_activation_mode",
    "set_default_activation_mode",
    "set_reference_mode",
]
