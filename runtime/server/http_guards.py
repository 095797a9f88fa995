"""HTTP that never reaches a route: request bodies past a size limit, bytes that are not HTTP, and the
paths that answer without the API key.

Both answer with the server's one JSON error shape (errors.py), so a client that sent something broken
reads the same `{"error": {...}}` it reads everywhere else instead of uvicorn's plain text.
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

from starlette.exceptions import HTTPException as StarletteHTTPException

from .errors import error_body

# NOTE: the largest real request is a batch of long prompts as token ids (~7 bytes an id): 64 MiB is
# about 64 prompts of 128k tokens. Without a limit a client could make the server buffer gigabytes.
MAX_REQUEST_BODY_BYTES = 64 << 20


# NOTE: load balancers probe /health and it reveals nothing. SGLang leaves /metrics and /health_generate open
# under its API key too, so a Prometheus scrape or a Kubernetes probe written for SGLang sends no key: behind
# the key they would fail on plait. `require_api_key_for_probes` closes those two (not /health).
ALWAYS_OPEN_PATHS = frozenset({"/health"})
PROBE_PATHS = frozenset({"/metrics", "/health_generate"})


def paths_without_api_key(server_args: Any) -> frozenset:
    """The paths the API key does not guard under these settings."""
    return ALWAYS_OPEN_PATHS if server_args.require_api_key_for_probes else ALWAYS_OPEN_PATHS | PROBE_PATHS


def body_too_large_message(limit: int) -> str:
    return f"request body is too large: the limit is {limit} bytes"


class BodyTooLarge(StarletteHTTPException):
    """Raised from `receive` while a route reads its body. An HTTPException, so FastAPI's body parsing
    passes it through (other errors it turns into a 400) and the app's handler answers 413."""

    def __init__(self, limit: int) -> None:
        super().__init__(status_code=413, detail=body_too_large_message(limit))


def _declared_length(scope: dict) -> int | None:
    for name, value in scope.get("headers") or ():
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP parser refuses such a request before the app sees it
    return None


class BodySizeLimit:
    """Pure ASGI middleware: 413 for a body past `limit` bytes. A declared Content-Length is refused before
    a byte of the body is read; a chunked body is counted as it arrives and refused once it passes."""

    def __init__(self, app: Any, limit: int = MAX_REQUEST_BODY_BYTES) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _declared_length(scope)
        if declared is not None and declared > self.limit:
            await send_json_error(send, 413, body_too_large_message(self.limit))
            return
        received = 0

        async def receive_within_limit() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        await self.app(scope, receive_within_limit, send)


async def send_json_error(send: Any, status: int, message: str) -> None:
    body = json.dumps(error_body(status, message)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def malformed_http_response(reason: str) -> bytes:
    """A whole HTTP/1.1 400 response (JSON body) for bytes the HTTP parser could not read."""
    return json_error_response(400, f"malformed HTTP request: {reason}")


def json_error_response(status: int, message: str) -> bytes:
    """A whole HTTP/1.1 error response with the server's JSON error body, closing the connection."""
    body = json.dumps(error_body(status, message)).encode()
    head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % (
        status,
        HTTPStatus(status).phrase.encode(),
        len(body),
    )
    return head + body


def declared_length_in_head(raw: bytes) -> int | None:
    """The Content-Length a request's head in `raw` declares (digits only), or None."""
    head = raw.split(b"\r\n\r\n", 1)[0]
    for line in head.split(b"\r\n")[1:]:
        name, sep, value = line.partition(b":")
        if sep and name.strip().lower() == b"content-length" and value.strip().isdigit():
            return int(value.strip())
    return None


def json_error_protocol_class() -> type:
    """The HTTP/1.1 protocol uvicorn would pick (httptools if installed, else h11) with its plain-text 400
    for unparseable requests (bad Content-Length, a non-ASCII request target, ...) turned into JSON."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base

    class JsonErrorHTTPProtocol(base):  # type: ignore[misc, valid-type]
        _received = b""  # the last bytes read: what a parse error came from

        def data_received(self, data: bytes) -> None:
            self._received = data
            super().data_received(data)

        def send_400_response(self, msg: str) -> None:
            # NOTE: called only before a response has started (the parser failed on the request), and
            # the connection closes right after, so writing the bytes directly keeps no parser state wrong.
            declared = declared_length_in_head(self._received)
            if declared is not None and declared > MAX_REQUEST_BODY_BYTES:
                # httptools refuses a Content-Length past 64 bits as unparseable; h11 hands it to the app,
                # whose BodySizeLimit answers 413. The same answer either way.
                self.transport.write(json_error_response(413, body_too_large_message(MAX_REQUEST_BODY_BYTES)))
            else:
                self.transport.write(malformed_http_response(msg))
            self.transport.close()

    return JsonErrorHTTPProtocol
