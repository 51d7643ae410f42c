"""Mistral (HF ``model_type`` "mistral"): the Llama decoder.

Sliding-window attention only matters past the window (4096+ tokens in the published models);
quickdraft refuses contexts longer than the window instead of computing them wrongly.
"""

from __future__ import annotations

from quickdraft.models.causal_lm import CausalLM

__all__ = ["CausalLM"]
