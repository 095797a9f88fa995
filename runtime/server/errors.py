"""One JSON error shape for every route, and the handlers that produce it.

Body: `{"error": {"message", "type", "param", "code"}}` — OpenAI's shape, which also satisfies SGLang
clients (they read `error.message`). `param` names the offending field when one is known, so a client
can tell `temperature` from `top_p` without parsing prose.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.tokenizer_manager import EngineUnavailableError, OverloadedError

logger = logging.getLogger("plait.server")

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    503: "server_overloaded",
}


class APIError(Exception):
    """Raised by route code for an HTTP error with a JSON body."""

    def __init__(
        self, status_code: int, message: str, param: Optional[str] = None, headers: Optional[dict[str, str]] = None
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.headers = headers  # e.g. Retry-After on a 503 for a full queue


def error_body(status_code: int, message: str, param: Optional[str] = None) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(status_code, "invalid_request_error" if status_code < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status_code}}


def error_response(
    status_code: int, message: str, param: Optional[str] = None, headers: Optional[dict[str, str]] = None
) -> JSONResponse:
    return JSONResponse(error_body(status_code, message, param), status_code=status_code, headers=headers)


def status_for(exc: BaseException) -> int:
    if isinstance(exc, APIError):
        return exc.status_code
    if isinstance(exc, (OverloadedError, EngineUnavailableError)):
        return 503
    return 400 if isinstance(exc, ValueError) else 500


def sse_error_event(exc: BaseException) -> str:
    """An error reported inside an already-started SSE stream (headers are gone by then)."""
    message = exc.message if isinstance(exc, APIError) else str(exc)
    return f"data: {json.dumps(error_body(status_for(exc), message))}\n\n"


_SCALAR_TYPE_NAMES = ("str", "int", "float", "bool", "dict")


def _is_union_member(part: str) -> bool:
    """Union members show up in an error's loc as type names ("str", "list[int]", a content part's class)."""
    return any(ch in part for ch in "[]") or part in _SCALAR_TYPE_NAMES or part.endswith("ContentPart")


def _loc(error: dict[str, Any]) -> list[str]:
    return [str(p) for p in error.get("loc", ()) if p != "body"]


def _union_error(errors: list[dict[str, Any]], loc: list[str]) -> Optional[tuple[str, Optional[str]]]:
    """One message for a value that matched no member of a union field (prompt, stop, content).

    Pydantic reports one error per member; the first ("should be a valid string") is misleading
    when the client sent a list. When exactly one member accepted the value's shape and failed
    deeper inside, that member's error is the real one; otherwise say what the field accepts.
    """
    at = next((i for i, p in enumerate(loc) if _is_union_member(p)), None)
    if at is None:
        return None
    prefix = loc[:at]
    members: dict[str, bool] = {}  # member type -> did it fail deeper than its own shape?
    for e in errors:
        e_loc = _loc(e)
        if e_loc[:at] == prefix and len(e_loc) > at and _is_union_member(e_loc[at]):
            members[e_loc[at]] = members.get(e_loc[at], False) or len(e_loc) > at + 1
    deeper = [m for m, deep in members.items() if deep]
    if len(deeper) == 1:
        if deeper[0] == loc[at]:
            return None  # the first error already is the real one
        return describe_validation_errors([e for e in errors if _loc(e)[: at + 1] == prefix + deeper])
    if len(members) < 2:
        return None
    names = list(members)
    expected = ", ".join(names[:-1]) + " or " + names[-1]
    return f"invalid value for field '{'.'.join(prefix)}': expected {expected}", prefix[0]


def describe_validation_errors(errors: list[dict[str, Any]]) -> tuple[str, Optional[str]]:
    """Turn pydantic's error list into one message and the name of the first offending field."""
    first = errors[0]
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        return f"malformed JSON body: {ctx.get('error', first.get('msg'))}", None
    loc = _loc(first)
    union = _union_error(errors, loc)
    if union is not None:
        return union
    field_path = [p for p in loc if not _is_union_member(p)]
    msg = str(first.get("msg", "invalid value"))
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    if first.get("type") == "missing" and field_path:
        return f"missing required field '{'.'.join(field_path)}'", field_path[0]
    if first.get("type") == "extra_forbidden" and field_path:
        return f"unknown field '{'.'.join(field_path)}'", field_path[-1]
    if not field_path:
        if first.get("type") in ("model_type", "dict_type", "model_attributes_type"):
            return ("request body must be a JSON object (sent with Content-Type: application/json)", None)
        return msg, None
    return f"invalid value for field '{'.'.join(field_path)}': {msg}", field_path[0]


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status_code, exc.message, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_errors(list(exc.errors()))
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        route = f"{request.method} {request.url.path}"
        if exc.status_code == 404 and message == "Not Found":
            message = (
                f"no route {route}; plait serves the OpenAI routes /v1/models, /v1/completions, /v1/responses, "
                "/v1/chat/completions and SGLang's native API (/generate, ...)"
            )
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "")
            message = f"method not allowed: {route}" + (f" (allowed: {allowed})" if allowed else "")
        response = error_response(exc.status_code, message)
        response.headers.update(exc.headers or {})
        return response

    @app.exception_handler(OverloadedError)
    async def _overloaded(_: Request, exc: OverloadedError) -> JSONResponse:
        # The tokenizer manager's own queue limit (it also counts requests of in-process callers).
        return error_response(503, str(exc), headers={"Retry-After": "1"})

    @app.exception_handler(EngineUnavailableError)
    async def _engine_unavailable(_: Request, exc: EngineUnavailableError) -> JSONResponse:
        # The scheduler died or the engine is shutting down: /health says 503 too; not the request's fault.
        return error_response(503, str(exc))

    @app.exception_handler(ValueError)
    async def _value_error(_: Request, exc: ValueError) -> JSONResponse:
        # The Engine and SamplingParams raise ValueError for bad input; their messages name the field.
        return error_response(400, str(exc))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error while serving a request")
        return error_response(500, f"internal server error: {type(exc).__name__}: {exc}")
