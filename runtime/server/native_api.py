"""SGLang's native HTTP API: /generate and the management routes, same fields as SGLang.

Responses are the Engine's dicts unchanged (`text`, `output_ids`, `meta_info`), so SGLang's own
clients and bench scripts parse them. Streaming chunks carry cumulative text, like SGLang's default (folded
here from the Engine's deltas).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Optional, Union

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..request_options import RequestOptionError, RequestOptions, expand_samples, is_sample_of, new_rid
from ..sampling_params import SamplingParams
from .engine_client import GenerationGroup
from .errors import APIError, error_response, sse_error_event
from .protocol.compat import NATIVE, review
from .protocol.native import AbortRequest, GenerateRequest, PinPrefixRequest, UnpinPrefixRequest
from .protocol.openai import MAX_N
from .server_context import ServerContext, get_context
from .sse import SSE_DONE, CumulativeEvents

router = APIRouter()

# Top-level fields of a /generate body that belong inside sampling_params (and OpenAI's name for one):
# ignoring them would silently change the answer.
MISPLACED_SAMPLING_FIELDS = frozenset(SamplingParams.field_names()) | {"max_tokens"}
_HEALTH_GENERATE_TIMEOUT_S = 30.0


# ---------------------------------------------------------------- request → Engine calls


def verified_sampling_params(
    params: Optional[dict[str, Any]],
    ctx: ServerContext,
    label: str = "sampling_params",
    param: Optional[str] = "sampling_params",
) -> SamplingParams:
    """Parse and range-check a sampling_params dict; SamplingParams' messages name the field (400)."""
    try:
        sp = SamplingParams.from_dict(_sglang_names(params))
        sp.verify(ctx.vocab_size)  # also the seed's 64-bit range and float32-finite logit biases
    except (ValueError, TypeError) as e:
        raise APIError(400, f"invalid {label}: {e}", param=param) from None
    if sp.n > MAX_N:
        # NOTE: n becomes n Engine calls built up front (expand_n): n = 1e30 blocked the event loop forever.
        raise APIError(400, f"invalid {label}: n must be <= {MAX_N}, got {sp.n}", param=param)
    return sp


