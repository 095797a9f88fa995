"""CORS (`--allowed-origins`): a web page on another origin may call the server only when the user says so.

Off by default: no CORS header is sent, so browsers keep other origins' pages from reading responses (a page
could otherwise drive a local model server). With a list of origins, or `*`, a pure ASGI middleware:

- answers a preflight (OPTIONS with Access-Control-Request-Method) from an allowed origin with 204 and the
  methods and headers it may use (the requested headers, Authorization included, so an API key works), and
  one from any other origin with a JSON 403 that says why;
- adds Access-Control-Allow-Origin (and the headers a page may read: X-Request-Id, X-Plait-Ignored-Fields)
  to the responses of allowed origins, errors included; other origins' requests go through without them.
"""

from __future__ import annotations

from typing import Any, Iterable

from .http_guards import send_json_error
from .protocol.compat import IGNORED_FIELDS_HEADER

ALLOWED_METHODS = b"GET, POST, DELETE, HEAD, OPTIONS"
EXPOSED_HEADERS = b"x-request-id, " + IGNORED_FIELDS_HEADER.encode()
PREFLIGHT_MAX_AGE_S = b"600"


class CORS:
    def __init__(self, app: Any, allowed_origins: Iterable[str]) -> None:
        self.app = app
        origins = set(allowed_origins)
        self.any_origin = "*" in origins
        self.origins = {o.rstrip("/").encode() for o in origins - {"*"}}

    def allows(self, origin: bytes) -> bool:
        return self.any_origin or origin in self.origins

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        origin = headers.get(b"origin")
        if origin is None:  # not a cross-origin request from a browser
            await self.app(scope, receive, send)
            return
        if scope.get("method") == "OPTIONS" and b"access-control-request-method" in headers:
            await self._preflight(origin, headers, send)
            return
        if not self.allows(origin):
            await self.app(scope, receive, send)
            return

        async def send_with_cors(message: dict) -> None:
            if message["type"] == "http.response.start":
                extra = [
                    (b"access-control-allow-origin", self._allow_origin(origin)),
                    (b"access-control-expose-headers", EXPOSED_HEADERS),
                    (b"vary", b"Origin"),
                ]
                message = {**message, "headers": list(message.get("headers") or []) + extra}
            await send(message)

        await self.app(scope, receive, send_with_cors)

    def _allow_origin(self, origin: bytes) -> bytes:
        return b"*" if self.any_origin else origin

    async def _preflight(self, origin: bytes, headers: dict, send: Any) -> None:
        if not self.allows(origin):
            await send_json_error(
                send,
                403,
                f"origin {origin.decode('latin-1')!r} is not allowed to call this "
                "server from a browser (start it with --allowed-origins to allow it)",
            )
            return
        requested = headers.get(b"access-control-request-headers")
        response = [
            (b"access-control-allow-origin", self._allow_origin(origin)),
            (b"access-control-allow-methods", ALLOWED_METHODS),
            (b"access-control-max-age", PREFLIGHT_MAX_AGE_S),
            (b"vary", b"Origin"),
            (b"content-length", b"0"),
        ]
        if requested:
            response.append((b"access-control-allow-headers", requested))
        await send({"type": "http.response.start", "status": 204, "headers": response})
        await send({"type": "http.response.body", "body": b""})
