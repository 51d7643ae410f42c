"""The OpenAI-compatible HTTP API over one :class:`~quickdraft.api.LLM`: FastAPI routes, SSE, errors.

Routes: POST /v1/chat/completions (tool calling included, see :mod:`quickdraft.server.tools`),
/v1/responses (OpenAI's Responses API, translated to and from chat, see
:mod:`quickdraft.server.responses_api`; GET and DELETE /v1/responses/{id} and GET
/v1/responses/{id}/input_items for stored ones),
/v1/messages and /v1/messages/count_tokens (Anthropic's Messages API, translated to and from the
chat route by :mod:`quickdraft.server.messages_api`; its errors are in Anthropic's shape) and
/v1/completions (streamed as server-sent events,
``data: {...}\\n\\n`` chunks then ``data: [DONE]\\n\\n``, or whole), GET /v1/models, /health and
/metrics (Prometheus), and the chat page at / with its files under /webui/ (unless turned off).
Requests are checked here, before they queue (model name, fields, prompt
and max_tokens against the context, the JSON schema); every failure is an OpenAI error object with
a 4xx status, and the server keeps serving. Generation runs on the :class:`EngineWorker` thread;
a client that disconnects cancels its request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, fields
from importlib import resources
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Receive, Scope, Send

from quickdraft import __version__
from quickdraft.constraints import Constraint
from quickdraft.detokenizer import IncrementalDetokenizer
from quickdraft.engine import RequestStats, StepOutput
from quickdraft.engine import TokenLogprob as EngineLogprob
from quickdraft.errors import QuickdraftError
from quickdraft.sampling import SamplingParams
from quickdraft.server import messages_api as m
from quickdraft.server import protocol as p
from quickdraft.server import responses_api as r
from quickdraft.server.grammar import ANY_JSON_OBJECT, GrammarCompiler
from quickdraft.server.metrics import ServerMetrics
from quickdraft.server.protocol import ApiError, error_body
from quickdraft.server.tools import (
    CallDelta,
    ToolFormat,
    ToolStream,
    forced_grammar,
    format_for_template,
    get_format,
    parse_output,
    template_renders_tools,
)
from quickdraft.server.worker import EngineWorker, Job

if TYPE_CHECKING:
    from quickdraft.api import LLM

log = logging.getLogger("quickdraft.server")

MAX_BODY_BYTES = 1 << 20  # 1 MiB: far more than any prompt the context can hold
MAX_JSON_DEPTH = 64  # nesting of arrays and objects in a body (a tool schema needs a few)
FINGERPRINT = f"quickdraft-{__version__}"
RETRY_AFTER_S = 1  # what a 429 for a full queue tells the client to wait
_LOGPROB_FLOOR = -9999.0  # JSON has no -inf


@dataclass
class _Server:
    """What the routes share: the model, its queue, metrics and grammar compiler."""

    llm: LLM
    names: tuple[str, ...]  # the served names (aliases); the first is reported in responses
    worker: EngineWorker
    metrics: ServerMetrics
    grammar: GrammarCompiler
    tool_format: ToolFormat | None = None  # how this model writes tool calls; None = it cannot
    tool_parser: str = "auto"
    created: int = field(default_factory=lambda: int(time.time()))
    responses: r.ResponseStore = field(default_factory=r.ResponseStore)  # for /v1/responses

    @property
    def context(self) -> int:
        return self.llm.engine.cache.max_len

    @property
    def name(self) -> str:
        return self.names[0]

    def check_model(self, model: str) -> None:
        if model not in self.names:
            served = ", ".join(f"`{n}`" for n in self.names)
            raise ApiError(
                404,
                f"The model `{model}` does not exist; this server serves {served}.",
                param="model",
                code="model_not_found",
            )


@dataclass(frozen=True)
class _Prepared:
    prompt_ids: list[int]
    params: SamplingParams
    constraint: Constraint | None
    tools: ToolFormat | None = None  # parse the output for calls in this format
    tool_names: frozenset[str] = frozenset()  # the request's functions
    provenance: bool = False  # each streamed chunk says which of its tokens were accepted drafts


def create_app(
    llm: LLM,
    served_name: str | Sequence[str],
    api_key: str | None = None,
    tool_call_parser: str = "auto",
    webui: bool = True,
) -> FastAPI:
    """The app serving ``llm`` as model ``served_name`` (or several aliases, the first being
    the name responses report); with ``api_key``, every route but /health and the chat page's
    files needs ``Authorization: Bearer <api_key>``. ``tool_call_parser``: the tool-call format
    (``auto`` = from the chat template, ``none`` = refuse tools). ``webui``: serve the chat page
    at / (:data:`WEBUI_FILES`)."""
    names = (served_name,) if isinstance(served_name, str) else tuple(dict.fromkeys(served_name))
    if not names:
        raise ValueError("create_app needs at least one served model name")
    metrics = ServerMetrics(llm.prefix_cache)
    worker = EngineWorker(llm.engine, llm.drafter, llm.num_draft, metrics)
    if tool_call_parser == "auto":
        tool_format = format_for_template(llm.tokenizer.chat_template)
    elif tool_call_parser == "none":
        tool_format = None
    else:
        tool_format = get_format(tool_call_parser)
    server = _Server(
        llm, names, worker, metrics, GrammarCompiler(llm.tokenizer), tool_format,
        tool_call_parser,
    )

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        worker.start()
        await asyncio.to_thread(lambda: server.grammar.ll_tokenizer)  # ~0.2 s, off the loop
        yield
        worker.stop()

    app = FastAPI(
        title="quickdraft", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None
    )
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    public = {"/health"}
    if webui:
        public |= set(_add_webui(app))
    if api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=api_key, public=frozenset(public))
    _add_error_handlers(app)
    _add_routes(app, server)
    app.state.worker = worker  # for the CLI: end streams at once when asked to shut down
    return app


# ----------------------------------------------------------------------------- errors and auth


def _error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _anthropic_error(path: str, status: int, message: str, headers: Any = None) -> Response | None:
    """The error in Anthropic's shape on the Messages API's routes; None elsewhere."""
    if not m.is_messages_path(path):
        return None
    return JSONResponse(m.error_body(status, message), status_code=status, headers=headers)


def _add_error_handlers(app: FastAPI) -> None:
    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return _anthropic_error(request.url.path, exc.status, exc.message, exc.headers) or _error_response(exc)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        code = "not_found" if exc.status_code == 404 else None
        message = str(exc.detail)
        headers = getattr(exc, "headers", None)  # 405: Allow
        if exc.status_code == 404 and not _matches_a_route(request):
            message = f"no route {request.method} {request.url.path}; this server serves: " + (
                ", ".join(_route_list(request.app))
            )
        elif exc.status_code == 405:
            code = "method_not_allowed"
            allowed = (headers or {}).get("Allow", "")
            message = f"method {request.method} is not allowed on {request.url.path}; allowed: {allowed}"
        return _anthropic_error(request.url.path, exc.status_code, message, headers) or JSONResponse(
            error_body(message, code=code), status_code=exc.status_code, headers=headers
        )

    async def validation_error(request: Request, exc: Exception) -> Response:
        return _anthropic_error(request.url.path, 400, str(exc)) or JSONResponse(
            error_body(str(exc)), status_code=400
        )

    async def internal_error(request: Request, exc: Exception) -> Response:
        log.error("internal error", exc_info=exc)
        message = f"internal server error ({type(exc).__name__})"
        return _anthropic_error(request.url.path, 500, message) or JSONResponse(
            error_body(message, "server_error"), status_code=500
        )

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, internal_error)


def _route_list(app: Any) -> list[str]:
    """Every HTTP route the app serves as "METHOD /path", in the order they were added."""
    listed = []
    for route in app.routes:
        methods = getattr(route, "methods", None)
        path = getattr(route, "path", None)
        if methods and path:
            listed += [f"{m} {path}" for m in sorted(methods) if m != "HEAD"]
    return listed


def _matches_a_route(request: Request) -> bool:
    """Whether some route's path matches the request (then a 404 came from the route itself)."""
    return any(
        route.matches(request.scope)[0] != Match.NONE for route in request.app.router.routes
    )


