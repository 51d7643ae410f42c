"""The OpenAPI document: routes that read their bodies themselves document them here."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from quickdraft.server.errors import ErrorShape


def body_doc(
    model: type[BaseModel],
    shape: ErrorShape,
    answer: str = "the completion, or with stream: true a text/event-stream of chunks",
) -> dict[str, Any]:
    """``openapi_extra`` of a route that reads its body itself: the body's schema (the pydantic
    model it is validated with) and the error answers, in the dialect's error ``shape``."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    error = {"$ref": f"#/components/schemas/{shape.component}"}
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


def document(app: FastAPI, shapes: Sequence[ErrorShape]) -> dict[str, Any]:
    """FastAPI's document with the request bodies' schemas moved into components, and the
    error objects of the dialects' error ``shapes`` added."""
    if app.openapi_schema:
        return app.openapi_schema
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
    components.update({shape.component: shape.schema for shape in shapes})
    app.openapi_schema = doc
    return doc
