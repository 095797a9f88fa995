"""RequestState: one request's output as the tokenizer manager collects it from the scheduler's messages
(`ReqOutput` deltas), and how it is handed out: whole (`result`, Engine.generate's dict) or, for a
stream, piece by piece (`delta`, the chunks streams.py carries to the caller)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from ..io_struct import ReqOutput

LOGPROB_KEYS = ("input_token_logprobs", "input_top_logprobs", "output_token_logprobs", "output_top_logprobs")


@dataclass
class RequestState:
    """A request in flight: what it has output so far; `event` wakes whoever waits for more."""

    rid: str
    prompt_tokens: int
    return_logprob: bool
    created: float
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    finished_reason: Optional[dict] = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    cached_tokens_host: Optional[int] = None  # (with a host tier)
    input_token_logprobs: list = field(default_factory=list)
    input_top_logprobs: list = field(default_factory=list)
    output_token_logprobs: list = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)
    first_token_time: Optional[float] = None
    grammar_warnings: list = field(default_factory=list)
    closed_early: Optional[str] = None
    spec: Optional[dict] = None  # speculative decoding's per-request counters (meta_info)
    group: Optional[str] = None
    event: asyncio.Event = field(default_factory=asyncio.Event)
    # How much of the text, ids and logprob lists a stream has handed out (`delta`; None before its first).
    sent: Optional[dict[str, int]] = None

    def apply(self, o: ReqOutput) -> None:
        if o.new_ids and self.first_token_time is None:
            self.first_token_time = o.first_token_time or time.monotonic()
        self.output_ids.extend(o.new_ids)
        self.text += o.text_delta
        if o.final_text is not None:
            self.text = o.final_text
        self.completion_tokens = o.completion_tokens
        self.cached_tokens, self.cached_tokens_host = o.cached_tokens, o.cached_tokens_host
        self.input_token_logprobs.extend(o.input_token_logprobs)
        self.input_top_logprobs.extend(o.input_top_logprobs)
        self.output_token_logprobs.extend(o.output_token_logprobs)
        self.output_top_logprobs.extend(o.output_top_logprobs)
        if o.finished_reason is not None:
            self.finished_reason = o.finished_reason
        if o.closed_early is not None:
            self.closed_early = o.closed_early
        if o.spec_verify_ct is not None:
            self.spec = {
                "spec_verify_ct": o.spec_verify_ct,
                "spec_draft_tokens": o.spec_draft_tokens,
                "spec_accepted_tokens": o.spec_accepted_tokens,
            }
        self.event.set()

    def meta_info(self) -> dict[str, Any]:
        """meta_info without the logprob lists (whole in `result`, the new entries in `delta`)."""
        meta = {
            "id": self.rid,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "finish_reason": self.finished_reason,
            "e2e_latency": time.monotonic() - self.created,
        }
        if self.first_token_time is not None:
            meta["ttft"] = self.first_token_time - self.created
        if self.grammar_warnings:
            meta["grammar_warnings"] = list(self.grammar_warnings)
        if self.closed_early is not None:
            meta["closed_early"] = self.closed_early
        if self.spec is not None:
            meta.update(self.spec)
        if self.cached_tokens_host is not None:  # the cached tokens by tier, with a host tier
            host = self.cached_tokens_host
            meta["cached_tokens_details"] = {"device": self.cached_tokens - host, "host": host}
        return meta

    def result(self) -> dict[str, Any]:
        """The whole output: {"text", "output_ids", "meta_info"} (Engine.generate's result)."""
        meta = self.meta_info()
        if self.return_logprob:
            for key in LOGPROB_KEYS:
                meta[key] = list(getattr(self, key))
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}

    def delta(self) -> dict[str, Any]:
        """What came since the last delta: a stream's chunk (streams.py). `text`, `output_ids` and the logprob
        lists of meta_info hold only the new part; `text_offset` is where `text` starts in the output's text
        (the text sent so far, unless the end of it was cut: a stop regex matched inside it); the rest of
        meta_info is the totals, as in `result`."""
        if self.sent is None:
            self.sent = dict.fromkeys(("text", "output_ids", *LOGPROB_KEYS), 0)
        sent = self.sent
        text_offset = min(sent["text"], len(self.text))
        chunk = {
            "text": self.text[text_offset:] if text_offset == sent["text"] else "",
            "text_offset": text_offset,
            "output_ids": self.output_ids[sent["output_ids"] :],
            "meta_info": self.meta_info(),
        }
        sent["text"], sent["output_ids"] = len(self.text), len(self.output_ids)
        if self.return_logprob:
            meta = chunk["meta_info"]
            for key in LOGPROB_KEYS:
                entries = getattr(self, key)
                meta[key] = entries[sent[key] :]
                sent[key] = len(entries)
        return chunk