class _ApiKeyMiddleware:
    """Every HTTP route but the ``public`` paths (/health, the chat page's files) needs
    ``Authorization: Bearer <key>`` or (Anthropic's clients) ``x-api-key: <key>``."""

    def __init__(self, app: ASGIApp, api_key: str, public: frozenset[str]) -> None:
        self.app = app
        self.key = api_key.encode()
        self.expected = b"Bearer " + self.key
        self.public = public

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.public:
            headers = dict(scope["headers"])
            bearer = secrets.compare_digest(headers.get(b"authorization", b""), self.expected)
            x_api_key = secrets.compare_digest(headers.get(b"x-api-key", b""), self.key)
            if not (bearer or x_api_key):
                message = (
                    "Incorrect or missing API key: send 'Authorization: Bearer <key>' "
                    "or 'x-api-key: <key>'."
                )
                err = ApiError(401, message, code="invalid_api_key")
                response = _anthropic_error(scope["path"], 401, message) or _error_response(err)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _read_json(request: Request) -> Any:
    """The body as JSON, refusing more than MAX_BODY_BYTES (413) and malformed JSON (400)."""
    declared = request.headers.get("content-length", "")
    too_big = ApiError(
        413, f"the request body is larger than {MAX_BODY_BYTES} bytes", code="request_too_large"
    )
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_big
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > MAX_BODY_BYTES:
            raise too_big
        parts.append(part)
    try:
        data = json.loads(b"".join(parts))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise _too_deep() from None
    _check_json(data)
    return data


