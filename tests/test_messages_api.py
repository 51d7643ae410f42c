"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens).

The translators are tested on their own (no model); then a real ``quickdraft serve`` of
Qwen2.5-Coder-0.5B (its template renders tools, Hermes style) with an API key is driven by the
real ``anthropic`` SDK: plain and streamed answers equal to the chat route's (greedy), a forced
tool call and the follow-up turn with its ``tool_result``, count_tokens, and errors in
Anthropic's shape.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from live_server import KEY, Server, running, start_server

from quickdraft.server.anthropic import protocol as m
from quickdraft.server.anthropic import translate as t
from quickdraft.server.anthropic.streaming_events import to_events
from quickdraft.server.errors import ApiError
from quickdraft.server.openai import protocol as p
from quickdraft.server.streaming import typed_sse
from quickdraft.server.validation import parse_request

NAME = "qwen"
WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


# ----------------------------------------------------------------------- translators, no model


def _request(**kw: Any) -> m.MessagesRequest:
    return parse_request(m.MessagesRequest, {"model": "x", "max_tokens": 5, "messages": ASK, **kw})


def test_request_translates_to_the_chat_request() -> None:
    req = _request(
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"},
                    {"type": "text", "text": "And tomorrow?"},
                ],
            },
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                 "content": [{"type": "text", "text": "no forecast"}]},
            ]},
        ],
        tools=[WEATHER],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        stop_sequences=["\n\n"],
        temperature=0,
        top_k=5,
        stream=True,
        metadata={"user_id": "u"},
    )
    chat = t.to_chat_request(req)
    assert [msg.to_template() for msg in chat.messages] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [{"id": "toolu_1", "type": "function",
                            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "18 C", "tool_call_id": "toolu_1"},
        {"role": "user", "content": "And tomorrow?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "toolu_2", "type": "function", "function": {"name": "get_weather", "arguments": {}}},
        ]},
        {"role": "tool", "content": "Error: no forecast", "tool_call_id": "toolu_2"},
    ]
    assert chat.tools is not None and chat.tools[0].function.parameters == WEATHER["input_schema"]
    assert chat.tools[0].function.name == "get_weather" and chat.tools[0].function.description
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.stop == ["\n\n"] and chat.max_tokens == 5 and chat.stream is True
    assert (chat.temperature, chat.top_k, chat.top_p) == (0, 5, None)

    named = t.to_chat_request(_request(tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}))
    assert isinstance(named.tool_choice, p.NamedToolChoice) and named.tool_choice.function.name == "get_weather"
    assert t.to_chat_request(_request(tools=[WEATHER], tool_choice={"type": "none"})).tool_choice == "none"
    assert t.to_chat_request(_request(tools=[WEATHER], tool_choice={"type": "auto"})).tool_choice == "auto"
    plain = t.to_chat_request(_request(system="sys"))
    assert [msg.to_template() for msg in plain.messages] == [
        {"role": "system", "content": "sys"}, {"role": "user", "content": ASK[0]["content"]}
    ]
    assert plain.tools is None and plain.tool_choice is None and plain.stop is None
    assert t.to_chat_request(_request(tool_choice={"type": "auto"}, thinking={"type": "disabled"})).tool_choice is None
    structured = {"effort": "low", "format": {"type": "json_schema", "schema": {"type": "object"}}}
    assert t.to_chat_request(_request(output_config=structured)).json_schema() == (True, {"type": "object"})
    counted = t.to_chat_request(parse_request(m.CountTokensRequest, {"model": "x", "messages": ASK}))
    assert counted.max_tokens is None


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "text-only"),
        ({"messages": [{"role": "user", "content": [{"type": "document"}]}]}, "text-only"),
        ({"messages": [{"role": "user", "content": [{"type": "bogus"}]}]}, "'bogus'"),
        ({"messages": [{"role": "user", "content": [{"text": "no type"}]}]}, "needs a `type`"),
        ({"messages": [{"role": "assistant", "content": [{"type": "thinking", "thinking": "."}]},
                       *ASK]}, "thinking"),
        ({"messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]}]}]},
         "text-only"),
        ({"system": [{"type": "image"}]}, "system"),
        ({"max_tokens": None}, "max_tokens"),
        ({"temperature": 1.5}, "temperature"),
        ({"messages": [{"role": "system", "content": "s"}]}, "role"),
    ],
)
def test_bad_bodies_are_refused_naming_the_field(body: dict[str, Any], needle: str) -> None:
    data = {"model": "x", "max_tokens": 5, "messages": ASK, **body}
    if body.get("max_tokens", 0) is None:
        del data["max_tokens"]
    with pytest.raises(ApiError, match=needle) as err:
        parse_request(m.MessagesRequest, data)
    assert err.value.status == 400


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}]}]},
         "messages.0.content.0.tool_use_id: 'toolu_9' answers no tool_use"),
        ({"messages": [{"role": "user", "content": [
            {"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]}, "belong in assistant"),
        ({"messages": [*ASK, {"role": "assistant", "content": "Sure"}]}, "prefilling"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"thinking": {"type": "adaptive"}}, "thinking"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
        ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "server tools"),
        ({"tools": [{"name": "f"}]}, "input_schema"),
        ({"tool_choice": {"type": "any"}}, "needs tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "not in tools"),
    ],
)
def test_untranslatable_requests_are_refused(body: dict[str, Any], needle: str) -> None:
    with pytest.raises(ApiError, match=needle) as err:
        t.to_chat_request(_request(**body)).check_tools()
    assert err.value.status == 400


def _usage(prompt: int = 10, completion: int = 4, cached: int = 3) -> p.Usage:
    return p.Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=p.PromptTokensDetails(cached_tokens=cached),
        quickdraft=p.SpecUsage(drafted=0, accepted=0, tau=1.0, tokens_per_second=1.0, ttft_s=0.1),
    )


def _completion(content: str | None, calls: list[tuple[str, str]], finish: str) -> p.ChatCompletion:
    tool_calls = [
        p.ToolCallOut(id=f"call_{i}", function=p.FunctionCallOut(name=name, arguments=args))
        for i, (name, args) in enumerate(calls)
    ]
    message = p.ChatMessageOut(content=content, tool_calls=tool_calls or None)
    return p.ChatCompletion(
        id="chatcmpl-abc", created=0, model="qwen",
        choices=[p.ChatChoice(message=message, finish_reason=finish)], usage=_usage(),
    )


def test_completion_translates_to_a_message() -> None:
    msg = t.to_message(_completion("Checking.", [("get_weather", '{"city": "Paris"}')], "tool_calls"))
    assert msg["id"] == "msg_abc" and msg["type"] == "message" and msg["role"] == "assistant"
    assert msg["content"] == [
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "call_0", "name": "get_weather", "input": {"city": "Paris"}},
    ]
    assert (msg["stop_reason"], msg["stop_sequence"]) == ("tool_use", None)
    usage = msg["usage"]
    assert (usage["input_tokens"], usage["output_tokens"], usage["cache_read_input_tokens"]) == (7, 4, 3)
    anthropic.types.Message.model_validate(msg)  # the SDK's own model takes it

    assert t.to_message(_completion("hi", [], "stop"))["stop_reason"] == "end_turn"
    assert t.to_message(_completion("hi", [], "length"))["stop_reason"] == "max_tokens"
    stopped = t.to_message(_completion("hi", [], "stop"), stop_sequence="END")
    assert (stopped["stop_reason"], stopped["stop_sequence"]) == ("stop_sequence", "END")
    assert t.to_message(_completion(None, [("f", "")], "tool_calls"))["content"] == [
        {"type": "tool_use", "id": "call_0", "name": "f", "input": {}}
    ]


def _chunk(delta: p.Delta, finish: str | None = None, usage: p.Usage | None = None) -> p.ChatCompletionChunk:
    return p.ChatCompletionChunk(
        id="chatcmpl-abc", created=0, model="qwen",
        choices=[p.ChunkChoice(delta=delta, finish_reason=finish)], usage=usage,
    )


def _call_head(index: int, name: str) -> p.Delta:
    head = p.ToolCallDelta(index=index, id=f"call_{index}", type="function",
                           function=p.FunctionDelta(name=name, arguments=""))
    return p.Delta(tool_calls=[head])


def _call_args(index: int, piece: str) -> p.Delta:
    return p.Delta(tool_calls=[p.ToolCallDelta(index=index, function=p.FunctionDelta(arguments=piece))])


async def _aiter(chunks: list[p.ChatCompletionChunk]) -> AsyncIterator[p.ChatCompletionChunk]:
    for chunk in chunks:
        yield chunk


def _events(chunks: list[p.ChatCompletionChunk], stop: str | None = None) -> list[dict[str, Any]]:
    async def run() -> list[dict[str, Any]]:
        return [e async for e in to_events(_aiter(chunks), 10, lambda: stop)]

    return asyncio.run(run())


def _accumulate(events: list[dict[str, Any]]) -> Any:
    """What the SDK's stream helper makes of the events (as parsed from the wire)."""
    from anthropic.lib.streaming._messages import accumulate_event

    snapshot, bufs = None, {}
    for event in events:
        wire = json.loads(typed_sse(event).split("data: ", 1)[1])
        snapshot = accumulate_event(event=wire, current_snapshot=snapshot, json_bufs=bufs)
    return snapshot


def test_chunks_translate_to_stream_events() -> None:
    pieces = ['{"ci', 'ty": "Pa', 'ris"', "}"]  # arguments in any number of pieces
    chunks = [
        _chunk(p.Delta(role="assistant", content="")),
        _chunk(p.Delta(content="Let me ")),
        _chunk(p.Delta(content="check.")),
        _chunk(_call_head(0, "get_weather")),
        *[_chunk(_call_args(0, piece)) for piece in pieces],
        _chunk(_call_head(1, "get_time")),
        _chunk(_call_args(1, "{}")),
        _chunk(p.Delta(), finish="tool_calls", usage=_usage()),
    ]
    events = _events(chunks)
    kinds = [e["type"] for e in events]
    assert kinds == [
        "message_start", "ping",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", *["content_block_delta"] * 4, "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop",
    ]
    start = events[0]["message"]
    assert start["id"] == "msg_abc" and start["usage"] == {"input_tokens": 10, "output_tokens": 0}
    assert [e["delta"]["partial_json"] for e in events[7:11]] == pieces
    assert [e["index"] for e in events if e["type"] == "content_block_start"] == [0, 1, 2]
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[-2]["usage"]["output_tokens"] == 4
    message = _accumulate(events)
    assert [b.type for b in message.content] == ["text", "tool_use", "tool_use"]
    assert message.content[0].text == "Let me check."
    assert message.content[1].input == {"city": "Paris"} and message.content[1].id == "call_0"
    assert message.content[2].name == "get_time" and message.content[2].input == {}
    assert message.stop_reason == "tool_use" and message.usage.output_tokens == 4
    assert message.usage.cache_read_input_tokens == 3 and message.usage.input_tokens == 7

    text_only = _events([_chunk(p.Delta(role="assistant", content="")), _chunk(p.Delta(content="a")),
                         _chunk(p.Delta(), finish="stop", usage=_usage())], stop="END")
    assert text_only[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    empty = _events([_chunk(p.Delta(role="assistant", content="")),
                     _chunk(p.Delta(), finish="length", usage=_usage())])
    assert [e["type"] for e in empty] == ["message_start", "ping", "message_delta", "message_stop"]
    assert empty[-2]["delta"]["stop_reason"] == "max_tokens"


def test_error_bodies() -> None:
    assert m.error_body(404, "no") == {"type": "error", "error": {"type": "not_found_error", "message": "no"}}
    assert m.error_body(401, "x")["error"]["type"] == "authentication_error"
    assert m.error_body(429, "x")["error"]["type"] == "rate_limit_error"
    assert m.error_body(500, "x")["error"]["type"] == "api_error"
    assert m.error_body(400, "x")["error"]["type"] == "invalid_request_error"
    assert typed_sse({"type": "ping"}) == 'event: ping\ndata: {"type": "ping"}\n\n'


def test_an_error_mid_stream_becomes_an_error_event() -> None:
    from quickdraft.errors import QuickdraftError
    from quickdraft.server.anthropic.router import failure_events
    from quickdraft.server.streaming import guarded

    class FakeJob:
        cancelled = False

        def cancel(self) -> None:
            self.cancelled = True

    async def events() -> AsyncIterator[dict[str, Any]]:
        yield {"type": "ping"}
        raise QuickdraftError("the generation was cut short")

    async def run(job: Any) -> list[str]:
        return [e async for e in guarded((typed_sse(e) async for e in events()), [job], failure_events)]

    job = FakeJob()
    wire = asyncio.run(run(job))
    assert wire[0].startswith("event: ping\n") and job.cancelled
    assert wire[1].startswith("event: error\ndata: ")
    assert json.loads(wire[1].split("data: ", 1)[1]) == {
        "type": "error", "error": {"type": "api_error", "message": "the generation was cut short"}
    }


# ------------------------------------------------------------------------------- a live server


@pytest.fixture(scope="module")
def server(qwen05_gguf: Path) -> Iterator[Server]:
    srv = start_server(qwen05_gguf, "--draft", "none", "--dtype", "auto", "--api-key", KEY, name=NAME, context=1024)
    with running(srv):
        yield srv


def _client(server: Server, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.root, api_key=key, max_retries=0, timeout=120)


GREEDY = {"extra_body": {"temperature": 0}}  # the 2.x SDK has no temperature argument any more


def _create(server: Server, **kw: Any) -> Any:
    args: dict[str, Any] = {"model": NAME, "max_tokens": 12, "messages": ASK, **GREEDY, **kw}
    return _client(server).messages.create(**args)


@pytest.mark.slow
def test_messages_equal_chat_completions(server: Server) -> None:
    system = "You are a terse assistant."
    msg = _create(server, system=system)
    chat = server.client(KEY).chat.completions.create(
        model=NAME, max_tokens=12, temperature=0,
        messages=[{"role": "system", "content": system}, *ASK],  # type: ignore[list-item]
    )
    text = chat.choices[0].message.content
    assert msg.content[0].type == "text" and msg.content[0].text == text and text
    assert msg.id.startswith("msg_") and msg.model == NAME and msg.role == "assistant"
    assert msg.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    assert msg.usage.output_tokens == chat.usage.completion_tokens
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == chat.usage.prompt_tokens

    # Streamed: the same text through the SDK's stream helper, and as raw events.
    with _client(server).messages.stream(
        model=NAME, max_tokens=12, system=system, messages=ASK, **GREEDY  # type: ignore[arg-type]
    ) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text and final.content[0].text == text  # type: ignore[union-attr]
    assert final.stop_reason == msg.stop_reason and final.usage.output_tokens == msg.usage.output_tokens
    raw = list(_create(server, system=system, stream=True))
    assert [e.type for e in raw[:2]] == ["message_start", "content_block_start"]
    assert raw[-2].type == "message_delta" and raw[-1].type == "message_stop"

    # count_tokens renders the same prompt.
    count = _client(server).messages.count_tokens(model=NAME, system=system, messages=ASK)  # type: ignore[arg-type]
    assert count.input_tokens == chat.usage.prompt_tokens

    # A stop sequence is reported as the one that ended the answer.
    word = text.split()[1] if len(text.split()) > 2 else text[1:3]
    stopped = _create(server, system=system, stop_sequences=["@@", word])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert stopped.content[0].text == text[: text.index(word)]
    with _client(server).messages.stream(
        model=NAME, max_tokens=12, system=system, messages=ASK, **GREEDY,  # type: ignore[arg-type]
        stop_sequences=[word],
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == word


@pytest.mark.slow
def test_forced_tool_call_and_the_follow_up_turn(server: Server) -> None:
    choice = {"type": "tool", "name": "get_weather"}
    msg = _create(server, max_tokens=40, tools=[WEATHER], tool_choice=choice)
    calls = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and len(calls) == 1
    call = calls[0]
    assert call.name == "get_weather" and set(call.input) == {"city"} and call.id

    # The same call through the chat route, and streamed.
    chat = server.client(KEY).chat.completions.create(
        model=NAME, max_tokens=40, temperature=0, messages=ASK,  # type: ignore[arg-type]
        tools=[{"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                                 "parameters": WEATHER["input_schema"]}}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    assert json.loads(chat.choices[0].message.tool_calls[0].function.arguments) == call.input  # type: ignore[index]
    with _client(server).messages.stream(
        model=NAME, max_tokens=40, messages=ASK, tools=[WEATHER], **GREEDY, tool_choice=choice,  # type: ignore[arg-type]
    ) as stream:
        final = stream.get_final_message()
    streamed = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and [(b.name, b.input) for b in streamed] == [(call.name, call.input)]

    # Turn 2: the tool's result goes back as a tool_result block; the answer is text.
    follow = [
        *ASK,
        {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call.id, "content": "18 degrees and sunny"},
        ]},
    ]
    answer = _create(server, max_tokens=16, tools=[WEATHER], messages=follow)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use") and answer.content
    count = _client(server).messages.count_tokens(model=NAME, messages=follow, tools=[WEATHER])  # type: ignore[arg-type]
    assert count.input_tokens == answer.usage.input_tokens + (answer.usage.cache_read_input_tokens or 0)


def _post(server: Server, body: Any, route: str = "messages", **headers: str) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        f"{server.url}/{route}", content=content, timeout=60,
        headers={"Content-Type": "application/json", "x-api-key": KEY, **headers},
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("body", "status", "kind", "needle"),
    [
        ({"model": NAME, "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "video"}]}]},
         400, "invalid_request_error", "'video'"),
        ({"model": NAME, "max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}]},
         400, "invalid_request_error", "answers no tool_use"),
        ({"model": NAME, "max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
         400, "invalid_request_error", "text-only"),
        ({"model": NAME, "messages": ASK}, 400, "invalid_request_error", "max_tokens"),
        ({"model": "claude-9", "max_tokens": 5, "messages": ASK}, 404, "not_found_error", "claude-9"),
        ({"model": NAME, "max_tokens": 5, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 9}},
         400, "invalid_request_error", "thinking"),
        ({"model": NAME, "max_tokens": 5000, "messages": ASK}, 400, "invalid_request_error", "context length"),
        (b'{"model": ', 400, "invalid_request_error", "not valid JSON"),
    ],
)
def test_bad_requests_get_anthropic_errors(
    server: Server, body: Any, status: int, kind: str, needle: str
) -> None:
    resp = _post(server, body)
    assert resp.status_code == status, resp.text
    assert resp.json()["type"] == "error" and resp.json()["error"]["type"] == kind
    assert needle in resp.json()["error"]["message"]


@pytest.mark.slow
def test_errors_through_the_sdk_auth_and_openapi(server: Server) -> None:
    with pytest.raises(anthropic.NotFoundError):
        _create(server, model="claude-9")
    with pytest.raises(anthropic.BadRequestError, match="answers no tool_use"):
        _create(server, messages=[{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "nope", "content": "1"}]}])
    with pytest.raises(anthropic.AuthenticationError):
        _client(server, "wrong").messages.create(model=NAME, max_tokens=1, messages=ASK)  # type: ignore[arg-type]
    resp = _post(server, {"model": NAME, "messages": ASK}, route="messages/count_tokens", **{"x-api-key": "no"})
    assert resp.status_code == 401 and resp.json()["error"]["type"] == "authentication_error"
    # Other routes keep OpenAI's shape, and take either header.
    resp = httpx.get(f"{server.url}/models", headers={"x-api-key": "no"})
    assert resp.status_code == 401 and set(resp.json()) == {"error"}
    assert httpx.get(f"{server.url}/models", headers={"x-api-key": KEY}).status_code == 200
    resp = httpx.get(f"{server.url}/messages", headers={"x-api-key": KEY})
    assert resp.status_code == 405 and resp.json()["error"]["type"] == "invalid_request_error"
    assert _post(server, {"model": NAME, "messages": ASK}, route="messages/count_tokens").json()["input_tokens"] > 5

    doc = httpx.get(f"{server.root}/openapi.json", headers={"x-api-key": KEY}).json()
    for route, model in (("messages", "MessagesRequest"), ("messages/count_tokens", "CountTokensRequest")):
        op = doc["paths"][f"/v1/{route}"]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"] == f"#/components/schemas/{model}"
        error = op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"]
        assert error == "#/components/schemas/AnthropicErrorResponse"
    schemas = doc["components"]["schemas"]
    assert {"model", "messages", "max_tokens", "system", "tools", "tool_choice", "stop_sequences"} <= set(
        schemas["MessagesRequest"]["properties"]
    )
    assert "max_tokens" in schemas["MessagesRequest"]["required"]
    assert {"TextBlock", "ToolUseBlock", "ToolResultBlock", "AnthropicErrorResponse"} <= set(schemas)
