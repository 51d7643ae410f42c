"""Qwen3 dense (HF ``model_type`` "qwen3"): the Llama decoder with per-head RMSNorm on q and k.

Switched by ``ModelConfig.qk_norm`` (True for qwen3); parameters ``self_attn.q_norm`` / ``k_norm``.
"""

from __future__ import annotations

from quickdraft.models.causal_lm import CausalLM

__all__ = ["CausalLM"]
