"""/v1/chat/completions: messages rendered with the model's chat template (tools included, tools/calls.py),
the outputs read back as messages or tool calls (tools/parser.py), whole or streamed as chunks."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Optional

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from ..engine_client import GenerationGroup
from ..errors import APIError
from ..native_api import check_prompt_length, check_unicode
from ..protocol.compat import CHAT, review
from ..protocol.openai import ChatCompletionRequest
from ..server_context import ServerContext, get_context
from ..sse import EventTemplate, Slot, sse_event
from ..tools.calls import call_schema, check_tools, plan_for, render_messages
from ..tools.parser import ToolCallStream, ToolPlan
from .api import (
    abort_event,
    check_model,
    continuous_usage,
    default_max_tokens,
    engine_calls,
    new_response_id,
    raise_if_aborted,
    results_or_stream,
    sampling_dict,
)
from .outputs import ChoiceCursor, chat_logprobs, finish_reason, matched_stop, usage

router = APIRouter(prefix="/v1")


def chat_prompt_ids(req: ChatCompletionRequest, ctx: ServerContext) -> list[int]:
    """Render the messages with the model's chat template and tokenize."""
    tokenizer = ctx.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
    for i, m in enumerate(req.messages):
        check_unicode(m.text(), f"messages[{i}].content", "messages")
    messages, tool_kwargs = render_messages(req, tokenizer)
    kwargs = {**request_template_kwargs(req), **(req.chat_template_kwargs or {}), **tool_kwargs}
    if req.continue_final_message:
        kwargs.update(add_generation_prompt=False, continue_final_message=True)
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except Exception as e:  # jinja raises TemplateError for e.g. roles the template refuses
        raise APIError(400, f"messages could not be rendered with the chat template: {e}", param="messages") from None
    # NOTE: the contents are checked above with a better name; tools (descriptions, parameter schemas) and
    # tool-call arguments reach the prompt too, and a lone surrogate there was a 500 from the tokenizer.
    check_unicode(text, "the prompt rendered from messages and tools", "messages")
    ids = tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
    check_prompt_length(len(ids), ctx, "messages")
    return ids


def request_template_kwargs(req: ChatCompletionRequest) -> dict[str, Any]:
    """What the request's own fields say to the chat template (vLLM's; chat_template_kwargs win)."""
    kwargs: dict[str, Any] = {"add_generation_prompt": req.add_generation_prompt}
    if req.documents is not None:
        kwargs["documents"] = req.documents
    if req.reasoning_effort is not None:
        kwargs["reasoning_effort"] = req.reasoning_effort
        if req.reasoning_effort == "none":  # templates with a thinking switch (Qwen3's) read this one
            kwargs["enable_thinking"] = False
    return kwargs


async def chat_runs(
    req: ChatCompletionRequest, ctx: ServerContext
) -> tuple[list[list[dict[str, Any]]], Optional[ToolPlan], list[int]]:
    """A chat request's Engine calls (one run of n samples), how its outputs are read back (tools), and its
    prompt's token ids. Shared by /v1/chat/completions and /v1/responses."""
    check_tools(req, ctx.server_args.grammar_backend)
    # (in a thread: rendering and tokenizing a long conversation would hold the event loop; see tokenize_prompts)
    ids = await asyncio.to_thread(chat_prompt_ids, req, ctx)
    max_new = req.max_new_tokens if req.max_new_tokens is not None else default_max_tokens(len(ids), ctx)
    logprob_args: dict[str, Any] = {}
    if req.logprobs:
        logprob_args = {
            "return_logprob": True,
            "top_logprobs_num": req.top_logprobs or 0,
            "return_text_in_logprobs": True,
        }
    params = sampling_dict(req, max_new)
    forced = call_schema(req)
    if forced is not None:  # tool_choice required / named: constrained decoding makes the calls
        params["json_schema"] = json.dumps(forced)
    prompt: dict[str, Any] = {"input_ids": ids}
    images = [url for m in req.messages for url in m.image_urls()]
    if images:
        prompt["image_data"] = checked_image_urls(images, ctx)
    return engine_calls(req, [prompt], params, ctx, logprob_args), plan_for(req), ids


def checked_image_urls(urls: list[str], ctx: ServerContext) -> list[str]:
    """A chat request's image_url parts, refused up front (400, param messages) where they cannot be used:
    a model that takes no images, a URL to fetch (no network). The images themselves are read by the Engine."""
    manager = getattr(ctx.engine, "tokenizer_manager", None)
    if getattr(manager, "images", None) is None:
        raise APIError(400, "image_url content parts: this model takes no images (a text-only model)", param="messages")
    for url in urls:
        if url[:8].lower().startswith(("http://", "https://")):
            raise APIError(
                400,
                f"image_url {url[:60]!r}: plait has no network access to fetch images; send the image "
                f"inline as a data: URL (data:image/png;base64,...)",
                param="messages",
            )
    return urls


