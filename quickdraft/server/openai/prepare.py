"""A chat or text completion request turned into what the engine runs: prompt ids, sampling
parameters, the constraint on the output (JSON schema, forced tool calls) and how to read tool
calls out of it. Every dialect ends here: the others are translated into a chat request first."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from quickdraft.constraints import Constraint
from quickdraft.errors import QuickdraftError
from quickdraft.sampling import SamplingParams
from quickdraft.server.errors import ApiError
from quickdraft.server.grammar import ANY_JSON_OBJECT
from quickdraft.server.model_server import ModelServer
from quickdraft.server.openai import protocol as p
from quickdraft.server.tools import ToolFormat, forced_grammar, template_renders_tools


@dataclass(frozen=True)
class Prepared:
    """One choice of a request, ready to queue."""

    prompt_ids: list[int]
    params: SamplingParams
    constraint: Constraint | None
    tools: ToolFormat | None = None  # parse the output for calls in this format
    tool_names: frozenset[str] = frozenset()  # the request's functions
    provenance: bool = False  # each streamed chunk says which of its tokens were accepted drafts



R = TypeVar("R", p.ChatCompletionRequest, p.CompletionRequest)


def prepare_choices(server: ModelServer, req: R, prepare: Callable[[ModelServer, R], Prepared]) -> list[Prepared]:
    """The request prepared once per choice (n): each has its own constraint state; sampled
    choice i draws with seed + i (a given seed still means one answer per choice), greedy ones
    are the same answer n times."""
    first = prepare(server, req)
    out = [first]
    for i in range(1, req.n or 1):
        nth = prepare(server, req) if first.constraint is not None else first
        if nth.params.seed is not None:
            nth = dataclasses.replace(nth, params=dataclasses.replace(nth.params, seed=nth.params.seed + i))
        out.append(nth)
    return out


def render_chat(server: ModelServer, req: p.ChatCompletionRequest) -> tuple[list[int], ToolFormat | None]:
    """The request checked and its prompt rendered by the chat template: (prompt ids, the format
    to parse tool calls in, None when no tools are offered)."""
    req.check_supported()
    req.check_tools()
    messages = [msg.to_template() for msg in req.messages]
    use_tools = bool(req.tools) and req.tool_choice != "none"
    fmt = _tool_format(server) if use_tools else None
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []] if use_tools else None
    try:
        ids = server.llm.tokenizer.encode_chat(messages, add_generation_prompt=True, tools=tools)
    except QuickdraftError as exc:
        raise ApiError(400, str(exc), param="messages") from None
    return ids, fmt


def prepare_chat(server: ModelServer, req: p.ChatCompletionRequest) -> Prepared:
    ids, fmt = render_chat(server, req)
    max_tokens = _max_tokens(server, len(ids), req.requested_max_tokens(), "messages")
    params = req.sampling_params(max_tokens, req.engine_logprobs(), _vocab(server))
    constraint = _tool_constraint(server, req, fmt) if fmt is not None else None
    names = frozenset(t.function.name for t in req.tools or []) if fmt is not None else frozenset()
    return Prepared(ids, params, constraint or _constraint(server, req), fmt, names, req.provenance())


def _vocab(server: ModelServer) -> int:
    return int(server.llm.target.config.vocab_size)


def _tool_format(server: ModelServer) -> ToolFormat:
    template = server.llm.tokenizer.chat_template
    if server.tool_parser == "none":
        raise ApiError(
            400, "tool calling is turned off on this server (--tool-call-parser none)",
            param="tools",
        )
    if not template_renders_tools(template):
        raise ApiError(
            400,
            f"the chat template of `{server.name}` has no place for tools, so the model never "
            "learned to call them; use a model whose template renders tools",
            param="tools",
        )
    if server.tool_format is None:
        raise ApiError(
            400,
            "this model's chat template writes tool calls in a format quickdraft does not "
            "recognise; start the server with --tool-call-parser hermes, llama3_json or mistral",
            param="tools",
        )
    return server.tool_format


def _tool_constraint(
    server: ModelServer, req: p.ChatCompletionRequest, fmt: ToolFormat
) -> Constraint | None:
    """The grammar of a forced call (tool_choice required or named), or of an answer whose
    calls to strict functions must match their schemas; None when nothing is forced.

    With ``response_format`` (json_schema or json_object): a forced call ignores it (the answer
    is calls only; response_format is for text answers, as OpenAI does); under ``auto`` the
    answer is calls (strict ones per their schemas) or the JSON answer."""
    tools = req.tools or []
    choice = req.tool_choice
    named = choice.function.name if isinstance(choice, p.NamedToolChoice) else None
    forced = named is not None or choice == "required"
    structured, answer = req.json_schema()
    if not forced and not structured and not any(t.function.strict for t in tools):
        return None
    functions = []
    for t in tools:
        if named is not None and t.function.name != named:
            continue
        schema = t.function.parameters or {"type": "object", "properties": {}}
        if not forced and not t.function.strict:
            schema = {"type": "object"}
        functions.append((t.function.name, schema))
    parallel = named is None and req.parallel_tool_calls is not False
    json_answer = (answer or ANY_JSON_OBJECT) if structured and not forced else None
    grammar = forced_grammar(
        fmt, functions, parallel, not forced, server.grammar.marker, answer=json_answer
    )
    try:
        return server.grammar.lark(grammar)
    except QuickdraftError as exc:
        error = exc
    # Name the function whose schema fails (each alone), else blame the response_format.
    for name, schema in functions:
        try:
            server.grammar.lark(forced_grammar(fmt, [(name, schema)], False, False, server.grammar.marker))
        except QuickdraftError as exc:
            raise ApiError(
                400, f"the parameters schema of tool `{name}` is not usable: {exc}", param="tools"
            ) from None
    param = "response_format" if json_answer is not None else "tools"
    raise ApiError(400, f"the tools' or response_format's schemas are not usable: {error}", param=param)


def prepare_completion(server: ModelServer, req: p.CompletionRequest) -> Prepared:
    req.check_supported()
    prompt = req.single_prompt()
    if isinstance(prompt, str):
        ids = server.llm.tokenizer.encode(prompt)
    else:
        vocab = server.llm.target.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise ApiError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        ids = prompt
    max_tokens = _max_tokens(
        server, len(ids), 16 if req.max_tokens is None else req.max_tokens, "prompt"
    )
    params = req.sampling_params(max_tokens, req.logprobs, _vocab(server))
    return Prepared(ids, params, _constraint(server, req))


def _max_tokens(server: ModelServer, n_prompt: int, asked: int | None, where: str) -> int:
    """``asked`` (None = all the context left), refused when the prompt and it do not fit."""
    ctx = server.context
    if n_prompt == 0:
        raise ApiError(400, "the prompt is empty; give at least one token of input", param=where)
    if n_prompt >= ctx or (asked is not None and n_prompt + asked > ctx):
        wanted = f", {asked} in the completion" if asked is not None else ""
        raise ApiError(
            400,
            f"This model's maximum context length is {ctx} tokens. However, you requested "
            f"{n_prompt + (asked or 0)} tokens ({n_prompt} in the {where}{wanted}). "
            f"Please reduce the length of the {where} or max_tokens.",
            param="max_tokens" if n_prompt < ctx else where,
            code="context_length_exceeded",
        )
    return ctx - n_prompt if asked is None else asked


def _constraint(
    server: ModelServer, req: p.ChatCompletionRequest | p.CompletionRequest
) -> Constraint | None:
    structured, schema = req.json_schema()
    if not structured:
        return None
    try:
        return server.grammar.json(schema)
    except QuickdraftError as exc:
        raise ApiError(400, str(exc), param="response_format") from None
