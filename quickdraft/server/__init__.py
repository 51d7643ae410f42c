"""``quickdraft serve``: an OpenAI-compatible HTTP server over one engine (see :mod:`.app`)."""

from __future__ import annotations

from quickdraft.server.app import create_app

__all__ = ["create_app"]
