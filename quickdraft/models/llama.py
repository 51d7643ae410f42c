"""Llama (HF ``model_type`` "llama"): the dense causal LM of :mod:`quickdraft.models.causal_lm`
as it is (the other dense families switch its variants by :class:`~quickdraft.config.ModelConfig`
fields)."""

from __future__ import annotations

from quickdraft.models.causal_lm import CausalLM

__all__ = ["CausalLM"]
