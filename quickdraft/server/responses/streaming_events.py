"""A streamed chat completion as the Responses API's typed events.

response.created and response.in_progress first; then per output item (a message, a function
call) its output_item.added, its deltas (output_text.delta, function_call_arguments.delta) and
its closing events (output_text.done, content_part.done / function_call_arguments.done, then
output_item.done); last response.completed (or response.incomplete) with the whole response.
Every event carries its ``sequence_number``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from quickdraft.server.openai import protocol as p
from quickdraft.server.responses.protocol import ResponsesRequest
from quickdraft.server.responses.translate import (
    message_item,
    new_item_id,
    new_response_id,
    response_object,
    status_of,
)
from quickdraft.server.streaming import StreamFailure, typed_sse

Event = dict[str, Any]


class ResponseStream:
    """The chat chunks of one request as the Responses API's events (dicts with ``type`` and
    ``sequence_number``); :meth:`error` is the event that ends a stream that failed."""

    def __init__(self, req: ResponsesRequest, model: str, response_id: str | None = None) -> None:
        self.req = req
        self.model = model
        self.id = response_id or new_response_id()
        self.created_at = int(time.time())
        self.seq = 0
        self.final: dict[str, Any] | None = None  # the finished response
        self.output: list[dict[str, Any]] = []  # the items done
        self.message: dict[str, Any] | None = None  # the open message item
        self.text: list[str] = []  # of the open message item
        self.call: dict[str, Any] | None = None  # the open function_call item
        self.call_index: int | None = None  # its index among the chat chunks' tool calls

    def _ev(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def _response(
        self, output: list[dict[str, Any]], status: str, use: p.Usage | None = None
    ) -> dict[str, Any]:
        return response_object(self.req, self.id, self.created_at, self.model, output, status, use)

    def error(self, message: str, code: str | None = None) -> Event:
        return self._ev("error", code=code, message=message, param=None)

    def failure_events(self, failure: StreamFailure) -> list[str]:
        """How this stream ends when it failed: an ``error`` event (``server_error`` for a bug)."""
        return [typed_sse(self.error(failure.message, "server_error" if failure.internal else None))]

    async def events(
        self,
        chunks: AsyncIterator[p.ChatCompletionChunk],
        on_done: Callable[[dict[str, Any]], None] | None = None,
    ) -> AsyncIterator[Event]:
        """The events of ``chunks``; ``on_done`` gets the finished response before the last."""
        yield self._ev("response.created", response=self._response([], "in_progress"))
        yield self._ev("response.in_progress", response=self._response([], "in_progress"))
        async for chunk in chunks:
            finish = None
            for choice in chunk.choices:
                for event in self._delta(choice.delta):
                    yield event
                finish = choice.finish_reason or finish
            if finish is not None or chunk.usage is not None:
                status = status_of(finish)
                for event in self._close_all(status):
                    yield event
                final = self._response(self.output, status, chunk.usage)
                self.final = final
                if on_done is not None:
                    on_done(final)
                kind = "response.incomplete" if status == "incomplete" else "response.completed"
                yield self._ev(kind, response=final)
                return

    def _delta(self, delta: p.Delta) -> list[Event]:
        events = self._text(delta.content) if delta.content else []
        for call in delta.tool_calls or []:
            events += self._call_piece(call)
        return events

    def _text(self, text: str) -> list[Event]:
        events = self._close_call()
        if self.message is None:
            events += self._open_message()
        assert self.message is not None
        self.text.append(text)
        at = {"item_id": self.message["id"], "output_index": len(self.output), "content_index": 0}
        return [*events, self._ev("response.output_text.delta", **at, delta=text, logprobs=[])]

    def _open_message(self) -> list[Event]:
        message = message_item("", "in_progress")
        message["content"] = []
        self.message = message
        self.text.clear()
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            self._ev("response.output_item.added", output_index=len(self.output), item=message),
            self._ev(
                "response.content_part.added",
                item_id=message["id"], output_index=len(self.output), content_index=0, part=part,
            ),
        ]

    def _call_piece(self, tc: p.ToolCallDelta) -> list[Event]:
        """A piece of a tool call: a new call (a new id, or another index) opens its item."""
        events: list[Event] = []
        if tc.id is not None or self.call is None or tc.index != self.call_index:
            events = self._close_message("completed") + self._close_call()
            self.call = {
                "type": "function_call",
                "id": new_item_id("fc"),
                "call_id": tc.id or f"call_{uuid.uuid4().hex[:24]}",
                "name": tc.function.name or "",
                "arguments": "",
                "status": "in_progress",
            }
            self.call_index = tc.index
            events.append(
                self._ev("response.output_item.added", output_index=len(self.output), item=dict(self.call))
            )
        assert self.call is not None
        piece = tc.function.arguments
        if piece:
            self.call["arguments"] += piece
            events.append(self._ev(
                "response.function_call_arguments.delta",
                item_id=self.call["id"], output_index=len(self.output), delta=piece,
            ))
        return events

    def _close_all(self, status: str) -> list[Event]:
        """Close the open item; an empty answer gets one empty message, as a whole response has."""
        events = self._close_message(status) + self._close_call()
        if not self.output:
            events += self._open_message() + self._close_message(status)
        return events

    def _close_message(self, status: str) -> list[Event]:
        if self.message is None:
            return []
        done = message_item("".join(self.text), status, self.message["id"])
        part = done["content"][0]
        at = {"item_id": done["id"], "output_index": len(self.output), "content_index": 0}
        events = [
            self._ev("response.output_text.done", **at, text=part["text"], logprobs=[]),
            self._ev("response.content_part.done", **at, part=part),
            self._ev("response.output_item.done", output_index=len(self.output), item=done),
        ]
        self.output.append(done)
        self.message = None
        return events

    def _close_call(self) -> list[Event]:
        if self.call is None:
            return []
        done = {**self.call, "status": "completed"}
        at = {"item_id": done["id"], "output_index": len(self.output)}
        events = [
            self._ev(
                "response.function_call_arguments.done",
                **at, name=done["name"], arguments=done["arguments"],
            ),
            self._ev("response.output_item.done", output_index=len(self.output), item=done),
        ]
        self.output.append(done)
        self.call = None
        return events