def _too_deep() -> ApiError:
    return ApiError(400, f"the request body nests arrays and objects deeper than {MAX_JSON_DEPTH}")


def _check_json(data: Any) -> None:
    """Refuse bodies nested deeper than MAX_JSON_DEPTH and strings that are not Unicode text (a
    lone surrogate such as "\\udcff" is valid JSON but no tokenizer can encode it)."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ApiError(
                    400,
                    f"the request body holds a string that is not valid Unicode text "
                    f"({exc.reason} at {exc.start}); send UTF-8 text",
                ) from None
        elif isinstance(value, (list, dict)):
            if depth > MAX_JSON_DEPTH:
                raise _too_deep()
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str):
                    stack.append((key, depth))
                stack.append((item, depth + 1))


# ------------------------------------------------------------------------------------- chat page

# The chat page's files (quickdraft/server/webui, shipped in the package) by URL path, with their
# media types. The page itself is public under --api-key (it holds no secret; it asks for the key
# and sends it with its API calls).
WEBUI_FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/webui/style.css": ("style.css", "text/css; charset=utf-8"),
    "/webui/markdown.js": ("markdown.js", "text/javascript; charset=utf-8"),
    "/webui/app.js": ("app.js", "text/javascript; charset=utf-8"),
}


def _add_webui(app: FastAPI) -> list[str]:
    """GET routes for the chat page's files, read once now; returns their paths."""
    folder = resources.files("quickdraft.server").joinpath("webui")
    for path, (name, media_type) in WEBUI_FILES.items():
        try:
            body = folder.joinpath(name).read_bytes()
        except OSError as exc:
            raise QuickdraftError(
                f"the chat page's file {name} is missing from the installed package ({exc}); "
                "reinstall quickdraft or start the server with --no-webui"
            ) from None
        app.add_api_route(path, _static(body, media_type), methods=["GET"], include_in_schema=False)
    return list(WEBUI_FILES)


def _static(body: bytes, media_type: str) -> Callable[[], Any]:
    headers = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}

    async def serve() -> Response:
        return Response(body, media_type=media_type, headers=headers)

    return serve


# ---------------------------------------------------------------------------------------- routes


def _add_routes(app: FastAPI, server: _Server) -> None:
    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return p.ModelList(data=[_card(server, name) for name in server.names]).model_dump()

    @app.get("/v1/models/{model}")
    async def model(model: str) -> dict[str, Any]:
        server.check_model(model)
        return _card(server, model).model_dump()

    @app.post("/v1/chat/completions", openapi_extra=_body_doc(p.ChatCompletionRequest))
    async def chat(request: Request) -> Response:
        req = p.parse_request(p.ChatCompletionRequest, await _read_json(request))
        server.check_model(req.model)
        choices = await asyncio.to_thread(_choices, server, req, _prepare_chat)
        jobs = _submit_all(server, choices)
        if req.stream:
            return _sse(_chat_events(server, jobs, req.include_usage(), choices))
        outputs = await _collect(request, jobs)
        return JSONResponse(_chat_response(server, outputs, choices).model_dump())

    @app.post("/v1/completions", openapi_extra=_body_doc(p.CompletionRequest))
    async def completions(request: Request) -> Response:
        req = p.parse_request(p.CompletionRequest, await _read_json(request))
        server.check_model(req.model)
        choices = await asyncio.to_thread(_choices, server, req, _prepare_completion)
        echo = server.llm.tokenizer.decode(choices[0].prompt_ids) if req.echo else ""
        jobs = _submit_all(server, choices)
        if req.stream:
            return _sse(_completion_events(server, jobs, echo, req.include_usage()))
        outputs = await _collect(request, jobs)
        return JSONResponse(_completion_response(server, outputs, echo).model_dump())

    @app.post("/v1/messages", openapi_extra=_body_doc(m.MessagesRequest, anthropic=True))
    async def messages(request: Request) -> Response:
        body = m.parse_body(m.MessagesRequest, await _read_json(request))
        req = m.to_chat_request(body)
        server.check_model(req.model)
        prepared = await asyncio.to_thread(_prepare_chat, server, req)
        stops = tuple(body.stop_sequences or ())
        if body.stream:
            job = _TappedJob.of(_submit(server, prepared))
            events = m.to_events(
                _chat_chunks(server, job, prepared),
                len(prepared.prompt_ids),
                lambda: _matched_stop(server, job.ids, stops),
            )
            return _sse(_messages_guarded(job, events))
        outputs = await _collect(request, [_submit(server, prepared)])
        chat = _chat_response(server, outputs, [prepared])
        matched = _matched_stop(server, [t for s in outputs[0] for t in s.token_ids], stops)
        return JSONResponse(m.to_message(chat, matched))

    @app.post(
        "/v1/messages/count_tokens",
        openapi_extra=_body_doc(m.CountTokensRequest, anthropic=True, answer="{input_tokens: N}"),
    )
    async def count_tokens(request: Request) -> Response:
        body = m.parse_body(m.CountTokensRequest, await _read_json(request))
        req = m.to_chat_request(body)
        server.check_model(req.model)
        ids, _fmt = await asyncio.to_thread(_render_chat, server, req)
        return JSONResponse({"input_tokens": len(ids)})

    @app.post("/v1/responses", openapi_extra=_body_doc(r.ResponsesRequest))
    async def responses(request: Request) -> Response:
        req = r.parse_request(await _read_json(request))
        server.check_model(req.model)
        history = server.responses.history(req)
        chat_req = r.to_chat_request(req, history)
        prepared = await asyncio.to_thread(_prepare_chat, server, chat_req)
        job = _submit(server, prepared)

        def store(response: dict[str, Any]) -> None:
            if req.store is not False:
                server.responses.put(req, response, history)

        if req.stream:
            return _sse(_response_events(server, job, prepared, req, store))
        outputs = await _collect(request, [job])
        response = r.to_response(req, _chat_response(server, outputs, [prepared]))
        store(response)
        return JSONResponse(response)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict[str, Any]:
        return server.responses.get(response_id)[0]

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(
        response_id: str, order: str = "desc", limit: int = 20, after: str | None = None
    ) -> dict[str, Any]:
        return server.responses.input_items(response_id, order, limit, after)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        server.responses.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}


