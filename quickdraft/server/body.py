"""A request's JSON body, read with limits: its size, its nesting, text that is Unicode."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request

from quickdraft.server.errors import ApiError

MAX_BODY_BYTES = 1 << 20  # 1 MiB: far more than any prompt the context can hold
MAX_JSON_DEPTH = 64  # nesting of arrays and objects in a body (a tool schema needs a few)


async def read_json(request: Request) -> Any:
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
