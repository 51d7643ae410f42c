"""OpenAI's Responses API on the wire: the request of ``POST /v1/responses`` and its input items.

What quickdraft cannot honour is refused by the request model's own validation (pydantic runs
:meth:`ResponsesRequest._served_only` before the fields), with a 400 naming the field in
OpenAI's ``input[2].content[0].type`` form: ``reasoning``, built-in tools (web search, files,
...), non-text parts, server-side conversations, stored prompts and background responses.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationError, model_validator

from quickdraft.server.errors import ApiError
from quickdraft.server.validation import Lenient

TEXT_PARTS = ("input_text", "output_text", "text")


class TextPart(Lenient):
    type: Literal["input_text", "output_text", "text"] = "input_text"
    text: str


class MessageItem(Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(Lenient):
    type: Literal["function_call"] = "function_call"
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str  # JSON text


class FunctionCallOutputItem(Lenient):
    type: Literal["function_call_output"] = "function_call_output"
    call_id: str = Field(min_length=1)
    output: str | list[TextPart]

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output)


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem
_TaggedItem = Annotated[InputItem, Field(discriminator="type")]
ITEM_TYPES: dict[str, type[BaseModel]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
}


class FunctionTool(Lenient):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(Lenient):
    type: Literal["function"]
    name: str


class TextFormat(Lenient):
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(Lenient):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(Lenient):
    """The body of ``POST /v1/responses`` (what quickdraft uses of it)."""

    model: str
    input: str | list[_TaggedItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunctionChoice | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[str] | None = None  # only values with nothing to add here (see _HARMLESS_INCLUDES)
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: dict[str, Any] | None = Field(
        default=None, description="refused unless empty: no reasoning is produced"
    )

    @model_validator(mode="before")
    @classmethod
    def _served_only(cls, data: Any) -> Any:
        """Refuse what quickdraft cannot honour (never ignore it), each with its own message;
        input items are checked one by one (an EasyInputMessage gets its type)."""
        if not isinstance(data, dict):
            return data
        for key, why in _REFUSED.items():
            value = data.get(key)
            if value not in (None, False, {}, 0) and not (
                key == "reasoning" and isinstance(value, dict) and all(v is None for v in value.values())
            ):
                raise ApiError(400, why, param=key)
        _check_include_and_text(data)
        items = data.get("input")
        if items is not None and not isinstance(items, (str, list)):
            raise ApiError(400, "input must be a string or a list of items", param="input")
        if isinstance(items, list):
            data = {**data, "input": [_check_item(i, item) for i, item in enumerate(items)]}
        _check_tools(data)
        return data



# Fields of OpenAI's request that quickdraft cannot honour: refused (never ignored) when set.
_REFUSED = {
    "reasoning": "reasoning is not supported: this server produces no reasoning items",
    "conversation": "conversation is not supported: continue with previous_response_id instead",
    "prompt": "prompt (stored prompt templates) is not supported; send instructions and input",
    "background": "background responses are not supported",
    "top_logprobs": "top_logprobs is not supported on /v1/responses; use /v1/chat/completions",
    "max_tool_calls": "max_tool_calls is not supported",
}
# ``include`` values that add nothing to what this server answers: no reasoning items and none of
# the hosted tools' calls (those tools are refused) are ever produced. Others are refused.
_HARMLESS_INCLUDES = (
    "reasoning.encrypted_content",
    "code_interpreter_call.outputs",
    "web_search_call.action.sources",
    "web_search_call.results",
    "file_search_call.results",
    "computer_call_output.output.image_url",
)


def _check_include_and_text(data: dict[str, Any]) -> None:
    include = data.get("include")
    for i, value in enumerate(include if isinstance(include, list) else []):
        if value == "message.output_text.logprobs":
            raise ApiError(
                400,
                "include message.output_text.logprobs is not supported on /v1/responses; "
                "use /v1/chat/completions with logprobs",
                param=f"include[{i}]",
            )
        if value not in _HARMLESS_INCLUDES:
            raise ApiError(400, f"include[{i}]: unknown value {value!r}", param=f"include[{i}]")
    text = data.get("text")
    verbosity = text.get("verbosity") if isinstance(text, dict) else None
    if verbosity not in (None, "medium"):
        raise ApiError(
            400,
            f"text.verbosity {verbosity!r} is not supported: the model has no verbosity control; "
            "leave it unset (or medium) and ask for a shorter or longer answer in the instructions",
            param="text.verbosity",
        )


def _check_tools(data: dict[str, Any]) -> None:
    tools = data.get("tools")
    for i, tool in enumerate(tools if isinstance(tools, list) else []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise ApiError(
                400,
                f"tools[{i}]: only function tools are supported (got type {kind!r})",
                param=f"tools[{i}].type",
            )
    choice = data.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") != "function":
        raise ApiError(
            400,
            f"tool_choice: only auto, none, required or a function are supported "
            f"(got type {choice.get('type')!r})",
            param="tool_choice",
        )


def _check_item(i: int, item: Any) -> Any:
    where = f"input[{i}]"
    if not isinstance(item, dict):
        raise ApiError(400, f"{where}: an input item must be an object", param=where)
    kind = item.get("type")
    if kind is None and "role" in item:
        item = {**item, "type": "message"}  # EasyInputMessage: a message without its type
        kind = "message"
    if kind not in ITEM_TYPES:
        raise ApiError(
            400,
            f"{where}.type: unsupported input item type {kind!r}; quickdraft accepts "
            + ", ".join(ITEM_TYPES),
            param=f"{where}.type",
        )
    parts = item.get("content") if kind == "message" else item.get("output")
    if isinstance(parts, list):
        field = "content" if kind == "message" else "output"
        for j, part in enumerate(parts):
            ptype = part.get("type") if isinstance(part, dict) else None
            if ptype not in TEXT_PARTS:
                raise ApiError(
                    400,
                    f"{where}.{field}[{j}].type: only text parts are supported "
                    f"({', '.join(TEXT_PARTS[:2])}; got {ptype!r})",
                    param=f"{where}.{field}[{j}].type",
                )
    try:
        ITEM_TYPES[kind].model_validate(item)
    except ValidationError as exc:  # name the item's field
        err = exc.errors()[0]
        loc = ".".join(str(x) for x in err["loc"] if isinstance(x, str) and "[" not in x)
        param = f"{where}.{loc}" if loc else where
        raise ApiError(400, f"{param}: {err['msg']}", param=param) from None
    return item
