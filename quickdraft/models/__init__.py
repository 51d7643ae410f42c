"""Model architectures, one module per family (Hugging Face ``model_type``): each declares its
:class:`~quickdraft.config.Family` as ``FAMILY`` and its ``CausalLM``; the modules in
:data:`SHARED_MODULES` hold the pieces families share."""

from __future__ import annotations

import importlib

from torch import nn

from quickdraft.config import ModelConfig, family_module, model_types
from quickdraft.errors import QuickdraftError

SHARED_MODULES = ("batch_invariance", "causal_lm", "forward_pass", "graphs", "layers", "moe", "native")  # every other module here is a family


def build_model(cfg: ModelConfig, max_len: int) -> nn.Module:
    """Instantiate the architecture named by ``cfg.model_type`` (weights uninitialised)."""
    module = family_module(cfg.model_type)
    if module is None:
        raise QuickdraftError(f"architecture {cfg.model_type!r} is not supported; supported: {', '.join(model_types())}")
    model: nn.Module = importlib.import_module(module).CausalLM(cfg, max_len)
    return model
