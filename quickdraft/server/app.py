"""The HTTP server over one :class:`~quickdraft.api.LLM`: the app assembled from one router per API dialect.

Where each dialect lives (its router, its protocol, its streaming events):

- OpenAI, :mod:`quickdraft.server.openai`: /v1/chat/completions, /v1/completions, /v1/models,
  with /health and /metrics; its chat serving (:mod:`~quickdraft.server.openai.prepare`,
  :mod:`~quickdraft.server.openai.serving`) is what every dialect generates through;
- Anthropic's Messages API, :mod:`quickdraft.server.anthropic`: /v1/messages and
  /v1/messages/count_tokens, errors in Anthropic's shape;
- OpenAI's Responses API, :mod:`quickdraft.server.responses`: /v1/responses and the stored ones;
- the chat page at / with its files under /webui/ (unless turned off), :mod:`.webui`.

Shared by all: the API key (:mod:`.auth`), the body's limits (:mod:`.body`), the validator
(:mod:`.validation`), errors and their shapes (:mod:`.errors`), the SSE encoder and stream guard
(:mod:`.streaming`), the OpenAPI document (:mod:`.openapi`). Generation runs on the
:class:`~quickdraft.server.worker.EngineWorker` thread; a client that disconnects cancels its
request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route

from quickdraft import __version__
from quickdraft.server.anthropic.protocol import ANTHROPIC_ERRORS
from quickdraft.server.anthropic.router import anthropic_router
from quickdraft.server.auth import ApiKeyMiddleware
from quickdraft.server.errors import ErrorShapes, http_error, internal_error
from quickdraft.server.grammar import GrammarCompiler
from quickdraft.server.metrics import ServerMetrics
from quickdraft.server.model_server import ModelServer
from quickdraft.server.openai.protocol import OPENAI_ERRORS
from quickdraft.server.openai.router import openai_router
from quickdraft.server.openapi import document
from quickdraft.server.responses.router import responses_router
from quickdraft.server.responses.store import ResponseStore
from quickdraft.server.tools import ToolFormat, format_for_template, get_format
from quickdraft.server.webui import WEBUI_FILES, webui_router
from quickdraft.server.worker import EngineWorker

if TYPE_CHECKING:
    from quickdraft.api import LLM

__all__ = ["WEBUI_FILES", "create_app"]


def create_app(
    llm: LLM,
    served_name: str | Sequence[str],
    api_key: str | None = None,
    tool_call_parser: str = "auto",
    webui: bool = True,
) -> FastAPI:
    """The app serving ``llm`` as model ``served_name`` (or several aliases, the first being
    the name responses report); with ``api_key``, every route but /health and the chat page's
    files needs ``Authorization: Bearer <api_key>``. ``tool_call_parser``: the tool-call format
    (``auto`` = from the chat template, ``none`` = refuse tools). ``webui``: serve the chat page
    at / (:data:`WEBUI_FILES`)."""
    names = (served_name,) if isinstance(served_name, str) else tuple(dict.fromkeys(served_name))
    if not names:
        raise ValueError("create_app needs at least one served model name")
    metrics = ServerMetrics(llm.prefix_cache)
    worker = EngineWorker(llm.engine, llm.drafter, llm.num_draft, metrics)
    server = ModelServer(
        llm, names, worker, metrics, GrammarCompiler(llm.tokenizer),
        _tool_format(llm, tool_call_parser), tool_call_parser,
    )

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        worker.start()
        await asyncio.to_thread(lambda: server.grammar.ll_tokenizer)  # ~0.2 s, off the loop
        yield
        worker.stop()

    app = FastAPI(
        title="quickdraft", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None
    )
    app.openapi = lambda: document(app, (OPENAI_ERRORS, ANTHROPIC_ERRORS))  # type: ignore[method-assign]
    routers = [webui_router()] if webui else []
    messages = anthropic_router(server)
    routers += [openai_router(server), messages, responses_router(server, ResponseStore())]
    for router in routers:
        app.include_router(router)
    shapes = ErrorShapes(OPENAI_ERRORS, ((messages.prefix, ANTHROPIC_ERRORS),))
    if api_key:
        public = frozenset({"/health", *(WEBUI_FILES if webui else ())})
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, public=public, shapes=shapes)
    _add_fallback_errors(app, shapes, _route_list(app, routers))
    app.state.worker = worker  # for the CLI: end streams at once when asked to shut down
    return app


def _tool_format(llm: LLM, tool_call_parser: str) -> ToolFormat | None:
    """How the model writes tool calls: from its chat template (``auto``), none, or named."""
    if tool_call_parser == "auto":
        return format_for_template(llm.tokenizer.chat_template)
    if tool_call_parser == "none":
        return None
    return get_format(tool_call_parser)


def _add_fallback_errors(app: FastAPI, shapes: ErrorShapes, routes: str) -> None:
    """Errors no dialect route answered: a path no route serves (404, listing the routes), a
    wrong method on the chat page's or the OpenAPI document's path (405), a failure there (500)."""

    async def http_fallback(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        shape = shapes.for_path(request.url.path)
        return shape.response(http_error(request, exc, routes))

    async def internal_fallback(request: Request, exc: Exception) -> Response:
        return shapes.for_path(request.url.path).response(internal_error(exc))

    app.add_exception_handler(StarletteHTTPException, http_fallback)
    app.add_exception_handler(Exception, internal_fallback)


def _route_list(app: FastAPI, routers: list[APIRouter]) -> str:
    """Every HTTP route the app serves as "METHOD /path", in the order they were added. The
    routers' routes are listed from the routers: FastAPI keeps an included router whole in
    ``app.routes`` (older versions copied its routes there: listed once all the same)."""
    routes = [*app.routes, *(route for router in routers for route in router.routes)]
    listed = []
    for route in routes:
        if isinstance(route, Route) and route.methods:
            listed += [f"{m} {route.path}" for m in sorted(route.methods) if m != "HEAD"]
    return ", ".join(dict.fromkeys(listed))
