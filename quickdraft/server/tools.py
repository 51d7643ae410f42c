"""OpenAI tool calling: the formats models write tool calls in, parsing them, streaming them, and
the grammars that force them.

A model learns one way to write a call during training, and its chat template (which renders the
``tools`` list into the prompt) names it. Three families cover the open models:

- ``hermes`` (Qwen2.5/Qwen3, Hermes, many fine-tunes): ``<tool_call>\\n{"name": ..., "arguments":
  {...}}\\n</tool_call>``, one block per call, text before the first block is content;
- ``llama3_json`` (Llama 3.1-3.3): the whole answer is ``{"name": ..., "parameters": {...}}``
  (optionally after ``<|python_tag|>``; several calls joined by ``;``);
- ``mistral``: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``.

:func:`format_for_template` picks the family from the template's text (the marker it writes);
``quickdraft serve --tool-call-parser`` overrides it. Parsing works on the output text decoded
with special tokens kept (``[TOOL_CALLS]`` is one), end-of-sequence tokens left out.

Output the model meant as a call but wrote badly (a block with broken JSON, an unknown shape) is
returned as content and logged as a warning; it never fails the request.

Forced calls (``tool_choice: "required"`` or a named function, or any function with
``strict: true``) become an llguidance Lark grammar: the family's frame around ``%json`` of the
function's parameters schema, so the arguments are valid for the schema. A schema with ``$ref``
(``$defs``, ``definitions``, recursion) is hoisted into the embedding schema's root ``$defs``
(:func:`hoist`), and every embedded JSON gets bounded whitespace (:data:`COMPACT`). With
``response_format`` under ``auto`` the answer is the calls or the JSON answer. Speculation stays
lossless under it exactly as under ``response_format``: the mask of a position depends on the
prefix alone (see :mod:`quickdraft.server.grammar`).
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("quickdraft.server")

FAMILIES = ("hermes", "llama3_json", "mistral")

# Writes a marker into a grammar: a special token by id (``<[151657]>``: the tokenizer has it as
# one token the model emits, which a quoted string would not match), else a quoted string.
MarkerWriter = Callable[[str], str]


def quoted(text: str) -> str:
    return json.dumps(text)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object as text, as OpenAI sends it
    id: str

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class CallDelta:
    """A piece of a streamed call, OpenAI's way: first ``id`` and ``name`` (arguments ""), then
    pieces of the arguments text; ``index`` counts the answer's calls."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class Parsed:
    content: str  # text that is not a call ("" when there is none)
    calls: list[ToolCall]


class Malformed(ValueError):
    """The text is shaped like a tool call but is not one."""


def _call_from_object(obj: Any, args_keys: Sequence[str]) -> ToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise Malformed(f"a tool call must be an object with a 'name': {obj!r:.200}")
    args: Any = {}
    for key in args_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):  # some models write the arguments already encoded
        try:
            args = json.loads(args)
        except ValueError:
            raise Malformed(f"the arguments of {obj['name']!r} are not JSON: {args!r:.200}") from None
    if not isinstance(args, dict):
        raise Malformed(f"the arguments of {obj['name']!r} must be a JSON object: {args!r:.200}")
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), new_call_id())


class ToolFormat:
    """One family: how calls start in the text, how to parse them, and their grammar."""

    name = ""
    start = ""  # the text that opens a call
    args_key = "arguments"  # the call object's key for the arguments

    def parse(self, text: str, names: frozenset[str] = frozenset()) -> Parsed:
        """Content and calls of a whole output; raises :class:`Malformed`. ``names``: the
        request's functions (a format may accept a bare call to one of them)."""
        raise NotImplementedError

    def call_grammar(self, schema: str, parallel: bool, lit: MarkerWriter) -> str:
        """Lark rules (``calls: ...``) for one or more calls; ``schema`` is the JSON of the
        call object's schema (anyOf over the allowed functions); ``lit`` writes a marker."""
        raise NotImplementedError

    def call_schema(self, name: str, parameters: dict[str, Any]) -> dict[str, Any]:
        return {
            "type": "object",
            "properties": {"name": {"const": name}, self.args_key: parameters},
            "required": ["name", self.args_key],
            "additionalProperties": False,
        }


_FENCE = re.compile(r"\A```(?:json)?\s*(.*?)\s*```\Z", re.S)


