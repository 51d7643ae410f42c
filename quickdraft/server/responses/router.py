"""OpenAI's Responses API: POST /v1/responses (translated onto the chat route, see
:mod:`.translate`), GET and DELETE /v1/responses/{id} and GET /v1/responses/{id}/input_items
for stored ones (:mod:`.store`). Its errors are OpenAI's error objects; a stream that fails ends
with the Responses API's ``error`` event."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from quickdraft.server.body import read_json
from quickdraft.server.model_server import ModelServer
from quickdraft.server.openai.prepare import prepare_chat
from quickdraft.server.openai.protocol import OPENAI_ERRORS
from quickdraft.server.openai.router import OpenAIRoute
from quickdraft.server.openai.serving import chat_chunks, chat_response, collect, submit
from quickdraft.server.openapi import body_doc
from quickdraft.server.responses.protocol import ResponsesRequest
from quickdraft.server.responses.store import ResponseStore
from quickdraft.server.responses.streaming_events import ResponseStream
from quickdraft.server.responses.translate import to_chat_request, to_response
from quickdraft.server.streaming import event_stream, guarded, typed_sse
from quickdraft.server.validation import parse_request


def responses_router(server: ModelServer, store: ResponseStore) -> APIRouter:
    """The Responses API's routes over ``server``, keeping finished responses in ``store``."""
    router = APIRouter(prefix="/v1/responses", route_class=OpenAIRoute)

    @router.post("", openapi_extra=body_doc(ResponsesRequest, OPENAI_ERRORS))
    async def responses(request: Request) -> Response:
        req = parse_request(ResponsesRequest, await read_json(request))
        server.check_model(req.model)
        history = store.history(req)
        chat_req = to_chat_request(req, history)
        prepared = await asyncio.to_thread(prepare_chat, server, chat_req)
        job = submit(server, prepared)

        def keep(response: dict[str, Any]) -> None:
            if req.store is not False:
                store.put(req, response, history)

        if req.stream:
            stream = ResponseStream(req, server.name)
            events = stream.events(chat_chunks(server, job, prepared), keep)
            return event_stream(guarded((typed_sse(e) async for e in events), [job], stream.failure_events))
        outputs = await collect(request, [job])
        response = to_response(req, chat_response(server, outputs, [prepared]))
        keep(response)
        return JSONResponse(response)

    @router.get("/{response_id}")
    async def get_response(response_id: str) -> dict[str, Any]:
        return store.get(response_id)[0]

    @router.get("/{response_id}/input_items")
    async def response_input_items(
        response_id: str, order: str = "desc", limit: int = 20, after: str | None = None
    ) -> dict[str, Any]:
        return store.input_items(response_id, order, limit, after)

    @router.delete("/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return router
