"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) over the chat route.

There is one request model underneath: a Messages request is translated into the OpenAI
:class:`~quickdraft.server.protocol.ChatCompletionRequest` (system prompt -> system message,
``tool_use`` blocks -> assistant ``tool_calls``, ``tool_result`` blocks -> ``tool`` messages,
tools and tool_choice -> OpenAI function tools), which is checked, rendered and generated exactly
as ``/v1/chat/completions`` does it, so a greedy answer is token for token the chat route's. The
finished :class:`~quickdraft.server.protocol.ChatCompletion`, or its stream of chunks, is then
translated back into Anthropic's message object or its server-sent events.

What quickdraft cannot honour is refused with a 400 naming the field: image, document, thinking
and server-tool blocks, ``thinking`` turned on, a ``tool_result`` answering no earlier
``tool_use``. ``cache_control`` marks are accepted and have no effect (quickdraft reuses computed
prefixes by itself); ``metadata`` is accepted and not used.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, Literal, TypeVar

from pydantic import Field, field_validator

from quickdraft.server import protocol as p
from quickdraft.server.protocol import ApiError, _Lenient

_BLOCK_TYPES = ("text", "tool_use", "tool_result")

# ------------------------------------------------------------------------------------ requests

_BLOCK_HINTS = {
    "image": "quickdraft serves text-only models; send the content as text",
    "document": "quickdraft serves text-only models; send the document's text as a text block",
    "thinking": "extended thinking is not supported; drop the thinking blocks from the history",
    "redacted_thinking": "extended thinking is not supported; drop the thinking blocks from the "
    "history",
}


class TextBlock(_Lenient):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Lenient):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any] = Field(default_factory=dict)


class ToolResultBlock(_Lenient):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: list[TextBlock] | str | None = None
    is_error: bool = False

    def text(self) -> str:
        content = self.content or ""
        text = content if isinstance(content, str) else "".join(b.text for b in content)
        return f"Error: {text}" if self.is_error else text


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


def _check_blocks(value: Any, allowed: tuple[str, ...]) -> Any:
    """Refuse a block list holding a type not in ``allowed``, with what to send instead (a
    plain union error would list every alternative pydantic tried)."""
    if not isinstance(value, list):
        return value
    for i, block in enumerate(value):
        kind = block.get("type") if isinstance(block, dict) else None
        if not isinstance(kind, str):
            raise ValueError(f"block {i} needs a `type` ({', '.join(allowed)})")
        if kind not in allowed:
            hint = _BLOCK_HINTS.get(kind, f"send {', '.join(allowed)} blocks")
            raise ValueError(f"block {i} has type {kind!r}, which is not supported here: {hint}")
        if kind == "tool_result":  # here, not in its own validator: a union error would hide it
            try:
                _check_blocks(block.get("content"), ("text",))
            except ValueError as exc:
                raise ValueError(f"block {i} (tool_result) content: {exc}") from None
    return value


class MessageParam(_Lenient):
    role: Literal["user", "assistant"]
    content: list[Block] | str

    @field_validator("content", mode="before")
    @classmethod
    def _known_blocks(cls, value: Any) -> Any:
        return _check_blocks(value, _BLOCK_TYPES)


class Tool(_Lenient):
    type: str | None = None  # "custom"; Anthropic's server tools (bash_..., web_search_...) are not served
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    input_schema: dict[str, Any] | None = None  # required of custom tools (checked on translation)


class ToolChoice(_Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(_Lenient):
    type: str  # "enabled", "adaptive" (refused) or "disabled"
    budget_tokens: int | None = None


class OutputFormat(_Lenient):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Lenient):
    effort: str | None = None  # accepted, no effect
    format: OutputFormat | None = None  # structured output: the answer is JSON of this schema