def _card(server: _Server, name: str) -> p.ModelCard:
    return p.ModelCard(id=name, created=server.created, max_model_len=server.context)


def _submit(server: _Server, prepared: _Prepared) -> Job:
    return _submit_all(server, [prepared])[0]


def _submit_all(server: _Server, choices: list[_Prepared]) -> list[Job]:
    """Queue one job per choice (all or none: a full queue is a 429 with Retry-After)."""
    if server.worker.waiting_room() < len(choices):
        raise ApiError(
            429, "the server is busy: too many requests are waiting; retry shortly", kind="rate_limit_error",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    return [server.worker.submit(c.prompt_ids, c.params, c.constraint) for c in choices]


R = TypeVar("R", p.ChatCompletionRequest, p.CompletionRequest)


def _choices(server: _Server, req: R, prepare: Callable[[_Server, R], _Prepared]) -> list[_Prepared]:
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


# ------------------------------------------------------------------------ request -> engine inputs


def _render_chat(server: _Server, req: p.ChatCompletionRequest) -> tuple[list[int], ToolFormat | None]:
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


def _prepare_chat(server: _Server, req: p.ChatCompletionRequest) -> _Prepared:
    ids, fmt = _render_chat(server, req)
    max_tokens = _max_tokens(server, len(ids), req.requested_max_tokens(), "messages")
    params = req.sampling_params(max_tokens, req.engine_logprobs(), _vocab(server))
    constraint = _tool_constraint(server, req, fmt) if fmt is not None else None
    names = frozenset(t.function.name for t in req.tools or []) if fmt is not None else frozenset()
    return _Prepared(ids, params, constraint or _constraint(server, req), fmt, names, req.provenance())


def _vocab(server: _Server) -> int:
    return int(server.llm.target.config.vocab_size)


def _tool_format(server: _Server) -> ToolFormat:
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
    server: _Server, req: p.ChatCompletionRequest, fmt: ToolFormat
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


def _prepare_completion(server: _Server, req: p.CompletionRequest) -> _Prepared:
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
    return _Prepared(ids, params, _constraint(server, req))


def _max_tokens(server: _Server, n_prompt: int, asked: int | None, where: str) -> int:
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
    server: _Server, req: p.ChatCompletionRequest | p.CompletionRequest
) -> Constraint | None:
    structured, schema = req.json_schema()
    if not structured:
        return None
    try:
        return server.grammar.json(schema)
    except QuickdraftError as exc:
        raise ApiError(400, str(exc), param="response_format") from None


# ------------------------------------------------------------------------------ engine -> clients


