"""Qwen2 / Qwen2.5 (HF ``model_type`` "qwen2"): the Llama decoder with q/k/v biases.

The difference is carried by ``ModelConfig.attention_bias`` (True for qwen2), so the model
class is the shared one.
"""

from __future__ import annotations

from quickdraft.models.causal_lm import CausalLM

__all__ = ["CausalLM"]