def bare_calls(text: str, names: frozenset[str]) -> list[ToolCall]:
    """A whole answer made of call objects without their tags (Qwen2.5-Coder often writes
    ``{"name": ..., "arguments": ...}`` bare, one per line, or in a json code fence), each
    naming one of the request's functions; [] for anything else (an answer that is merely JSON
    stays content)."""
    body = text.strip()
    fenced = _FENCE.match(body)
    if fenced:
        body = fenced.group(1)
    if not body.startswith("{") or not names:
        return []
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    pos = 0
    while pos < len(body):
        try:
            obj, pos = decoder.raw_decode(body, pos)
        except ValueError:
            return []
        keys = set(obj) if isinstance(obj, dict) else set()
        if (
            not isinstance(obj, dict)
            or obj.get("name") not in names
            or not keys & {"arguments", "parameters"}
            or not keys <= {"name", "arguments", "parameters"}
        ):
            return []
        try:
            calls.append(_call_from_object(obj, ("arguments", "parameters")))
        except Malformed:
            return []
        while pos < len(body) and body[pos] in " \t\r\n":
            pos += 1
    return calls


# A call object's opening up to its arguments object, as models write it (name first; Llama 3
# names the arguments "parameters").
_CALL_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)+")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)'
)


def _element_texts(body: str) -> list[str]:
    """The text of each element of the JSON list ``body`` (already known to parse)."""
    decoder, pos = json.JSONDecoder(), body.index("[") + 1
    texts: list[str] = []
    while True:
        while body[pos] in " \t\r\n,":
            pos += 1
        if body[pos] == "]":
            return texts
        _value, end = decoder.raw_decode(body, pos)
        texts.append(body[pos:end])
        pos = end


def _raw_arguments(body: str, call: ToolCall) -> ToolCall:
    """The call with its arguments as the model wrote them (the text of the arguments object,
    which streaming sends piece by piece) when the object is ``{"name": ..., "arguments": {...}}``."""
    head = _CALL_HEAD.match(body)
    if head is None:
        return call
    try:
        value, end = json.JSONDecoder().raw_decode(body, head.end())
    except ValueError:
        return call
    if value != json.loads(call.arguments):
        return call
    return ToolCall(call.name, body[head.end() : end], call.id)


class HermesFormat(ToolFormat):
    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)

    def parse(self, text: str, names: frozenset[str] = frozenset()) -> Parsed:
        first = text.find(self.start)
        if first < 0:
            bare = bare_calls(text, names)
            return Parsed("", bare) if bare else Parsed(text, [])
        calls: list[ToolCall] = []
        for m in self._block.finditer(text, first):
            body = m.group(1).strip()
            try:
                obj = json.loads(body)
            except ValueError:
                raise Malformed(f"a <tool_call> block is not JSON: {body!r:.200}") from None
            calls.append(_raw_arguments(body, _call_from_object(obj, ("arguments", "parameters"))))
        rest = self._block.sub("", text[first:]).strip()
        if rest:
            raise Malformed(f"text between or after the tool calls: {rest!r:.200}")
        return Parsed(text[:first].rstrip(), calls)

    def call_grammar(self, schema: str, parallel: bool, lit: MarkerWriter) -> str:
        many = "call+" if parallel else "call"
        return (
            f"calls: {many}\n"
            f"call: {lit(self.start)} call_body\n"
            f'call_body: "\\n" %json {schema} "\\n" {lit(self.end)} "\\n"?\n'
            f"after_open: call_body{' call*' if parallel else ''}\n"
        )


class Llama3JsonFormat(ToolFormat):
    name = "llama3_json"
    start = "{"
    args_key = "parameters"
    tag = "<|python_tag|>"

    def parse(self, text: str, names: frozenset[str] = frozenset()) -> Parsed:
        body = text.strip()
        if body.startswith(self.tag):
            body = body[len(self.tag) :].strip()
        elif not body.startswith("{"):
            return Parsed(text, [])
        calls: list[ToolCall] = []
        decoder = json.JSONDecoder()
        pos = 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except ValueError:
                if not calls and not text.strip().startswith(self.tag):
                    return Parsed(text, [])  # plain text that starts with a brace
                raise Malformed(f"a tool call is not JSON: {body[pos:]!r:.200}") from None
            if not calls and not (isinstance(obj, dict) and "name" in obj):
                return Parsed(text, [])  # a JSON answer, not a call
            call = _call_from_object(obj, ("parameters", "arguments"))
            calls.append(_raw_arguments(body[pos:end], call))
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return Parsed("", calls)

    def call_grammar(self, schema: str, parallel: bool, lit: MarkerWriter) -> str:
        many = 'call ("; " call)*' if parallel else "call"
        return f"calls: {many}\ncall: %json {schema}\n"


