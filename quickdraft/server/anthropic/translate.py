"""Anthropic's Messages API translated onto the chat route, and its answers back.

There is one request model underneath: a Messages request is translated into the OpenAI
:class:`~quickdraft.server.openai.protocol.ChatCompletionRequest` (system prompt -> system
message, ``tool_use`` blocks -> assistant ``tool_calls``, ``tool_result`` blocks -> ``tool``
messages, tools and tool_choice -> OpenAI function tools), which is checked, rendered and
generated exactly as ``/v1/chat/completions`` does it, so a greedy answer is token for token the
chat route's. The finished :class:`~quickdraft.server.openai.protocol.ChatCompletion` is then
translated back into Anthropic's message object (its stream: :mod:`.streaming_events`).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from quickdraft.server.anthropic.protocol import (
    MessagesBase,
    MessagesRequest,
    TextBlock,
    Tool,
    ToolChoice,
    ToolResultBlock,
    ToolUseBlock,
)
from quickdraft.server.errors import ApiError
from quickdraft.server.openai import protocol as p
from quickdraft.server.validation import parse_request

# -------------------------------------------------------------------- Messages -> chat request


def to_chat_request(req: MessagesBase) -> p.ChatCompletionRequest:
    """The chat completion request that asks the same thing (``max_tokens`` None for a
    count_tokens request). Raises :class:`ApiError` (400) for what cannot be translated."""
    if req.thinking is not None and req.thinking.type != "disabled":
        raise ApiError(
            400,
            "thinking: extended thinking is not supported by quickdraft; leave `thinking` out "
            "(or send {\"type\": \"disabled\"})",
            param="thinking",
        )
    body: dict[str, Any] = {"model": req.model, "messages": _messages(req)}
    if req.tools:
        body["tools"] = _tools(req.tools)
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
    return parse_request(p.ChatCompletionRequest, body)


def _messages(req: MessagesBase) -> list[dict[str, Any]]:
    """The system prompt and the turns as chat messages."""
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
    return messages


def _tools(tools: list[Tool]) -> list[dict[str, Any]]:
    """Custom tools as OpenAI function tools; server tools and tools without a schema refused."""
    for j, tool in enumerate(tools):
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
    return [
        {
            "type": "function",
            "function": {
                "name": t.name,
                "description": t.description,
                "parameters": t.input_schema,
            },
        }
        for t in tools
    ]


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


def message_id(chat_id: str) -> str:
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
        "id": message_id(completion.id),
        "type": "message",
        "role": "assistant",
        "model": completion.model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": stop_sequence if reason == "stop_sequence" else None,
        "usage": usage(completion.usage),
    }
