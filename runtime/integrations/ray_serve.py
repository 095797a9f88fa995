"""plait on Ray Serve: replicas of a plait server as a Ray Serve deployment, behind an OpenAI ingress that
routes each request to the replica holding its prefix (ray_router.py).

    from plait.runtime.integrations.ray_serve import build_app
    app = build_app({"max_total_tokens": 65536}, num_replicas=2)      # ServerArgs fields, as plait serve's
    serve.run(app)                                                      # or `serve run deploy/ray/plait.yaml`

Why not Ray Serve LLM's own classes (`ray.serve.llm`: `LLMConfig(server_cls=...)`, `build_openai_app`)?
In Ray 2.60 importing them needs vLLM's or SGLang's request models installed (its OpenAI protocol is theirs),
and `ray[llm]` pins a vLLM build with its own CUDA torch, so that API cannot be installed beside plait. This
module stands on Ray Serve's core public API instead (deployments, handles, `RequestRouter`), which
`ray[serve]` installs alone; it plays the same parts: `PlaitServer` is the server class (one Engine per
replica, health for Serve's checks, `reset_prefix_cache`, `tokenize` / `detokenize`), `PlaitIngress` the
OpenAI app, `build_app` the builder.

Each replica runs plait's whole HTTP app over its Engine on a loopback port (so every route behaves as under
`plait serve`: chat templates, tools, structured outputs, streams) and the ingress hands it each request's
body through a deployment handle, where the router sees the prompt. A tensor-parallel replica
(`tp_size` > 1) reserves its devices as one placement-group bundle: the Engine starts its rank processes
itself, on that node, over the GPUs Ray gave the replica.
"""

# NOTE: no `from __future__ import annotations` here: Ray Serve's ingress rewrites the routes' signatures and
# needs `request: Request` as a class, not a string, or FastAPI reads it as a body field.
import json
import logging
import socket
import threading
import time
from typing import Any, AsyncIterator, Optional

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.config import RequestRouterConfig

from ..engine.engine import Engine
from ..server.http_server import create_app
from ..server_args import ServerArgs

logger = logging.getLogger("plait.ray_serve")

REPLICA_HEADER = "X-Plait-Replica"
_ROUTER = "plait.runtime.integrations.ray_router:PlaitPrefixRouter"


class PlaitServer:
    """One replica: a plait Engine and its HTTP app on a loopback port. `forward` / `stream` pass a route's
    JSON body through; the rest is what Ray Serve and an operator call."""

    def __init__(self, engine_kwargs: dict[str, Any]) -> None:
        self.engine = Engine(**engine_kwargs)
        self.replica = _replica_id()
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        import uvicorn

        app = create_app(self.engine, self.engine.server_args)
        self._http = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self._thread = threading.Thread(target=self._http.run, name="plait-replica-http", daemon=True)
        self._thread.start()
        deadline = time.time() + 120
        while not self._http.started:
            if not self._thread.is_alive() or time.time() > deadline:
                raise RuntimeError("the replica's HTTP app did not start")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{port}"
        self._session: Optional[aiohttp.ClientSession] = None

    def _client(self) -> aiohttp.ClientSession:
        # (made on first use: a session belongs to the event loop it was made on, the replica's)
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        return self._session

    async def forward(self, route: str, body: dict[str, Any]) -> tuple[int, Any, str]:
        """(status, JSON answer, this replica's id) of `route` for `body`, not streamed."""
        async with self._client().post(self.url + route, json=body) as resp:
            return resp.status, await resp.json(content_type=None), self.replica

    async def forward_get(self, route: str) -> tuple[int, Any, str]:
        """(status, JSON answer, this replica's id) of a GET route (the model's and the server's info)."""
        async with self._client().get(self.url + route) as resp:
            return resp.status, await resp.json(content_type=None), self.replica

    async def stream(self, route: str, body: dict[str, Any]) -> AsyncIterator[bytes]:
        """The route's streamed answer, chunk by chunk as the app writes it (SSE for the OpenAI routes);
        the first item is the status and replica as JSON bytes."""
        async with self._client().post(self.url + route, json=body) as resp:
            yield json.dumps({"status": resp.status, "replica": self.replica}).encode()
            async for chunk in resp.content.iter_any():
                yield chunk

    async def check_health(self) -> None:
        """Ray Serve's health check: raising marks the replica unhealthy, and Serve replaces it."""
        dead = getattr(self.engine.tokenizer_manager, "dead_reason", None)
        if dead or not self._thread.is_alive():
            raise RuntimeError(f"plait replica {self.replica} is down: {dead or 'its HTTP app stopped'}")

    def reset_prefix_cache(self) -> bool:
        return self.engine.flush_cache()

    def tokenize(self, text: str) -> list[int]:
        return self.engine.tokenizer.encode(text)

    def detokenize(self, token_ids: list[int]) -> str:
        return self.engine.tokenizer.decode(token_ids)

    def stats(self) -> dict[str, Any]:
        """This replica's id and the scheduler's counters (cached and prompt tokens among them)."""
        return {"replica": self.replica, **self.engine.get_stats()}

    def __del__(self) -> None:
        http = getattr(self, "_http", None)
        if http is not None:
            http.should_exit = True
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - constructed outside Serve (a test, a script)
        return "local"


