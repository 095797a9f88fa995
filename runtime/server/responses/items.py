"""The pieces of a Response object (OpenAI's Responses API): output items and usage, shared by the whole
response (responses/api.py) and the stream (responses/stream.py)."""

from __future__ import annotations

import uuid
from typing import Any, Optional


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str, logprobs: Optional[list] = None) -> dict[str, Any]:
    """`logprobs`: the text's tokens as chat's logprobs.content entries (token, logprob, bytes, top_logprobs),
    when the request included "message.output_text.logprobs"."""
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": list(logprobs or [])}
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": [part]}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def response_usage(meta: dict[str, Any]) -> dict[str, Any]:
    prompt, completion = int(meta.get("prompt_tokens") or 0), int(meta.get("completion_tokens") or 0)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": int(meta.get("cached_tokens") or 0), "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }
