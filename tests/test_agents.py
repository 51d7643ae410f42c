"""Agents against ``quickdraft serve``: OpenAI tool calling on a real model (Qwen2.5-Coder-1.5B,
whose template writes Hermes-style ``<tool_call>`` blocks; the 0.5B loses track after a tool
result), with speculation on and off.

Two servers run for the module: the default drafter (``auto``: the 0.5B draft model and lookup)
and ``--draft none``. Greedy
answers must be identical between them, tool calls included: speculation is lossless, forced calls
(a grammar) included; ``logit_bias`` is tested in test_server.py. The last test drives a real agent framework (LangChain's
``ChatOpenAI.bind_tools``, a test-only dependency) through a two-tool loop to a final answer.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import bench_script
from live_server import Server, running, start_server

pytestmark = pytest.mark.slow

NAME = "qwen-coder"
# The tools, system prompt and task of benchmarks/agent_loop.py: what is tested is what is timed.
AGENT = bench_script("agent_loop")
TOOLS: list[dict[str, Any]] = AGENT.TOOLS
SYSTEM = {"role": "system", "content": "You are a helpful assistant. Use the tools when they help."}
ASK = [SYSTEM, {"role": "user", "content": "What is 1234 * 5678? Use the calculator."}]


@pytest.fixture(scope="module")
def agents(qwen15_gguf: Path) -> Iterator[tuple[Server, Server]]:
    common = ["--dtype", "auto"]
    spec = start_server(qwen15_gguf, *common, name=NAME, context=2048)  # the default drafter
    plain = start_server(qwen15_gguf, *common, "--draft", "none", name=NAME, context=2048)
    with running(spec, plain):
        yield spec, plain


def _ask(server: Server, **kw: Any) -> Any:
    args: dict[str, Any] = {"model": NAME, "messages": ASK, "max_tokens": 96, "temperature": 0}
    return server.client().chat.completions.create(**{**args, **kw})


def _calls(message: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def test_auto_tool_call_is_parsed_and_lossless(agents: tuple[Server, Server]) -> None:
    spec, plain = agents
    fast, slow = _ask(spec, tools=TOOLS), _ask(plain, tools=TOOLS)
    msg = fast.choices[0].message
    assert fast.choices[0].finish_reason == "tool_calls"
    (name, args), *_ = _calls(msg)
    assert name == "calculator" and "1234" in args["expression"] and "5678" in args["expression"]
    assert msg.tool_calls[0].id.startswith("call_") and msg.tool_calls[0].type == "function"
    assert _calls(msg) == _calls(slow.choices[0].message)
    assert msg.content == slow.choices[0].message.content
    _streamed_equals(spec, fast.choices[0])
    # Without tools the same question is answered as text, with no calls.
    text = _ask(spec, max_tokens=16).choices[0]
    assert text.message.tool_calls is None and text.finish_reason in ("stop", "length")
    # tool_choice none: tools are not shown, no calls are parsed.
    none = _ask(spec, tools=TOOLS, tool_choice="none", max_tokens=16).choices[0]
    assert none.message.tool_calls is None and none.finish_reason != "tool_calls"


def _streamed_equals(spec: Server, whole: Any) -> None:
    chunks = list(_ask(spec, tools=TOOLS, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls: dict[int, dict[str, str]] = {}
    for d in deltas:
        for tc in d.tool_calls or []:
            entry = calls.setdefault(tc.index, {"name": "", "arguments": "", "id": ""})
            if tc.id:
                entry["id"] = tc.id
                assert tc.function.name and tc.type == "function"  # id, type, name come first
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
    got = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
    assert got == _calls(whole.message) and all(c["id"] for c in calls.values())
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert "".join(d.content or "" for d in deltas).strip() == (whole.message.content or "").strip()


def test_forced_calls_follow_the_schema_and_are_lossless(agents: tuple[Server, Server]) -> None:
    spec, plain = agents
    question = [SYSTEM, {"role": "user", "content": "How many people live in Lisbon?"}]
    fast = _ask(spec, messages=question, tools=TOOLS, tool_choice="required").choices[0]
    slow = _ask(plain, messages=question, tools=TOOLS, tool_choice="required").choices[0]
    assert fast.finish_reason == "tool_calls" and _calls(fast.message) == _calls(slow.message)
    (name, args), *_ = _calls(fast.message)
    assert name == "population" and set(args) == {"city"} and "Lisbon" in args["city"]
    # A named function the model would not pick itself is still what comes out.
    calc = {"type": "function", "function": {"name": "calculator"}}
    forced = _ask(spec, messages=question, tools=TOOLS, tool_choice=calc).choices[0]
    assert [n for n, _ in _calls(forced.message)] == ["calculator"]
    assert isinstance(_calls(forced.message)[0][1]["expression"], str)


def test_strict_functions_constrain_calls_but_allow_text(agents: tuple[Server, Server]) -> None:
    spec, plain = agents
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]
    fast = _ask(spec, tools=strict).choices[0]
    slow = _ask(plain, tools=strict).choices[0]
    assert fast.finish_reason == "tool_calls" and _calls(fast.message) == _calls(slow.message)
    assert all(set(args) == {"expression"} for n, args in _calls(fast.message) if n == "calculator")
    hello = [{"role": "user", "content": "Say hello in French, one word."}]
    text = _ask(spec, messages=hello, tools=strict, max_tokens=8).choices[0]
    assert text.message.tool_calls is None and text.message.content.strip()


def _agent_loop(server: Server) -> tuple[list[tuple[str, dict[str, Any]]], str]:
    """A LangChain agent with two tools, run to its final answer; (tool calls made, answer).

    The tools are bound as OpenAI tool definitions (``bind_tools`` takes them as they are): a
    model this small is sensitive to how the JSON it is shown is written, and the schemas
    LangChain derives from Python functions put ``type`` last."""
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=NAME, base_url=server.url, api_key="unused", temperature=0, max_tokens=128,
        max_retries=0, timeout=300,
    ).bind_tools(TOOLS)
    messages: list[Any] = [
        SystemMessage(AGENT.SYSTEM),
        HumanMessage(AGENT.TASK),
    ]
    made: list[tuple[str, dict[str, Any]]] = []
    for _ in range(6):
        reply = llm.invoke(messages)
        messages.append(reply)
        if not reply.tool_calls:
            return made, str(reply.content)
        for call in reply.tool_calls:
            made.append((call["name"], call["args"]))
            result = AGENT.run_tool(call["name"], json.dumps(call["args"]))  # the benchmark's tools
            messages.append(ToolMessage(result, tool_call_id=call["id"]))
    raise AssertionError(f"no final answer after 6 turns: {made}")


def test_langchain_agent_loop_with_and_without_speculation(agents: tuple[Server, Server]) -> None:
    spec, plain = agents
    made, answer = _agent_loop(spec)
    names = [n for n, _ in made]
    assert names[:2] == ["population", "calculator"] and "Lisbon" in made[0][1]["city"]
    assert "545923" in made[1][1]["expression"]  # the tool's result went back into the loop
    assert "1637769" in answer.replace(",", "")  # 545923 * 3
    assert _agent_loop(plain) == (made, answer)  # greedy: the same calls and the same answer
