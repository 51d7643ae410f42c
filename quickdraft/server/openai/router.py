"""OpenAI's API: POST /v1/chat/completions (tool calling included, see
:mod:`quickdraft.server.tools`) and /v1/completions (streamed as server-sent events or whole),
GET /v1/models, /v1/models/{model}, and the server's /health and /metrics (Prometheus).

Requests are checked before they queue (model name, fields, prompt and max_tokens against the
context, the JSON schema); every failure is OpenAI's error object with a 4xx status.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from quickdraft.server.body import read_json
from quickdraft.server.errors import DialectRoute
from quickdraft.server.model_server import ModelServer
from quickdraft.server.openai import protocol as p
from quickdraft.server.openai.prepare import prepare_chat, prepare_choices, prepare_completion
from quickdraft.server.openai.serving import chat_response, collect, completion_response, submit_all
from quickdraft.server.openai.streaming_events import chat_events, completion_events
from quickdraft.server.openapi import body_doc
from quickdraft.server.streaming import event_stream
from quickdraft.server.validation import parse_request


class OpenAIRoute(DialectRoute):
    """A route answering its errors as OpenAI's error object."""

    shape = p.OPENAI_ERRORS


def openai_router(server: ModelServer) -> APIRouter:
    """OpenAI's routes, with /health and /metrics, over ``server``."""
    router = APIRouter(route_class=OpenAIRoute)

    @router.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        return p.ModelList(data=[_card(server, name) for name in server.names]).model_dump()

    @router.get("/v1/models/{model}")
    async def model(model: str) -> dict[str, Any]:
        server.check_model(model)
        return _card(server, model).model_dump()

    @router.post("/v1/chat/completions", openapi_extra=body_doc(p.ChatCompletionRequest, p.OPENAI_ERRORS))
    async def chat(request: Request) -> Response:
        req = parse_request(p.ChatCompletionRequest, await read_json(request))
        server.check_model(req.model)
        choices = await asyncio.to_thread(prepare_choices, server, req, prepare_chat)
        jobs = submit_all(server, choices)
        if req.stream:
            return event_stream(chat_events(server, jobs, req.include_usage(), choices))
        outputs = await collect(request, jobs)
        return JSONResponse(chat_response(server, outputs, choices).model_dump())

    @router.post("/v1/completions", openapi_extra=body_doc(p.CompletionRequest, p.OPENAI_ERRORS))
    async def completions(request: Request) -> Response:
        req = parse_request(p.CompletionRequest, await read_json(request))
        server.check_model(req.model)
        choices = await asyncio.to_thread(prepare_choices, server, req, prepare_completion)
        echo = server.llm.tokenizer.decode(choices[0].prompt_ids) if req.echo else ""
        jobs = submit_all(server, choices)
        if req.stream:
            return event_stream(completion_events(server, jobs, echo, req.include_usage()))
        outputs = await collect(request, jobs)
        return JSONResponse(completion_response(server, outputs, echo).model_dump())

    return router


def _card(server: ModelServer, name: str) -> p.ModelCard:
    return p.ModelCard(id=name, created=server.created, max_model_len=server.context)
