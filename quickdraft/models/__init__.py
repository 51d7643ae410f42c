"""Model architectures, one module per Hugging Face ``model_type``."""

from __future__ import annotations

import importlib

from torch import nn

from quickdraft.config import ModelConfig
from quickdraft.errors import QuickdraftError

SUPPORTED = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text", "phi3", "qwen3_5", "gemma4_text")
MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "llama4", "llama4_text", "qwen3_5_moe", "qwen3_next", "gpt_oss")  # mixture-of-experts families
ARCHITECTURES: tuple[str, ...] = SUPPORTED + MOE  # what build_model accepts
_MODULE = {"llama4_text": "llama4", "gemma3_text": "gemma3", "qwen3_5_moe": "qwen3_5", "qwen3_next": "qwen3_5",
           "gemma4_text": "gemma4"}  # model_type -> module, where they differ


def build_model(cfg: ModelConfig, max_len: int) -> nn.Module:
    """Instantiate the architecture named by ``cfg.model_type`` (weights uninitialised)."""
    if cfg.model_type not in ARCHITECTURES:
        raise QuickdraftError(
            f"architecture {cfg.model_type!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )
    module = importlib.import_module(f"quickdraft.models.{_MODULE.get(cfg.model_type, cfg.model_type)}")
    return module.CausalLM(cfg, max_len)
