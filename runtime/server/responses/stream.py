"""A streamed Response: the official event types, in the official order.

    response.created, response.in_progress
    per text:  response.output_item.added (message), response.content_part.added,
               response.output_text.delta ..., response.output_text.done, response.content_part.done,
               response.output_item.done
    per call:  response.output_item.added (function_call), response.function_call_arguments.delta ...,
               response.function_call_arguments.done, response.output_item.done
    response.completed, or response.incomplete (max_output_tokens), or error + response.failed

Every event carries `sequence_number`; each is sent as `event: <type>` + `data: <json>`, as OpenAI does (no
`[DONE]` at the end). Tool calls come from the same ToolCallStream as chat's, so arguments arrive piece by piece.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

from ..engine_client import GenerationGroup
from ..errors import APIError, status_for
from ..openai.outputs import ChoiceCursor, abort_error, finish_reason
from ..tools.parser import ToolPlan
from .items import function_call_item, message_item, new_item_id, response_usage

logger = logging.getLogger("plait.server")

BodyOf = Callable[[list[dict[str, Any]], str, Optional[dict[str, Any]]], dict[str, Any]]
Store = Callable[[dict[str, Any], dict[str, Any], list[int]], Awaitable[None]]


@dataclass
class _Events:
    """The stream's event numbering and its output items as they are built."""

    sequence: int = 0
    output: list[dict[str, Any]] = field(default_factory=list)
    text_item: Optional[dict[str, Any]] = None  # the message item being written, None when closed
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)  # tool-call index -> its function_call item
    # Logprobs of tokens whose text is not sent yet (the tool-call reader may hold text back): they go with
    # the next text delta.
    pending_logprobs: list[dict[str, Any]] = field(default_factory=list)

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def text(self, delta: str) -> list[str]:
        out = []
        if self.text_item is None:
            self.text_item = message_item(new_item_id("msg"), "", "in_progress")
            self.output.append(self.text_item)
            out.append(
                self.event(
                    "response.output_item.added",
                    output_index=self._index(self.text_item),
                    item={**self.text_item, "content": []},
                )
            )
            out.append(
                self.event(
                    "response.content_part.added",
                    **self._where(self.text_item),
                    part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
                )
            )
        logprobs, self.pending_logprobs = self.pending_logprobs, []
        self.text_item["content"][0]["text"] += delta
        self.text_item["content"][0]["logprobs"] += logprobs
        where = self._where(self.text_item)
        out.append(self.event("response.output_text.delta", **where, delta=delta, logprobs=logprobs))
        return out

    def close_text(self, status: str) -> list[str]:
        item, self.text_item = self.text_item, None
        if item is None:
            return []
        item["status"] = status
        part = item["content"][0]
        return [
            self.event("response.output_text.done", **self._where(item), text=part["text"], logprobs=part["logprobs"]),
            self.event("response.content_part.done", **self._where(item), part=part),
            self.event("response.output_item.done", output_index=self._index(item), item=item),
        ]

    def tool_call(self, delta: dict[str, Any]) -> list[str]:
        out = []
        if "id" in delta:  # a new call: its item first
            out += self.close_text("completed")
            item = function_call_item(new_item_id("fc"), delta["id"], delta["function"]["name"], "", "in_progress")
            self.calls[delta["index"]] = item
            self.output.append(item)
            out.append(self.event("response.output_item.added", output_index=self._index(item), item=dict(item)))
        item = self.calls[delta["index"]]
        piece = delta["function"].get("arguments") or ""
        if piece:
            item["arguments"] += piece
            out.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=self._index(item),
                    delta=piece,
                )
            )
        return out

    def close_calls(self, status: str) -> list[str]:
        out = []
        for item in self.calls.values():
            item["status"] = status
            out.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=self._index(item),
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
            out.append(self.event("response.output_item.done", output_index=self._index(item), item=item))
        return out

    def assistant_message(self) -> dict[str, Any]:
        """What this response adds to the conversation, as a chat message."""
        text = "".join(i["content"][0]["text"] for i in self.output if i["type"] == "message")
        calls = [
            {"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
            for i in self.output
            if i["type"] == "function_call"
        ]
        return {"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}

    def _index(self, item: dict[str, Any]) -> int:
        return next(k for k, i in enumerate(self.output) if i is item)

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self._index(item), "content_index": 0}


async def response_events(
    group: GenerationGroup,
    tools: Optional[ToolPlan],
    body_of: BodyOf,
    store: Store,
    logprobs_of: Optional[Callable[[dict[str, Any]], list[dict[str, Any]]]] = None,
) -> AsyncIterator[str]:
    """`logprobs_of`: a chunk's meta_info -> its tokens' logprobs entries, when the request included them."""
    events = _Events()
    yield events.event("response.created", response=body_of([], "in_progress", None))
    yield events.event("response.in_progress", response=body_of([], "in_progress", None))
    cursor, tool_stream = ChoiceCursor(), tools.new_stream() if tools else None
    output_ids: list[int] = []
    meta: dict[str, Any] = {}
    try:
        async for _, chunk in group.chunks():
            output_ids.extend(chunk.get("output_ids") or ())
            meta = chunk.get("meta_info") or {}
            if logprobs_of is not None:
                events.pending_logprobs += logprobs_of(meta)
            for event in _deltas(events, cursor, tool_stream, chunk):
                yield event
        reason = finish_reason(meta)
        error = abort_error(meta)
        if error is not None:
            raise APIError(*error)
        if tool_stream is not None:
            rest, calls = tool_stream.finish(cursor.text, cut=reason == "length")
            for event in (events.text(rest) if rest else []) + [e for c in calls for e in events.tool_call(c)]:
                yield event
        if not events.output:  # nothing was written: an empty message, as a whole response has
            for event in events.text(""):
                yield event
        status = "incomplete" if reason == "length" else "completed"
        for event in events.close_text(status) + events.close_calls(status):
            yield event
        body = body_of(events.output, status, response_usage(meta))
        yield events.event(f"response.{status}", response=body)
        await store(body, events.assistant_message(), output_ids)
    except Exception as e:  # headers are sent: report in-band, as the official stream does
        if not isinstance(e, APIError):
            logger.exception("a streamed response failed")
        message = e.message if isinstance(e, APIError) else f"{type(e).__name__}: {e}"
        code = "invalid_request_error" if status_for(e) < 500 else "server_error"
        yield events.event("error", code=code, message=message, param=getattr(e, "param", None))
        failed = body_of(events.output, "failed", None)
        failed["error"] = {"code": code, "message": message}
        yield events.event("response.failed", response=failed)
    finally:
        await group.close()


def _deltas(events: _Events, cursor: ChoiceCursor, tool_stream: Any, chunk: dict[str, Any]) -> list[str]:
    text, calls = cursor.text_delta(chunk), []
    if tool_stream is not None:
        text, calls = tool_stream.update(cursor.text)
    out = events.text(text) if text else []
    for call in calls:
        out += events.tool_call(call)
    return out
