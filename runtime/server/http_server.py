"""The FastAPI app over an Engine, and `launch_server` (Engine + uvicorn, one log line when ready).

`create_app(engine, server_args)` works with any object that has the Engine's methods, so the same
app serves an in-process Engine in tests and in `plait serve`.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import secrets
import time
import uuid
from typing import Any, Optional

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from ..server_args import ServerArgs
from .cors import CORS
from .errors import error_body, install_error_handlers
from .http_guards import BodySizeLimit, json_error_protocol_class, paths_without_api_key
from .lora_api import router as lora_router
from .metrics import CONTENT_TYPE
from .native_api import router as native_router
from .openai.api import router as openai_router
from .openai.chat import router as chat_router
from .openapi_schema import install_openapi
from .protocol.compat import IGNORED_FIELDS_HEADER
from .request_encoding import RequestDecompression
from .responses.api import router as responses_router
from .server_context import ServerContext, get_context

logger = logging.getLogger("plait.server")


class BearerAuth:
    """Pure ASGI middleware (not BaseHTTPMiddleware, which would get between the route and the
    client's `http.disconnect` that aborts requests): 401 unless `Authorization: Bearer <api_key>`."""

    def __init__(self, app: Any, api_key: str, open_paths: frozenset = frozenset({"/health"})) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._open_paths = open_paths

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") in self._open_paths or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        if secrets.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
            return
        body = json.dumps(error_body(401, "missing or invalid API key: send 'Authorization: Bearer <key>'")).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"www-authenticate", b"Bearer"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


class ResponseHeaders:
    """Pure ASGI middleware for the headers every response may carry:

    - `X-Request-Id`, which clients log and quote (the openai client exposes it as `_request_id`). A
      client's own X-Request-Id is echoed, as vLLM does; otherwise the id of the response body
      (`chatcmpl-...`, which the route puts in request.state), else a fresh one, so even an error can be
      traced.
    - `X-Plait-Ignored-Fields`: the request's top-level fields that no API defines, which the route
      ignored (protocol.compat.review puts them in request.state), so a client can see a typo."""

    REQUEST_ID = b"x-request-id"
    IGNORED = IGNORED_FIELDS_HEADER.encode()

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = dict(scope.get("headers") or []).get(self.REQUEST_ID)

        async def send_with_headers(message: dict) -> None:
            if message["type"] == "http.response.start":
                state = scope.get("state") or {}
                request_id = incoming or str(state.get("request_id") or uuid.uuid4().hex).encode()
                headers = [h for h in message.get("headers") or [] if h[0].lower() != self.REQUEST_ID]
                headers.append((self.REQUEST_ID, request_id))
                if state.get("ignored_fields"):
                    headers.append((self.IGNORED, _header_list(state["ignored_fields"])))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)


def _header_list(names: list[str], limit: int = 20) -> bytes:
    """Field names as one header value: JSON-escaped to printable ASCII (a key may hold any character,
    a header value may not), at most `limit` of them."""
    shown = [json.dumps(n)[1:-1] for n in names[:limit]]
    if len(names) > limit:
        shown.append(f"... ({len(names) - limit} more)")
    return ", ".join(shown).encode("ascii")


