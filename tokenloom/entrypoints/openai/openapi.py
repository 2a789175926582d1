"""The published ``/openapi.json``: what each route takes and answers.

Request bodies are parsed by hand (see body.py) so that size, nesting and
encoding stay under the server's control, which leaves FastAPI nothing to
infer the bodies from. They are declared here instead, from the same
pydantic models the handlers validate with, plus the facts only the app
knows (the served model names).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from .protocol import ErrorResponse

_REF = "#/components/schemas/{model}"

# Every status a route may answer with besides 200 (all with an ErrorResponse body).
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid request; `param` names the field."},
    413: {"model": ErrorResponse, "description": "Body larger than --max-request-bytes."},
    500: {"model": ErrorResponse, "description": "The engine failed."},
    503: {"model": ErrorResponse, "description": "Overloaded or the engine is dead."},
}


def json_body(*models: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` declaring ``models`` (one of them) as a route's required JSON body."""
    refs: list[dict[str, Any]] = [_ref(model) for model in models]
    schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def generation_responses(
    model: type[BaseModel], chunk: type[BaseModel]
) -> dict[int | str, dict[str, Any]]:
    """200 is ``model`` as JSON, or server-sent events of ``chunk`` when ``stream`` is set.

    Events are described one at a time with ``itemSchema`` (as Open API 3.2
    does): each ``data`` is a chunk, or an error once the headers have gone
    out, as JSON; the last one is ``[DONE]``.
    """
    chunk_json = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {"anyOf": [_ref(chunk), _ref(ErrorResponse)]},
    }
    data = {
        "anyOf": [chunk_json, {"type": "string", "const": "[DONE]"}],
        "description": "A chunk (or a late error) as JSON; the last event's data is [DONE].",
    }
    event = {
        "type": "object",
        "properties": {"data": data, "event": {"type": "string", "const": "message"}},
        "required": ["data"],
    }
    ok = {
        "model": model,
        "description": "The result, or a stream of chunks when `stream` is true.",
        "content": {"text/event-stream": {"itemSchema": event}},
    }
    return {200: ok, **ERROR_RESPONSES}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": _REF.format(model=model.__name__)}


def install_openapi(
    app: FastAPI,
    request_models: list[type[BaseModel]],
    chunk_models: list[type[BaseModel]],
    model_names: list[str] | None,
) -> None:
    """Make ``app.openapi()`` include the request and stream chunk models, and restrict
    the requests' ``model`` to ``model_names`` (None: any string, as when LoRA
    adapters come and go)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        _, defs = models_json_schema(
            [(m, "validation") for m in request_models]
            + [(m, "serialization") for m in chunk_models],
            ref_template=_REF,
        )
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name, definition in defs.get("$defs", {}).items():
            components.setdefault(name, definition)
        if model_names is None:
            model_field = {
                "anyOf": [{"type": "string"}, {"type": "null"}],
                "description": "The served model name or a loaded LoRA adapter's name; "
                "anything else is a 400.",
            }
        else:
            model_field = {
                "anyOf": [{"type": "string", "enum": model_names}, {"type": "null"}],
                "description": "The served model name; anything else is a 400.",
            }
        for model in request_models:
            properties = components[model.__name__].get("properties", {})
            if "model" in properties:
                properties["model"] = {**model_field, "title": "Model"}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