def _sglang_names(params: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """Current SGLang's `sampling_seed` is plait's `seed`."""
    if not isinstance(params, dict) or "sampling_seed" not in params:
        return params
    params = dict(params)
    seed = params.pop("sampling_seed")
    if params.get("seed") is not None and seed is not None and params["seed"] != seed:
        raise ValueError(f"seed ({params['seed']}) and sampling_seed ({seed}) differ: give one")
    if seed is not None:
        params["seed"] = seed
    return params


def check_unicode(text: str, label: str, param: str) -> None:
    """JSON may escape lone surrogates ("\\ud800"), which no tokenizer can encode (a 500 without this)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"{label} is not valid Unicode: {e.reason} (character {e.start})", param=param) from None


def check_prompt_ids(ids: list[int], ctx: ServerContext, field_name: str) -> None:
    if not ids:
        raise APIError(400, f"{field_name} must not be empty", param=field_name)
    if ctx.vocab_size is not None:
        bad = next((t for t in ids if t < 0 or t >= ctx.vocab_size), None)
        if bad is not None:
            raise APIError(
                400, f"{field_name} contains token id {bad}, outside [0, {ctx.vocab_size})", param=field_name
            )
    check_prompt_length(len(ids), ctx, field_name)


def check_prompt_length(num_tokens: int, ctx: ServerContext, field_name: str) -> None:
    if ctx.context_len is not None and num_tokens >= ctx.context_len:
        raise APIError(
            400,
            f"{field_name} is too long: {num_tokens} tokens, the model's context length is {ctx.context_len}",
            param=field_name,
        )


def request_options(**fields: Any) -> RequestOptions:
    """RequestOptions.of for an HTTP request (every call the server makes streams); a bad field is a 400
    naming it."""
    try:
        return RequestOptions.of(stream=True, **fields)
    except RequestOptionError as e:
        raise APIError(400, str(e), param=e.field) from None


def expand_n(base: dict[str, Any], sp: SamplingParams, options: RequestOptions) -> list[dict[str, Any]]:
    """One Engine call per sample (request_options.expand_samples: rid-j, seed + j); the prefix cache
    makes the copies of the prompt cheap. `base` holds the prompt."""
    return [{**base, "sampling_params": sample, "options": opts} for sample, opts in expand_samples(sp, options)]


async def tokenize_prompts(runs: list[list[dict[str, Any]]], ctx: ServerContext) -> None:
    """Replace the text prompts of Engine calls by their token ids, tokenized in a worker thread.

    NOTE: the Engine tokenizes a text prompt in its caller's thread, here the event loop: a 48 MB prompt
    (the body limit allows 64 MiB) held every client, /health included, for over a minute before it was
    refused as too long. Fast tokenizers release the GIL, so from a thread the loop keeps serving."""
    manager = getattr(ctx.engine, "tokenizer_manager", None)
    texts = {call["prompt"] for run in runs for call in run if isinstance(call.get("prompt"), str)}
    if not texts or not hasattr(manager, "tokenize"):  # (an Engine stand-in without one: it tokenizes)
        return
    ids = await asyncio.to_thread(lambda: {text: manager.tokenize(text) for text in texts})
    for run in runs:
        for call in run:
            if isinstance(call.get("prompt"), str):
                call["input_ids"] = ids[call.pop("prompt")]


def _per_item(value: Any, i: int, batch: int, is_batch: bool, name: str) -> Any:
    if isinstance(value, list):
        if not is_batch:
            raise APIError(400, f"{name} is a list but the request is not a batch", param=name)
        if len(value) != batch:
            raise APIError(400, f"{name} has {len(value)} entries but the batch has {batch} prompts", param=name)
        return value[i]
    return value


def _images_for(image_data: Any, i: int, is_batch: bool, ctx: ServerContext) -> Any:
    """Batch item i's images, refused up front (named by param) on a model that takes none."""
    manager = getattr(ctx.engine, "tokenizer_manager", None)
    if getattr(manager, "images", None) is None:
        raise APIError(400, "image_data: this model takes no images (a text-only model)", param="image_data")
    return image_data[i] if is_batch else image_data


def native_calls(body: GenerateRequest, ctx: ServerContext) -> list[list[dict[str, Any]]]:
    """Engine calls for one /generate body: one run of n samples per batch item, each its own rid."""
    batch, is_batch = body.batch_size, body.is_batch
    if batch == 0:
        raise APIError(400, "the batch is empty", param="text" if body.text is not None else "input_ids")
    runs: list[list[dict[str, Any]]] = []
    for i in range(batch):
        base: dict[str, Any] = {}
        if body.text is not None:
            text = body.text[i] if is_batch else body.text
            if text == "":
                raise APIError(400, "text must not be empty", param="text")
            check_unicode(text, "text", "text")
            base["prompt"] = text
        else:
            ids = body.input_ids[i] if is_batch else body.input_ids
            check_prompt_ids(ids, ctx, "input_ids")  # type: ignore[arg-type]
            base["input_ids"] = ids
        if body.image_data is not None:
            base["image_data"] = _images_for(body.image_data, i, is_batch, ctx)
        sp = verified_sampling_params(_per_item(body.sampling_params, i, batch, is_batch, "sampling_params"), ctx)
        fields = {
            name: _per_item(getattr(body, name), i, batch, is_batch, name)
            for name in ("return_logprob", "logprob_start_len", "top_logprobs_num", "lora_path")
        }
        rid = _per_item(body.rid, i, batch, is_batch, "rid") or new_rid()
        options = request_options(
            rid=rid,
            return_text_in_logprobs=body.return_text_in_logprobs,
            group=body.group,
            priority=body.priority,
            cache_salt=body.cache_salt,
            **fields,
        )
        runs.append(expand_n(base, sp, options))
    return runs


# ---------------------------------------------------------------- /generate


async def _stream_native(group: GenerationGroup, indexed: bool) -> AsyncIterator[Union[str, bytes]]:
    streams: dict[int, CumulativeEvents] = {}
    try:
        async for index, delta in group.chunks():
            stream = streams.get(index)
            if stream is None:
                stream = streams[index] = CumulativeEvents(index if indexed else None)
            yield stream.add(delta)
    except Exception as e:  # headers are sent: report in-band, then end the stream
        yield sse_error_event(e)
    finally:
        await group.close()
    yield SSE_DONE


@router.post("/generate")
async def generate(body: GenerateRequest, request: Request):
    ctx = get_context(request)
    review(body, NATIVE, request, ctx.logged_once, misplaced=MISPLACED_SAMPLING_FIELDS)
    runs = native_calls(body, ctx)
    await tokenize_prompts(runs, ctx)
    if len(runs) == 1 and len(runs[0]) == 1:  # X-Request-Id = meta_info.id (http_server.ResponseHeaders)
        request.state.request_id = runs[0][0]["options"].rid
    group = ctx.new_group(request, log_metrics=body.log_metrics)
    await group.start(runs, final_only=not body.stream)
    indexed = body.is_batch or len(runs[0]) > 1
    if body.stream:
        return StreamingResponse(_stream_native(group, indexed), media_type="text/event-stream")
    try:
        results = await group.results()
    finally:
        await group.close()
    return results if indexed else results[0]


# ---------------------------------------------------------------- management routes


@router.api_route("/health", methods=["GET", "HEAD"], response_class=Response)
async def health(request: Request) -> Response:
    """200 while the server can serve; 503 once the scheduler process is gone. HEAD too: some load
    balancers probe with it."""
    manager = getattr(get_context(request).engine, "tokenizer_manager", None)
    dead_reason = getattr(manager, "dead_reason", None)
    if dead_reason:
        return error_response(503, dead_reason)
    return Response(status_code=200)


@router.get("/health_generate", response_class=Response)
async def health_generate(request: Request) -> Response:
    """200 once the whole path (tokenizer → scheduler → model → detokenizer) produces a token."""
    ctx = get_context(request)
    group = ctx.new_group(None, log_metrics=False)
    call = {
        "prompt": "ping",
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        "options": request_options(rid="health-" + new_rid()),
    }
    try:
        await asyncio.wait_for(_run_to_end(group, call), timeout=_HEALTH_GENERATE_TIMEOUT_S)
    except APIError:
        raise
    except Exception as e:
        return error_response(503, f"health generation failed: {type(e).__name__}: {e}")
    finally:
        await group.close()
    return Response(status_code=200)


async def _run_to_end(group: GenerationGroup, call: dict[str, Any]) -> list[dict]:
    await group.start([[call]], final_only=True)
    return await group.results()


@router.get("/get_model_info")
@router.get("/model_info")
async def get_model_info(request: Request) -> dict[str, Any]:
    ctx = get_context(request)
    engine = ctx.engine
    return {
        "model_path": str(getattr(engine, "model_path", ctx.server_args.model_path)),
        "tokenizer_path": str(ctx.server_args.tokenizer_path or getattr(engine, "model_path", None)),
        "served_model_name": ctx.model_name,
        "is_generation": True,
        "context_length": ctx.context_len,
        "vocab_size": ctx.vocab_size,
        "preferred_sampling_params": None,
    }


@router.get("/get_server_info")
@router.get("/server_info")
async def get_server_info(request: Request) -> dict[str, Any]:
    ctx = get_context(request)
    info = await asyncio.to_thread(ctx.engine.get_server_info)
    if info.get("api_key"):  # never hand the secret to whoever can read this route
        info = {
            **info,
            "api_key": "<redacted>",
            "internal_states": [
                {**state, "api_key": "<redacted>"} if state.get("api_key") else state
                for state in info.get("internal_states") or []
            ],
        }
    return {
        **info,
        "num_open_http_requests": len(ctx.admission.open_rids),
        "uptime_s": round(time.time() - ctx.started_at, 3),
    }


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request) -> JSONResponse:
    ctx = get_context(request)
    ok = await asyncio.to_thread(ctx.engine.flush_cache)
    if ok:
        return JSONResponse({"success": True, "message": "Cache flushed."})
    return JSONResponse(
        {"success": False, "message": "Cache not flushed: requests are running or waiting."}, status_code=400
    )


