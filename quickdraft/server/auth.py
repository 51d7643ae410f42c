"""The API key: every HTTP route but the public paths needs it, checked before routing."""

from __future__ import annotations

import secrets

from starlette.types import ASGIApp, Receive, Scope, Send

from quickdraft.server.errors import ApiError, ErrorShapes


class ApiKeyMiddleware:
    """Every HTTP route but the ``public`` paths (/health, the chat page's files) needs
    ``Authorization: Bearer <key>`` or (Anthropic's clients) ``x-api-key: <key>``; a 401 is in
    the shape of the dialect whose path was asked for."""

    def __init__(self, app: ASGIApp, api_key: str, public: frozenset[str], shapes: ErrorShapes) -> None:
        self.app = app
        self.key = api_key.encode()
        self.expected = b"Bearer " + self.key
        self.public = public
        self.shapes = shapes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.public:
            headers = dict(scope["headers"])
            bearer = secrets.compare_digest(headers.get(b"authorization", b""), self.expected)
            x_api_key = secrets.compare_digest(headers.get(b"x-api-key", b""), self.key)
            if not (bearer or x_api_key):
                message = (
                    "Incorrect or missing API key: send 'Authorization: Bearer <key>' "
                    "or 'x-api-key: <key>'."
                )
                error = ApiError(401, message, code="invalid_api_key")
                await self.shapes.for_path(scope["path"]).response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)