class MistralFormat(ToolFormat):
    name = "mistral"
    start = "[TOOL_CALLS]"

    def parse(self, text: str, names: frozenset[str] = frozenset()) -> Parsed:
        first = text.find(self.start)
        if first < 0:
            return Parsed(text, [])
        body = text[first + len(self.start) :].strip()
        try:
            objs = json.loads(body)
        except ValueError:
            raise Malformed(f"[TOOL_CALLS] is not followed by JSON: {body!r:.200}") from None
        texts = [body] if isinstance(objs, dict) else None
        if isinstance(objs, dict):
            objs = [objs]
        if not isinstance(objs, list) or not objs:
            raise Malformed(f"[TOOL_CALLS] must be followed by a list of calls: {body!r:.200}")
        texts = texts or _element_texts(body)
        calls = [_call_from_object(o, ("arguments", "parameters")) for o in objs]
        if len(texts) == len(calls):
            calls = [_raw_arguments(t, c) for t, c in zip(texts, calls, strict=True)]
        return Parsed(text[:first].rstrip(), calls)

    def call_grammar(self, schema: str, parallel: bool, lit: MarkerWriter) -> str:
        call = json.loads(schema)
        items = {"type": "array", "items": call, "minItems": 1}
        for key in ("$defs", "x-guidance"):  # root-only keys move to the array, the new root
            if key in call:
                items[key] = call.pop(key)
        if not parallel:
            items["maxItems"] = 1
        return f"calls: {lit(self.start)} after_open\nafter_open: %json {json.dumps(items)}\n"


_FORMATS: dict[str, ToolFormat] = {
    f.name: f for f in (HermesFormat(), Llama3JsonFormat(), MistralFormat())
}


def get_format(name: str) -> ToolFormat:
    try:
        return _FORMATS[name]
    except KeyError:
        raise ValueError(
            f"unknown tool-call format {name!r}; choose one of {', '.join(FAMILIES)}"
        ) from None


def template_renders_tools(template: str | None) -> bool:
    return bool(template) and "tools" in str(template)


def format_for_template(template: str | None) -> ToolFormat | None:
    """The family a chat template writes calls in, from the markers it contains; None when the
    template shows no tool calls at all."""
    if not template_renders_tools(template):
        return None
    text = str(template)
    if "<tool_call>" in text:
        return _FORMATS["hermes"]
    if "[TOOL_CALLS]" in text:
        return _FORMATS["mistral"]
    if "<|python_tag|>" in text or "ipython" in text:
        return _FORMATS["llama3_json"]
    return None


def parse_output(fmt: ToolFormat, text: str, names: frozenset[str] = frozenset()) -> Parsed:
    """Content and calls of a whole output; malformed calls come back as content (logged)."""
    try:
        return fmt.parse(text, names)
    except Malformed as exc:
        log.warning("tool call output not understood, returned as content: %s", exc)
        return Parsed(text, [])