PIN_TTL_S = 600.0


@router.post("/pin_prefix")
async def pin_prefix(body: PinPrefixRequest, request: Request) -> dict[str, Any]:
    """plait's program hint: lock the cached part of a prefix -> {"pin_id", "pinned_tokens"}. Clients
    (plait's RuntimeEndpoint) pin a running program's context and unpin it when the program ends."""
    ctx = get_context(request)
    if body.input_ids is not None:
        check_prompt_ids(body.input_ids, ctx, "input_ids")
        prefix: Any = body.input_ids
    else:
        check_unicode(body.text, "text", "text")  # type: ignore[arg-type]
        prefix = body.text
    try:
        # NOTE: pins made over HTTP always expire (PIN_TTL_S): a client may die without unpinning.
        return await asyncio.to_thread(ctx.engine.pin_prefix, prefix, PIN_TTL_S)
    except ValueError as e:
        raise APIError(
            400, f"cannot pin the prefix: {e}", param="text" if body.text is not None else "input_ids"
        ) from None


@router.post("/unpin_prefix")
async def unpin_prefix(body: UnpinPrefixRequest, request: Request) -> JSONResponse:
    # NOTE: an unknown id is not an error (the Engine answers False too): a flush_cache drops all pins.
    ok = await asyncio.to_thread(get_context(request).engine.unpin_prefix, body.pin_id)
    return JSONResponse({"success": bool(ok)} if ok else {"success": False, "message": f"no pin with id {body.pin_id}"})


@router.post("/abort_request")
async def abort_request(body: AbortRequest, request: Request) -> JSONResponse:
    ctx = get_context(request)
    if body.abort_all:
        rids = sorted(ctx.admission.open_rids)
    elif body.rid:
        # n > 1 expands rid into rid-0, rid-1, ...: abort those too.
        rids = [body.rid] + [r for r in ctx.admission.open_rids if is_sample_of(r, body.rid)]
    else:
        raise APIError(400, "give 'rid' or 'abort_all': true", param="rid")
    for rid in rids:
        if not ctx.admission.abort(rid):  # not open at this server: maybe still in the Engine
            ctx.engine.abort(rid)
    return JSONResponse({"success": True, "aborted": rids})
