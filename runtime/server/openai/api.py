"""OpenAI-compatible routes /v1/models and /v1/completions, and what every OpenAI route shares (model names,
sampling fields, Engine calls, streaming); /v1/chat/completions is in openai/chat.py, /v1/responses in
responses/api.py.

Each request becomes a list of Engine calls (prompts × n) run by one `GenerationGroup`; choices are
numbered prompt-major (`index = prompt * n + sample`), as OpenAI does.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator, Callable, Optional, Union

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from ...request_options import new_rid
from ...sampling_params import SamplingParams
from ..engine_client import GenerationGroup
from ..errors import APIError, sse_error_event
from ..lora_api import adapter_cards, adapter_of_model
from ..native_api import (
    check_prompt_ids,
    check_unicode,
    expand_n,
    request_options,
    tokenize_prompts,
    verified_sampling_params,
)
from ..protocol.compat import COMPLETIONS, review
from ..protocol.openai import ChatCompletionRequest, CompletionRequest
from ..server_context import ServerContext, get_context
from ..sse import SSE_DONE, EventTemplate, Slot, sse_event
from .outputs import ChoiceCursor, abort_error, completion_logprobs, finish_reason, matched_stop, usage
from .response_format import response_format_to_sampling
from .structured_outputs import structured_outputs_to_sampling

router = APIRouter(prefix="/v1")

# OpenAI field → SamplingParams field, copied when the client sets it.
_SAMPLING_FIELDS = (
    ("temperature", "temperature"),
    ("top_p", "top_p"),
    ("top_k", "top_k"),
    ("min_p", "min_p"),
    ("presence_penalty", "presence_penalty"),
    ("frequency_penalty", "frequency_penalty"),
    ("repetition_penalty", "repetition_penalty"),
    ("min_tokens", "min_new_tokens"),
    ("stop", "stop"),
    ("stop_token_ids", "stop_token_ids"),
    ("seed", "seed"),
    ("regex", "regex"),
    ("ebnf", "ebnf"),
    ("ignore_eos", "ignore_eos"),
    ("skip_special_tokens", "skip_special_tokens"),
    ("spaces_between_special_tokens", "spaces_between_special_tokens"),
    ("stop_regex", "stop_regex"),
    ("stream_interval", "stream_interval"),
    ("custom_params", "custom_params"),
    ("n", "n"),
)


def check_model(req: Union[CompletionRequest, ChatCompletionRequest], ctx: ServerContext) -> None:
    # NOTE: an empty name means the served model, as in vLLM: wrappers that leave the model setting
    # unset send "" (the openai client requires the argument).
    adapter_of_model(req.model, ctx)  # the served model, or one of its LoRA adapters (a 404 names any other)


def sampling_dict(
    req: Union[CompletionRequest, ChatCompletionRequest], max_new_tokens: Optional[int]
) -> dict[str, Any]:
    params: dict[str, Any] = {"max_new_tokens": max_new_tokens}
    for src, dst in _SAMPLING_FIELDS:
        value = getattr(req, src)
        if value is not None:
            params[dst] = value
    if req.no_stop_trim or req.include_stop_str_in_output:
        params["no_stop_trim"] = True
    if req.logit_bias:
        try:
            params["logit_bias"] = {int(k): float(v) for k, v in req.logit_bias.items()}
        except ValueError:
            raise APIError(400, "logit_bias keys must be token ids (integers as strings)", param="logit_bias") from None
    params.update(response_format_to_sampling(req.response_format))
    params.update(structured_outputs_to_sampling(req.structured_outputs))
    return params


def engine_calls(
    req: Union[CompletionRequest, ChatCompletionRequest],
    prompts: list[dict[str, Any]],
    params: dict[str, Any],
    ctx: ServerContext,
    logprob_args: dict[str, Any],
) -> list[list[dict[str, Any]]]:
    """One run of n samples per prompt (see GenerationGroup.start)."""
    sp = verified_sampling_params(params, ctx, label="sampling parameters", param=None)
    _check_strict_schema(req, sp, ctx)
    rid = req.rid
    runs = []
    for i, prompt in enumerate(prompts):
        base_rid = rid if rid and len(prompts) == 1 else (f"{rid}-p{i}" if rid else new_rid())
        options = request_options(
            rid=base_rid,
            priority=req.priority,
            lora_path=adapter_of_model(req.model, ctx),
            cache_salt=req.cache_salt,
            **logprob_args,
        )
        runs.append(expand_n(prompt, sp, options))
    return runs


def _check_strict_schema(
    req: Union[CompletionRequest, ChatCompletionRequest], sp: SamplingParams, ctx: ServerContext
) -> None:
    """`strict: true` promises output that matches the schema. Keywords the grammar backend cannot
    enforce (uniqueItems, format, ...) would break that promise silently, so they are a 400 here, as
    OpenAI refuses keywords its strict mode does not support; without strict they are best effort."""
    rf = req.response_format
    if rf is None or rf.json_schema is None or not rf.json_schema.strict or sp.grammar_key is None:
        return
    from ...constrained.validation import validate_constraint  # (not at import: see server_context.warm_validators)

    try:
        warnings = validate_constraint(*sp.grammar_key, ctx.server_args.grammar_backend)
    except ValueError as e:
        raise APIError(400, f"invalid json_schema: {e}", param="response_format") from None
    if warnings:
        raise APIError(
            400,
            "response_format json_schema has strict=true, but "
            + "; ".join(warnings)
            + " (set strict=false for best effort)",
            param="response_format",
        )


def default_max_tokens(prompt_len: int, ctx: ServerContext) -> Optional[int]:
    return None if ctx.context_len is None else max(ctx.context_len - prompt_len, 1)


async def results_or_stream(
    group: GenerationGroup, runs: list[list[dict[str, Any]]], stream: bool, events: Callable[[], AsyncIterator[str]]
) -> Union[list[dict], StreamingResponse]:
    await group.start(runs, final_only=not stream)
    if stream:
        return StreamingResponse(_sse(group, events()), media_type="text/event-stream")
    try:
        return await group.results()
    finally:
        await group.close()


async def _sse(group: GenerationGroup, events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Wrap an event generator: report a mid-stream error in-band, always close the group."""
    try:
        async for event in events:
            yield event
    except Exception as e:
        yield sse_error_event(e)
    finally:
        await group.close()
    yield SSE_DONE


