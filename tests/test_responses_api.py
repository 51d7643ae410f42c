"""``POST /v1/responses`` (OpenAI's Responses API) against ``quickdraft serve``, through the real
``openai`` SDK (and openai-agents' default Responses model).

One server runs for the module on Qwen2.5-Coder-0.5B (its template renders tools, Hermes-style),
with n-gram speculation. Every greedy answer through /v1/responses must be token-identical to the
equivalent /v1/chat/completions request: the route is a translation onto the same request.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from live_server import Server, running, start_server

from quickdraft.server.openai import protocol as p
from quickdraft.server.responses import protocol as r
from quickdraft.server.responses.streaming_events import ResponseStream
from quickdraft.server.responses.translate import to_chat_request, to_response
from quickdraft.server.validation import parse_request

slow = pytest.mark.slow  # the tests on the live server; the translator tests need no model

NAME = "qwen-small"
ASK = "Write a haiku about the sea."
SYSTEM = "You are a terse poet."
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
CHAT_WEATHER = {
    "type": "function",
    "function": {k: v for k, v in WEATHER.items() if k != "type"},
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(qwen05_gguf: Path) -> Iterator[Server]:
    s = start_server(qwen05_gguf, "--draft", "ngram", "--num-draft", "4", "--dtype", "auto", name=NAME, context=1024)
    with running(s):
        yield s


def _respond(server: Server, **kw: Any) -> Any:
    args: dict[str, Any] = {"model": NAME, "input": ASK, "max_output_tokens": 12, "temperature": 0}
    return server.client().responses.create(**{**args, **kw})


def _chat(server: Server, messages: list[dict[str, Any]], **kw: Any) -> Any:
    args: dict[str, Any] = {"model": NAME, "messages": messages, "max_tokens": 12, "temperature": 0}
    return server.client().chat.completions.create(**{**args, **kw}).choices[0]


@slow
def test_plain_answers_equal_chat_completions(server: Server) -> None:
    resp = _respond(server)
    chat = _chat(server, [{"role": "user", "content": ASK}])
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.model == NAME
    assert resp.output_text == chat.message.content and resp.output_text
    assert [o.type for o in resp.output] == ["message"]
    msg = resp.output[0]
    assert msg.role == "assistant" and msg.content[0].type == "output_text"
    # 12 tokens cut the haiku short: incomplete, for the max_output_tokens reason.
    assert chat.finish_reason == "length" and resp.status == "incomplete"
    assert resp.incomplete_details is not None
    assert resp.incomplete_details.reason == "max_output_tokens"
    u = resp.usage
    assert u is not None and u.output_tokens == 12 and u.input_tokens > 0
    assert u.total_tokens == u.input_tokens + u.output_tokens
    assert u.output_tokens_details.reasoning_tokens == 0
    # The same request again reuses the prompt from the prefix cache.
    assert _respond(server).usage.input_tokens_details.cached_tokens > 0

    # Items (a developer message, text parts) with instructions: the system message first.
    items = [
        {"role": "developer", "content": "Answer in English."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": ASK}]},
    ]
    resp = _respond(server, input=items, instructions=SYSTEM, max_output_tokens=40)
    chat = _chat(
        server,
        [{"role": "system", "content": SYSTEM}, {"role": "system", "content": "Answer in English."},
         {"role": "user", "content": ASK}],
        max_tokens=40,
    )
    assert resp.output_text == chat.message.content
    assert resp.instructions == SYSTEM and resp.max_output_tokens == 40
    assert resp.status == ("incomplete" if chat.finish_reason == "length" else "completed")


@slow
def test_stream_events_build_the_same_response(server: Server) -> None:
    whole = _respond(server, instructions=SYSTEM)
    events = list(_respond(server, instructions=SYSTEM, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.incomplete",  # max_output_tokens cut it short, as OpenAI names it
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    assert next(e for e in events if e.type == "response.output_text.done").text == text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == 12
    assert final.status == "incomplete" and final.id == events[0].response.id
    # Streamed responses are stored too.
    assert server.client().responses.retrieve(final.id).output_text == text

    # A short answer completes: response.completed.
    done = list(_respond(server, input="Say OK.", max_output_tokens=40, stream=True))
    assert done[-1].type == "response.completed" and done[-1].response.status == "completed"


@slow
def test_function_call_then_its_output(server: Server) -> None:
    ask = "What is the weather in Paris?"
    resp = _respond(server, input=ask, tools=[WEATHER], tool_choice="required", max_output_tokens=40)
    chat = _chat(
        server, [{"role": "user", "content": ask}], tools=[CHAT_WEATHER], tool_choice="required",
        max_tokens=40,
    )
    calls = [o for o in resp.output if o.type == "function_call"]
    assert len(calls) >= 1 and resp.status == "completed"
    call = calls[0]
    expected = chat.message.tool_calls[0]
    assert (call.name, json.loads(call.arguments)) == (
        expected.function.name, json.loads(expected.function.arguments)
    )
    assert call.name == "get_weather" and "city" in json.loads(call.arguments)
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert resp.tools[0].name == "get_weather" and resp.tool_choice == "required"

    # Streamed: the arguments arrive as deltas and are whole at .done.
    events = list(
        _respond(server, input=ask, tools=[WEATHER], tool_choice="required", max_output_tokens=40,
                 stream=True)
    )
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(deltas) == json.loads(done.arguments) == json.loads(call.arguments)
    assert events[-1].type == "response.completed"
    streamed = [o for o in events[-1].response.output if o.type == "function_call"]
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]

    # The next turn: the call and its output go back as items; the answer is text.
    result = json.dumps({"city": "Paris", "weather": "sunny, 21 C"})
    follow = [
        {"role": "user", "content": ask},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": result},
    ]
    resp2 = _respond(server, input=follow, tools=[WEATHER], max_output_tokens=24)
    chat2 = _chat(
        server,
        [{"role": "user", "content": ask},
         {"role": "assistant", "content": None, "tool_calls": [
             {"id": call.call_id, "type": "function",
              "function": {"name": call.name, "arguments": call.arguments}}]},
         {"role": "tool", "tool_call_id": call.call_id, "content": result}],
        tools=[CHAT_WEATHER], max_tokens=24,
    )
    assert resp2.output_text == (chat2.message.content or "")
    assert [o.type for o in resp2.output] == (["message"] if not chat2.message.tool_calls else
                                             [o.type for o in resp2.output])


@slow
def test_json_schema_text_format(server: Server) -> None:
    fmt = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
    resp = _respond(server, input="Invent a person.", text=fmt, max_output_tokens=40)
    person = json.loads(resp.output_text)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    assert resp.text.format.type == "json_schema" and resp.text.format.name == "person"
    chat = _chat(
        server, [{"role": "user", "content": "Invent a person."}], max_tokens=40,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
    )
    assert resp.output_text == chat.message.content


@slow
def test_previous_response_id_continues_the_conversation(server: Server) -> None:
    first = _respond(server, input="My name is Ada. Say hi.", max_output_tokens=8)
    second = _respond(server, input="What is my name?", previous_response_id=first.id)
    chat = _chat(
        server,
        [{"role": "user", "content": "My name is Ada. Say hi."},
         {"role": "assistant", "content": first.output_text},
         {"role": "user", "content": "What is my name?"}],
    )
    assert second.output_text == chat.message.content
    assert second.previous_response_id == first.id
    got = server.client().responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    # the second response's input: the first turn, its answer, the second turn (newest first)
    listed = server.client().responses.input_items.list(second.id)
    texts = [item.content[0].text for item in listed.data]
    assert texts == ["What is my name?", first.output_text, "My name is Ada. Say hi."]
    assert [item.role for item in listed.data] == ["user", "assistant", "user"]
    page = server.client().responses.input_items.list(second.id, order="asc", limit=1)
    assert [item.content[0].text for item in page.data] == ["My name is Ada. Say hi."] and page.has_more
    # store: false keeps nothing; an unknown id is a 404 naming the field.
    unstored = _respond(server, store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        server.client().responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError, match="resp_nope"):
        _respond(server, previous_response_id="resp_nope")
    server.client().responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        server.client().responses.retrieve(first.id)


@slow
@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": [{"type": "reasoning", "summary": []}]}, 400, "input[0].type"),
        ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, 400,
         "input[0].call_id"),
        ({"input": [{"role": "user", "content": [
            {"type": "input_text", "text": "what is this?"},
            {"type": "input_image", "image_url": "https://example.com/a.png"}]}]}, 400,
         "input[0].content[1].type"),
        ({"input": "hi", "reasoning": {"effort": "high"}}, 400, "reasoning"),
        ({"input": "hi", "model": "nope"}, 404, "model"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
        ({"input": "hi", "previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
        ({"input": "hi", "conversation": "conv_1"}, 400, "conversation"),
        ({"input": "hi", "include": ["message.output_text.logprobs"]}, 400, "include[0]"),
        ({"input": "hi", "include": ["reasoning.encrypted_content", "x.y"]}, 400, "include[1]"),
        ({"input": "hi", "text": {"verbosity": "low"}}, 400, "text.verbosity"),
        ({"input": [{"role": "user"}]}, 400, "input[0].content"),
        ({"input": 3}, 400, "input"),
        ({"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400,
         "text.format.schema"),
        ({"input": "hi", "tool_choice": "required"}, 400, "tool_choice"),
    ],
)
def test_bad_requests_name_the_field(
    server: Server, body: dict[str, Any], status: int, param: str
) -> None:
    resp = httpx.post(f"{server.url}/responses", json={"model": NAME, **body}, timeout=60)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["param"] == param, error
    assert set(error) == {"message", "type", "param", "code"}


@slow
def test_get_unknown_response_and_openapi(server: Server) -> None:
    resp = httpx.get(f"{server.url}/responses/resp_nothing", timeout=30)
    assert resp.status_code == 404 and resp.json()["error"]["param"] == "response_id"
    # a bad query parameter: a 400 naming it and what it must be, not the endpoint's source file
    resp = httpx.get(f"{server.url}/responses/resp_nothing/input_items", params={"limit": "many"}, timeout=30)
    error = resp.json()["error"]
    assert resp.status_code == 400 and error["param"] == "limit", resp.text
    assert error["message"].startswith("query parameter 'limit': ") and "'many'" in error["message"], error
    assert ".py" not in error["message"] and set(error) == {"message", "type", "param", "code"}
    doc = httpx.get(f"{server.root}/openapi.json", timeout=30).json()
    op = doc["paths"]["/v1/responses"]["post"]
    ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert ref == "#/components/schemas/ResponsesRequest" and "400" in op["responses"]
    props = doc["components"]["schemas"]["ResponsesRequest"]["properties"]
    assert {"input", "instructions", "tools", "text", "previous_response_id"} <= set(props)


@slow
def test_openai_agents_default_responses_model(server: Server) -> None:
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=server.url, api_key="unused", max_retries=0)
    model = agents.OpenAIResponsesModel(model=NAME, openai_client=client)
    agent = agents.Agent(
        name="poet",
        instructions=SYSTEM,
        model=model,
        model_settings=agents.ModelSettings(temperature=0, max_tokens=40),
    )
    # A short answer: openai-agents treats a cut-short (incomplete) response as a failure.
    result = agents.Runner.run_sync(agent, "Say OK.")
    expected = _chat(
        server, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Say OK."}],
        max_tokens=40,
    )
    assert expected.finish_reason == "stop"
    assert result.final_output == expected.message.content

    async def streamed() -> tuple[str, Any]:
        fresh = openai.AsyncOpenAI(base_url=server.url, api_key="unused", max_retries=0)
        model = agents.OpenAIResponsesModel(model=NAME, openai_client=fresh)  # this loop's client
        run = agents.Runner.run_streamed(agent.clone(model=model), "Say OK.")
        deltas = [
            ev.data.delta
            async for ev in run.stream_events()
            if ev.type == "raw_response_event" and ev.data.type == "response.output_text.delta"
        ]
        return "".join(deltas), run.final_output

    text, final = asyncio.run(streamed())
    assert text == final == expected.message.content


# ------------------------------------------------------------------ the translators, without a model


def _chunk(delta: dict[str, Any], finish: str | None = None, usage: p.Usage | None = None) -> Any:
    return p.ChatCompletionChunk(
        id="chatcmpl-x", created=0, model="m",
        choices=[p.ChunkChoice(delta=p.Delta.model_validate(delta), finish_reason=finish)],
        usage=usage,
    )


def _usage() -> p.Usage:
    return p.Usage(
        prompt_tokens=10, completion_tokens=5, total_tokens=15,
        prompt_tokens_details=p.PromptTokensDetails(cached_tokens=4),
        quickdraft=p.SpecUsage(drafted=0, accepted=0, tau=1.0, tokens_per_second=1.0, ttft_s=0.1),
    )


def _events(chunks: list[Any], fail: Exception | None = None) -> list[dict[str, Any]]:
    req = parse_request(r.ResponsesRequest, {"model": "m", "input": "hi", "tools": [WEATHER]})
    stream = ResponseStream(req, "m")

    async def source() -> Any:
        for c in chunks:
            yield c
        if fail is not None:
            raise fail

    async def run() -> list[dict[str, Any]]:
        out = []
        try:
            async for ev in stream.events(source()):
                out.append(ev)
        except RuntimeError as exc:
            out.append(stream.error(str(exc)))
        return out

    return asyncio.run(run())


def test_stream_translator_text_then_calls_in_pieces() -> None:
    def head(i: int, name: str) -> dict[str, Any]:
        fn = {"name": name, "arguments": ""}
        return {"tool_calls": [{"index": i, "id": f"call_{i}", "type": "function", "function": fn}]}

    def piece(i: int, text: str) -> dict[str, Any]:
        return {"tool_calls": [{"index": i, "function": {"arguments": text}}]}

    chunks = [
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"content": "Let me "}), _chunk({"content": "check."}),
        _chunk(head(0, "get_weather")),
        *[_chunk(piece(0, t)) for t in ('{"ci', 'ty": ', '"Par', 'is"}')],
        _chunk(head(1, "get_weather")), _chunk(piece(1, '{"city": "Rome"}')),
        _chunk({}, finish="tool_calls", usage=_usage()),
    ]
    events = _events(chunks)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds.count("response.function_call_arguments.delta") == 5
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 3
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [json.loads(e["arguments"])["city"] for e in done] == ["Paris", "Rome"]
    assert [e["output_index"] for e in done] == [1, 2]
    final = events[-1]
    assert final["type"] == "response.completed"
    out = final["response"]["output"]
    assert [o["type"] for o in out] == ["message", "function_call", "function_call"]
    assert out[0]["content"][0]["text"] == "Let me check."
    assert [o["call_id"] for o in out[1:]] == ["call_0", "call_1"]
    assert final["response"]["usage"]["input_tokens_details"]["cached_tokens"] == 4
    # The SDK reads every event and the final response.
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    adapter: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
    for ev in events:
        assert adapter.validate_python(ev).type == ev["type"]
    assert Response.model_validate(final["response"]).output_text == "Let me check."


def test_stream_translator_error_and_empty_answer() -> None:
    events = _events([_chunk({"role": "assistant", "content": ""}), _chunk({"content": "a"})],
                     fail=RuntimeError("boom"))
    assert events[-1]["type"] == "error" and events[-1]["message"] == "boom"
    assert events[-1]["sequence_number"] == len(events) - 1
    empty = _events([_chunk({"role": "assistant", "content": ""}),
                     _chunk({}, finish="stop", usage=_usage())])
    out = empty[-1]["response"]["output"]
    assert [o["type"] for o in out] == ["message"] and out[0]["content"][0]["text"] == ""


def test_items_become_chat_messages() -> None:
    req = parse_request(r.ResponsesRequest, {
        "model": "m",
        "instructions": "Be brief.",
        "input": [
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "Checking."}]},
            {"type": "function_call", "call_id": "a", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call", "call_id": "b", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "a", "output": "sunny"},
            {"type": "function_call_output", "call_id": "b",
             "output": [{"type": "input_text", "text": "rain"}]},
        ],
        "text": {"format": {"type": "json_object"}},
        "max_output_tokens": 7,
        "tool_choice": {"type": "function", "name": "get_weather"},
        "tools": [WEATHER],
    })
    chat = to_chat_request(req)
    msgs = [(m.role, m.content, [c.id for c in m.tool_calls or []], m.tool_call_id)
            for m in chat.messages]
    assert msgs == [
        ("system", "Be brief.", [], None),
        ("user", "Weather in Paris and Rome?", [], None),
        ("assistant", "Checking.", ["a", "b"], None),
        ("tool", "sunny", [], "a"),
        ("tool", "rain", [], "b"),
    ]
    assert chat.max_tokens == 7 and chat.response_format is not None
    assert chat.response_format.type == "json_object"
    assert isinstance(chat.tool_choice, p.NamedToolChoice)
    assert chat.tools is not None and chat.tools[0].function.strict is True


def test_whole_response_is_what_the_sdk_reads() -> None:
    from openai.types.responses import Response

    req = parse_request(r.ResponsesRequest, {"model": "m", "input": "hi", "tools": [WEATHER], "max_output_tokens": 5})
    call = p.ToolCallOut(id="call_1", function=p.FunctionCallOut(name="get_weather", arguments="{}"))
    for finish, message in (
        ("length", p.ChatMessageOut(content="cut sho")),
        ("tool_calls", p.ChatMessageOut(content=None, tool_calls=[call])),
    ):
        chat = p.ChatCompletion(
            id="chatcmpl-x", created=0, model="m", usage=_usage(),
            choices=[p.ChatChoice(message=message, finish_reason=finish)],
        )
        resp = Response.model_validate(to_response(req, chat))  # strict: every field checked
        if finish == "length":
            assert resp.status == "incomplete" and resp.output_text == "cut sho"
            assert resp.incomplete_details is not None
        else:
            assert resp.status == "completed" and [o.type for o in resp.output] == ["function_call"]
        assert resp.usage is not None and resp.usage.input_tokens_details.cached_tokens == 4


def test_includes_that_add_nothing_are_accepted() -> None:
    """Values naming output this server never produces (reasoning, hosted tools) are no-ops."""
    req = parse_request(
        r.ResponsesRequest,
        {"model": "m", "input": "hi", "include": ["reasoning.encrypted_content", "file_search_call.results"],
         "text": {"verbosity": "medium"}},
    )
    assert req.include == ["reasoning.encrypted_content", "file_search_call.results"]
