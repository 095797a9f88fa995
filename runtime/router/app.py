"""`plait router`: one address in front of replicas (`plait serve` processes, on any machines).

Native (`/generate`) and OpenAI (`/v1/completions`, `/v1/chat/completions`) requests go to the replica
the policy picks (policy.py) and come back as the replica wrote them: a stream is passed through chunk
by chunk as it arrives. A replica that cannot be reached, or answers 503, gets the request of nobody
who has seen a byte of it yet: the request is sent to the next replica (once to each). One that fails
mid-stream ends that stream with an error event naming it. Unreachable replicas are taken out at once;
the health checks (replicas.py) take out the ones whose /health fails and bring back the ones that
recover. The router's own `/metrics` counts what it routed where and why.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any, AsyncIterator, Hashable, Optional, Sequence

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .args import RouterArgs
from .metrics import RouterMetrics
from .policy import make_policy
from .replicas import ReplicaSet

logger = logging.getLogger("plait.router")

ROUTED = ("/generate", "/v1/completions", "/v1/chat/completions")
PASSED_HEADERS = ("authorization", "content-type", "content-encoding", "accept")
REPLICA_HEADER = "X-Plait-Replica"


def error_json(status: int, message: str) -> JSONResponse:
    kind = "server_overloaded" if status == 503 else ("server_error" if status >= 500 else "invalid_request_error")
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": status}}, status_code=status
    )


def routing_key(route: str, payload: Any) -> Sequence[Hashable]:
    """What the prefix tree is keyed on: the prompt's text (characters) or token ids, after its cache
    namespace if it has one (`cache_namespace`); () when the body names no prompt (the policy then
    balances)."""
    if not isinstance(payload, dict):
        return ()
    key = _prompt_key(route, payload)
    namespace = cache_namespace(route, payload)
    if not key or namespace is None:
        return key
    # A replica's prefix cache shares nothing across namespaces, so neither does the tree: the same text
    # under two adapters (or two salts) are two prefixes. Text keys stay strings (a marker string first);
    # token ids get one marker item that no token id equals.
    if isinstance(key, str):
        return f"\x00{namespace!r}\x00{key}"
    return (namespace, *key)


def cache_namespace(route: str, payload: dict) -> Optional[tuple[Optional[str], Optional[str]]]:
    """The (LoRA adapter, cache_salt) a request's prefixes are cached under, None for the base model
    unsalted. /generate names its adapter in `lora_path`; an OpenAI route in `model` (SGLang's
    "base:adapter", or vLLM's bare adapter name: the router cannot tell that from the served model's
    name, so any model name is a namespace there; the same name always routes alike)."""
    adapter = payload.get("lora_path") if route == "/generate" else payload.get("model")
    if isinstance(adapter, str) and route != "/generate":
        adapter = adapter.rpartition(":")[2] or None
    salt = payload.get("cache_salt")
    adapter = adapter if isinstance(adapter, str) and adapter else None
    salt = salt if isinstance(salt, str) and salt else None
    return None if adapter is None and salt is None else (adapter, salt)


def _prompt_key(route: str, payload: dict) -> Sequence[Hashable]:
    if route == "/v1/chat/completions":
        messages = payload.get("messages")
        if not isinstance(messages, list):
            return ()
        return "".join(f"<{m.get('role')}>{_content_text(m.get('content'))}" for m in messages if isinstance(m, dict))
    prompt = payload.get("text") if route == "/generate" else payload.get("prompt")
    if prompt is None and route == "/generate":
        prompt = payload.get("input_ids")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch goes to one replica: keyed on its first prompt
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return tuple(prompt)
    return ()


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


class Router:
    def __init__(self, args: RouterArgs):
        self.args = args
        self.policy = make_policy(args)
        self.replicas = ReplicaSet(args.worker_urls, args.health_failure_threshold, self.policy.forget)
        self.metrics = RouterMetrics(args.worker_urls)
        self.session: Optional[aiohttp.ClientSession] = None
        self._checks: Optional[asyncio.Task] = None

    async def start(self) -> None:
        # NOTE: no connection limit: the router's concurrency is its clients'; no total timeout on the
        # session (streams last as long as their generation), a read timeout per request instead.
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)
        self._checks = asyncio.create_task(self._check_loop())

    async def stop(self) -> None:
        if self._checks is not None:
            self._checks.cancel()
        if self.session is not None:
            await self.session.close()

    async def _check_loop(self) -> None:
        while True:
            await self.replicas.check_all(self.session, timeout_s=min(10.0, self.args.health_check_interval * 2))
            self.metrics.set_health(self.replicas)
            await asyncio.sleep(self.args.health_check_interval)

    # ------------------------------------------------------------------ routing
    async def route(self, route: str, request: Request) -> Response:
        body = await request.body()
        try:
            payload = json.loads(body)
        except ValueError:
            payload = None  # the replica answers the 400 (or the body is compressed): routed without a key
        key = routing_key(route, payload)
        streamed = isinstance(payload, dict) and bool(payload.get("stream"))
        headers = {k: v for k, v in request.headers.items() if k.lower() in PASSED_HEADERS}
        tried: set[str] = set()
        last_error = "no replica is healthy"
        while True:
            candidates = [u for u in self.replicas.healthy() if u not in tried]
            if not candidates:
                self.metrics.failed.inc()
                return error_json(503, f"no replica could take the request: {last_error}")
            choice = self.policy.choose(key, candidates, self.replicas.load())
            tried.add(choice.replica)
            self.metrics.routed(choice, route, len(key))
            if tried != {choice.replica}:
                self.metrics.retries.inc()
            outcome = await self._send(choice.replica, route, body, headers, streamed)
            if isinstance(outcome, Response):
                return outcome
            last_error = outcome  # not sent anywhere yet: the next replica

    async def _send(self, url: str, route: str, body: bytes, headers: dict, streamed: bool):
        """The replica's response, or why it could not take the request (a string: try another)."""
        replica = self.replicas.replicas[url]
        timeout = aiohttp.ClientTimeout(
            total=None if streamed else self.args.request_timeout, sock_read=self.args.request_timeout
        )
        replica.in_flight += 1
        release = True
        try:
            resp = await self.session.post(url + route, data=body, headers=headers, timeout=timeout)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            replica.in_flight -= 1
            why = f"{url} unreachable ({type(e).__name__}: {e})"
            self.metrics.error(url, "unreachable")
            self.replicas.mark_down(url, why)
            return why
        try:
            if resp.status == 503:  # its scheduler is gone or it is full: someone else may take it
                text = (await resp.read()).decode(errors="replace")
                self.metrics.error(url, "503")
                return f"{url} answered 503: {text[:300]}"
            out_headers = {"content-type": resp.headers.get("content-type", "application/json"), REPLICA_HEADER: url}
            if streamed and resp.status == 200:
                release = False  # the stream releases it when it ends
                return StreamingResponse(self._pass_through(url, resp), status_code=200, headers=out_headers)
            data = await resp.read()
            if resp.headers.get("content-encoding"):
                out_headers["content-encoding"] = resp.headers["content-encoding"]
            replica.served += 1
            return Response(data, status_code=resp.status, headers=out_headers)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            why = f"{url} failed while answering ({type(e).__name__}: {e})"
            self.metrics.error(url, "broken")
            self.replicas.mark_down(url, why)
            return why
        finally:
            if release:
                resp.release()
                replica.in_flight -= 1

    async def _pass_through(self, url: str, resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
        replica = self.replicas.replicas[url]
        try:
            async for chunk in resp.content.iter_any():
                yield chunk
            replica.served += 1
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            why = f"replica {url} failed mid-stream ({type(e).__name__}: {e})"
            self.metrics.error(url, "mid_stream")
            self.replicas.mark_down(url, why)
            err = {"error": {"message": why, "type": "server_error", "param": None, "code": 502}}
            yield f"data: {json.dumps(err)}\n\n".encode()
        finally:  # (also when the client went away: closing the response tells the replica to abort)
            resp.close()
            replica.in_flight -= 1

    async def forward_get(self, path: str, request: Request) -> Response:
        """A GET any replica can answer (/v1/models, /get_model_info): the first healthy one."""
        headers = {k: v for k, v in request.headers.items() if k.lower() in PASSED_HEADERS}
        for url in self.replicas.healthy():
            try:
                async with self.session.get(
                    url + path, headers=headers, timeout=aiohttp.ClientTimeout(total=30)
                ) as resp:
                    return Response(
                        await resp.read(),
                        status_code=resp.status,
                        headers={"content-type": resp.headers.get("content-type", "application/json")},
                    )
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                self.replicas.mark_down(url, f"{url} unreachable ({type(e).__name__}: {e})")
        return error_json(503, "no replica is healthy")

    async def broadcast_post(self, path: str, request: Request) -> Response:
        """A POST every healthy replica must get (/flush_cache): 200 when all answered 200."""
        headers = {k: v for k, v in request.headers.items() if k.lower() in PASSED_HEADERS}
        body = await request.body()

        async def one(url: str):
            try:
                async with self.session.post(
                    url + path, data=body, headers=headers, timeout=aiohttp.ClientTimeout(total=60)
                ) as resp:
                    return url, resp.status, (await resp.read()).decode(errors="replace")
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                return url, 503, f"{type(e).__name__}: {e}"

        results = await asyncio.gather(*(one(u) for u in self.replicas.healthy()))
        ok = bool(results) and all(status == 200 for _, status, _ in results)
        return JSONResponse(
            {"replicas": {u: {"status": s, "body": b[:500]} for u, s, b in results}}, status_code=200 if ok else 503
        )


def create_router_app(args: RouterArgs) -> FastAPI:
    router = Router(args)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="plait router", lifespan=lifespan)
    app.state.router = router

    for path in ROUTED:

        async def handler(request: Request, _path: str = path) -> Response:
            started = time.perf_counter()
            try:
                return await router.route(_path, request)
            finally:
                router.metrics.latency.labels(_path).observe(time.perf_counter() - started)

        app.add_api_route(path, handler, methods=["POST"])

    @app.get("/health")
    async def health() -> Response:
        healthy = router.replicas.healthy()
        if not healthy:
            return error_json(
                503,
                "no replica is healthy: "
                + "; ".join(f"{r['url']}: {r['last_error']}" for r in router.replicas.status()),
            )
        return JSONResponse({"healthy_replicas": len(healthy)})

    @app.get("/metrics")
    async def metrics() -> Response:
        router.metrics.set_health(router.replicas)
        return Response(router.metrics.render(), media_type=router.metrics.content_type)

    @app.get("/get_server_info")
    async def server_info() -> Response:
        return JSONResponse({"policy": router.policy.name, "replicas": router.replicas.status()})

    for path in ("/v1/models", "/get_model_info"):

        async def get_handler(request: Request, _path: str = path) -> Response:
            return await router.forward_get(_path, request)

        app.add_api_route(path, get_handler, methods=["GET"])

    @app.post("/flush_cache")
    async def flush_cache(request: Request) -> Response:
        return await router.broadcast_post("/flush_cache", request)

    return app


def launch_router(args: RouterArgs) -> None:
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logger.info(
        "plait router on http://%s:%d over %d replicas (%s)", args.host, args.port, len(args.worker_urls), args.policy
    )
    uvicorn.run(
        create_router_app(args),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=args.log_level == "debug",
        timeout_graceful_shutdown=5,
    )
