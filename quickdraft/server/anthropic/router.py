"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens, translated onto
the chat route (:mod:`.translate`); every error, before routing or after, in Anthropic's shape."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, fields

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from quickdraft.engine import StepOutput
from quickdraft.server.anthropic import protocol as m
from quickdraft.server.anthropic.streaming_events import to_events
from quickdraft.server.anthropic.translate import to_chat_request, to_message
from quickdraft.server.body import read_json
from quickdraft.server.errors import DialectRoute
from quickdraft.server.model_server import ModelServer
from quickdraft.server.openai.prepare import prepare_chat, render_chat
from quickdraft.server.openai.serving import chat_chunks, chat_response, collect, submit
from quickdraft.server.openapi import body_doc
from quickdraft.server.streaming import StreamFailure, event_stream, guarded, typed_sse
from quickdraft.server.validation import parse_request
from quickdraft.server.worker import Job


class AnthropicRoute(DialectRoute):
    """A route answering its errors as Anthropic's error object."""

    shape = m.ANTHROPIC_ERRORS


def failure_events(failure: StreamFailure) -> list[str]:
    """How a Messages stream that failed ends: Anthropic's error event (the status line is
    sent already)."""
    return [typed_sse(m.error_body(500, failure.message))]


def anthropic_router(server: ModelServer) -> APIRouter:
    """The Messages API's routes over ``server``."""
    router = APIRouter(prefix="/v1/messages", route_class=AnthropicRoute)

    @router.post("", openapi_extra=body_doc(m.MessagesRequest, m.ANTHROPIC_ERRORS))
    async def messages(request: Request) -> Response:
        body = parse_request(m.MessagesRequest, await read_json(request))
        req = to_chat_request(body)
        server.check_model(req.model)
        prepared = await asyncio.to_thread(prepare_chat, server, req)
        stops = tuple(body.stop_sequences or ())
        if body.stream:
            job = TappedJob.of(submit(server, prepared))
            events = to_events(
                chat_chunks(server, job, prepared),
                len(prepared.prompt_ids),
                lambda: matched_stop(server, job.ids, stops),
            )
            return event_stream(guarded((typed_sse(e) async for e in events), [job], failure_events))
        outputs = await collect(request, [submit(server, prepared)])
        chat = chat_response(server, outputs, [prepared])
        matched = matched_stop(server, [t for s in outputs[0] for t in s.token_ids], stops)
        return JSONResponse(to_message(chat, matched))

    @router.post(
        "/count_tokens",
        openapi_extra=body_doc(m.CountTokensRequest, m.ANTHROPIC_ERRORS, answer="{input_tokens: N}"),
    )
    async def count_tokens(request: Request) -> Response:
        body = parse_request(m.CountTokensRequest, await read_json(request))
        req = to_chat_request(body)
        server.check_model(req.model)
        ids, _fmt = await asyncio.to_thread(render_chat, server, req)
        return JSONResponse({"input_tokens": len(ids)})

    return router


@dataclass
class TappedJob(Job):
    """A job read through this view records its tokens (to tell which stop sequence ended it);
    it shares the job's queue and cancel flag."""

    ids: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, job: Job) -> TappedJob:
        return cls(**{f.name: getattr(job, f.name) for f in fields(job)})

    async def steps(self) -> AsyncIterator[StepOutput]:
        async for step in super().steps():
            self.ids.extend(step.token_ids)
            yield step


def matched_stop(server: ModelServer, ids: list[int], stops: tuple[str, ...]) -> str | None:
    """The stop sequence that ended an output of ``ids``, None when none did. A stop sequence
    ends the output on the token completing it (an end-of-sequence or stop token ends it
    otherwise); the earliest in the text is the one that matched."""
    if not stops or not ids or ids[-1] in server.llm.tokenizer.eos_ids:
        return None
    text = server.llm.tokenizer.decode(ids)
    hits = [(text.find(s), i) for i, s in enumerate(stops) if s in text]
    return stops[min(hits)[1]] if hits else None
