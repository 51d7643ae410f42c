"""quickdraft: fast, lossless single-user LLM inference with speculative decoding."""

from __future__ import annotations

from quickdraft.errors import QuickdraftError

__version__ = "0.1.0"

__all__ = ["QuickdraftError", "__version__"]
