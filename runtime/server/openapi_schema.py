"""/openapi.json: the schema FastAPI derives from the request models, corrected to what the server answers.

FastAPI documents a 422 with its own body for invalid requests; plait answers 400 with its one error body
(errors.py), and 401/404/413/415/503 where they apply. Generation routes stream `text/event-stream` when
asked. Routes with several methods get one operation id per method. Fuzzers (tests/server/test_server_fuzz.py)
read this schema, so it must be the truth.
"""

from __future__ import annotations

import warnings
from importlib import metadata
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

STREAMING_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses")
ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {
                    "anyOf": [{"type": "string"}, {"type": "null"}],
                    "description": "the field at fault, if one is",
                },
                "code": {"type": "integer"},
            },
        }
    },
}
_ERRORS = {
    "400": "invalid request: the message (and `param`) name the field at fault",
    "401": "missing or wrong API key (when the server has one)",
    "404": "no such model, route or stored response",
    "405": "the route takes other methods",
    "413": "request body too large",
    "415": "unsupported Content-Encoding",
    "503": "the server is at capacity, or its scheduler is gone",
}


def install_openapi(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _build(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _build(app: FastAPI) -> dict[str, Any]:
    with warnings.catch_warnings():  # (duplicate ids of multi-method routes: made unique below)
        warnings.simplefilter("ignore")
        schema = get_openapi(
            title="plait",
            version=_version(),
            routes=app.routes,
            description="SGLang's native API and the OpenAI API, served by plait.",
        )
    error_ref = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            operation["operationId"] = f"{method}_{path.strip('/').replace('/', '_').replace('{', '').replace('}', '')}"
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            for status, description in _ERRORS.items():
                responses[status] = {"description": description, "content": error_ref}
            if path in STREAMING_ROUTES and method == "post":
                responses["200"].setdefault("content", {})["text/event-stream"] = {"schema": {"type": "string"}}
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    components["Error"] = ERROR_SCHEMA
    return schema


def _version() -> str:
    try:
        return metadata.version("plait")
    except metadata.PackageNotFoundError:
        return "0"