def new_response_id(request: Request, prefix: str, rid: Optional[str]) -> tuple[str, int]:
    """The response's id (the client's rid when it sent one) and creation time; the id is also the
    X-Request-Id header (http_server.ResponseHeaders)."""
    response_id = prefix + (rid or uuid.uuid4().hex)
    request.state.request_id = response_id
    return response_id, int(time.time())


def raise_if_aborted(results: list[dict]) -> None:
    for out in results:
        error = abort_error(out.get("meta_info") or {})
        if error is not None:
            raise APIError(*error)


def continuous_usage(req: Union[CompletionRequest, ChatCompletionRequest]) -> bool:
    """vLLM's stream_options.continuous_usage_stats: every chunk carries its choice's usage so far."""
    options = req.stream_options
    return options is not None and options.include_usage and options.continuous_usage_stats


def abort_event(meta: dict[str, Any]) -> Optional[str]:
    error = abort_error(meta)
    return None if error is None else sse_error_event(APIError(*error))


# ---------------------------------------------------------------- /v1/models


def _model_card(ctx: ServerContext) -> dict[str, Any]:
    return {
        "id": ctx.model_name,
        "object": "model",
        "created": int(ctx.started_at),
        "owned_by": "plait",
        "root": str(getattr(ctx.engine, "model_path", ctx.model_name)),
        "max_model_len": ctx.context_len,
    }


@router.get("/models")
async def list_models(request: Request) -> dict[str, Any]:
    """The served model, then its LoRA adapters loaded now."""
    ctx = get_context(request)
    return {"object": "list", "data": [_model_card(ctx), *adapter_cards(ctx, int(ctx.started_at))]}