def create_app(engine: Any, server_args: Optional[ServerArgs] = None) -> FastAPI:
    server_args = server_args or getattr(engine, "server_args", None) or ServerArgs()
    # strict_content_type=False: a body without a Content-Type header is still read as JSON.
    app = FastAPI(title="plait", docs_url=None, redoc_url=None, openapi_url="/openapi.json", strict_content_type=False)
    install_openapi(app)
    ctx = ServerContext.build(engine, server_args)
    ctx.started_at = time.time()
    app.state.plait = ctx
    install_error_handlers(app)
    app.include_router(native_router)
    app.include_router(lora_router)
    app.include_router(openai_router)
    app.include_router(chat_router)
    app.include_router(responses_router)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics(request: Request) -> Response:
        c = get_context(request)
        try:
            info = await asyncio.to_thread(c.engine.get_server_info)
        except Exception:  # metrics must not fail because the scheduler is busy or gone
            logger.exception("get_server_info failed while rendering /metrics")
            info = None
        return Response(c.metrics.render(info), media_type=CONTENT_TYPE)

    if server_args.api_key:
        app.add_middleware(BearerAuth, api_key=server_args.api_key, open_paths=paths_without_api_key(server_args))
    if server_args.allowed_origins:  # outside the auth: a 401 is readable by an allowed page too
        app.add_middleware(CORS, allowed_origins=server_args.allowed_origins)
    app.add_middleware(BodySizeLimit)
    app.add_middleware(RequestDecompression)  # outside BodySizeLimit, which then counts inflated bytes
    app.add_middleware(ResponseHeaders)  # added last = outermost: a 401 carries the request id too
    return app


def launch_server(server_args: ServerArgs) -> None:
    """Build the Engine, serve until SIGINT/SIGTERM, then shut the Engine down (`plait serve` goes
    through launch.py, which loads this module while the engine starts)."""
    from .launch import launch_server as launch

    launch(server_args)


def serve(engine: Any, server_args: ServerArgs) -> None:
    """Serve `engine` (an Engine) on its own event loop until SIGINT/SIGTERM (its shutdown is the caller's)."""
    app = create_app(engine, server_args)
    ctx: ServerContext = app.state.plait
    config = uvicorn.Config(
        app,
        host=server_args.host,
        port=server_args.port,
        log_level=server_args.log_level,
        access_log=server_args.log_level == "debug",
        http=json_error_protocol_class(),
        timeout_graceful_shutdown=5,
    )
    ready = (
        f"plait server ready on http://{server_args.host}:{server_args.port} "
        f"(model {ctx.model_name}, context {ctx.context_len})"
    )
    server = _ReadyLoggingServer(config, ready)

    async def serving() -> Any:
        try:
            await server.serve()
        except SystemExit as e:
            # uvicorn exits when it cannot start (a port in use); on the engine's loop that would end the
            # loop's thread and leave this one waiting for it: the exit is raised here instead.
            return e.code
        return None

    # NOTE: served on the engine's own loop, the routes read its streams with no thread hop per chunk
    # (engine/streams.py). The signals are caught here, on the main thread: they ask uvicorn to shut
    # down gracefully there, as they do when uvicorn runs its own loop.
    with server.capture_signals():
        exit_code = engine.run_on_loop(serving())
    if exit_code is not None:
        raise SystemExit(exit_code)


class _ReadyLoggingServer(uvicorn.Server):
    """Logs one line once the socket listens (lifespan startup runs before the bind, so the app
    itself cannot know when it becomes reachable)."""

    def __init__(self, config: uvicorn.Config, ready_message: str) -> None:
        super().__init__(config)
        self._ready_message = ready_message

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            logger.info(self._ready_message)
            freeze_startup_heap()
            warm_validators()


def freeze_startup_heap() -> None:
    """Move what start-up allocated (FastAPI, pydantic, the tokenizer, the engine) out of the garbage
    collector's reach, and collect the young generation less often.

    NOTE: every chunk of every stream allocates a few container objects (the scheduler's outputs, a
    delta, its JSON event), so under hundreds of streams the young collections ran hundreds of times a
    second and the full ones walked the whole start-up heap; that was a large share of the server's time
    per chunk. Cycles are still collected, later."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20000, 50, 100)


def warm_validators() -> None:
    """Load the grammar backends' schema validators on a daemon thread, once the server listens.

    NOTE: they bring torch, transformers and xgrammar into this process (seconds of imports); loaded at
    import, that came before the engine's scheduler process was even launched. Loaded here, while the
    server is idle, the first request with a schema rarely waits for them (one that does waits on the
    import, not longer)."""
    import importlib
    import threading

    threading.Thread(
        target=importlib.import_module,
        args=("plait.runtime.constrained.validation",),
        name="plait-warm-validators",
        daemon=True,
    ).start()
