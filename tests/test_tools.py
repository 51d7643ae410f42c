"""Tool calling, without a server: the three call formats, streaming them in any cut, choosing a
format from a chat template, and the grammars that force calls (on the real Qwen vocabulary)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pydantic
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
    (MISTRAL, '[TOOL_CALLS][{"name": "calc", "arguments": {"expression":"2"}},{"name": "lookup", "arguments": {}}]'),
    (MISTRAL, '[TOOL_CALLS] {"arguments": {"expression": "2"}, "name": "calc"}'),
    (MISTRAL, '[TOOL_CALLS] [{"name": "calc", "arguments": {"expression": "2"'),  # cut short
    (LLAMA, '{"name": "calc", "parameters": {"expression": "1"}}; {"name": "lookup", "parameters": {"city": "X"}}'),
    (LLAMA, '{"name": "Ada", "age": 36}'),
    (LLAMA, '<|python_tag|>{"name": "calc", "parameters": {"expression": "1"'),  # cut short
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


# ------------------------------------------------------- nested schemas, whitespace, streaming


class Place(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)


class Trip(pydantic.BaseModel):
    origin: Place
    stops: list[Place]


class Node(pydantic.BaseModel):  # recursive: children are Nodes
    name: str
    children: list[Node] = []


TRIP = Trip.model_json_schema()  # {"$defs": {"Place": ...}, "properties": {"origin": {"$ref": ...
TRIP_ARGS = '{"origin": {"city": "Oslo", "country": "Norway"}, "stops": [{"city": "Rome", "country": "Italy"}]}'
BAD_TRIP_ARGS = '{"origin": {"city": "Oslo"}, "stops": []}'  # Place without its country


def test_nested_schemas_with_defs_work_inside_every_grammar(qwen05_gguf: Path) -> None:
    assert "$defs" in TRIP and "$ref" in json.dumps(TRIP["properties"])
    compiler = GrammarCompiler(Tokenizer.from_gguf(qwen05_gguf))
    fns = [("plan", TRIP), ("calc", CALC)]
    call = '<tool_call>\n{"name": "plan", "arguments": ' + TRIP_ARGS + "}\n</tool_call>"
    bad = '<tool_call>\n{"name": "plan", "arguments": ' + BAD_TRIP_ARGS + "}\n</tool_call>"
    # tool_choice required (both functions), named (one), strict under auto.
    for grammar in (
        forced_grammar(HERMES, fns, True, False, compiler.marker),
        forced_grammar(HERMES, fns[:1], False, False, compiler.marker),
        forced_grammar(HERMES, fns, True, True, compiler.marker),
    ):
        assert _walk(compiler, grammar, call) and not _walk(compiler, grammar, bad)
    Trip.model_validate_json(parse_output(HERMES, call).calls[0].arguments)
    # The `definitions` spelling and the other two formats (Mistral's wraps calls in an array).
    old_style = json.loads(json.dumps(TRIP).replace("$defs", "definitions"))
    llama = forced_grammar(LLAMA, [("plan", old_style)], False, False, compiler.marker)
    assert _walk(compiler, llama, '{"name": "plan", "parameters": ' + TRIP_ARGS + "}")
    assert not _walk(compiler, llama, '{"name": "plan", "parameters": ' + BAD_TRIP_ARGS + "}")
    mistral = forced_grammar(MISTRAL, fns, True, False, compiler.marker)
    assert _walk(compiler, mistral, '[TOOL_CALLS][{"name": "plan", "arguments": ' + TRIP_ARGS + "}]")
    # response_format: the schema alone, and as the answer next to strict tools.
    assert _walk_json(compiler, TRIP, TRIP_ARGS) and not _walk_json(compiler, TRIP, BAD_TRIP_ARGS)
    both = forced_grammar(HERMES, fns, True, True, compiler.marker, answer=TRIP)
    assert _walk(compiler, both, TRIP_ARGS) and _walk(compiler, both, call)
    assert not _walk(compiler, both, "Plain text is not the JSON answer.")
    assert not _walk(compiler, both, BAD_TRIP_ARGS)


def test_recursive_schemas_keep_their_recursion(qwen05_gguf: Path) -> None:
    compiler = GrammarCompiler(Tokenizer.from_gguf(qwen05_gguf))
    tree = '{"name": "a", "children": [{"name": "b", "children": [{"name": "c"}]}]}'
    grammar = forced_grammar(HERMES, [("grow", Node.model_json_schema())], False, False, compiler.marker)
    assert _walk(compiler, grammar, '<tool_call>\n{"name": "grow", "arguments": ' + tree + "}\n</tool_call>")
    assert not _walk(compiler, grammar, '<tool_call>\n{"name": "grow", "arguments": {"children": []}}\n</tool_call>')
    # Recursion through the root ("#"), which the hoisting rebases too.
    root = {"type": "object", "properties": {"next": {"$ref": "#"}, "v": {"type": "integer"}}}
    llama = forced_grammar(LLAMA, [("chain", root)], False, False, compiler.marker)
    assert _walk(compiler, llama, '{"name": "chain", "parameters": {"next": {"next": {"v": 3}}, "v": 1}}')
    assert _walk_json(compiler, Node.model_json_schema(), tree)


def _walk_json(compiler: GrammarCompiler, schema: dict[str, object], text: str) -> bool:
    tok = compiler.tokenizer
    constraint = compiler.json(schema)
    for t in tok.encode(text, add_special_tokens=False):
        if not bool(constraint.allowed([], tok.vocab_size)[0, t]):
            return False
        constraint.commit([t])
    return bool(constraint.allowed([], tok.vocab_size)[0, sorted(tok.eos_ids)].any())


def test_json_whitespace_is_bounded(qwen05_gguf: Path) -> None:
    """At most one space where JSON allows whitespace: a greedy model cannot pad with spaces."""
    compiler = GrammarCompiler(Tokenizer.from_gguf(qwen05_gguf))
    tok = compiler.tokenizer
    assert _walk_json(compiler, TRIP, TRIP_ARGS)
    assert _walk_json(compiler, TRIP, TRIP_ARGS.replace(": ", ":").replace(", ", ","))
    assert not _walk_json(compiler, TRIP, TRIP_ARGS.replace(", ", ",  "))
    assert not _walk_json(compiler, TRIP, TRIP_ARGS[:-1] + "  }")
    assert not _walk_json(compiler, None, '{\n  "a": 1\n}')  # type: ignore[arg-type]
    spaces = [i for i in range(tok.vocab_size) if (t := compiler.token_text(i)[0]) and not t.strip()]
    for grammar_text in (TRIP_ARGS[:-1], TRIP_ARGS[:-1] + " "):  # after the last field
        constraint = compiler.json(TRIP)
        constraint.commit(tok.encode(grammar_text, add_special_tokens=False))
        mask = constraint.allowed([], tok.vocab_size)[0]
        allowed = [compiler.token_text(i)[0] for i in spaces if mask[i]]
        assert allowed == ([] if grammar_text.endswith(" ") else [" "])
    # Tool arguments too.
    grammar = forced_grammar(HERMES, [("calc", CALC)], False, False, compiler.marker)
    assert not _walk(compiler, grammar, '<tool_call>\n{"name": "calc", "arguments": {"expression": "1"}   }\n</tool_call>')


def test_streamed_arguments_arrive_in_pieces_and_equal_the_whole_parse() -> None:
    long = "x" * 200
    text = (
        "Let me look.\n<tool_call>\n"
        '{"name": "lookup", "arguments": {"city": "' + long + '", "n": [1, {"a": "}"}]}}\n</tool_call>\n'
        '<tool_call>\n{"arguments": {"expression": "1"}, "name": "calc"}\n</tool_call>'  # name last
    )
    whole = parse_output(HERMES, text)
    assert [c.arguments for c in whole.calls][0] == (
        '{"city": "' + long + '", "n": [1, {"a": "}"}]}'  # the model's own text
    )
    stream = ToolStream(HERMES)
    deltas = []
    for i in range(0, len(text), 7):
        stream.push(text[i : i + 7])
        deltas += stream.take_deltas()
    stream.finish()
    deltas += stream.take_deltas()
    assert [d.index for d in deltas if d.id] == [0, 1]
    for index, call in enumerate(whole.calls):
        mine = [d for d in deltas if d.index == index]
        assert mine[0].name == call.name and mine[0].id and mine[0].arguments == ""
        assert all(d.id is None and d.name is None for d in mine[1:])
        assert "".join(d.arguments for d in mine) == call.arguments
    assert len([d for d in deltas if d.index == 0]) > 10  # streamed as it came
    assert len([d for d in deltas if d.index == 1]) == 2  # name after the arguments: whole
    # The first call's head goes out before its arguments are complete.
    stream = ToolStream(HERMES)
    stream.push(text[: text.index(long) + 50])
    head, *pieces = stream.take_deltas()
    assert head.name == "lookup" and pieces and "".join(d.arguments for d in pieces).endswith("x" * 50)


@pytest.mark.parametrize(
    ("fmt", "opening", "closing"),
    [
        (LLAMA, '<|python_tag|>{"name": "lookup", "parameters": ', '}; {"name": "calc", "parameters": {"expression": "1"}}'),
        (MISTRAL, 'On it. [TOOL_CALLS] [{"name": "lookup", "arguments": ', '}, {"name": "calc", "arguments": {"expression": "1"}}]'),
    ],
)
def test_llama3_and_mistral_stream_the_first_calls_arguments(fmt: object, opening: str, closing: str) -> None:
    """The first call's head as soon as its arguments open, its arguments in pieces (the model's
    own text, as the whole parse returns it), later calls whole at the end."""
    args = '{"city": "' + "y" * 120 + '", "n": [1, {"a": "}"}]}'
    text = opening + args + closing
    whole = parse_output(fmt, text, NAMES)  # type: ignore[arg-type]
    assert [c.arguments for c in whole.calls] == [args, '{"expression": "1"}']
    stream = ToolStream(fmt, NAMES)  # type: ignore[arg-type]
    deltas, content = [], ""
    for i in range(0, len(text), 5):
        content += stream.push(text[i : i + 5])[0]
        deltas += stream.take_deltas()
        if i + 5 == len(opening) + 60:  # mid-arguments: the head and some pieces are out
            assert deltas[0].name == "lookup" and len(deltas) > 2
    out, calls = stream.finish()
    deltas += stream.take_deltas()
    assert (content + out).strip() == whole.content.strip()
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole.calls]
    assert [d.id for d in deltas if d.id] == [c.id for c in calls]
    for index, call in enumerate(whole.calls):
        mine = [d for d in deltas if d.index == index]
        assert mine[0].name == call.name and mine[0].arguments == ""
        assert "".join(d.arguments for d in mine) == call.arguments
    assert len([d for d in deltas if d.index == 0]) > 10
