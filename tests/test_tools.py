"""Tool calling, without a server: the three call formats, streaming them in any cut, choosing a
format from a chat template, and the grammars that force calls (on the real Qwen vocabulary)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from quickdraft.server.grammar import GrammarCompiler
from quickdraft.server.tools import (
    ToolStream,
    forced_grammar,
    format_for_template,
    get_format,
    parse_output,
)
from quickdraft.tokenizer import Tokenizer

HERMES = get_format("hermes")
LLAMA = get_format("llama3_json")
MISTRAL = get_format("mistral")

CALC = {
    "type": "object",
    "properties": {"expression": {"type": "string", "maxLength": 40}},
    "required": ["expression"],
    "additionalProperties": False,
}
LOOKUP = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}},
    "required": ["city"],
    "additionalProperties": False,
}


def _calls(parsed: object) -> list[tuple[str, dict[str, object]]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]  # type: ignore[attr-defined]


def test_hermes_content_and_calls() -> None:
    text = (
        "Let me compute that.\n<tool_call>\n"
        '{"name": "calc", "arguments": {"expression": "2+3"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "lookup", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n</tool_call>'
    )
    parsed = parse_output(HERMES, text)
    assert parsed.content == "Let me compute that."
    assert _calls(parsed) == [("calc", {"expression": "2+3"}), ("lookup", {"city": "Oslo"})]
    assert len({c.id for c in parsed.calls}) == 2 and parsed.calls[0].id.startswith("call_")
    # An unterminated last block (the output ended at EOS) still counts.
    end = parse_output(HERMES, '<tool_call>\n{"name": "calc", "arguments": {}}\n')
    assert _calls(end) == [("calc", {})] and end.content == ""
    assert parse_output(HERMES, "no calls here").content == "no calls here"


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "calc", "arguments": {"expression": }\n</tool_call>',  # broken JSON
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "calc", "arguments": [1]}\n</tool_call>',  # not an object
        '<tool_call>\n{"name": "calc", "arguments": {}}\n</tool_call> and then text',
    ],
)
def test_malformed_calls_come_back_as_content(text: str, caplog: pytest.LogCaptureFixture) -> None:
    parsed = parse_output(HERMES, text)
    assert parsed.calls == [] and parsed.content == text
    assert "not understood" in caplog.text


def test_llama3_json_and_mistral() -> None:
    one = parse_output(LLAMA, '{"name": "calc", "parameters": {"expression": "1+1"}}')
    assert _calls(one) == [("calc", {"expression": "1+1"})] and one.content == ""
    two = parse_output(
        LLAMA, '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}'
    )
    assert _calls(two) == [("a", {}), ("b", {"x": 1})]
    answer = '{"result": 4}'  # JSON that is not a call stays an answer
    assert parse_output(LLAMA, answer).content == answer and not parse_output(LLAMA, answer).calls
    assert parse_output(LLAMA, "{curly text").content == "{curly text"
    assert parse_output(LLAMA, "Hello").content == "Hello"

    m = parse_output(MISTRAL, 'Sure. [TOOL_CALLS] [{"name": "calc", "arguments": {"expression": "3"}}]')
    assert m.content == "Sure." and _calls(m) == [("calc", {"expression": "3"})]
    bad = "[TOOL_CALLS] [{"
    assert parse_output(MISTRAL, bad).content == bad


NAMES = frozenset({"calc", "lookup"})


def test_bare_call_objects_count_when_they_name_a_function() -> None:
    bare = '{"name": "calc", "arguments": {"expression": "1234 * 5678"}}'
    assert _calls(parse_output(HERMES, bare, NAMES)) == [("calc", {"expression": "1234 * 5678"})]
    fenced = parse_output(HERMES, "```json\n" + bare + "\n```", NAMES)
    assert _calls(fenced) == [("calc", {"expression": "1234 * 5678"})] and fenced.content == ""
    assert parse_output(HERMES, bare).calls == []  # no tools in the request: an answer
    two = parse_output(HERMES, bare + '\n{"name": "lookup", "arguments": {"city": "Rome"}}', NAMES)
    assert [n for n, _ in _calls(two)] == ["calc", "lookup"]
    for answer in ('{"name": "Ada", "age": 36}', '{"name": "calc"}', bare + " and more"):
        assert parse_output(HERMES, answer, NAMES).content == answer  # JSON, not a call


STREAM_CASES = [
    (HERMES, 'Sure.\n<tool_call>\n{"name": "calc", "arguments": {"expression": "7*6"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "lookup", "arguments": {"city": "Rome"}}\n</tool_call>'),
    (HERMES, "An answer that mentions <tool and <tool_ca but never calls."),
    (HERMES, '<tool_call>\n{"name": "calc", "arguments": {"expression": }\n</tool_call>'),
    (LLAMA, '<|python_tag|>{"name": "calc", "parameters": {"expression": "1"}}'),
    (LLAMA, '  {"name": "calc", "parameters": {"expression": "1"}}'),
    (LLAMA, "Plain words {with braces}."),
    (MISTRAL, 'Ok [TOOL_CALLS] [{"name": "calc", "arguments": {"expression": "2"}}]'),
    (MISTRAL, "text with [TOOL but no calls"),
    (HERMES, '  {"name": "lookup", "arguments": {"city": "Oslo"}}'),
    (HERMES, '```json\n{"name": "calc", "arguments": {"expression": "1"}}\n```'),
    (HERMES, '{"name": "Ada", "age": 36}'),
    (HERMES, "``code`` then <tool_call>\n{\"name\": \"calc\", \"arguments\": {}}\n</tool_call>"),
]


@pytest.mark.parametrize(("fmt", "text"), STREAM_CASES)
def test_streaming_equals_whole_parse_in_any_cut(fmt: object, text: str) -> None:
    whole = parse_output(fmt, text, NAMES)  # type: ignore[arg-type]
    rng = random.Random(len(text))
    for trial in range(30):
        stream = ToolStream(fmt, NAMES)  # type: ignore[arg-type]
        content, calls, pos = "", [], 0
        while pos < len(text):
            n = 1 if trial == 0 else rng.randint(1, 12)
            out, done = stream.push(text[pos : pos + n])
            content += out
            calls += done
            pos += n
        out, done = stream.finish()
        content += out
        calls += done
        assert [(c.name, c.arguments) for c in calls] == [
            (c.name, c.arguments) for c in whole.calls
        ]
        assert content.strip() == whole.content.strip()


def test_content_before_a_call_streams_before_the_call_ends() -> None:
    stream = ToolStream(HERMES)
    assert stream.push("Checking the weather. <tool")[0] == "Checking the weather. "
    assert stream.push("_call>\n{")[0] == ""  # the marker was held back, then recognised
    out, calls = stream.push('"name": "lookup", "arguments": {"city": "Oslo"}}\n</tool_call>')
    assert out == "" and [c.name for c in calls] == ["lookup"]  # complete before finish()


def test_format_from_the_chat_template(qwen05_gguf: Path, smollm2_gguf: Path) -> None:
    qwen = Tokenizer.from_gguf(qwen05_gguf)
    assert format_for_template(qwen.chat_template) is HERMES
    assert format_for_template(Tokenizer.from_gguf(smollm2_gguf).chat_template) is None
    assert format_for_template("{% for tool in tools %}[TOOL_CALLS]{% endfor %}") is MISTRAL
    assert format_for_template("{{ tools }} <|python_tag|>") is LLAMA
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral"):
        get_format("xml")
    # The template renders tools and the history's calls and results (Qwen: <tool_response>).
    tools = [{"type": "function", "function": {"name": "calc", "parameters": CALC}}]
    history = [
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calc", "arguments": {"expression": "2+3"}}}
        ]},
        {"role": "tool", "content": "5", "tool_call_id": "call_1"},
    ]
    text = qwen.apply_chat_template(history, tools=tools)
    assert '"name": "calc"' in text and "<tools>" in text
    assert '<tool_call>\n{"name": "calc", "arguments": {"expression": "2+3"}}' in text
    assert "<tool_response>\n5\n</tool_response>" in text


def _walk(compiler: GrammarCompiler, grammar: str, text: str) -> bool:
    """Whether the grammar accepts ``text`` (as the model's tokens) and then allows EOS."""
    tok = compiler.tokenizer
    constraint = compiler.lark(grammar)
    ids = tok.encode(text, add_special_tokens=False)
    vocab = tok.vocab_size
    for t in ids:
        if not bool(constraint.allowed([], vocab)[0, t]):
            return False
        constraint.commit([t])
    return bool(constraint.allowed([], vocab)[0, sorted(tok.eos_ids)].any())


def test_forced_grammars_accept_calls_and_refuse_the_rest(qwen05_gguf: Path) -> None:
    compiler = GrammarCompiler(Tokenizer.from_gguf(qwen05_gguf))
    assert compiler.marker("<tool_call>") == "<[151657]>"  # one special token in Qwen's vocabulary
    assert compiler.marker("[TOOL_CALLS]") == '"[TOOL_CALLS]"'  # just text here
    fns = [("calc", CALC), ("lookup", LOOKUP)]
    good = '<tool_call>\n{"name": "calc", "arguments": {"expression": "2+3"}}\n</tool_call>'
    other = '<tool_call>\n{"name": "lookup", "arguments": {"city": "Oslo"}}\n</tool_call>'
    wrong_args = '<tool_call>\n{"name": "calc", "arguments": {"city": "Oslo"}}\n</tool_call>'

    required = forced_grammar(HERMES, fns, True, False, compiler.marker)
    assert _walk(compiler, required, good)
    assert _walk(compiler, required, good + "\n" + other)  # parallel calls
    assert not _walk(compiler, required, wrong_args)
    assert not _walk(compiler, required, "I will not call anything.")

    single = forced_grammar(HERMES, fns[:1], False, False, compiler.marker)
    assert _walk(compiler, single, good) and not _walk(compiler, single, other)
    assert not _walk(compiler, single, good + "\n" + good)

    strict = forced_grammar(HERMES, fns, True, True, compiler.marker)
    assert _walk(compiler, strict, "Just an answer, no tools needed.")
    assert _walk(compiler, strict, "First I compute.\n" + good)
    assert not _walk(compiler, strict, "First I compute.\n" + wrong_args)
    # A marker that is plain text here (Mistral's, in Qwen's vocabulary) is kept out of the text.
    text_marker = forced_grammar(MISTRAL, fns, True, True, compiler.marker)
    assert _walk(compiler, text_marker, "Plain [TOOL answer.")
    assert not _walk(compiler, text_marker, "Plain [TOOL_CALLS] answer.")
    assert _walk(compiler, text_marker, 'Ok [TOOL_CALLS][{"name": "calc", "arguments": {"expression": "1"}}]')

    llama = forced_grammar(LLAMA, fns, False, False, compiler.marker)
    assert _walk(compiler, llama, '{"name": "lookup", "parameters": {"city": "Rome"}}')
    assert not _walk(compiler, llama, '{"name": "lookup", "parameters": {"expression": "1"}}')
    mistral = forced_grammar(MISTRAL, fns, True, False, compiler.marker)
    assert _walk(compiler, mistral, '[TOOL_CALLS][{"name": "calc", "arguments": {"expression": "1"}}]')
