"""Mistral (HF ``model_type`` "mistral"): the Llama decoder.

Sliding-window attention only matters past the window (4096+ tokens in the published models);
quickdraft refuses contexts longer than the window instead of computing them wrongly.
"""

from __future__ import annotations

from typing import Any

from quickdraft.config import ConfigUpdate, Family
from quickdraft.models.causal_lm import CausalLM

__all__ = ["FAMILY", "CausalLM"]


def _hf_fields(d: dict[str, Any]) -> ConfigUpdate:
    """The window applies unless ``use_sliding_window`` is false (transformers' Mistral default: on)."""
    return {"sliding_window": d.get("sliding_window") if d.get("use_sliding_window", True) else None}


FAMILY = Family(model_types=("mistral",), hf_architecture="MistralForCausalLM", read_hf=_hf_fields)
