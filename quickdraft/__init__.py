"""quickdraft: fast, lossless LLM inference with speculative decoding, built for speed per user."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from quickdraft.errors import QuickdraftError

__version__ = "0.1.0"

__all__ = ["LLM", "QuickdraftError", "RequestOutput", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from quickdraft.api import LLM, RequestOutput
    from quickdraft.sampling import SamplingParams


def __getattr__(name: str) -> Any:
    # Lazy, so `import quickdraft` (and `quickdraft --help`) does not import torch.
    if name in ("LLM", "RequestOutput"):
        from quickdraft import api

        return getattr(api, name)
    if name == "SamplingParams":
        from quickdraft.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'quickdraft' has no attribute {name!r}")