async def _collect(request: Request, jobs: list[Job]) -> list[list[StepOutput]]:
    """All steps of each job, cancelling them if the client disconnects first."""

    async def steps(job: Job) -> list[StepOutput]:
        return [step async for step in job.steps()]

    async def gather() -> list[list[StepOutput]]:
        return list(await asyncio.gather(*(steps(job) for job in jobs)))

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    result = asyncio.ensure_future(gather())
    gone = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not result.done():
            raise ApiError(499, "the client closed the request")  # nobody reads this
        outputs = _engine_result(result)
    finally:
        gone.cancel()
        result.cancel()
        for job in jobs:
            job.cancel()  # a no-op once finished
    return outputs


def _engine_result(task: asyncio.Future[list[list[StepOutput]]]) -> list[list[StepOutput]]:
    try:
        outputs = task.result()
    except QuickdraftError as exc:
        raise ApiError(400, str(exc)) from None
    if any(not steps or steps[-1].finish_reason is None for steps in outputs):
        raise ApiError(503, "the server is shutting down", kind="server_error")
    return outputs


def _sse(events: AsyncIterator[str]) -> StreamingResponse:
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(events, media_type="text/event-stream", headers=headers)


def _event(obj: BaseModel | dict[str, Any], usage_key: bool = True) -> str:
    """One SSE event. OpenAI's chunks carry a ``usage`` key only under include_usage (null
    until the last); ours also put usage on the chunk that finishes the choice."""
    if isinstance(obj, BaseModel):
        data = obj.model_dump_json(exclude=None if usage_key else {"usage"})
    else:
        data = json.dumps(obj)
    return f"data: {data}\n\n"


_DONE = "data: [DONE]\n\n"


async def _guarded(jobs: list[Job], events: Callable[[], AsyncIterator[str]]) -> AsyncIterator[str]:
    """Stream ``events``; an error mid-stream becomes an error event; leaving cancels the job.

    A client disconnect cancels this generator at its ``await`` (Starlette watches for
    ``http.disconnect``), so the ``finally`` stops the generation right away.
    """
    try:
        async for event in events():
            yield event
    except QuickdraftError as exc:
        yield _event(error_body(str(exc)))
        yield _DONE
    except Exception as exc:
        log.error("stream failed", exc_info=exc)
        yield _event(error_body(f"internal server error ({type(exc).__name__})", "server_error"))
        yield _DONE
    finally:
        for job in jobs:
            job.cancel()


async def _messages_guarded(job: Job, events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """The Messages API's events on the wire; an error mid-stream becomes Anthropic's error event
    (the status line is sent already); leaving cancels the job."""
    try:
        async for event in events:
            yield m.sse(event)
    except Exception as exc:
        if not isinstance(exc, QuickdraftError):
            log.error("stream failed", exc_info=exc)
        message = str(exc) if isinstance(exc, QuickdraftError) else f"internal server error ({type(exc).__name__})"
        yield m.sse(m.error_body(500, message))
    finally:
        job.cancel()


@dataclass
class _TappedJob(Job):
    """A job read through this view records its tokens (to tell which stop sequence ended it);
    it shares the job's queue and cancel flag."""

    ids: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, job: Job) -> _TappedJob:
        return cls(**{f.name: getattr(job, f.name) for f in fields(job)})

    async def steps(self) -> AsyncIterator[StepOutput]:
        async for step in super().steps():
            self.ids.extend(step.token_ids)
            yield step


def _matched_stop(server: _Server, ids: list[int], stops: tuple[str, ...]) -> str | None:
    """The stop sequence that ended an output of ``ids``, None when none did. A stop sequence
    ends the output on the token completing it (an end-of-sequence or stop token ends it
    otherwise); the earliest in the text is the one that matched."""
    if not stops or not ids or ids[-1] in server.llm.tokenizer.eos_ids:
        return None
    text = server.llm.tokenizer.decode(ids)
    hits = [(text.find(s), i) for i, s in enumerate(stops) if s in text]
    return stops[min(hits)[1]] if hits else None


def _ids() -> tuple[str, int]:
    return uuid.uuid4().hex, int(time.time())


