"""Errors: :class:`ApiError` (what the server's code raises) and each API dialect's shape of it.

Every failure becomes an :class:`ApiError` (status, message, param, code), and the dialect that
answers writes it in its own shape (:class:`ErrorShape`): OpenAI's ``{"error": {...}}`` or
Anthropic's ``{"type": "error", "error": {...}}``. A dialect's routes are of its
:class:`DialectRoute` subclass, which answers whatever its endpoints raise (and a wrong method on
its paths) in its shape. What no route of a dialect handles (a missing API key, checked before
routing; a path no route serves) is answered by the dialect whose router holds the path
(:class:`ErrorShapes`).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

log = logging.getLogger("quickdraft.server")


class ApiError(Exception):
    """An error to send to the client: an HTTP status, a message and OpenAI's ``param``,
    ``code`` and ``type`` (``kind``); ``headers`` go with the answer (429: Retry-After)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind


def internal_error(exc: Exception) -> ApiError:
    """A bug or an unexpected failure, logged; the client learns only the exception's type."""
    log.error("internal error", exc_info=exc)
    return ApiError(500, f"internal server error ({type(exc).__name__})", kind="server_error")


def http_error(request: Request, exc: StarletteHTTPException, routes: str = "") -> ApiError:
    """Starlette's 404 (``routes``: the routes served, for a path none serves) and 405 (with
    the methods allowed) and any other HTTP error, as an ApiError."""
    headers = exc.headers  # 405: Allow
    if exc.status_code == 404 and routes:
        message = f"no route {request.method} {request.url.path}; this server serves: {routes}"
        return ApiError(404, message, code="not_found", headers=headers)
    if exc.status_code == 405:
        allowed = (headers or {}).get("Allow", "")
        message = f"method {request.method} is not allowed on {request.url.path}; allowed: {allowed}"
        return ApiError(405, message, code="method_not_allowed", headers=headers)
    code = "not_found" if exc.status_code == 404 else None
    return ApiError(exc.status_code, str(exc.detail), code=code, headers=headers)


def as_api_error(request: Request, exc: Exception) -> ApiError:
    """Whatever a route raised, as the ApiError to answer with."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, StarletteHTTPException):
        return http_error(request, exc)
    if isinstance(exc, RequestValidationError):  # a bad path or query parameter
        return parameter_error(exc)
    return internal_error(exc)


def parameter_error(exc: RequestValidationError) -> ApiError:
    """A bad path or query parameter, named with what it must be (str(exc) would add the
    endpoint's source file and line)."""
    errors = exc.errors()
    problems = []
    for error in errors:
        where, *names = error.get("loc") or ("request",)
        name = ".".join(str(n) for n in names) or str(where)
        got = f" (got {error['input']!r})" if error.get("input") is not None else ""
        problems.append(f"{where} parameter {name!r}: {error.get('msg', 'invalid')}{got}")
    first = errors[0].get("loc") if errors else None
    return ApiError(400, "; ".join(problems) or "invalid request parameters",
                    param=str(first[-1]) if first else None)


class ErrorShape(ABC):
    """How one API dialect writes an error; ``component`` and ``schema``: its error object in the
    OpenAPI document."""

    component: ClassVar[str]
    schema: ClassVar[dict[str, Any]]

    @abstractmethod
    def body(self, error: ApiError) -> dict[str, Any]:
        """The JSON body of the error's answer."""

    def response(self, error: ApiError) -> JSONResponse:
        return JSONResponse(self.body(error), status_code=error.status, headers=error.headers)


class DialectRoute(APIRoute):
    """A route of one API dialect: what its endpoint raises, and a method it does not serve, are
    answered in the dialect's :attr:`shape` (a subclass per dialect sets it; routers take it as
    ``route_class``)."""

    shape: ClassVar[ErrorShape]

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        shape = self.shape

        async def shaped(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as exc:
                return shape.response(as_api_error(request, exc))

        return shaped

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().handle(scope, receive, send)
        except StarletteHTTPException as exc:  # 405: the path is this route's, the method is not
            await self.shape.response(http_error(Request(scope), exc))(scope, receive, send)


@dataclass(frozen=True)
class ErrorShapes:
    """The shape of an error no dialect route answered (a missing API key, checked before any
    route; a path no route serves): that of the dialect whose router's prefix holds the path,
    else ``default``."""

    default: ErrorShape
    by_prefix: tuple[tuple[str, ErrorShape], ...] = ()

    def for_path(self, path: str) -> ErrorShape:
        for prefix, shape in self.by_prefix:
            if path == prefix or path.startswith(prefix + "/"):
                return shape
        return self.default