class _OpenCall:
    """A call whose arguments are streaming: where the arguments object stands."""

    def __init__(self, call_id: str, name: str, index: int, prefix: str) -> None:
        self.prefix = prefix  # the block's text before the arguments
        self.id = call_id
        self.name = name
        self.index = index
        self.arguments = ""
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.done = False  # the arguments object closed

    def scan(self, text: str) -> int:
        """How much of ``text`` belongs to the arguments object (all of it until it closes)."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)


class ToolStream:
    """Splits streamed output text into content to show now and tool calls.

    Content is passed on as it comes, except a tail that could be the start of a call marker
    (held back until the next text decides). From the marker on, text is held until
    :meth:`finish` (or, for ``hermes``, until each ``</tool_call>``), then parsed: a good call
    becomes a :class:`ToolCall`, anything malformed goes out as content after all.

    :attr:`deltas` (taken with :meth:`take_deltas`) is the calls as OpenAI streams them. A
    ``hermes`` block written ``{"name": ..., "arguments": {...}}`` (name first, arguments last,
    as Qwen's template shows them) streams: its id and name as soon as the arguments open, then
    the arguments text as it comes, the same text the whole-answer parse returns. Any other
    call goes out whole (head, then all its arguments) once complete. A streamed block that
    turns out malformed (or is cut short by max_tokens) ends as content like in the whole parse,
    but its head and arguments so far have gone out already.
    """

    def __init__(self, fmt: ToolFormat, names: frozenset[str] = frozenset()) -> None:
        self.fmt = fmt
        self.names = names
        self.buffer = ""
        self.in_calls = False
        self.bare = False  # hermes: the answer opened like a bare call object; held to the end
        self.seen_text = False  # the answer's opening is decided (llama3_json, bare calls)
        self.calls: list[ToolCall] = []
        self.deltas: list[CallDelta] = []
        self.started = 0  # calls whose head went out
        self.open: _OpenCall | None = None
        self.stuck = False  # a streamed block turned out malformed: the rest waits for finish()

    def take_deltas(self) -> list[CallDelta]:
        out, self.deltas = self.deltas, []
        return out

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        """Content to emit now, and calls completed by this text."""
        self.buffer += text
        out = ""
        if not self.in_calls:
            out = self._content()
        if self.in_calls and isinstance(self.fmt, HermesFormat) and not self.bare:
            return out, self._hermes_blocks()
        if self.in_calls and not isinstance(self.fmt, HermesFormat):
            self._stream_first_call()
        return out, []

    def finish(self) -> tuple[str, list[ToolCall]]:
        """Everything still held: the last content and calls."""
        if self.open is not None and not isinstance(self.fmt, HermesFormat):
            return self._finish_streamed(self.open)
        done: list[ToolCall] = []
        if self.open is not None:
            opened, self.open = self.open, None
            block = opened.prefix + opened.arguments + self.buffer
            if opened.done and self._parses(block):  # an unterminated last block (EOS) counts
                self.buffer = ""
                done.append(self._close(opened))
            else:  # cut short or malformed: content, as the whole-answer parse has it
                self.buffer = block
        rest, self.buffer = self.buffer, ""
        if not self.in_calls:
            return rest, done
        parsed = parse_output(self.fmt, rest, self.names)
        for one in parsed.calls:
            self._whole(one)
        content = parsed.content
        if not parsed.calls and self.calls and content:
            content = "\n" + content
        return content, done + parsed.calls

    def _finish_streamed(self, opened: _OpenCall) -> tuple[str, list[ToolCall]]:
        """llama3_json / mistral: the whole-answer parse of everything from the first call on; its
        first call is the streamed one (same arguments text), the others go out whole."""
        self.open = None
        text, self.buffer = opened.prefix + opened.arguments + self.buffer, ""
        parsed = parse_output(self.fmt, text, self.names)
        if not parsed.calls:  # cut short or malformed: content (its head has gone out already)
            return parsed.content, []
        first, *rest = parsed.calls
        done = [ToolCall(first.name, first.arguments, opened.id), *rest]
        self.calls.append(done[0])
        for one in rest:
            self._whole(one)
        return parsed.content, done

    def _first_object_at(self) -> int | None:
        """llama3_json / mistral: where the first call object opens in the held text; None while
        that is not known yet or when the text does not open with an object (then ``stuck``)."""
        buf, fmt = self.buffer, self.fmt
        at = len(buf) - len(buf.lstrip())
        if isinstance(fmt, Llama3JsonFormat) and buf.startswith(fmt.tag, at):
            at += len(fmt.tag)
        elif isinstance(fmt, MistralFormat):
            at += len(fmt.start)  # the held text starts at [TOOL_CALLS]
            at += len(buf[at:]) - len(buf[at:].lstrip())
            if buf.startswith("[", at):
                at += 1
        at += len(buf[at:]) - len(buf[at:].lstrip())
        if at >= len(buf):
            return None
        if buf[at] != "{":
            self.stuck = True
            return None
        return at

    def _stream_first_call(self) -> None:
        """llama3_json / mistral: the first call's id and name as soon as its arguments open (name
        first), then its arguments as they come; the text after them waits for :meth:`finish`."""
        if self.open is None:
            if self.started or self.stuck:
                return
            at = self._first_object_at()
            if at is None:
                return
            head = _CALL_HEAD.match(self.buffer, at)
            if head is None:
                if self.buffer.count("{", at) >= 2:  # another layout: the calls go out whole
                    self.stuck = True
                return
            try:
                name = json.loads(head.group(1))
            except ValueError:
                self.stuck = True
                return
            self.open = _OpenCall(new_call_id(), name, self.started, self.buffer[: head.end()])
            self.started += 1
            self.deltas.append(CallDelta(self.open.index, "", self.open.id, name))
            self.buffer = self.buffer[head.end() :]
        if not self.open.done:
            self._stream_arguments(self.open)

    def _stream_arguments(self, call: _OpenCall) -> None:
        """The held text that belongs to ``call``'s arguments object goes out as one delta."""
        n = call.scan(self.buffer)
        piece, self.buffer = self.buffer[:n], self.buffer[n:]
        if piece:
            call.arguments += piece
            self.deltas.append(CallDelta(call.index, piece))

    def _whole(self, call: ToolCall) -> None:
        """A call complete before any of it streamed: head, then all its arguments."""
        self.calls.append(call)
        index, self.started = self.started, self.started + 1
        self.deltas.append(CallDelta(index, "", call.id, call.name))
        self.deltas.append(CallDelta(index, call.arguments))

    def _parses(self, block: str) -> bool:
        try:
            return len(self.fmt.parse(block.strip()).calls) == 1
        except Malformed:
            return False

    def _close(self, call: _OpenCall) -> ToolCall:
        done = ToolCall(call.name, call.arguments, call.id)
        self.calls.append(done)
        return done

    def _content(self) -> str:
        fmt = self.fmt
        if isinstance(fmt, Llama3JsonFormat):
            if self.seen_text:
                out, self.buffer = self.buffer, ""
                return out
            stripped = self.buffer.lstrip()
            if not stripped:
                return ""
            if stripped.startswith(("{", fmt.tag)) or fmt.tag.startswith(stripped):
                if stripped.startswith(("{", fmt.tag)):
                    self.in_calls = True
                return ""
            self.seen_text = True
            out, self.buffer = self.buffer, ""
            return out
        if isinstance(fmt, HermesFormat) and self.names and not self.seen_text:
            stripped = self.buffer.lstrip()
            if not stripped or "```".startswith(stripped):
                return ""
            if stripped.startswith(("{", "```")):
                self.in_calls = self.bare = True
                return ""
            self.seen_text = True
        at = self.buffer.find(fmt.start)
        if at >= 0:
            out = self.buffer[:at]
            self.buffer = self.buffer[at:]
            self.in_calls = True
            return out.rstrip() if isinstance(fmt, HermesFormat) else out
        hold = _partial_suffix(self.buffer, fmt.start)
        out = self.buffer[: len(self.buffer) - hold]
        self.buffer = self.buffer[len(out) :]
        return out

    def _hermes_blocks(self) -> list[ToolCall]:
        fmt = self.fmt
        assert isinstance(fmt, HermesFormat)
        done: list[ToolCall] = []
        while True:
            call = self.open
            if call is not None and not call.done:
                self._stream_arguments(call)
                if not call.done:
                    return done
            if call is not None:  # the arguments closed: wait for the block's end
                end = self.buffer.find(fmt.end)
                if end < 0:
                    return done
                block = call.prefix + call.arguments + self.buffer[: end + len(fmt.end)]
                self.open = None
                if not self._parses(block):  # held for finish(), which makes it content
                    self.buffer = call.prefix + call.arguments + self.buffer
                    self.stuck = True
                    return done
                self.buffer = self.buffer[end + len(fmt.end) :].lstrip()
                done.append(self._close(call))
                continue
            if self.stuck:
                return done
            if self.buffer.startswith(fmt.start):
                head = _CALL_HEAD.match(self.buffer, len(fmt.start))
                if head is not None:
                    try:
                        name = json.loads(head.group(1))
                    except ValueError:
                        name = ""
                    if name:
                        prefix = self.buffer[: head.end()]
                        self.open = _OpenCall(new_call_id(), name, self.started, prefix)
                        self.started += 1
                        self.deltas.append(CallDelta(self.open.index, "", self.open.id, name))
                        self.buffer = self.buffer[head.end() :]
                        continue
            end = self.buffer.find(fmt.end)
            if end < 0:
                return done
            block = self.buffer[: end + len(fmt.end)]
            try:
                parsed = fmt.parse(block.strip())
            except Malformed:
                return done  # left for finish(), which returns it as content
            self.buffer = self.buffer[end + len(fmt.end) :].lstrip()
            for one in parsed.calls:
                self._whole(one)
            done += parsed.calls


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