def _chat_chunks(
    server: _Server, job: Job, prepared: _Prepared, index: int = 0, stamp: tuple[str, int] | None = None
) -> AsyncIterator[p.ChatCompletionChunk]:
    """The streamed chat completion as chunk objects: the role first, then content (and logprobs)
    as generated, each tool call's id and name then its arguments, and a last chunk with the
    finish reason and usage. The Responses and Messages APIs translate these into their events.
    ``index``: the choice these chunks are of; ``stamp``: the response's (id, created). With
    ``prepared.provenance`` every chunk says which of the tokens it brings were accepted drafts."""
    rid, created = stamp or _ids()
    provenance = _Provenance() if prepared.provenance else None

    def chunk(
        delta: p.Delta, logprobs: p.ChatLogprobs | None = None, finish: str | None = None, usage: p.Usage | None = None
    ) -> p.ChatCompletionChunk:
        return p.ChatCompletionChunk(
            id=f"chatcmpl-{rid}",
            created=created,
            model=server.name,
            system_fingerprint=FINGERPRINT,
            choices=[p.ChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish)],
            usage=usage,
            quickdraft=None if provenance is None else provenance.take(),
        )

    async def chunks() -> AsyncIterator[p.ChatCompletionChunk]:
        yield chunk(p.Delta(role="assistant", content=""))
        last = None
        calls = _CallText(server, prepared) if prepared.tools is not None else None
        n_calls = 0
        async for step in job.steps():
            last = step
            if provenance is not None:
                provenance.add(step)
            logprobs = _chat_logprobs(server, step.logprobs)
            if calls is None:
                if step.text or step.logprobs:
                    yield chunk(p.Delta(content=step.text), logprobs=logprobs)
                continue
            content, deltas = calls.push(step.token_ids, final=step.finish_reason is not None)
            if content or logprobs:
                yield chunk(p.Delta(content=content or None), logprobs=logprobs)
            for delta in deltas:
                yield chunk(_call_delta(delta))
                n_calls = max(n_calls, delta.index + 1)
        if last is None or last.finish_reason is None:
            raise QuickdraftError("the generation was cut short (the server is shutting down)")
        yield chunk(p.Delta(), finish=_finish_reason(last.finish_reason, n_calls), usage=_usage(last.stats))

    return chunks()


class _Provenance:
    """The provenance of the steps a choice's next chunk brings: a step whose text is held back
    (part of a character, a possible stop string) goes with the next chunk sent."""

    def __init__(self) -> None:
        self.tokens = 0
        self.accepted = 0
        self.spans: list[tuple[int, int]] = []

    def add(self, step: StepOutput) -> None:
        self.tokens += len(step.token_ids)
        self.accepted += step.accepted
        start, end = step.accepted_text
        if end > start:
            self.spans.append((start, end))

    def take(self) -> p.ChunkProvenance:
        out = p.ChunkProvenance(tokens=self.tokens, accepted=self.accepted, accepted_text=self.spans)
        self.tokens, self.accepted, self.spans = 0, 0, []
        return out


def _chat_events(
    server: _Server, jobs: list[Job], include_usage: bool, choices: list[_Prepared]
) -> AsyncIterator[str]:
    """The chat chunks of every choice as OpenAI's server-sent events, in the order they are
    generated; usage on each choice's last one (and, under stream_options.include_usage, one
    usage-only chunk for all choices after them), then [DONE]."""
    stamp = _ids()
    streams = [_chat_chunks(server, job, prep, i, stamp) for i, (job, prep) in enumerate(zip(jobs, choices, strict=True))]

    async def events() -> AsyncIterator[str]:
        usages = []
        last = None
        async for chunk in _merged(streams):
            yield _event(chunk, usage_key=include_usage or chunk.usage is not None)
            if chunk.usage is not None:
                usages.append(chunk.usage)
                last = chunk
        if include_usage and last is not None:  # OpenAI's include_usage chunk
            totals = {"choices": [], "usage": _total_usage(usages), "quickdraft": None}
            yield _event(last.model_copy(update=totals))
        yield _DONE

    return _guarded(jobs, events)


T = TypeVar("T")


async def _merged(streams: list[AsyncIterator[T]]) -> AsyncIterator[T]:
    """The items of several streams as they come (one stream: itself); an error in any ends all."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield item
        return
    queue: asyncio.Queue[tuple[int, T | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
        except BaseException as exc:
            await queue.put((i, exc))
            return
        await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            _, got = await queue.get()
            if got is None:
                running -= 1
            elif isinstance(got, BaseException):
                raise got
            else:
                yield got
    finally:
        for task in tasks:
            task.cancel()


def _total_usage(usages: list[p.Usage]) -> p.Usage:
    """The usage of n choices of one prompt: the prompt counted once, every choice's tokens."""
    first = usages[0]
    completion = sum(u.completion_tokens for u in usages)
    return first.model_copy(update={"completion_tokens": completion,
                                    "total_tokens": first.prompt_tokens + completion})


def _response_events(
    server: _Server,
    job: Job,
    prepared: _Prepared,
    req: r.ResponsesRequest,
    on_done: Callable[[dict[str, Any]], None],
) -> AsyncIterator[str]:
    """The chat chunks as the Responses API's typed events; an error mid-stream becomes an
    ``error`` event; leaving cancels the job."""
    stream = r.ResponseStream(req, server.name)

    async def events() -> AsyncIterator[str]:
        try:
            async for event in stream.events(_chat_chunks(server, job, prepared), on_done):
                yield r.sse(event)
        except QuickdraftError as exc:
            yield r.sse(stream.error(str(exc)))
        except Exception as exc:
            log.error("stream failed", exc_info=exc)
            yield r.sse(stream.error(f"internal server error ({type(exc).__name__})", "server_error"))
        finally:
            job.cancel()

    return events()