@router.post("/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request):
    ctx = get_context(request)
    review(req, CHAT, request, ctx.logged_once)
    check_model(req, ctx)
    runs, tools, _ = await chat_runs(req, ctx)
    group = ctx.new_group(request)
    response_id, created = new_response_id(request, "chatcmpl-", req.rid)
    result = await results_or_stream(
        group, runs, req.stream, lambda: _chat_events(group, req, response_id, created, ctx, tools)
    )
    if isinstance(result, StreamingResponse):
        return result
    raise_if_aborted(result)
    choices = []
    for index, out in enumerate(result):
        meta = out.get("meta_info") or {}
        logprobs = None
        if req.logprobs:
            logprobs = chat_logprobs(
                meta.get("output_token_logprobs") or [],
                meta.get("output_top_logprobs") or [],
                ctx.tokenizer,
                ctx.token_bytes,
            )
        text = out.get("text") or ""
        reason = finish_reason(meta)
        message, called = (
            tools.message(text, cut=reason == "length") if tools else ({"role": "assistant", "content": text}, False)
        )
        choices.append(
            {
                "index": index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": "tool_calls" if called and reason == "stop" else reason,
                "matched_stop": matched_stop(meta),
            }
        )
    metas = [o.get("meta_info") or {} for o in result]
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": created,
        "model": ctx.model_name,
        "choices": choices,
        "usage": usage(metas[:1], metas),
    }


async def _chat_events(
    group: GenerationGroup,
    req: ChatCompletionRequest,
    response_id: str,
    created: int,
    ctx: ServerContext,
    tools: Optional[ToolPlan],
) -> AsyncIterator[str]:
    cursors: dict[int, ChoiceCursor] = {}
    tool_streams: dict[int, ToolCallStream] = {}  # with tools: what each choice may send as content yet
    last_meta: dict[int, dict] = {}
    head = {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": ctx.model_name}
    continuous = continuous_usage(req)
    meta: dict[str, Any] = {}

    # (the event of most chunks: new content, nothing else)
    content_only = EventTemplate(
        {
            **head,
            "choices": [
                {"index": Slot("index"), "delta": {"content": Slot("content")}, "logprobs": None, "finish_reason": None}
            ],
        }
    )

    def event(index: int, delta: dict, reason: Optional[str] = None, logprobs: Any = None) -> str:
        if reason is None and logprobs is None and not continuous and len(delta) == 1 and "content" in delta:
            return content_only.render(index, delta["content"])
        body = {**head, "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}]}
        if continuous:
            body["usage"] = usage([meta], [meta])  # the current chunk's choice
        return sse_event(body)

    async for index, chunk in group.chunks():
        cur = cursors.get(index)
        if cur is None:  # (not setdefault: a cursor built per chunk, for nothing but the first)
            cur = cursors[index] = ChoiceCursor()
        meta = chunk.get("meta_info") or {}
        last_meta[index] = meta
        if not cur.role_sent:
            cur.role_sent = True
            yield event(index, {"role": "assistant", "content": ""})
        tool_stream = tool_streams.get(index)
        if tool_stream is None and tools:
            tool_stream = tool_streams[index] = tools.new_stream()
        calls: list[dict] = []
        text = cur.text_delta(chunk)
        if tool_stream is not None:
            text, calls = tool_stream.update(cur.text)
        logprobs = None
        if req.logprobs:
            tokens, tops = cur.logprob_delta(meta)
            logprobs = chat_logprobs(tokens, tops, ctx.tokenizer, ctx.token_bytes) if tokens else None
        if text or logprobs:
            yield event(index, {"content": text}, logprobs=logprobs)
        if calls:
            yield event(index, {"tool_calls": calls})
        reason = finish_reason(meta)
        if reason is not None and not cur.finished:
            cur.finished = True
            if tool_stream is not None and reason != "abort":  # held text: content, or the calls' last pieces
                rest, calls = tool_stream.finish(cur.text, cut=reason == "length")
                if rest:
                    yield event(index, {"content": rest})
                if calls:
                    yield event(index, {"tool_calls": calls})
                if tool_stream.sent_calls and reason == "stop":
                    reason = "tool_calls"
            yield event(index, {}, reason)
            if reason == "abort" and (error := abort_event(meta)):
                yield error
    if req.stream_options is not None and req.stream_options.include_usage:
        metas = [last_meta[i] for i in sorted(last_meta)]
        yield sse_event({**head, "choices": [], "usage": usage(metas[:1], metas)})
