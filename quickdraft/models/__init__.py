"""Model architectures, one module per Hugging Face ``model_type``."""

from __future__ import annotations

import importlib

from torch import nn

from quickdraft.config import ModelConfig
from quickdraft.errors import QuickdraftError

SUPPORTED = ("llama", "qwen2", "qwen3", "mistral")


def build_model(cfg: ModelConfig, max_len: int) -> nn.Module:
    """Instantiate the architecture named by ``cfg.model_type`` (weights uninitialised)."""
    if cfg.model_type not in SUPPORTED:
        raise QuickdraftError(
            f"architecture {cfg.model_type!r} is not supported; supported: {', '.join(SUPPORTED)}"
        )
    module = importlib.import_module(f"quickdraft.models.{cfg.model_type}")
    return module.CausalLM(cfg, max_len)