def _completion_events(
    server: _Server, jobs: list[Job], echo: str, include_usage: bool
) -> AsyncIterator[str]:
    rid, created = _ids()

    def chunk(
        text: str,
        index: int = 0,
        logprobs: p.CompletionLogprobs | None = None,
        finish: str | None = None,
        usage: p.Usage | None = None,
        choices: bool = True,
    ) -> p.Completion:
        choice = p.CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish)
        return p.Completion(
            id=f"cmpl-{rid}",
            created=created,
            model=server.name,
            system_fingerprint=FINGERPRINT,
            choices=[choice] if choices else [],
            usage=usage,
        )

    async def one(index: int, job: Job) -> AsyncIterator[p.Completion]:
        offset = len(echo)
        if echo:
            yield chunk(echo, index)
        last = None
        async for step in job.steps():
            last = step
            if step.text or step.logprobs:
                yield chunk(step.text, index, _completion_logprobs(server, step.logprobs, offset))
            offset += len(step.text)
        if last is None or last.finish_reason is None:
            raise QuickdraftError("the generation was cut short (the server is shutting down)")
        yield chunk("", index, finish=last.finish_reason, usage=_usage(last.stats))

    async def events() -> AsyncIterator[str]:
        usages = []
        async for c in _merged([one(i, job) for i, job in enumerate(jobs)]):
            if c.usage is not None:
                usages.append(c.usage)
            yield _event(c, usage_key=include_usage or c.usage is not None)
        if include_usage and usages:
            yield _event(chunk("", usage=_total_usage(usages), choices=False))
        yield _DONE

    return _guarded(jobs, events)


def _chat_response(server: _Server, outputs: list[list[StepOutput]], choices: list[_Prepared]) -> p.ChatCompletion:
    """The whole answer: one choice per (steps, prepared) pair, usage over all of them."""
    rid, created = _ids()
    out = []
    for index, (steps, prepared) in enumerate(zip(outputs, choices, strict=True)):
        logprobs = _chat_logprobs(server, _all_logprobs(steps))
        finish = steps[-1].finish_reason
        if prepared.tools is None:
            message = p.ChatMessageOut(content="".join(s.text for s in steps))
        else:
            text = _CallText(server, prepared).text([t for s in steps for t in s.token_ids])
            parsed = parse_output(prepared.tools, text, prepared.tool_names)
            message = p.ChatMessageOut(
                content=parsed.content or (None if parsed.calls else ""),
                tool_calls=[p.ToolCallOut.model_validate(c.to_openai()) for c in parsed.calls]
                or None,
            )
            finish = _finish_reason(finish, len(parsed.calls))
        out.append(p.ChatChoice(index=index, message=message, logprobs=logprobs, finish_reason=finish))
    return p.ChatCompletion(
        id=f"chatcmpl-{rid}",
        created=created,
        model=server.name,
        system_fingerprint=FINGERPRINT,
        choices=out,
        usage=_total_usage([_usage(steps[-1].stats) for steps in outputs]),
    )


def _completion_response(server: _Server, outputs: list[list[StepOutput]], echo: str) -> p.Completion:
    rid, created = _ids()
    out = []
    for index, steps in enumerate(outputs):
        logprobs = _completion_logprobs(server, _all_logprobs(steps), len(echo))
        text = echo + "".join(s.text for s in steps)
        out.append(p.CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=steps[-1].finish_reason))
    return p.Completion(
        id=f"cmpl-{rid}",
        created=created,
        model=server.name,
        system_fingerprint=FINGERPRINT,
        choices=out,
        usage=_total_usage([_usage(steps[-1].stats) for steps in outputs]),
    )


# ------------------------------------------------------------------------------------ tool calls


class _CallText:
    """The output as text for the tool-call parser: decoded with special tokens kept (some
    formats open calls with one) and end-of-sequence tokens left out."""

    def __init__(self, server: _Server, prepared: _Prepared) -> None:
        assert prepared.tools is not None
        tokenizer = server.llm.tokenizer
        self.eos = set(tokenizer.eos_ids)
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
        self.stream = ToolStream(prepared.tools, prepared.tool_names)

    def text(self, ids: list[int]) -> str:
        return self.detok.push([t for t in ids if t not in self.eos]) + self.detok.flush()

    def push(self, ids: list[int], final: bool) -> tuple[str, list[CallDelta]]:
        """Content to stream now and the pieces of calls these tokens made (see ToolStream)."""
        text = self.detok.push([t for t in ids if t not in self.eos])
        if final:
            text += self.detok.flush()
        content, _ = self.stream.push(text)
        if final:
            more, _ = self.stream.finish()
            content += more
        return content, self.stream.take_deltas()


