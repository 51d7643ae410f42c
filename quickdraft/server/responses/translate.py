"""OpenAI's Responses API (``POST /v1/responses``) as a translation of the chat completions API.

There is one request model underneath: a Responses request becomes a
:class:`~quickdraft.server.openai.protocol.ChatCompletionRequest` (:func:`to_chat_request`), is served
exactly as ``/v1/chat/completions`` serves it (so greedy answers are token-identical), and the
finished :class:`~quickdraft.server.openai.protocol.ChatCompletion` becomes a Response object
(:func:`to_response`), or the stream of chat chunks becomes the Responses API's typed events
(:mod:`.streaming_events`).

The mapping, as llama.cpp's server and vLLM serve it:

- ``instructions`` -> a system message first; ``input`` (a string = one user message, or items)
  -> messages: ``message`` items keep their role (text parts only), ``function_call`` items ->
  an assistant message's ``tool_calls``, ``function_call_output`` -> ``tool`` messages;
- ``tools`` (function tools, flat: ``{type, name, description, parameters, strict}``) and
  ``tool_choice`` -> the chat forms; ``text.format`` -> ``response_format``;
  ``max_output_tokens`` -> ``max_tokens``;
- ``store`` (default true) keeps the finished response in memory (:mod:`.store`, the last
  :data:`~.store.MAX_STORED`), so ``GET /v1/responses/{id}`` returns it and ``previous_response_id``
  continues from it: its input and output come before the new input (its ``instructions`` do not,
  as with OpenAI). Responses are lost when the server stops.

No reasoning items are produced; what cannot be honoured is refused by :mod:`.protocol`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel

from quickdraft.server.errors import ApiError
from quickdraft.server.openai import protocol as p
from quickdraft.server.responses.protocol import (
    FunctionCallItem,
    InputItem,
    MessageItem,
    NamedFunctionChoice,
    ResponsesRequest,
    TextConfig,
)

# ----------------------------------------------------------------------- request -> chat request


def input_items(req: ResponsesRequest) -> list[InputItem]:
    if isinstance(req.input, str):
        return [MessageItem(role="user", content=req.input)]
    return list(req.input)


def to_chat_request(
    req: ResponsesRequest, history: list[InputItem] | None = None
) -> p.ChatCompletionRequest:
    """The chat completions request this Responses request means; ``history``: the items of the
    response named by ``previous_response_id`` (its input and output), put before the input."""
    messages = _messages(req, list(history or []))
    if not messages:
        raise ApiError(400, "input is empty; give at least one message", param="input")
    return p.ChatCompletionRequest(
        model=req.model,
        messages=messages,
        max_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        tools=[
            p.ToolDefinition(
                type="function",
                function=p.FunctionDefinition(
                    name=t.name, description=t.description, parameters=t.parameters, strict=t.strict
                ),
            )
            for t in req.tools
        ]
        if req.tools
        else None,
        tool_choice=_chat_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls,
        response_format=_response_format(req.text),
    )


def _messages(req: ResponsesRequest, old: list[InputItem]) -> list[p.ChatMessage]:
    """The instructions, then the items of ``old`` (the history) and of the input, as chat
    messages: function calls join the assistant message before them."""
    messages: list[p.ChatMessage] = []
    if req.instructions:
        messages.append(p.ChatMessage(role="system", content=req.instructions))
    items = old + input_items(req)
    known_calls: set[str] = set()
    for n, item in enumerate(items):
        where = f"input[{n - len(old)}]"
        if isinstance(item, MessageItem):
            messages.append(p.ChatMessage(role=item.role, content=item.text()))
        elif isinstance(item, FunctionCallItem):
            known_calls.add(item.call_id)
            call = p.ToolCallIn(
                id=item.call_id, function=p.FunctionCallIn(name=item.name, arguments=item.arguments)
            )
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant" and (
                last.tool_calls or _open_turn(items, n)
            ):
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(p.ChatMessage(role="assistant", content=None, tool_calls=[call]))
        else:
            if item.call_id not in known_calls:
                raise ApiError(
                    400,
                    f"{where}.call_id: no function_call with call_id {item.call_id!r} comes "
                    "before this function_call_output",
                    param=f"{where}.call_id",
                )
            messages.append(
                p.ChatMessage(role="tool", content=item.text(), tool_call_id=item.call_id)
            )
    return messages


def _open_turn(items: list[InputItem], n: int) -> bool:
    """Whether the function_call at ``n`` directly follows an assistant message item (the same
    turn: the text before the calls), so it joins that message."""
    before = items[n - 1] if n > 0 else None
    return isinstance(before, MessageItem) and before.role == "assistant"


def _chat_tool_choice(
    choice: Literal["auto", "none", "required"] | NamedFunctionChoice | None,
) -> Literal["none", "auto", "required"] | p.NamedToolChoice | None:
    if isinstance(choice, NamedFunctionChoice):
        return p.NamedToolChoice(type="function", function=p.NamedFunction(name=choice.name))
    return choice


def _response_format(text: TextConfig | None) -> p.ResponseFormat | None:
    fmt = text.format if text is not None else None
    if fmt is None:
        return None
    if fmt.type != "json_schema":
        return p.ResponseFormat(type=fmt.type)
    if fmt.schema_ is None:
        raise ApiError(400, "text.format json_schema needs schema", param="text.format.schema")
    return p.ResponseFormat(
        type="json_schema",
        json_schema=p.JsonSchemaFormat(
            name=fmt.name or "schema",
            description=fmt.description,
            schema=fmt.schema_,
            strict=fmt.strict,
        ),
    )


# ----------------------------------------------------------------------- chat output -> response


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {
        "type": "message",
        "id": item_id or new_item_id("msg"),
        "status": status,
        "role": "assistant",
        "content": content,
    }


def call_item(call_id: str, name: str, arguments: str, item_id: str | None = None) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id or new_item_id("fc"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": "completed",
    }


def usage(u: p.Usage | None) -> dict[str, Any] | None:
    if u is None:
        return None
    return {
        "input_tokens": u.prompt_tokens,
        # cache_write_tokens (newer SDKs require it) is not counted by quickdraft: always 0
        "input_tokens_details": {
            "cached_tokens": u.prompt_tokens_details.cached_tokens, "cache_write_tokens": 0
        },
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.total_tokens,
    }


def response_object(
    req: ResponsesRequest,
    response_id: str,
    created_at: int,
    model: str,
    output: list[dict[str, Any]],
    status: str,
    use: p.Usage | None,
) -> dict[str, Any]:
    """A Response object with the request's settings echoed, as OpenAI returns them."""
    fmt = req.text.format if req.text is not None and req.text.format is not None else None
    text_format: dict[str, Any] = {"type": "text"}
    if fmt is not None:
        text_format = fmt.model_dump(by_alias=True, exclude_none=True)
        if fmt.type == "json_schema":
            text_format.setdefault("name", "schema")
    choice = req.tool_choice
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": model,
        "output": output,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": None,
        "store": req.store is not False,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": text_format},
        "tool_choice": choice.model_dump() if isinstance(choice, BaseModel) else (choice or "auto"),
        "tools": [
            {**t.model_dump(), "strict": t.strict is True} for t in req.tools or []
        ],
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": req.truncation or "disabled",
        "usage": usage(use),
        "user": req.user,
        "metadata": req.metadata or {},
    }


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def to_response(
    req: ResponsesRequest, chat: p.ChatCompletion, response_id: str | None = None
) -> dict[str, Any]:
    """A finished chat completion as the Response object of ``req``."""
    choice = chat.choices[0]
    status = status_of(choice.finish_reason)
    output: list[dict[str, Any]] = []
    msg = choice.message
    if msg.content is not None and (msg.content or not msg.tool_calls):
        output.append(message_item(msg.content, status))
    for call in msg.tool_calls or []:
        output.append(call_item(call.id, call.function.name, call.function.arguments))
    return response_object(
        req, response_id or new_response_id(), int(time.time()), chat.model, output, status,
        chat.usage,
    )
