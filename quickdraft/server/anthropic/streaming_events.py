"""A streamed chat completion as Anthropic's Messages stream events.

The chat chunks (:func:`quickdraft.server.openai.serving.chat_chunks`) become message_start,
ping, per content block a content_block_start, its deltas (``text_delta`` or
``input_json_delta`` pieces) and content_block_stop, then message_delta (stop reason, usage) and
message_stop. A text run is one block; each tool call is one ``tool_use`` block.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from quickdraft.server.anthropic.translate import message_id, stop_reason, usage
from quickdraft.server.openai import protocol as p

Event = dict[str, Any]


async def to_events(
    chunks: AsyncIterator[p.ChatCompletionChunk],
    input_tokens: int,
    stop_sequence: Callable[[], str | None] = lambda: None,
) -> AsyncIterator[Event]:
    """The chat chunks as Anthropic's stream events (each a dict with its ``type``).
    ``input_tokens``: the prompt's length, for message_start (the final usage comes with
    message_delta); ``stop_sequence`` is asked once the stream has ended."""
    events = MessageEvents(input_tokens, stop_sequence)
    async for chunk in chunks:
        for event in events.of_chunk(chunk):
            yield event


class MessageEvents:
    """The state of one message's stream: which content block is open, and its index."""

    def __init__(self, input_tokens: int, stop_sequence: Callable[[], str | None]) -> None:
        self.input_tokens = input_tokens
        self.stop_sequence = stop_sequence
        self.started = False
        self.index = -1  # of the open (or last) content block
        self.open_block: str | None = None  # "text" or "call:<i>" (the tool call's index)

    def of_chunk(self, chunk: p.ChatCompletionChunk) -> list[Event]:
        """The events one chat chunk brings."""
        events = [] if self.started else self._start(chunk)
        self.started = True
        if not chunk.choices:
            return events
        choice = chunk.choices[0]
        if choice.delta.content:
            events += self._text(choice.delta.content)
        for call in choice.delta.tool_calls or []:
            events += self._call(call)
        if choice.finish_reason is not None:
            events += self._finish(choice.finish_reason, chunk.usage)
        return events

    def _start(self, chunk: p.ChatCompletionChunk) -> list[Event]:
        message: dict[str, Any] = {
            "id": message_id(chunk.id),
            "type": "message",
            "role": "assistant",
            "model": chunk.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": 0},
        }
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def _open(self, kind: str, block: dict[str, Any]) -> list[Event]:
        """Close the open block, open the next (of ``kind``) with ``block``."""
        events = self._close()
        self.index += 1
        self.open_block = kind
        return [*events, {"type": "content_block_start", "index": self.index, "content_block": block}]

    def _close(self) -> list[Event]:
        if self.open_block is None:
            return []
        self.open_block = None
        return [{"type": "content_block_stop", "index": self.index}]

    def _text(self, text: str) -> list[Event]:
        events = [] if self.open_block == "text" else self._open("text", {"type": "text", "text": ""})
        delta = {"type": "text_delta", "text": text}
        return [*events, {"type": "content_block_delta", "index": self.index, "delta": delta}]

    def _call(self, call: p.ToolCallDelta) -> list[Event]:
        kind = f"call:{call.index}"
        events: list[Event] = []
        if self.open_block != kind:
            block = {
                "type": "tool_use",
                "id": call.id or f"toolu_{uuid.uuid4().hex[:24]}",
                "name": call.function.name or "",
                "input": {},
            }
            events = self._open(kind, block)
        if call.function.arguments:
            delta = {"type": "input_json_delta", "partial_json": call.function.arguments}
            events.append({"type": "content_block_delta", "index": self.index, "delta": delta})
        return events

    def _finish(self, finish_reason: str, use: p.Usage | None) -> list[Event]:
        events = self._close()
        matched = self.stop_sequence()
        reason = stop_reason(finish_reason, matched)
        delta = {"stop_reason": reason, "stop_sequence": matched if reason == "stop_sequence" else None}
        usage_now = usage(use, self.input_tokens)
        return [*events, {"type": "message_delta", "delta": delta, "usage": usage_now}, {"type": "message_stop"}]
