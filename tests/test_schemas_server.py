"""Nested schemas and tool calls through ``quickdraft serve`` and the real ``openai`` client, on
Qwen2.5-Coder-0.5B (its template renders tools and writes Hermes ``<tool_call>`` blocks), without
speculation: pydantic models with ``$defs`` as a forced tool, a strict tool and a response_format
(``chat.completions.parse``), response_format next to a forced tool, and streamed arguments."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from helpers import Place, Trip
from live_server import Server, running, start_server

pytestmark = pytest.mark.slow

NAME = "qwen-small"


TRIP_TOOL = {
    "type": "function",
    "function": {
        "name": "plan_trip",
        "description": "Plan a trip: where it starts and where it stops.",
        "parameters": Trip.model_json_schema(),
    },
}
ASK = [{"role": "user", "content": "Plan a trip from Oslo, Norway with stops in Rome, Italy and Paris, France."}]


@pytest.fixture(scope="module")
def qwen(qwen05_gguf: Path) -> Iterator[Server]:
    server = start_server(qwen05_gguf, "--draft", "none", "--dtype", "auto", name=NAME, context=1024)
    with running(server):
        yield server


def _chat(server: Server, **kw: Any) -> Any:
    args: dict[str, Any] = {"model": NAME, "messages": ASK, "max_tokens": 160, "temperature": 0}
    return server.client().chat.completions.create(**{**args, **kw})


def _streamed_calls(chunks: Any) -> tuple[dict[int, dict[str, Any]], str | None]:
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for c in chunks:
        if not c.choices:
            continue
        finish = c.choices[0].finish_reason or finish
        for tc in c.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": None, "name": None, "pieces": []})
            if tc.id:
                assert entry["id"] is None and tc.type == "function" and tc.function.name
                entry["id"], entry["name"] = tc.id, tc.function.name
            else:
                assert entry["id"] is not None  # the head came first
            entry["pieces"].append(tc.function.arguments or "")
    return calls, finish


def test_nested_schema_as_forced_and_strict_tool(qwen: Server) -> None:
    named = {"type": "function", "function": {"name": "plan_trip"}}
    whole = _chat(qwen, tools=[TRIP_TOOL], tool_choice=named)
    call = whole.choices[0].message.tool_calls[0]
    assert call.function.name == "plan_trip" and whole.choices[0].finish_reason == "tool_calls"
    Trip.model_validate_json(call.function.arguments)
    required = _chat(qwen, tools=[TRIP_TOOL], tool_choice="required").choices[0].message
    Trip.model_validate_json(required.tool_calls[0].function.arguments)
    strict = {**TRIP_TOOL, "function": {**TRIP_TOOL["function"], "strict": True}}
    auto = _chat(qwen, tools=[strict]).choices[0].message
    for c in auto.tool_calls or []:
        Trip.model_validate_json(c.function.arguments)
    # Streamed: the arguments come in pieces that concatenate to the whole answer's.
    calls, finish = _streamed_calls(_chat(qwen, tools=[TRIP_TOOL], tool_choice=named, stream=True))
    assert finish == "tool_calls" and list(calls) == [0]
    assert calls[0]["name"] == "plan_trip" and calls[0]["pieces"][0] == ""
    assert len(calls[0]["pieces"]) > 3
    assert "".join(calls[0]["pieces"]) == call.function.arguments


def test_response_format_with_nested_schema_and_with_tools(qwen: Server) -> None:
    client = qwen.client()
    parsed = client.chat.completions.parse(
        model=NAME, messages=ASK, max_tokens=160, temperature=0, response_format=Trip
    )
    assert parsed.choices[0].finish_reason == "stop"
    trip = parsed.choices[0].message.parsed
    assert isinstance(trip, Trip) and isinstance(trip.origin, Place)
    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": Trip.model_json_schema()}}
    # A forced call with a response_format: calls only (response_format is for text answers).
    forced = _chat(qwen, tools=[TRIP_TOOL], tool_choice="required", response_format=fmt)
    Trip.model_validate_json(forced.choices[0].message.tool_calls[0].function.arguments)
    # Strict tools under auto with a response_format: a call, or the JSON answer.
    strict = {**TRIP_TOOL, "function": {**TRIP_TOOL["function"], "strict": True}}
    either = _chat(qwen, tools=[strict], response_format=fmt).choices[0].message
    if either.tool_calls:
        Trip.model_validate_json(either.tool_calls[0].function.arguments)
    else:
        Trip.model_validate_json(either.content)
    json_object = _chat(qwen, tools=[strict], response_format={"type": "json_object"})
    assert json_object.choices[0].message is not None


def test_unusable_tool_schema_names_the_tool(qwen: Server) -> None:
    bad = {"type": "function", "function": {"name": "broken", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}},
    }}}
    with pytest.raises(openai.BadRequestError, match="broken"):
        _chat(qwen, tools=[TRIP_TOOL, bad], tool_choice="required")
    assert json.dumps(Trip.model_json_schema())  # the good schema is fine on its own
