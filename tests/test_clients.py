"""The client libraries people point at an OpenAI-compatible server, unchanged, against ``quickdraft
serve``: pydantic-ai (chat and Responses models) with a nested ``output_type``, instructor's TOOLS
mode with a nested model, ``create_iterable`` and ``create_partial``, openai-agents on its default
Responses path with a ``function_tool`` taking a pydantic model and with ``output_type`` next to
tools. (The SDK's ``pydantic_function_tool`` and ``chat.completions.parse``: test_schemas_server.py.)

Every one of them sends pydantic's ``$defs``/``$ref`` schemas. Each pattern runs against two servers
on Qwen2.5-Coder-0.5B, one with n-gram speculation and one with ``--draft none``: greedy answers must
be the same (speculation is lossless on every route these clients use) and must parse into the
client's model.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import agents
import instructor
import openai
import pydantic
import pytest
from helpers import Place, Trip  # the nested models (pydantic writes $defs for Place)
from live_server import Server, running, start_server
from pydantic_ai import Agent
from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
from pydantic_ai.providers.openai import OpenAIProvider

pytestmark = pytest.mark.slow

NAME = "qwen-small"
ASK = "Plan a trip from Oslo, Norway with stops in Rome, Italy and Paris, France."
CAPITALS = "List the capitals: Norway, Italy, France."
MAX_TOKENS = 200


@pytest.fixture(scope="module")
def servers(qwen05_gguf: Path) -> Iterator[tuple[Server, Server]]:
    """(speculative, plain) servers on the same model."""
    # --dtype auto: the GGUF's blocks with the native kernels (float32 would dequantize the weights)
    spec = start_server(qwen05_gguf, "--draft", "ngram", "--dtype", "auto", name=NAME, context=1024)
    plain = start_server(qwen05_gguf, "--draft", "none", "--dtype", "auto", name=NAME, context=1024)
    with running(spec, plain):
        yield spec, plain


def _fields(answer: Any) -> Any:
    """What an answer says: pydantic models by their fields (instructor attaches the raw completion,
    with its own id and timestamps, to the model it returns)."""
    if isinstance(answer, pydantic.BaseModel):
        return answer.model_dump()
    if isinstance(answer, list):
        return [_fields(a) for a in answer]
    return answer


def both(servers: tuple[Server, Server], run: Callable[[Server], Any]) -> Any:
    """``run`` against each server at once; the answers must say the same. Returns the first."""
    with ThreadPoolExecutor(2) as pool:  # one thread per server: the two run side by side
        got, want = pool.map(run, servers)
    assert _fields(got) == _fields(want)
    return got


def _instructor(server: Server) -> Any:
    return instructor.from_openai(server.client(), mode=instructor.Mode.TOOLS)


def _sampling() -> dict[str, Any]:
    return {"temperature": 0, "max_tokens": MAX_TOKENS, "max_retries": 0}


@pytest.mark.parametrize("model_class", [OpenAIChatModel, OpenAIResponsesModel])
def test_pydantic_ai_nested_output_type(servers: tuple[Server, Server], model_class: type) -> None:
    def run(server: Server) -> Trip:
        provider = OpenAIProvider(base_url=server.url, api_key="unused")
        agent = Agent(
            model_class(NAME, provider=provider),
            output_type=Trip,
            model_settings={"temperature": 0, "max_tokens": MAX_TOKENS},
        )
        return agent.run_sync(ASK).output

    trip = both(servers, run)
    assert isinstance(trip, Trip) and trip.origin.city == "Oslo"


def test_instructor_tools_with_a_nested_model(servers: tuple[Server, Server]) -> None:
    def run(server: Server) -> Trip:
        return _instructor(server).chat.completions.create(
            model=NAME, response_model=Trip, messages=[{"role": "user", "content": ASK}], **_sampling()
        )

    trip = both(servers, run)
    assert isinstance(trip, Trip) and [s.city for s in trip.stops] == ["Rome", "Paris"]


def test_instructor_create_iterable_and_partial(servers: tuple[Server, Server]) -> None:
    def iterable(server: Server) -> list[Place]:
        return list(
            _instructor(server).chat.completions.create_iterable(
                model=NAME, response_model=Place, messages=[{"role": "user", "content": CAPITALS}], **_sampling()
            )
        )

    places = both(servers, iterable)
    assert places and all(isinstance(p, Place) for p in places)

    def partial(server: Server) -> Any:
        parts = list(
            _instructor(server).chat.completions.create_partial(
                model=NAME, response_model=Trip, messages=[{"role": "user", "content": ASK}], **_sampling()
            )
        )
        # arguments stream in pieces: the partial object grows over many chunks, not in one at the
        # end (how many depends on how many tokens each step emits, so only the last must agree)
        assert len(parts) > 10
        return parts[-1]

    last = both(servers, partial)
    assert last.origin.city == "Oslo" and len(last.stops) == 2


def _agent_model(server: Server) -> agents.OpenAIResponsesModel:
    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=server.url, api_key="unused", max_retries=0)
    return agents.OpenAIResponsesModel(model=NAME, openai_client=client)


def test_openai_agents_function_tool_taking_a_pydantic_model(servers: tuple[Server, Server]) -> None:
    booked: list[Trip] = []

    @agents.function_tool
    def plan_trip(trip: Trip) -> str:
        """Book a trip: where it starts and where it stops."""
        booked.append(trip)
        return f"booked {trip.origin.city} -> " + ", ".join(s.city for s in trip.stops)

    def run(server: Server) -> str:
        agent = agents.Agent(
            name="planner",
            instructions="Use the tool to book trips.",
            model=_agent_model(server),
            tools=[plan_trip],
            model_settings=agents.ModelSettings(temperature=0, max_tokens=MAX_TOKENS, tool_choice="required"),
            tool_use_behavior="stop_on_first_tool",
        )
        return str(asyncio.run(agents.Runner.run(agent, ASK)).final_output)

    assert both(servers, run) == "booked Oslo -> Rome, Paris"
    assert len(booked) == 2 and booked[0] == booked[1]


def test_openai_agents_output_type_with_tools(servers: tuple[Server, Server]) -> None:
    @agents.function_tool
    def capital(country: str) -> str:
        """The capital of a country."""
        return {"Norway": "Oslo", "Italy": "Rome", "France": "Paris"}.get(country, "unknown")

    def run(server: Server) -> Trip:
        agent = agents.Agent(
            name="planner",
            instructions="Answer with the trip.",
            model=_agent_model(server),
            tools=[capital],
            output_type=Trip,
            model_settings=agents.ModelSettings(temperature=0, max_tokens=MAX_TOKENS),
        )
        return asyncio.run(agents.Runner.run(agent, ASK)).final_output

    trip = both(servers, run)
    assert isinstance(trip, Trip) and trip.origin.country == "Norway"
