"""The chat page: its files (quickdraft/server/webui, shipped in the package) as GET routes.

The page itself is public under --api-key (it holds no secret; it asks for the key and sends it
with its API calls).
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response

from quickdraft.errors import QuickdraftError

# The page's files by URL path, with their media types.
WEBUI_FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/webui/style.css": ("style.css", "text/css; charset=utf-8"),
    "/webui/markdown.js": ("markdown.js", "text/javascript; charset=utf-8"),
    "/webui/app.js": ("app.js", "text/javascript; charset=utf-8"),
}


def webui_router() -> APIRouter:
    """GET routes for the chat page's files, read once now."""
    router = APIRouter()
    folder = resources.files("quickdraft.server").joinpath("webui")
    for path, (name, media_type) in WEBUI_FILES.items():
        try:
            body = folder.joinpath(name).read_bytes()
        except OSError as exc:
            raise QuickdraftError(
                f"the chat page's file {name} is missing from the installed package ({exc}); "
                "reinstall quickdraft or start the server with --no-webui"
            ) from None
        router.add_api_route(path, _static(body, media_type), methods=["GET"], include_in_schema=False)
    return router


def _static(body: bytes, media_type: str) -> Callable[[], Any]:
    headers = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}

    async def serve() -> Response:
        return Response(body, media_type=media_type, headers=headers)

    return serve