@router.get("/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> dict[str, Any]:
    """The openai client's `models.retrieve(name)`; any name the server accepts (aliases included), or a
    LoRA adapter's."""
    ctx = get_context(request)
    if model_id in ctx.accepted_model_names:
        return _model_card(ctx)
    for card in adapter_cards(ctx, int(ctx.started_at)):
        if card["id"] == model_id:
            return card
    raise APIError(404, f"model '{model_id}' does not exist; this server serves '{ctx.model_name}'", param="model")


# ---------------------------------------------------------------- /v1/completions


def _completion_prompts(req: CompletionRequest, ctx: ServerContext) -> list[dict[str, Any]]:
    p = req.prompt
    if isinstance(p, str):
        items: list = [p]
    elif p and isinstance(p[0], int):
        items = [p]
    else:
        items = list(p)
    prompts = []
    for item in items:
        if isinstance(item, str):
            if item == "":
                raise APIError(400, "prompt must not be empty", param="prompt")
            check_unicode(item, "prompt", "prompt")
            prompts.append({"prompt": item})
        else:
            check_prompt_ids(item, ctx, "prompt")
            prompts.append({"input_ids": item})
    return prompts


@router.post("/completions")
async def completions(req: CompletionRequest, request: Request):
    ctx = get_context(request)
    review(req, COMPLETIONS, request, ctx.logged_once)
    check_model(req, ctx)
    prompts = _completion_prompts(req, ctx)
    logprob_args: dict[str, Any] = {}
    if req.logprobs is not None:
        logprob_args = {"return_logprob": True, "top_logprobs_num": req.logprobs, "return_text_in_logprobs": True}
        if req.echo:
            logprob_args["logprob_start_len"] = 0
    params = sampling_dict(req, req.max_tokens)
    if req.json_schema is not None:
        params["json_schema"] = req.json_schema
    runs = engine_calls(req, prompts, params, ctx, logprob_args)
    await tokenize_prompts(runs, ctx)
    group = ctx.new_group(request)
    response_id, created = new_response_id(request, "cmpl-", req.rid)
    echo_texts = [_prompt_text(p, ctx) if req.echo else "" for p in prompts]
    result = await results_or_stream(
        group, runs, req.stream, lambda: _completion_events(group, req, response_id, created, ctx, echo_texts)
    )
    if isinstance(result, StreamingResponse):
        return result
    raise_if_aborted(result)
    choices = []
    for index, out in enumerate(result):
        meta = out.get("meta_info") or {}
        echo = echo_texts[index // req.n]
        logprobs = None
        if req.logprobs is not None:
            tokens = (meta.get("input_token_logprobs") or [])[:] if req.echo else []
            tops = (meta.get("input_top_logprobs") or [])[:] if req.echo else []
            tokens += meta.get("output_token_logprobs") or []
            tops += meta.get("output_top_logprobs") or []
            logprobs = completion_logprobs(tokens, tops, ctx.tokenizer, 0)
        choices.append(
            {
                "index": index,
                "text": echo + (out.get("text") or ""),
                "logprobs": logprobs,
                "finish_reason": finish_reason(meta),
                "matched_stop": matched_stop(meta),
            }
        )
    metas = [o.get("meta_info") or {} for o in result]
    return {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": ctx.model_name,
        "choices": choices,
        "usage": usage(metas[:: req.n], metas),
    }


def _prompt_text(prompt: dict[str, Any], ctx: ServerContext) -> str:
    return prompt["prompt"] if "prompt" in prompt else ctx.tokenizer.decode(prompt["input_ids"])


async def _completion_events(
    group: GenerationGroup,
    req: CompletionRequest,
    response_id: str,
    created: int,
    ctx: ServerContext,
    echo_texts: list[str],
) -> AsyncIterator[str]:
    cursors: dict[int, ChoiceCursor] = {}
    last_meta: dict[int, dict] = {}
    head = {"id": response_id, "object": "text_completion", "created": created, "model": ctx.model_name}
    continuous = continuous_usage(req)
    # (the event of most chunks: new text, nothing else)
    text_only = EventTemplate(
        {**head, "choices": [{"index": Slot("index"), "text": Slot("text"), "logprobs": None, "finish_reason": None}]}
    )
    async for index, chunk in group.chunks():
        cur = cursors.get(index)
        if cur is None:  # (not setdefault: a cursor built per chunk, for nothing but the first)
            cur = cursors[index] = ChoiceCursor()
        meta = chunk.get("meta_info") or {}
        last_meta[index] = meta
        text = cur.text_delta(chunk)
        first = not cur.role_sent
        if first:  # first chunk of this choice: the echoed prompt goes first
            cur.role_sent = True
            text = echo_texts[index // req.n] + text
        logprobs = None
        if req.logprobs is not None:
            tokens, tops = cur.logprob_delta(meta)
            if first and req.echo:  # the prompt's logprobs go with the echoed prompt, as without stream
                tokens = list(meta.get("input_token_logprobs") or []) + tokens
                tops = list(meta.get("input_top_logprobs") or []) + tops
            logprobs = completion_logprobs(tokens, tops, ctx.tokenizer, cur.text_offset)
            cur.text_offset += sum(len(t) for t in logprobs["tokens"])
        reason = finish_reason(meta)
        if text and reason is None and logprobs is None and not continuous:
            yield text_only.render(index, text)
        elif text or reason or logprobs:
            body = {**head, "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}]}
            if continuous:
                body["usage"] = usage([meta], [meta])
            yield sse_event(body)
        if reason == "abort" and (event := abort_event(meta)):
            yield event
    if req.stream_options is not None and req.stream_options.include_usage:
        metas = [last_meta[i] for i in sorted(last_meta)]
        yield sse_event({**head, "choices": [], "usage": usage(metas[:: req.n], metas)})