def build_app(
    engine_kwargs: Optional[dict[str, Any]] = None,
    *,
    num_replicas: int = 1,
    autoscaling_config: Optional[dict[str, Any]] = None,
    policy: str = "cache_aware",
    replica_cpus: float = 1.0,
    max_ongoing_requests: int = 64,
    health_check_period_s: float = 10.0,
) -> Any:
    """The Serve application: `PlaitServer` replicas (`engine_kwargs` are ServerArgs fields, checked here
    before anything starts) behind `PlaitIngress`, routed by `policy` ("cache_aware" or "round_robin")."""
    engine_kwargs = dict(engine_kwargs or {})
    args = ServerArgs.from_kwargs(**engine_kwargs)
    devices = args.world_size() if args.resolved_device() == "cuda" else 0
    options: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": replica_cpus, "num_gpus": devices},
        "max_ongoing_requests": max_ongoing_requests,
        "health_check_period_s": health_check_period_s,
        "request_router_config": RequestRouterConfig(
            request_router_class=_ROUTER, request_router_kwargs={"policy": policy}
        ),
    }
    if autoscaling_config is not None:
        options["autoscaling_config"] = autoscaling_config
    else:
        options["num_replicas"] = num_replicas
    if devices > 1:  # the replica's ranks on one node, together
        options["placement_group_bundles"] = [{"CPU": replica_cpus, "GPU": devices}]
        options["placement_group_strategy"] = "STRICT_PACK"
    server = serve.deployment(PlaitServer, name="PlaitServer", **options).bind(engine_kwargs)
    model_name = args.served_model_name or args.model_path or "SmolLM2-135M-Instruct"
    ingress = serve.deployment(PlaitIngress, name="PlaitIngress", ray_actor_options={"num_cpus": 0})
    return ingress.bind(server, model_name)


_app = FastAPI(title="plait on Ray Serve")


@serve.ingress(_app)
class PlaitIngress:
    """The OpenAI (and SGLang native) routes of the application: each body passed to a replica chosen by
    the deployment's router; a replica that died mid-request answers 503, so a client's retry goes on."""

    def __init__(self, server: Any, model_name: str) -> None:
        self.server = server
        self.model_name = model_name

    @_app.get("/health")
    async def health(self) -> Response:
        return Response(status_code=200)

    @_app.get("/v1/models")
    async def models(self) -> JSONResponse:
        card = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "plait"}
        return JSONResponse({"object": "list", "data": [card]})

    @_app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._route("/v1/completions", request)

    @_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._route("/v1/chat/completions", request)

    @_app.post("/generate")
    async def generate(self, request: Request) -> Response:
        return await self._route("/generate", request)

    # The routes a DSL `RuntimeEndpoint` reads before it sends requests: any replica answers for all.
    @_app.get("/get_model_info")
    async def get_model_info(self) -> Response:
        return await self._get("/get_model_info")

    @_app.get("/get_server_info")
    async def get_server_info(self) -> Response:
        return await self._get("/get_server_info")

    async def _get(self, route: str) -> Response:
        try:
            status, answer, replica = await self.server.forward_get.remote(route)
        except Exception as e:  # noqa: BLE001 - the replica died mid-request
            return _error(503, f"the replica serving this request went away ({type(e).__name__}); retry")
        return JSONResponse(answer, status_code=status, headers={REPLICA_HEADER: replica})

    async def _route(self, route: str, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object")
        try:
            if body.get("stream"):
                return await self._streamed(route, body)
            status, answer, replica = await self.server.forward.remote(route, body)
        except Exception as e:  # noqa: BLE001 - the replica died or was taken out mid-request
            logger.warning("replica call failed for %s: %s", route, e)
            return _error(503, f"the replica serving this request went away ({type(e).__name__}); retry")
        return JSONResponse(answer, status_code=status, headers={REPLICA_HEADER: replica})

    async def _streamed(self, route: str, body: dict) -> Response:
        chunks = self.server.options(stream=True).stream.remote(route, body)
        head = json.loads(await chunks.__anext__())

        async def rest() -> AsyncIterator[bytes]:
            async for chunk in chunks:
                yield chunk

        return StreamingResponse(
            rest(),
            status_code=head["status"],
            media_type="text/event-stream",
            headers={REPLICA_HEADER: head["replica"]},
        )


def _error(status: int, message: str) -> JSONResponse:
    kind = "server_overloaded" if status == 503 else "invalid_request_error"
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": status}}, status_code=status
    )


def app_builder(args: dict[str, Any]) -> Any:
    """A Serve config's `import_path` (`serve run deploy/ray/plait.yaml`): `build_app` with the config's `args`."""
    return build_app(**args)