def _call_delta(delta: CallDelta) -> p.Delta:
    """OpenAI's streamed form of a call piece: index, id, type and name (arguments "") first,
    then index and a piece of the arguments."""
    if delta.id is not None:
        call = p.ToolCallDelta(
            index=delta.index, id=delta.id, type="function",
            function=p.FunctionDelta(name=delta.name, arguments=delta.arguments),
        )
    else:
        call = p.ToolCallDelta(index=delta.index, function=p.FunctionDelta(arguments=delta.arguments))
    return p.Delta(tool_calls=[call])


def _finish_reason(engine_reason: str | None, n_calls: int) -> str | None:
    return "tool_calls" if n_calls and engine_reason == "stop" else engine_reason


# --------------------------------------------------------------------------------------- OpenAPI


def _body_doc(
    model: type[BaseModel],
    anthropic: bool = False,
    answer: str = "the completion, or with stream: true a text/event-stream of chunks",
) -> dict[str, Any]:
    """``openapi_extra`` of a route that reads its body itself: the body's schema (the pydantic
    model it is validated with) and the error answers (``anthropic``: in Anthropic's shape)."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    error = {"$ref": f"#/components/schemas/{'Anthropic' if anthropic else ''}ErrorResponse"}
    errors = {
        str(code): {"description": what, "content": {"application/json": {"schema": error}}}
        for code, what in (
            (400, "invalid request"),
            (401, "missing or wrong API key"),
            (404, "unknown model"),
            (413, "body too large"),
            (429, "too many requests waiting"),
        )
    }
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
        },
        "responses": {
            "200": {
                "description": answer,
                "content": {"application/json": {"schema": {}}, "text/event-stream": {"schema": {"type": "string"}}},
            },
            **errors,
        },
        "x-quickdraft-schema": schema,
    }


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document with the request bodies' schemas moved into components."""
    if app.openapi_schema:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    for path in doc.get("paths", {}).values():
        for op in path.values():
            schema = op.pop("x-quickdraft-schema", None)
            if schema is None:
                continue
            defs = schema.pop("$defs", {})
            components.update(defs)
            name = op["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
            components[name] = schema
    components["ErrorResponse"] = {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"]},
                },
            }
        },
    }
    components["AnthropicErrorResponse"] = m.ERROR_SCHEMA
    app.openapi_schema = doc
    return doc


def _usage(stats: RequestStats) -> p.Usage:
    spec = p.SpecUsage(
        drafted=stats.drafted,
        accepted=stats.accepted,
        tau=stats.tau,
        tokens_per_second=stats.tokens_per_second,
        ttft_s=round(stats.ttft, 4),
    )
    return p.Usage(
        prompt_tokens=stats.prompt_tokens,
        completion_tokens=stats.output_tokens,
        total_tokens=stats.prompt_tokens + stats.output_tokens,
        prompt_tokens_details=p.PromptTokensDetails(cached_tokens=stats.cached_tokens),
        quickdraft=spec,
    )


# -------------------------------------------------------------------------------------- logprobs


def _all_logprobs(steps: list[StepOutput]) -> list[EngineLogprob] | None:
    if steps[0].logprobs is None:
        return None
    return [lp for s in steps for lp in s.logprobs or []]


def _token_text(server: _Server, token: int) -> tuple[str, bytes]:
    return server.grammar.token_text(token)


def _finite(logprob: float) -> float:
    return logprob if logprob >= _LOGPROB_FLOOR else _LOGPROB_FLOOR  # also maps NaN to the floor


def _chat_logprobs(server: _Server, lps: list[EngineLogprob] | None) -> p.ChatLogprobs | None:
    if lps is None:
        return None

    def top(token: int, logprob: float) -> p.TopLogprob:
        text, raw = _token_text(server, token)
        return p.TopLogprob(token=text, logprob=_finite(logprob), bytes=list(raw))

    content = [
        p.TokenLogprob(
            **top(lp.token, lp.logprob).model_dump(), top_logprobs=[top(t, v) for t, v in lp.top]
        )
        for lp in lps
    ]
    return p.ChatLogprobs(content=content)


def _completion_logprobs(
    server: _Server, lps: list[EngineLogprob] | None, offset: int
) -> p.CompletionLogprobs | None:
    if lps is None:
        return None
    out = p.CompletionLogprobs()
    for lp in lps:
        text = _token_text(server, lp.token)[0]
        out.tokens.append(text)
        out.token_logprobs.append(_finite(lp.logprob))
        out.top_logprobs.append({_token_text(server, t)[0]: _finite(v) for t, v in lp.top})
        out.text_offset.append(offset)
        offset += len(text)
    return out