class _MessagesBase(_Lenient):
    """What a Messages request and a count_tokens request share."""

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: list[TextBlock] | str | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None

    @field_validator("system", mode="before")
    @classmethod
    def _text_system(cls, value: Any) -> Any:
        return _check_blocks(value, ("text",))


class MessagesRequest(_MessagesBase):
    """The body of ``POST /v1/messages``."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)  # None = Anthropic's default, 1
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool | None = False
    metadata: dict[str, Any] | None = None  # accepted, not used
    output_config: OutputConfig | None = None


class CountTokensRequest(_MessagesBase):
    """The body of ``POST /v1/messages/count_tokens``."""


M = TypeVar("M", bound=_MessagesBase)


def parse_body(model: type[M], data: Any) -> M:
    """Validate a decoded body; the first problem becomes a 400 naming the field as the client
    wrote it (``messages.0.content.1.id``, without pydantic's union branch labels)."""
    return p.parse_request(model, data, _client_path)


def _client_path(parts: tuple[int | str, ...]) -> str:
    loc: list[str] = []
    for k, part in enumerate(parts):
        label = isinstance(part, str) and ("[" in part or part in ("str", "int"))
        tag = part in _BLOCK_TYPES and k > 0 and isinstance(parts[k - 1], int)  # the union's tag
        if not (label or tag):
            loc.append(str(part))
    return ".".join(loc)


# -------------------------------------------------------------------- Messages -> chat request


def to_chat_request(req: _MessagesBase) -> p.ChatCompletionRequest:
    """The chat completion request that asks the same thing (``max_tokens`` None for a
    count_tokens request). Raises :class:`ApiError` (400) for what cannot be translated."""
    if req.thinking is not None and req.thinking.type != "disabled":
        raise ApiError(
            400,
            "thinking: extended thinking is not supported by quickdraft; leave `thinking` out "
            "(or send {\"type\": \"disabled\"})",
            param="thinking",
        )
    messages: list[dict[str, Any]] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else _parts(req.system)
        messages.append({"role": "system", "content": system})
    last = len(req.messages) - 1
    if req.messages[last].role == "assistant":
        raise ApiError(
            400,
            f"messages.{last}: the last message is the assistant's; prefilling the answer is not "
            "supported, end with a user message",
            param=f"messages.{last}",
        )
    seen_calls: set[str] = set()
    for i, message in enumerate(req.messages):
        where = f"messages.{i}.content"
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
        elif message.role == "assistant":
            messages.append(_assistant(message.content, where, seen_calls))
        else:
            messages.extend(_user(message.content, where, seen_calls))
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    if req.tools:
        for j, tool in enumerate(req.tools):
            if tool.type not in (None, "custom"):
                raise ApiError(
                    400,
                    f"tools.{j}.type: {tool.type!r} is one of Anthropic's server tools, which "
                    "quickdraft does not run; describe the tool with name, description and "
                    "input_schema and run it yourself",
                    param=f"tools.{j}.type",
                )
            if tool.input_schema is None:
                raise ApiError(
                    400, f"tools.{j}.input_schema: Field required (the JSON schema of the input)",
                    param=f"tools.{j}.input_schema",
                )
        body["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description,
                    "parameters": t.input_schema,
                },
            }
            for t in req.tools
        ]
    if req.tool_choice is not None and (req.tools or req.tool_choice.type != "auto"):
        body.update(_tool_choice(req.tool_choice))  # auto without tools: nothing to choose
    if isinstance(req, MessagesRequest):
        body["max_tokens"] = req.max_tokens
        body["temperature"] = req.temperature
        body["top_p"] = req.top_p
        body["top_k"] = req.top_k
        if req.stop_sequences:
            body["stop"] = list(req.stop_sequences)
        body["stream"] = bool(req.stream)
        if req.output_config is not None and req.output_config.format is not None:
            schema = req.output_config.format.schema_
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    return p.parse_request(p.ChatCompletionRequest, body)


