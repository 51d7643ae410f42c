"""The responses kept for ``previous_response_id`` and ``GET /v1/responses/{id}``: in memory,
the last :data:`MAX_STORED`, lost when the server stops."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from quickdraft.server.errors import ApiError
from quickdraft.server.responses.protocol import (
    FunctionCallItem,
    InputItem,
    MessageItem,
    ResponsesRequest,
)
from quickdraft.server.responses.translate import input_items

MAX_STORED = 256  # finished responses kept for previous_response_id and GET /v1/responses/{id}


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
