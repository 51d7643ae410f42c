"""OpenAI's Responses API (``POST /v1/responses``) as a translation of the chat completions API.

There is one request model underneath: a Responses request becomes a
:class:`~quickdraft.server.protocol.ChatCompletionRequest` (:func:`to_chat_request`), is served
exactly as ``/v1/chat/completions`` serves it (so greedy answers are token-identical), and the
finished :class:`~quickdraft.server.protocol.ChatCompletion` becomes a Response object
(:func:`to_response`), or the stream of chat chunks becomes the Responses API's typed events
(:class:`ResponseStream`).

The mapping, as llama.cpp's server and vLLM serve it:

- ``instructions`` -> a system message first; ``input`` (a string = one user message, or items)
  -> messages: ``message`` items keep their role (text parts only), ``function_call`` items ->
  an assistant message's ``tool_calls``, ``function_call_output`` -> ``tool`` messages;
- ``tools`` (function tools, flat: ``{type, name, description, parameters, strict}``) and
  ``tool_choice`` -> the chat forms; ``text.format`` -> ``response_format``;
  ``max_output_tokens`` -> ``max_tokens``;
- ``store`` (default true) keeps the finished response in memory (:class:`ResponseStore`, the last
  :data:`MAX_STORED`), so ``GET /v1/responses/{id}`` returns it and ``previous_response_id``
  continues from it: its input and output come before the new input (its ``instructions`` do not,
  as with OpenAI). Responses are lost when the server stops.

No reasoning items are produced; ``reasoning``, built-in tools (web search, files, ...),
non-text parts and server-side conversations are refused with a 400 naming the field.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from quickdraft.server import protocol as p
from quickdraft.server.protocol import ApiError

MAX_STORED = 256  # finished responses kept for previous_response_id and GET /v1/responses/{id}

TEXT_PARTS = ("input_text", "output_text", "text")


# ------------------------------------------------------------------------------------ requests


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class TextPart(_Lenient):
    type: Literal["input_text", "output_text", "text"] = "input_text"
    text: str


class MessageItem(_Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(_Lenient):
    type: Literal["function_call"] = "function_call"
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str  # JSON text


class FunctionCallOutputItem(_Lenient):
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


class FunctionTool(_Lenient):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(_Lenient):
    type: Literal["function"]
    name: str


class TextFormat(_Lenient):
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Lenient):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(_Lenient):
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


def parse_request(data: Any) -> ResponsesRequest:
    """The body checked and validated; every problem is a 400 naming the field (OpenAI's
    ``input[2].content[0].type`` form)."""
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
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
    return p.parse_request(ResponsesRequest, data)


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


# ----------------------------------------------------------------------- request -> chat request


def input_items(req: ResponsesRequest) -> list[InputItem]:
    if isinstance(req.input, str):
        return [MessageItem(role="user", content=req.input)]
    return list(req.input)


def to_chat_request(
    req: ResponsesRequest, history: list[InputItem] | None = None
) -> p.ChatCompletionRequest:
    """The chat completions request this Responses request means; ``history``: the items of the
    response named by ``previous_response_id`` (its input and output), put before the input."""
    messages: list[p.ChatMessage] = []
    if req.instructions:
        messages.append(p.ChatMessage(role="system", content=req.instructions))
    old = list(history or [])
    new = input_items(req)
    known_calls: set[str] = set()
    for n, item in enumerate(old + new):
        where = f"input[{n - len(old)}]"
        if isinstance(item, MessageItem):
            messages.append(p.ChatMessage(role=item.role, content=item.text()))
        elif isinstance(item, FunctionCallItem):
            known_calls.add(item.call_id)
            call = p.ToolCallIn(
                id=item.call_id, function=p.FunctionCallIn(name=item.name, arguments=item.arguments)
            )
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant" and (
                last.tool_calls or _open_turn(old + new, n)
            ):
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(p.ChatMessage(role="assistant", content=None, tool_calls=[call]))
        else:
            if item.call_id not in known_calls:
                raise ApiError(
                    400,
                    f"{where}.call_id: no function_call with call_id {item.call_id!r} comes "
                    "before this function_call_output",
                    param=f"{where}.call_id",
                )
            messages.append(
                p.ChatMessage(role="tool", content=item.text(), tool_call_id=item.call_id)
            )
    if not messages:
        raise ApiError(400, "input is empty; give at least one message", param="input")
    return p.ChatCompletionRequest(
        model=req.model,
        messages=messages,
        max_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        tools=[
            p.ToolDefinition(
                type="function",
                function=p.FunctionDefinition(
                    name=t.name, description=t.description, parameters=t.parameters, strict=t.strict
                ),
            )
            for t in req.tools
        ]
        if req.tools
        else None,
        tool_choice=_chat_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls,
        response_format=_response_format(req.text),
    )


def _open_turn(items: list[InputItem], n: int) -> bool:
    """Whether the function_call at ``n`` directly follows an assistant message item (the same
    turn: the text before the calls), so it joins that message."""
    before = items[n - 1] if n > 0 else None
    return isinstance(before, MessageItem) and before.role == "assistant"


def _chat_tool_choice(
    choice: Literal["auto", "none", "required"] | NamedFunctionChoice | None,
) -> Literal["none", "auto", "required"] | p.NamedToolChoice | None:
    if isinstance(choice, NamedFunctionChoice):
        return p.NamedToolChoice(type="function", function=p.NamedFunction(name=choice.name))
    return choice


def _response_format(text: TextConfig | None) -> p.ResponseFormat | None:
    fmt = text.format if text is not None else None
    if fmt is None:
        return None
    if fmt.type != "json_schema":
        return p.ResponseFormat(type=fmt.type)
    if fmt.schema_ is None:
        raise ApiError(400, "text.format json_schema needs schema", param="text.format.schema")
    return p.ResponseFormat(
        type="json_schema",
        json_schema=p.JsonSchemaFormat(
            name=fmt.name or "schema",
            description=fmt.description,
            schema=fmt.schema_,
            strict=fmt.strict,
        ),
    )


# ----------------------------------------------------------------------- chat output -> response


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {
        "type": "message",
        "id": item_id or _item_id("msg"),
        "status": status,
        "role": "assistant",
        "content": content,
    }


def call_item(call_id: str, name: str, arguments: str, item_id: str | None = None) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id or _item_id("fc"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": "completed",
    }


def usage(u: p.Usage | None) -> dict[str, Any] | None:
    if u is None:
        return None
    return {
        "input_tokens": u.prompt_tokens,
        # cache_write_tokens (newer SDKs require it) is not counted by quickdraft: always 0
        "input_tokens_details": {
            "cached_tokens": u.prompt_tokens_details.cached_tokens, "cache_write_tokens": 0
        },
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.total_tokens,
    }


def response_object(
    req: ResponsesRequest,
    response_id: str,
    created_at: int,
    model: str,
    output: list[dict[str, Any]],
    status: str,
    use: p.Usage | None,
) -> dict[str, Any]:
    """A Response object with the request's settings echoed, as OpenAI returns them."""
    fmt = req.text.format if req.text is not None and req.text.format is not None else None
    text_format: dict[str, Any] = {"type": "text"}
    if fmt is not None:
        text_format = fmt.model_dump(by_alias=True, exclude_none=True)
        if fmt.type == "json_schema":
            text_format.setdefault("name", "schema")
    choice = req.tool_choice
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": model,
        "output": output,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": None,
        "store": req.store is not False,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": text_format},
        "tool_choice": choice.model_dump() if isinstance(choice, BaseModel) else (choice or "auto"),
        "tools": [
            {**t.model_dump(), "strict": t.strict is True} for t in req.tools or []
        ],
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": req.truncation or "disabled",
        "usage": usage(use),
        "user": req.user,
        "metadata": req.metadata or {},
    }


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def to_response(
    req: ResponsesRequest, chat: p.ChatCompletion, response_id: str | None = None
) -> dict[str, Any]:
    """A finished chat completion as the Response object of ``req``."""
    choice = chat.choices[0]
    status = _status(choice.finish_reason)
    output: list[dict[str, Any]] = []
    msg = choice.message
    if msg.content is not None and (msg.content or not msg.tool_calls):
        output.append(message_item(msg.content, status))
    for call in msg.tool_calls or []:
        output.append(call_item(call.id, call.function.name, call.function.arguments))
    return response_object(
        req, response_id or new_response_id(), int(time.time()), chat.model, output, status,
        chat.usage,
    )