def _parts(blocks: list[TextBlock]) -> list[dict[str, Any]]:
    """Text blocks as OpenAI text content parts (joined as the chat route joins them)."""
    return [{"type": "text", "text": b.text} for b in blocks]


def _assistant(blocks: list[Any], where: str, seen_calls: set[str]) -> dict[str, Any]:
    texts: list[TextBlock] = []
    calls = []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            texts.append(block)
        elif isinstance(block, ToolUseBlock):
            seen_calls.add(block.id)
            function = {"name": block.name, "arguments": json.dumps(block.input)}
            calls.append({"id": block.id, "type": "function", "function": function})
        else:
            raise ApiError(
                400,
                f"{where}.{j}: tool_result blocks belong in user messages (they answer the "
                "assistant's tool_use blocks)",
                param=f"{where}.{j}",
            )
    out: dict[str, Any] = {"role": "assistant", "content": _parts(texts) if texts else ""}
    if calls:
        out["tool_calls"] = calls
    return out


def _user(blocks: list[Any], where: str, seen_calls: set[str]) -> list[dict[str, Any]]:
    """A user turn: tool results become tool messages, runs of text blocks user messages."""
    out: list[dict[str, Any]] = []
    texts: list[TextBlock] = []

    def flush() -> None:
        if texts:
            out.append({"role": "user", "content": _parts(texts)})
            texts.clear()

    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            texts.append(block)
        elif isinstance(block, ToolResultBlock):
            if block.tool_use_id not in seen_calls:
                raise ApiError(
                    400,
                    f"{where}.{j}.tool_use_id: {block.tool_use_id!r} answers no tool_use block of "
                    "an earlier assistant message; send the assistant's tool_use block before its "
                    "tool_result",
                    param=f"{where}.{j}.tool_use_id",
                )
            flush()
            out.append({"role": "tool", "content": block.text(), "tool_call_id": block.tool_use_id})
        else:
            raise ApiError(
                400,
                f"{where}.{j}: tool_use blocks belong in assistant messages",
                param=f"{where}.{j}",
            )
    flush()
    if not out:
        out.append({"role": "user", "content": ""})
    return out


def _tool_choice(choice: ToolChoice) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if choice.type == "tool":
        if not choice.name:
            raise ApiError(400, "tool_choice.name: a tool_choice of type tool needs the tool's name",
                           param="tool_choice.name")
        out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if choice.disable_parallel_tool_use:
        out["parallel_tool_calls"] = False
    return out


# ---------------------------------------------------------------------- chat -> Messages answer


def _message_id(chat_id: str) -> str:
    return "msg_" + (chat_id.removeprefix("chatcmpl-") or uuid.uuid4().hex)


def stop_reason(finish_reason: str | None, stop_sequence: str | None) -> str | None:
    if finish_reason == "tool_calls":
        return "tool_use"
    if finish_reason == "length":
        return "max_tokens"
    if finish_reason == "stop":
        return "stop_sequence" if stop_sequence is not None else "end_turn"
    return finish_reason


def usage(u: p.Usage | None, input_tokens: int = 0) -> dict[str, Any]:
    """Anthropic's usage: ``input_tokens`` are the prompt tokens computed, the ones read from the
    prefix cache are ``cache_read_input_tokens`` (their sum is the prompt)."""
    if u is None:
        return {"input_tokens": input_tokens, "output_tokens": 0}
    cached = u.prompt_tokens_details.cached_tokens
    return {
        "input_tokens": u.prompt_tokens - cached,
        "output_tokens": u.completion_tokens,
        "cache_read_input_tokens": cached,
        "quickdraft": u.quickdraft.model_dump(),
    }


def _tool_input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {"arguments": arguments}  # not JSON: kept, not lost
    return value if isinstance(value, dict) else {"arguments": value}


