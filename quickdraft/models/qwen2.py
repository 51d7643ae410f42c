"""Qwen2 / Qwen2.5 (HF ``model_type`` "qwen2"): the Llama decoder with q/k/v biases.

The difference is carried by ``ModelConfig.attention_bias`` (True for qwen2 unless its config.json
says otherwise), so the model class is the shared one.
"""

from __future__ import annotations

from typing import Any

from quickdraft.config import ConfigUpdate, Family
from quickdraft.models.causal_lm import CausalLM

__all__ = ["FAMILY", "CausalLM"]


def _hf_fields(d: dict[str, Any]) -> ConfigUpdate:
    return {"attention_bias": bool(d.get("attention_bias", True))}


FAMILY = Family(model_types=("qwen2",), hf_architecture="Qwen2ForCausalLM", read_hf=_hf_fields,
                gguf_archs={"qwen2": "qwen2"})