# Bounded JSON whitespace for llguidance: at most one space where JSON allows whitespace (both
# '{"a": 1}' and '{"a":1}' fit, no newlines or runs), so a greedy model cannot pad an object with
# spaces until max_tokens. (``whitespace_flexible: false`` alone would fix the separators to ","
# and ":", which models trained on json.dumps output do not write.)
COMPACT = {"whitespace_flexible": True, "whitespace_pattern": "[ ]?"}
_DEFS_PREFIX = "qd_fn"


def compact(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with llguidance's compact-whitespace option at its root."""
    opts = dict(schema.get("x-guidance") or {})
    opts.update(COMPACT)
    return {**schema, "x-guidance": opts}


def has_ref(obj: Any) -> bool:
    if isinstance(obj, dict):
        return isinstance(obj.get("$ref"), str) or any(has_ref(v) for v in obj.values())
    if isinstance(obj, list):
        return any(has_ref(v) for v in obj)
    return False


def _rebase(obj: Any, base: str) -> Any:
    """A copy of ``obj`` whose root-relative ``$ref``s (``#``, ``#/$defs/X``, ``#/definitions/X``,
    any pointer) point into ``#/$defs/<base>`` instead of the root."""
    if isinstance(obj, dict):
        out = {k: _rebase(v, base) for k, v in obj.items()}
        ref = obj.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            out["$ref"] = f"#/$defs/{base}{ref[1:]}"
        return out
    if isinstance(obj, list):
        return [_rebase(v, base) for v in obj]
    return obj


def hoist(schemas: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Schemas to embed inside a larger one (each function's parameters under
    ``properties.arguments``, an ``anyOf`` across functions): a schema with ``$ref``s moves whole
    into the root's ``$defs`` (as ``qd_fn<i>``, its own ``$defs``/``definitions`` inside it) with
    its refs rebased, and is replaced by a ``$ref`` to it. Recursion stays recursion through
    ``$ref``. Returns the schemas to embed and the ``$defs`` for the root."""
    out: list[dict[str, Any]] = []
    defs: dict[str, Any] = {}
    for i, schema in enumerate(schemas):
        if not has_ref(schema):
            out.append(schema)
            continue
        key = f"{_DEFS_PREFIX}{i}"
        defs[key] = _rebase(schema, key)
        out.append({"$ref": f"#/$defs/{key}"})
    return out, defs


def calls_schema(fmt: ToolFormat, functions: Sequence[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The JSON schema of one call object to any of ``functions``, with each function's
    ``$defs`` hoisted to the root and compact whitespace."""
    params, defs = hoist([schema for _, schema in functions])
    schemas = [fmt.call_schema(name, p) for (name, _), p in zip(functions, params, strict=True)]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    if defs:
        schema = {**schema, "$defs": defs}
    return compact(schema)


def forced_grammar(
    fmt: ToolFormat,
    functions: Sequence[tuple[str, dict[str, Any]]],
    parallel: bool,
    free_text: bool,
    lit: MarkerWriter = quoted,
    answer: dict[str, Any] | None = None,
) -> str:
    """The Lark grammar of an answer made of calls to ``functions`` ((name, parameters schema)).

    ``free_text``: the answer may also be plain text (``tool_choice: "auto"`` with strict
    functions): then either text that never opens a call, or (hermes, mistral) such text then
    the calls. Where the marker is a special token, text cannot contain it anyway.
    ``answer``: with ``free_text``, the answer that is not calls must be JSON for this schema
    (``response_format``) instead of free text: then the answer is the calls or that JSON.
    """
    schema = json.dumps(calls_schema(fmt, functions))
    rules = fmt.call_grammar(schema, parallel, lit)
    if not free_text:
        return f"%llguidance {{}}\nstart: calls\n{rules}"
    if answer is not None:
        return (
            f"%llguidance {{}}\nstart: calls | answer\n"
            f"answer: %json {json.dumps(compact(answer))}\n{rules}"
        )
    if isinstance(fmt, Llama3JsonFormat):  # text that does not open with a brace, or calls
        return "%llguidance {}\nstart: calls | TEXT\nTEXT: /[^{\\s](.|\\n)*/\n" + rules
    if lit(fmt.start) != quoted(fmt.start):  # a special token: no text can contain it
        return f"%llguidance {{}}\nstart: TEXT | TEXT? calls\nTEXT: /(.|\\n)+/\n{rules}"
    # A text marker: one lexeme runs from the answer's start to the marker's first occurrence
    # (two lexemes, text then marker, would be ambiguous to a longest-match lexer).
    marker = re.escape(fmt.start).replace("/", "\\/")
    return (
        "%llguidance {}\n"
        "start: TEXT | OPEN after_open\n"
        f"TEXT: /(.|\\n)+/ & ~/(.|\\n)*{marker}(.|\\n)*/\n"
        f"NOMARK: /(.|\\n)*/ & ~/(.|\\n)*{marker}(.|\\n)*/\n"
        f"OPEN: NOMARK {quoted(fmt.start)}\n"
        f"{rules}"
    )