def to_message(completion: p.ChatCompletion, stop_sequence: str | None = None) -> dict[str, Any]:
    """The finished chat completion as Anthropic's message object. ``stop_sequence``: the stop
    sequence that ended it, if one did (the chat completion only says "stop")."""
    choice = completion.choices[0]
    content: list[dict[str, Any]] = []
    if choice.message.content:
        content.append({"type": "text", "text": choice.message.content})
    for call in choice.message.tool_calls or []:
        content.append(
            {
                "type": "tool_use",
                "id": call.id,
                "name": call.function.name,
                "input": _tool_input(call.function.arguments),
            }
        )
    reason = stop_reason(choice.finish_reason, stop_sequence)
    return {
        "id": _message_id(completion.id),
        "type": "message",
        "role": "assistant",
        "model": completion.model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": stop_sequence if reason == "stop_sequence" else None,
        "usage": usage(completion.usage),
    }


# ----------------------------------------------------------------------- chat stream -> events


async def to_events(
    chunks: AsyncIterator[p.ChatCompletionChunk],
    input_tokens: int,
    stop_sequence: Callable[[], str | None] = lambda: None,
) -> AsyncIterator[dict[str, Any]]:
    """The chat chunks as Anthropic's stream events (each a dict with its ``type``): message_start,
    ping, per content block a content_block_start, its deltas (``text_delta`` or
    ``input_json_delta`` pieces) and content_block_stop, then message_delta (stop reason, usage)
    and message_stop. ``input_tokens``: the prompt's length, for message_start (the final usage
    comes with message_delta); ``stop_sequence`` is asked once the stream has ended."""
    index = -1
    open_kind: str | None = None  # "text" or the tool call index (as "call:<i>") of the open block
    started = False

    def stop_block() -> list[dict[str, Any]]:
        nonlocal open_kind
        if open_kind is None:
            return []
        open_kind = None
        return [{"type": "content_block_stop", "index": index}]

    async for chunk in chunks:
        if not started:
            started = True
            yield {
                "type": "message_start",
                "message": {
                    "id": _message_id(chunk.id),
                    "type": "message",
                    "role": "assistant",
                    "model": chunk.model,
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": {"input_tokens": input_tokens, "output_tokens": 0},
                },
            }
            yield {"type": "ping"}
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        if delta.content:
            if open_kind != "text":
                for event in stop_block():
                    yield event
                index += 1
                open_kind = "text"
                yield {
                    "type": "content_block_start",
                    "index": index,
                    "content_block": {"type": "text", "text": ""},
                }
            yield {
                "type": "content_block_delta",
                "index": index,
                "delta": {"type": "text_delta", "text": delta.content},
            }
        for call in delta.tool_calls or []:
            kind = f"call:{call.index}"
            if open_kind != kind:
                for event in stop_block():
                    yield event
                index += 1
                open_kind = kind
                yield {
                    "type": "content_block_start",
                    "index": index,
                    "content_block": {
                        "type": "tool_use",
                        "id": call.id or f"toolu_{uuid.uuid4().hex[:24]}",
                        "name": call.function.name or "",
                        "input": {},
                    },
                }
            if call.function.arguments:
                yield {
                    "type": "content_block_delta",
                    "index": index,
                    "delta": {"type": "input_json_delta", "partial_json": call.function.arguments},
                }
        if choice.finish_reason is not None:
            for event in stop_block():
                yield event
            matched = stop_sequence()
            reason = stop_reason(choice.finish_reason, matched)
            yield {
                "type": "message_delta",
                "delta": {
                    "stop_reason": reason,
                    "stop_sequence": matched if reason == "stop_sequence" else None,
                },
                "usage": usage(chunk.usage, input_tokens),
            }
            yield {"type": "message_stop"}


def sse(event: dict[str, Any]) -> str:
    """One event on the wire: ``event: <type>`` then its JSON."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


# ------------------------------------------------------------------------------------ errors

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error object for an HTTP status."""
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"type": "string", "enum": ["error"]},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
        },
    },
}


def is_messages_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")
