"""Qwen3 dense (HF ``model_type`` "qwen3"): the Llama decoder with per-head RMSNorm on q and k.

Switched by ``ModelConfig.qk_norm`` (True for qwen3); parameters ``self_attn.q_norm`` / ``k_norm``.
"""

from __future__ import annotations

from typing import Any

from quickdraft.config import ConfigUpdate, Family
from quickdraft.models.causal_lm import CausalLM

__all__ = ["FAMILY", "CausalLM"]


def _hf_fields(d: dict[str, Any]) -> ConfigUpdate:
    return {"qk_norm": True}


FAMILY = Family(model_types=("qwen3",), hf_architecture="Qwen3ForCausalLM", read_hf=_hf_fields,
                gguf_archs={"qwen3": "qwen3"})
