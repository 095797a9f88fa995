"""Compressed request bodies: `Content-Encoding: gzip` or `deflate` is inflated before a route reads it.

Clients that send large batches compress them (HTTP libraries and gateways do it with one setting).
Without this the route read the compressed bytes as JSON and answered FastAPI's opaque "There was an
error parsing the body". Other encodings (br, zstd, ...) are a 415 that names the supported ones.
"""

from __future__ import annotations

import zlib
from typing import Any

from starlette.exceptions import HTTPException as StarletteHTTPException

from .http_guards import send_json_error

SUPPORTED_ENCODINGS = ("gzip", "deflate")
# NOTE: inflate at most this much per receive: a few KiB of gzip can expand to gigabytes, and the
# body-size limit (BodySizeLimit, which sits inside this middleware) must see the output in pieces.
_INFLATE_STEP = 1 << 20
# zlib's window bits for "a gzip or a zlib header, detected" (HTTP's deflate is the zlib format).
_GZIP_OR_ZLIB = 32 + zlib.MAX_WBITS


class BadRequestBody(StarletteHTTPException):
    """Raised from `receive`; an HTTPException, so FastAPI's body parsing lets it through as a 400."""

    def __init__(self, message: str) -> None:
        super().__init__(status_code=400, detail=message)


def _encoding(scope: dict) -> str:
    for name, value in scope.get("headers") or ():
        if name.lower() == b"content-encoding":
            return value.decode("latin-1").strip().lower()
    return ""


class RequestDecompression:
    """Pure ASGI middleware: the route reads the inflated body. Content-Length goes from the scope (it
    counted the compressed bytes), so the body-size limit counts the inflated ones as they arrive."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        encoding = _encoding(scope) if scope["type"] == "http" else ""
        if encoding in ("", "identity"):
            await self.app(scope, receive, send)
            return
        if encoding not in SUPPORTED_ENCODINGS and encoding != "x-gzip":
            await send_json_error(
                send,
                415,
                f"unsupported Content-Encoding '{encoding}': send the body "
                f"uncompressed or as {' or '.join(SUPPORTED_ENCODINGS)}",
            )
            return
        headers = [
            (k, v) for k, v in scope.get("headers") or () if k.lower() not in (b"content-encoding", b"content-length")
        ]
        inflater = zlib.decompressobj(_GZIP_OR_ZLIB)
        pending = b""  # compressed bytes received but not inflated yet
        more = True  # the client has more body messages to send
        finished = False  # the whole body went to the app

        async def inflated_receive() -> dict:
            nonlocal pending, more, finished
            if finished:  # later reads wait for the disconnect (engine_client's watcher does)
                return await receive()
            while True:
                if pending or not more:
                    data = pending
                else:
                    message = await receive()
                    if message["type"] != "http.request":
                        return message  # a disconnect
                    data, more = message.get("body", b""), message.get("more_body", False)
                try:
                    out = inflater.decompress(data, _INFLATE_STEP)
                except zlib.error as e:
                    raise BadRequestBody(f"request body is not valid {encoding} data: {e}") from None
                pending = inflater.unconsumed_tail
                done = not more and not pending
                if done and not inflater.eof:
                    raise BadRequestBody(f"request body ends inside its {encoding} stream (truncated)")
                if out or done:
                    finished = done
                    return {"type": "http.request", "body": out, "more_body": not done}

        await self.app({**scope, "headers": headers}, inflated_receive, send)
