"""OpenAI's wire types: the chat and text completion requests and answers, and its error object.

Requests tolerate fields they do not know (clients send vendor extras); the extras quickdraft
understands follow vLLM: ``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``,
``stop_token_ids``. Anything invalid becomes an :class:`~quickdraft.server.errors.ApiError`,
which OpenAI's routes answer as its error object ``{"error": {"message", "type", "param",
"code"}}`` with a 4xx status. The other dialects are translated into the chat request here.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from quickdraft.errors import QuickdraftError
from quickdraft.sampling import SamplingParams
from quickdraft.server.errors import ApiError, ErrorShape
from quickdraft.server.validation import Lenient

MAX_LOGPROBS = 20


def error_body(
    message: str,
    kind: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


ERROR_SCHEMA: dict[str, Any] = {  # OpenAPI's schema of error_body
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


class OpenAIErrors(ErrorShape):
    """Errors as OpenAI writes them: ``{"error": {"message", "type", "param", "code"}}``."""

    component = "ErrorResponse"
    schema = ERROR_SCHEMA

    def body(self, error: ApiError) -> dict[str, Any]:
        return error_body(error.message, error.kind, error.param, error.code)


OPENAI_ERRORS = OpenAIErrors()


# ------------------------------------------------------------------------------------ requests


class StreamOptions(Lenient):
    include_usage: bool = False


class JsonSchemaFormat(Lenient):
    name: str = "schema"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what a torch generator can be seeded with
MAX_CHOICES = 16  # n: choices per request (each a sequence of its own; more than the engine runs at once wait)


class _GenerationRequest(Lenient):
    """Fields shared by chat and text completions."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)  # None = OpenAI's default, 1
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int | None = 1
    best_of: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    logit_bias: dict[str, float] | None = Field(
        default=None,
        description="token id (as a string) -> bias in [-100, 100] added to its logit",
    )

    def check_supported(self) -> None:
        if self.n is not None and not 1 <= self.n <= MAX_CHOICES:
            raise ApiError(400, f"n must be between 1 and {MAX_CHOICES} (got {self.n})", param="n")
        if self.best_of not in (None, 1):
            raise ApiError(400, f"best_of must be 1 (got {self.best_of})", param="best_of")
        fmt = self.response_format
        if (
            fmt is not None
            and fmt.type == "json_schema"
            and (fmt.json_schema is None or fmt.json_schema.schema_ is None)
        ):
            raise ApiError(
                400, "response_format json_schema needs json_schema.schema", param="response_format"
            )

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def json_schema(self) -> tuple[bool, dict[str, Any] | None]:
        """(structured output asked, its schema: None = any JSON object)."""
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return False, None
        if fmt.type == "json_object":
            return True, None
        assert fmt.json_schema is not None
        return True, fmt.json_schema.schema_

    def logit_bias_items(self, vocab_size: int) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as (token id, bias) pairs, the ids checked against the vocabulary
        (SamplingParams checks the values)."""
        out = []
        for key, bias in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise ApiError(
                    400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
                ) from None
            if not 0 <= token < vocab_size:
                raise ApiError(
                    400, f"logit_bias token id {token} is not in [0, {vocab_size})",
                    param="logit_bias",
                )
            out.append((token, float(bias)))
        return tuple(out)

    def sampling_params(
        self, max_tokens: int, logprobs: int | None, vocab_size: int
    ) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        logit_bias = self.logit_bias_items(vocab_size)
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_k=self.top_k or 0,
                top_p=1.0 if self.top_p is None else self.top_p,
                min_p=self.min_p or 0.0,
                repetition_penalty=1.0
                if self.repetition_penalty is None
                else self.repetition_penalty,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                seed=self.seed,
                stop=tuple(stop),
                stop_token_ids=tuple(self.stop_token_ids or ()),
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                logit_bias=logit_bias,
            )
        except QuickdraftError as exc:
            raise ApiError(400, str(exc)) from None


class ContentPart(Lenient):
    type: str
    text: str | None = None


class FunctionCallIn(Lenient):
    name: str
    arguments: str = "{}"  # JSON text, as OpenAI sends it


class ToolCallIn(Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def to_template(self) -> dict[str, Any]:
        """The message as chat templates expect it: role, plain-text content, and the tool
        fields transformers passes (a call's arguments as an object, not JSON text)."""
        role = "system" if self.role == "developer" else self.role  # OpenAI's newer name
        if isinstance(self.content, list):
            if any(p.type != "text" or p.text is None for p in self.content):
                raise ApiError(400, "only text content parts are supported", param="messages")
            content = "".join(p.text or "" for p in self.content)
        else:
            content = self.content or ""
        out: dict[str, Any] = {"role": role, "content": content}
        if self.name:
            out["name"] = self.name
        if self.tool_calls:
            if role != "assistant":
                raise ApiError(400, "only assistant messages carry tool_calls", param="messages")
            out["tool_calls"] = [_call_for_template(c) for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _call_for_template(call: ToolCallIn) -> dict[str, Any]:
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        raise ApiError(
            400,
            f"tool_calls: the arguments of {call.function.name!r} are not JSON text",
            param="messages",
        ) from None
    function = {"name": call.function.name, "arguments": arguments}
    return {"id": call.id, "type": "function", "function": function}


class FunctionDefinition(Lenient):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None = no arguments
    strict: bool | None = None


class ToolDefinition(Lenient):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Lenient):
    name: str


class NamedToolChoice(Lenient):
    type: Literal["function"]
    function: NamedFunction


class QuickdraftOptions(BaseModel):
    """quickdraft's own request field, ``"quickdraft": {...}``; OpenAI clients never send it.
    Unknown keys are refused (a misspelt option is an error, not silently off)."""

    model_config = ConfigDict(extra="forbid")

    provenance: bool = Field(
        default=False,
        description="stream: true only: each chunk says how many of its tokens were drafts the "
        "target accepted, and where their text is (see ChunkProvenance)",
    )


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    quickdraft: QuickdraftOptions | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None  # OpenAI's deprecated form of tools
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None

    def check_tools(self) -> None:
        if self.functions is not None or self.function_call is not None:
            raise ApiError(
                400,
                "functions and function_call are OpenAI's deprecated form; send tools and "
                "tool_choice instead",
                param="functions" if self.functions is not None else "function_call",
            )
        if self.modalities not in (None, ["text"]):
            raise ApiError(400, "only text output is supported (modalities: ['text'])", param="modalities")
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ApiError(400, "tools: every function needs its own name", param="tools")
        choice = self.tool_choice
        if choice is not None and choice != "none" and not names:
            raise ApiError(400, "tool_choice needs tools", param="tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ApiError(
                400,
                f"tool_choice names {choice.function.name!r}, which is not in tools",
                param="tool_choice",
            )

    def provenance(self) -> bool:
        """Whether the chunks carry provenance (``quickdraft.provenance``; streams only)."""
        if self.quickdraft is None or not self.quickdraft.provenance:
            return False
        if not self.stream:
            raise ApiError(
                400, "quickdraft.provenance describes streamed chunks; send stream: true "
                "(a whole answer's drafts are in usage.quickdraft)", param="quickdraft.provenance",
            )
        return True

    def engine_logprobs(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None

    def single_prompt(self) -> str | list[int]:
        """The one prompt (text or token ids) of this request; batches are refused."""
        p = self.prompt
        if isinstance(p, str):
            return p
        if p and all(isinstance(x, int) for x in p):
            return list(p)  # type: ignore[arg-type]
        if len(p) != 1:
            raise ApiError(400, "give exactly one prompt per request", param="prompt")
        return p[0]  # type: ignore[return-value]

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise ApiError(400, "suffix is not supported", param="suffix")
        if self.echo and self.logprobs is not None:
            raise ApiError(
                400, "echo with logprobs (prompt logprobs) is not supported", param="echo"
            )


# ----------------------------------------------------------------------------------- responses


class SpecUsage(BaseModel):
    """quickdraft's extra usage field: what speculation did for this request."""

    drafted: int
    accepted: int
    tau: float
    tokens_per_second: float
    ttft_s: float  # request start (on the engine) to the first output token


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens reused from the prefix cache, not computed again


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    quickdraft: SpecUsage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None

    @model_serializer(mode="wrap")
    def _without_empty_calls(self, handler: Any) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        if out.get("tool_calls") is None:
            out.pop("tool_calls", None)
        return out


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage


class FunctionDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}  # OpenAI omits them


class ChunkProvenance(BaseModel):
    """Where a streamed chunk's tokens came from (asked with ``"quickdraft": {"provenance": true}``):
    ``tokens`` generated tokens reached the client with this chunk (a token whose text is held
    back, e.g. part of a character, comes with a later one), ``accepted`` of them were drafts the
    target accepted (the rest it wrote itself), and their text is at ``accepted_text``: [start,
    end) character offsets (code points) into the choice's output text, the concatenated content
    when no tool calls are parsed out of it. Over a stream ``tokens`` add up to
    usage.completion_tokens, and ``accepted`` to usage.quickdraft.accepted less the drafts accepted
    past a stop (verified, but not output)."""

    tokens: int
    accepted: int
    accepted_text: list[tuple[int, int]]


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChunkChoice]
    usage: Usage | None = None
    quickdraft: ChunkProvenance | None = None  # only when asked: absent, not null, otherwise

    @model_serializer(mode="wrap")
    def _without_provenance(self, handler: Any) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        if out.get("quickdraft", 0) is None:
            out.pop("quickdraft")
        return out


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class Completion(BaseModel):
    """A text completion, or (``usage`` None until the last) one chunk of a streamed one."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "quickdraft"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