# --------------------------------------------------------------------- chat stream -> SSE events


def sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


class ResponseStream:
    """The chat chunks of one request as the Responses API's events (dicts with ``type`` and
    ``sequence_number``); :meth:`error` is the event that ends a stream that failed."""

    def __init__(self, req: ResponsesRequest, model: str, response_id: str | None = None) -> None:
        self.req = req
        self.model = model
        self.id = response_id or new_response_id()
        self.created_at = int(time.time())
        self.seq = 0
        self.final: dict[str, Any] | None = None  # the finished response

    def _ev(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def _response(
        self, output: list[dict[str, Any]], status: str, use: p.Usage | None = None
    ) -> dict[str, Any]:
        return response_object(self.req, self.id, self.created_at, self.model, output, status, use)

    def error(self, message: str, code: str | None = None) -> dict[str, Any]:
        return self._ev("error", code=code, message=message, param=None)

    async def events(
        self,
        chunks: AsyncIterator[p.ChatCompletionChunk],
        on_done: Callable[[dict[str, Any]], None] | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        output: list[dict[str, Any]] = []
        text: list[str] = []  # of the open message item
        message: dict[str, Any] | None = None
        call: dict[str, Any] | None = None  # the open function_call item
        call_index: int | None = None
        yield self._ev("response.created", response=self._response([], "in_progress"))
        yield self._ev("response.in_progress", response=self._response([], "in_progress"))

        def close_message(status: str) -> list[dict[str, Any]]:
            nonlocal message
            if message is None:
                return []
            done = message_item("".join(text), status, message["id"])
            part = done["content"][0]
            at = {"item_id": done["id"], "output_index": len(output), "content_index": 0}
            out = [
                self._ev("response.output_text.done", **at, text=part["text"], logprobs=[]),
                self._ev("response.content_part.done", **at, part=part),
                self._ev("response.output_item.done", output_index=len(output), item=done),
            ]
            output.append(done)
            message = None
            return out

        def close_call() -> list[dict[str, Any]]:
            nonlocal call
            if call is None:
                return []
            done = {**call, "status": "completed"}
            at = {"item_id": done["id"], "output_index": len(output)}
            out = [
                self._ev(
                    "response.function_call_arguments.done",
                    **at, name=done["name"], arguments=done["arguments"],
                ),
                self._ev("response.output_item.done", output_index=len(output), item=done),
            ]
            output.append(done)
            call = None
            return out

        async for chunk in chunks:
            finish = None
            for choice in chunk.choices:
                delta = choice.delta
                if delta.content:
                    for ev in close_call():
                        yield ev
                    if message is None:
                        message = message_item("", "in_progress")
                        message["content"] = []
                        text.clear()
                        yield self._ev(
                            "response.output_item.added", output_index=len(output), item=message
                        )
                        yield self._ev(
                            "response.content_part.added",
                            item_id=message["id"], output_index=len(output), content_index=0,
                            part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
                        )
                    text.append(delta.content)
                    yield self._ev(
                        "response.output_text.delta",
                        item_id=message["id"], output_index=len(output), content_index=0,
                        delta=delta.content, logprobs=[],
                    )
                for tc in delta.tool_calls or []:
                    if tc.id is not None or call is None or tc.index != call_index:
                        for ev in close_message("completed") + close_call():
                            yield ev
                        call = {
                            "type": "function_call",
                            "id": _item_id("fc"),
                            "call_id": tc.id or f"call_{uuid.uuid4().hex[:24]}",
                            "name": tc.function.name or "",
                            "arguments": "",
                            "status": "in_progress",
                        }
                        call_index = tc.index
                        yield self._ev(
                            "response.output_item.added", output_index=len(output), item=dict(call)
                        )
                    piece = tc.function.arguments
                    if piece:
                        call["arguments"] += piece
                        yield self._ev(
                            "response.function_call_arguments.delta",
                            item_id=call["id"], output_index=len(output), delta=piece,
                        )
                finish = choice.finish_reason or finish
            if finish is not None or chunk.usage is not None:
                status = _status(finish)
                for ev in close_message(status) + close_call():
                    yield ev
                if not output:  # an empty answer: one empty message, as the whole response has
                    message = message_item("", "in_progress")
                    message["content"] = []
                    text.clear()
                    yield self._ev(
                        "response.output_item.added", output_index=0, item=message
                    )
                    yield self._ev(
                        "response.content_part.added",
                        item_id=message["id"], output_index=0, content_index=0,
                        part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
                    )
                    for ev in close_message(status):
                        yield ev
                final = self._response(output, status, chunk.usage)
                self.final = final
                if on_done is not None:
                    on_done(final)
                kind = "response.incomplete" if status == "incomplete" else "response.completed"
                yield self._ev(kind, response=final)
                return


# ---------------------------------------------------------------------------------- the store


def _listed_item(item_id: str, item: InputItem) -> dict[str, Any]:
    body: dict[str, Any] = {"id": item_id, **item.model_dump(exclude_none=True)}
    if isinstance(item, MessageItem):
        kind = "output_text" if item.role == "assistant" else "input_text"
        part: dict[str, Any] = {"type": kind, "text": item.text()}
        if kind == "output_text":
            part["annotations"] = []
        body["content"] = [part]
        body["status"] = "completed"
    elif isinstance(item, FunctionCallItem):
        body["status"] = "completed"
    return body


class ResponseStore:
    """The last :data:`MAX_STORED` finished responses (least recently used dropped first), each
    with the conversation it ends: its input items (after its own history) and output items."""

    def __init__(self, capacity: int = MAX_STORED) -> None:
        self.capacity = capacity
        # id -> (the response, its conversation's items, how many of them were its input)
        self._items: OrderedDict[str, tuple[dict[str, Any], list[InputItem], int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, req: ResponsesRequest, response: dict[str, Any], history: list[InputItem]) -> None:
        items = [*history, *input_items(req)]
        inputs = len(items)
        for out in response["output"]:
            if out["type"] == "message":
                items.append(
                    MessageItem(role="assistant", content=out["content"][0]["text"])
                )
            elif out["type"] == "function_call":
                items.append(
                    FunctionCallItem(
                        call_id=out["call_id"], name=out["name"], arguments=out["arguments"]
                    )
                )
        self._items[response["id"]] = (response, items, inputs)
        self._items.move_to_end(response["id"])
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str, param: str = "response_id") -> tuple[dict[str, Any], list[InputItem]]:
        found = self._items.get(response_id)
        if found is None:
            raise ApiError(
                404,
                f"No response with id {response_id!r} is stored on this server (it keeps the "
                f"last {self.capacity} responses made with store: true, in memory)",
                param=param,
                code="response_not_found",
            )
        self._items.move_to_end(response_id)
        return found[0], found[1]

    def input_items(
        self, response_id: str, order: str = "desc", limit: int = 20, after: str | None = None
    ) -> dict[str, Any]:
        """``GET /v1/responses/{id}/input_items``: the items the response was made from (those of
        the responses before it included), as OpenAI lists them, newest first unless ``order`` is asc."""
        if order not in ("asc", "desc"):
            raise ApiError(400, f"order must be asc or desc (got {order!r})", param="order")
        if not 1 <= limit <= 100:
            raise ApiError(400, f"limit must be between 1 and 100 (got {limit})", param="limit")
        self.get(response_id)
        _response, items, inputs = self._items[response_id]
        listed = [_listed_item(f"item_{response_id.removeprefix('resp_')}_{i}", it) for i, it in enumerate(items[:inputs])]
        if order == "desc":
            listed.reverse()
        if after is not None:
            at = next((i for i, it in enumerate(listed) if it["id"] == after), None)
            if at is None:
                raise ApiError(400, f"after: no item {after!r} in this response's input", param="after")
            listed = listed[at + 1 :]
        page = listed[:limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(listed) > limit,
        }

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._items[response_id]

    def history(self, req: ResponsesRequest) -> list[InputItem]:
        """The items before ``req``'s input: those of its previous response, if it names one."""
        if req.previous_response_id is None:
            return []
        return list(self.get(req.previous_response_id, param="previous_response_id")[1])
