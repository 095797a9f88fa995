"""OpenAI's Responses API: POST /v1/responses (whole or streamed), GET and DELETE /v1/responses/{id}.

A Responses request runs as the chat request it amounts to (instructions as the system message, input items as
messages, function tools, `text.format` as response_format; openai.chat.chat_runs), so its prompt is the one
chat completions would render. `previous_response_id` continues a stored conversation (responses/store.py):
its messages go before the new input, and its tokens, pinned in the prefix cache, are not prefilled again.
The stream's events are those of the official API (responses/stream.py).
"""

from __future__ import annotations

import time
from typing import Any, Optional

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from ..errors import APIError, describe_validation_errors
from ..openai.api import check_model, raise_if_aborted
from ..openai.chat import chat_runs
from ..openai.outputs import chat_logprobs, finish_reason
from ..protocol.compat import RESPONSES, review
from ..protocol.openai import ChatCompletionRequest
from ..protocol.responses import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    MessageItem,
    ResponsesRequest,
    input_items,
)
from ..server_context import ServerContext, get_context
from ..tools.parser import ToolPlan
from .items import function_call_item, message_item, new_item_id, response_usage
from .store import StoredResponse
from .stream import response_events

router = APIRouter(prefix="/v1")

# Where an error about the chat request a Responses request became belongs in the Responses request.
_PARAM_OF_CHAT_FIELD = {"messages": "input", "response_format": "text", "max_tokens": "max_output_tokens"}


# ---------------------------------------------------------------- request → chat request


def conversation_messages(items: list[InputItem]) -> list[dict[str, Any]]:
    """Input items as chat messages: function calls join the assistant turn they follow, outputs are tool turns."""
    out: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return out


def chat_request_for(req: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    body: dict[str, Any] = {"messages": messages, "stream": bool(req.stream)}
    for src, dst in (
        ("max_output_tokens", "max_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("parallel_tool_calls", "parallel_tool_calls"),
        ("user", "user"),
    ):
        if getattr(req, src) is not None:
            body[dst] = getattr(req, src)
    tools = req.function_tools
    if tools:
        body["tools"] = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in tools
        ]
    if req.tool_choice is not None:
        choice = req.tool_choice
        body["tool_choice"] = (
            choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice.name}}
        )
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": fmt.model_dump(exclude={"type"}, exclude_none=True, by_alias=True),
        }
    elif fmt is not None:
        body["response_format"] = {"type": fmt.type}
    if req.reasoning is not None and req.reasoning.effort is not None:
        body["reasoning_effort"] = req.reasoning.effort
    if req.wants_logprobs:
        body["logprobs"], body["top_logprobs"] = True, req.top_logprobs or 0
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        message, param = describe_validation_errors(list(e.errors()))
        raise APIError(400, message, param=_PARAM_OF_CHAT_FIELD.get(param or "", param)) from None


# ---------------------------------------------------------------- outputs → a Response


def output_items(message: dict[str, Any], status: str, logprobs: Optional[list] = None) -> list[dict[str, Any]]:
    """A chat message (content and/or tool_calls) as Response output items (`logprobs`: its text's)."""
    items: list[dict[str, Any]] = []
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        items.append(message_item(new_item_id("msg"), message.get("content") or "", status, logprobs))
    items += [
        function_call_item(new_item_id("fc"), c["id"], c["function"]["name"], c["function"]["arguments"], status)
        for c in calls
    ]
    return items


def response_body(
    req: ResponsesRequest,
    response_id: str,
    created: float,
    model: str,
    output: list[dict[str, Any]],
    status: str,
    usage: Optional[dict[str, Any]],
) -> dict[str, Any]:
    fmt = req.text.format if req.text is not None and req.text.format is not None else None
    choice = req.tool_choice
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": model,
        "output": output,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
        "store": req.store is not False,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "text": {"format": fmt.model_dump(exclude_none=True, by_alias=True) if fmt else {"type": "text"}},
        "tool_choice": (
            choice.model_dump() if choice is not None and not isinstance(choice, str) else choice or "auto"
        ),
        "tools": [t.model_dump() for t in req.function_tools],
        "truncation": "disabled",
        "usage": usage,
        "user": req.user,
        "metadata": req.metadata or {},
        "background": False,
        "service_tier": "default",
    }


