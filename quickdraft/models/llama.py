"""Llama (HF ``model_type`` "llama"): the dense causal LM of :mod:`quickdraft.models.causal_lm`
as it is (the other dense families switch its variants by :class:`~quickdraft.config.ModelConfig`
fields)."""

from __future__ import annotations

from quickdraft.config import Family
from quickdraft.models.causal_lm import CausalLM

__all__ = ["FAMILY", "CausalLM"]

# Llama's GGUFs keep q/k rows in llama.cpp's interleaved RoPE order (Mistral's and Mixtral's
# files are "llama" ones too).
FAMILY = Family(model_types=("llama",), hf_architecture="LlamaForCausalLM", gguf_archs={"llama": "llama"}, gguf_permute_qk=True)
