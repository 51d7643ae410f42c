"""The one request validator: a decoded JSON body through a dialect's pydantic model.

Request models tolerate fields they do not know (clients send vendor extras) and are
:class:`Lenient`; what a dialect refuses with a message of its own (a field it cannot honour)
its model's validators raise as an :class:`~quickdraft.server.errors.ApiError`, which pydantic
lets through. Any other problem becomes a 400 naming the field as the dialect writes it
(:meth:`Lenient.field_name`).
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from quickdraft.server.errors import ApiError


class Lenient(BaseModel):
    """A request model: unknown fields are ignored, aliased fields accepted by either name."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    @classmethod
    def field_name(cls, loc: tuple[int | str, ...]) -> str:
        """A validation error's location as the API names the field (``messages.0.role``)."""
        return ".".join(str(part) for part in loc)


M = TypeVar("M", bound=Lenient)


def parse_request(model: type[M], data: Any) -> M:
    """Validate a decoded JSON body; the first problem becomes a 400 naming the field."""
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = model.field_name(tuple(err["loc"])) or None
        msg = err["msg"].removeprefix("Value error, ")
        raise ApiError(400, f"{param}: {msg}" if param else msg, param=param) from None