def status_of(reason: Optional[str]) -> str:
    return "incomplete" if reason == "length" else "completed"


# ---------------------------------------------------------------- routes


@router.post("/responses")
async def create_response(req: ResponsesRequest, request: Request):
    ctx = get_context(request)
    review(req, RESPONSES, request, ctx.logged_once)
    check_model(req, ctx)
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        previous = ctx.responses.get(req.previous_response_id)
        if previous is None:
            raise APIError(
                404,
                f"no stored response with id '{req.previous_response_id}' (responses are kept in "
                "this server's memory, the newest ones, when store is not false)",
                param="previous_response_id",
            )
        history = previous.conversation
    new_messages = conversation_messages(input_items(req.input))
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    chat = chat_request_for(req, system + history + new_messages)
    runs, tools, prompt_ids = await chat_runs(chat, ctx)
    response_id = new_item_id("resp")
    request.state.request_id = response_id  # the X-Request-Id header (http_server.ResponseHeaders)
    created = time.time()
    group = ctx.new_group(request)
    await group.start(runs, final_only=not req.stream)

    async def store(body: dict[str, Any], assistant: dict[str, Any], output_ids: list[int]) -> None:
        if req.store is not False:
            await ctx.responses.put(
                response_id,
                StoredResponse(body, history + new_messages + [assistant], prompt_ids + output_ids),
                req.previous_response_id,
            )

    if req.stream:

        def body_of(output: list[dict[str, Any]], status: str, usage: Optional[dict[str, Any]]) -> dict[str, Any]:
            return response_body(req, response_id, created, ctx.model_name, output, status, usage)

        logprobs_of = (lambda meta: output_logprobs(ctx, meta)) if req.wants_logprobs else None
        events = response_events(group, tools, body_of, store, logprobs_of)
        return StreamingResponse(events, media_type="text/event-stream")
    try:
        results = await group.results()
    finally:
        await group.close()
    raise_if_aborted(results)
    body, assistant = whole_response(req, response_id, created, ctx, tools, results[0])
    await store(body, assistant, list(results[0].get("output_ids") or []))
    return body


def whole_response(
    req: ResponsesRequest,
    response_id: str,
    created: float,
    ctx: ServerContext,
    tools: Optional[ToolPlan],
    out: dict[str, Any],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The Response for a finished output, and the assistant message it adds to the conversation."""
    meta = out.get("meta_info") or {}
    text, reason = out.get("text") or "", finish_reason(meta)
    message, _ = (
        tools.message(text, cut=reason == "length") if tools else ({"role": "assistant", "content": text}, False)
    )
    logprobs = output_logprobs(ctx, meta) if req.wants_logprobs else None
    body = response_body(
        req,
        response_id,
        created,
        ctx.model_name,
        output_items(message, status_of(reason), logprobs),
        status_of(reason),
        response_usage(meta),
    )
    return body, message


def output_logprobs(ctx: ServerContext, meta: dict[str, Any]) -> list[dict[str, Any]]:
    """The output tokens' logprobs in `meta` (a whole output's, or a stream chunk's) as the Responses API
    writes them: chat's logprobs.content entries."""
    tokens, tops = meta.get("output_token_logprobs") or [], meta.get("output_top_logprobs") or []
    return chat_logprobs(tokens, tops, ctx.tokenizer, ctx.token_bytes)["content"]


@router.get("/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request) -> dict[str, Any]:
    stored = get_context(request).responses.get(response_id)
    if stored is None:
        raise APIError(404, f"no stored response with id '{response_id}'", param="response_id")
    return stored.body


@router.delete("/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
    if not await get_context(request).responses.delete(response_id):
        raise APIError(404, f"no stored response with id '{response_id}'", param="response_id")
    return {"id": response_id, "object": "response", "deleted": True}
