"""Anthropic's Messages API on the wire: its requests (``POST /v1/messages``,
``/v1/messages/count_tokens``) and its error object.

What quickdraft cannot honour is refused with a 400 naming the field as the client wrote it
(``messages.0.content.1.id``): image, document, thinking and server-tool blocks (here, with what
to send instead), ``thinking`` turned on and a ``tool_result`` answering no earlier ``tool_use``
(on translation, :mod:`.translate`). ``cache_control`` marks are accepted and have no effect
(quickdraft reuses computed prefixes by itself); ``metadata`` is accepted and not used.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from quickdraft.server.errors import ApiError, ErrorShape
from quickdraft.server.validation import Lenient

_BLOCK_TYPES = ("text", "tool_use", "tool_result")

# ------------------------------------------------------------------------------------ requests

_BLOCK_HINTS = {
    "image": "quickdraft serves text-only models; send the content as text",
    "document": "quickdraft serves text-only models; send the document's text as a text block",
    "thinking": "extended thinking is not supported; drop the thinking blocks from the history",
    "redacted_thinking": "extended thinking is not supported; drop the thinking blocks from the "
    "history",
}


class TextBlock(Lenient):
    type: Literal["text"]
    text: str


class ToolUseBlock(Lenient):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any] = Field(default_factory=dict)


class ToolResultBlock(Lenient):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: list[TextBlock] | str | None = None
    is_error: bool = False

    def text(self) -> str:
        content = self.content or ""
        text = content if isinstance(content, str) else "".join(b.text for b in content)
        return f"Error: {text}" if self.is_error else text


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


def _check_blocks(value: Any, allowed: tuple[str, ...]) -> Any:
    """Refuse a block list holding a type not in ``allowed``, with what to send instead (a
    plain union error would list every alternative pydantic tried)."""
    if not isinstance(value, list):
        return value
    for i, block in enumerate(value):
        kind = block.get("type") if isinstance(block, dict) else None
        if not isinstance(kind, str):
            raise ValueError(f"block {i} needs a `type` ({', '.join(allowed)})")
        if kind not in allowed:
            hint = _BLOCK_HINTS.get(kind, f"send {', '.join(allowed)} blocks")
            raise ValueError(f"block {i} has type {kind!r}, which is not supported here: {hint}")
        if kind == "tool_result":  # here, not in its own validator: a union error would hide it
            try:
                _check_blocks(block.get("content"), ("text",))
            except ValueError as exc:
                raise ValueError(f"block {i} (tool_result) content: {exc}") from None
    return value


class MessageParam(Lenient):
    role: Literal["user", "assistant"]
    content: list[Block] | str

    @field_validator("content", mode="before")
    @classmethod
    def _known_blocks(cls, value: Any) -> Any:
        return _check_blocks(value, _BLOCK_TYPES)


class Tool(Lenient):
    type: str | None = None  # "custom"; Anthropic's server tools (bash_..., web_search_...) are not served
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    input_schema: dict[str, Any] | None = None  # required of custom tools (checked on translation)


class ToolChoice(Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(Lenient):
    type: str  # "enabled", "adaptive" (refused) or "disabled"
    budget_tokens: int | None = None


class OutputFormat(Lenient):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Lenient):
    effort: str | None = None  # accepted, no effect
    format: OutputFormat | None = None  # structured output: the answer is JSON of this schema


class MessagesBase(Lenient):
    """What a Messages request and a count_tokens request share; a problem is named by the
    field as the client wrote it (``messages.0.content.1.id``, without pydantic's union
    branch labels)."""

    @classmethod
    def field_name(cls, loc: tuple[int | str, ...]) -> str:
        return _client_path(loc)

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: list[TextBlock] | str | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None

    @field_validator("system", mode="before")
    @classmethod
    def _text_system(cls, value: Any) -> Any:
        return _check_blocks(value, ("text",))


class MessagesRequest(MessagesBase):
    """The body of ``POST /v1/messages``."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)  # None = Anthropic's default, 1
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool | None = False
    metadata: dict[str, Any] | None = None  # accepted, not used
    output_config: OutputConfig | None = None


class CountTokensRequest(MessagesBase):
    """The body of ``POST /v1/messages/count_tokens``."""



def _client_path(parts: tuple[int | str, ...]) -> str:
    loc: list[str] = []
    for k, part in enumerate(parts):
        label = isinstance(part, str) and ("[" in part or part in ("str", "int"))
        tag = part in _BLOCK_TYPES and k > 0 and isinstance(parts[k - 1], int)  # the union's tag
        if not (label or tag):
            loc.append(str(part))
    return ".".join(loc)



# ------------------------------------------------------------------------------------ errors

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error object for an HTTP status."""
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"type": "string", "enum": ["error"]},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
        },
    },
}



class AnthropicErrors(ErrorShape):
    """Errors as Anthropic writes them: ``{"type": "error", "error": {"type", "message"}}``."""

    component = "AnthropicErrorResponse"
    schema = ERROR_SCHEMA

    def body(self, error: ApiError) -> dict[str, Any]:
        return error_body(error.status, error.message)


ANTHROPIC_ERRORS = AnthropicErrors()
