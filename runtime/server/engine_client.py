"""Running the Engine requests behind one HTTP request: admission, disconnect → abort, metrics.

Every generation route (native and OpenAI, streaming or not) goes through `GenerationGroup`:

1. admission: with `--max-queued-requests` the server refuses (503) a request that would push the
   number of open generations past `max_running_requests + max_queued_requests`;
2. `start()` hands each prompt to the Engine, which validates it synchronously, so bad input becomes a
   400 with a JSON body before any response byte is sent; a streaming response then starts at once
   (a queued request gets its headers immediately, its tokens when it runs);
3. a watcher task listens for the client's `http.disconnect` and aborts every unfinished request of
   the group at once (the issue: no zombie decoding to max_tokens); `close()` does the same when the
   handler itself is cancelled or fails;
4. TTFT / inter-token / end-to-end latencies and token counts go to `ServerMetrics`.

Streaming is used internally even for non-streaming HTTP requests: it is what lets the server measure
time to first token. The Engine streams deltas (engine/streams.py); `results()` folds them into each
request's complete output, and a route that streams cumulative text builds it itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import math
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

from starlette.requests import Request

from ..engine.streams import CumulativeOutput
from .errors import APIError
from .metrics import ServerMetrics

logger = logging.getLogger("plait.server")


class AdmissionControl:
    """Tracks open generations (rid → its GenerationGroup); refuses new ones past the limit (None =
    unlimited). /abort_request goes through here, so the group can stop a request that has not reached
    the Engine yet (an abort sent to the Engine before the request itself is lost)."""

    def __init__(self, limit: Optional[int], metrics: ServerMetrics) -> None:
        self.limit = limit
        self.open_rids: dict[str, "GenerationGroup"] = {}
        self._metrics = metrics
        # Requests ended per second, smoothed (what says when a refused client may come back).
        self._end_rate = 0.0
        self._last_end: Optional[float] = None

    def admit(self, rids: list[str], group: "GenerationGroup") -> None:
        n_open = len(self.open_rids)
        if self.limit is not None and n_open + len(rids) > self.limit:
            self._metrics.observe_rejected()
            raise APIError(
                503,
                f"server is at capacity ({n_open} requests open, limit {self.limit} = "
                f"max_running_requests + max_queued_requests); retry later",
                headers={"Retry-After": str(self.retry_after(n_open + len(rids) - self.limit))},
            )
        duplicate = next((r for r in rids if r in self.open_rids), None)
        if duplicate is not None or len(set(rids)) != len(rids):
            raise APIError(400, f"rid {duplicate or rids} is already in use", param="rid")
        self.open_rids.update(dict.fromkeys(rids, group))
        self._metrics.set_in_flight(len(self.open_rids))

    def release(self, rid: str) -> None:
        if self.open_rids.pop(rid, None) is not None:
            now = time.monotonic()
            if self._last_end is not None:
                gap = max(now - self._last_end, 1e-3)
                self._end_rate = 0.9 * self._end_rate + 0.1 / gap
            self._last_end = now
        self._metrics.set_in_flight(len(self.open_rids))

    def retry_after(self, excess: int) -> int:
        """Whole seconds until `excess` open requests have likely ended (at least 1, at most 60)."""
        if self._end_rate <= 0:
            return 1
        return max(1, min(60, math.ceil(excess / self._end_rate)))

    def abort(self, rid: str) -> bool:
        """Abort an open generation through its group; False when no generation with that rid is open."""
        group = self.open_rids.get(rid)
        if group is None:
            return False
        group.abort_rid(rid)
        return True


@dataclass
class _SubStream:
    """One Engine request (one prompt, one sample)."""

    rid: str
    call: dict[str, Any]
    leader: Optional[int] = None  # index of the sample whose first token must come first (n > 1)
    iterator: Any = None
    first_token: Optional[asyncio.Event] = None  # set once this leader's prompt is prefilled
    finished: bool = False
    aborted: bool = False
    submitted: bool = False  # its stream is being read, so the Engine has (or is about to get) the request
    released: bool = False
    counted: bool = False  # its end is in the metrics
    started_at: float = 0.0
    last_token_at: Optional[float] = None
    tokens_seen: int = 0
    last: Optional[dict] = None


@dataclass
class GenerationGroup:
    engine: Any
    admission: AdmissionControl
    metrics: ServerMetrics
    request: Optional[Request]  # None: nobody to watch (internal health probe)
    log_metrics: bool = True
    _subs: list[_SubStream] = field(default_factory=list)
    _watcher: Optional[asyncio.Task] = None
    _pumps: list[asyncio.Task] = field(default_factory=list)
    disconnected: bool = False

    # ---------------------------------------------------------------- lifecycle
    async def start(self, runs: list[list[dict[str, Any]]], final_only: bool = False) -> None:
        """Hand the calls (kwargs of `Engine.async_generate`: the prompt, a verified SamplingParams and the
        RequestOptions, streamed) to the Engine.

        `runs` groups the calls that share a prompt (the n samples of one prompt). Only the first
        sample of a run starts now; the others start once it has produced its first token, i.e. once
        the prompt is prefilled and in the prefix cache, so the prompt is computed once, not n times.
        Outputs are indexed in the order of the flattened runs.

        `final_only`: the caller reads `results()` alone (a request without stream): each request is asked of
        the scheduler as its first token (the n samples wait on it; time to first token) and its end, not every
        token between (`_final_only`), unless it set its own stream_interval.
        """
        self._subs = []
        for run in runs:
            leader = len(self._subs)
            for j, call in enumerate(run):
                if final_only:
                    call = _final_only(call)
                self._subs.append(_SubStream(rid=call["options"].rid, call=call, leader=leader if j else None))
            if len(run) > 1:
                self._subs[leader].first_token = asyncio.Event()
        self.admission.admit([s.rid for s in self._subs], self)
        if self.request is not None:
            self._watcher = asyncio.create_task(self._watch_disconnect())
        leaders = [s for s in self._subs if s.leader is None]
        try:
            opened = await asyncio.gather(*(self._open(s) for s in leaders), return_exceptions=True)
        except BaseException:
            await self.close()
            raise
        errors = [e for e in opened if isinstance(e, BaseException)]
        if errors:
            await self.close()
            raise errors[0]

    async def _open(self, sub: _SubStream) -> None:
        sub.started_at = time.perf_counter()
        result = self.engine.async_stream_deltas(**sub.call)
        if inspect.isawaitable(result):
            result = await result
        sub.iterator = result.__aiter__()

    async def close(self) -> None:
        """Stop watching; abort whatever has not finished (cancelled handler, error, disconnect)."""
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
        for task in self._pumps:
            task.cancel()
        self._pumps = []
        self._abort_unfinished()
        for sub in self._subs:
            self._count_abort(sub)
            self._release(sub)

    def _count_abort(self, sub: _SubStream) -> None:
        """A stream closed before its last chunk (the client went away, the handler failed) still ends
        a request in the metrics: an abort, with the tokens it got so far."""
        if sub.counted or sub.iterator is None or not self.log_metrics:
            return
        sub.counted = True
        meta = dict((sub.last or {}).get("meta_info") or {})
        meta["finish_reason"] = {
            "type": "abort",
            "message": "the client disconnected" if self.disconnected else "the response ended early",
        }
        self.metrics.observe_finished(meta, time.perf_counter() - sub.started_at)

    def _release(self, sub: _SubStream) -> None:
        if not sub.released:
            sub.released = True
            self.admission.release(sub.rid)

    async def _watch_disconnect(self) -> None:
        assert self.request is not None
        try:
            while True:
                message = await self.request.receive()
                if message["type"] == "http.disconnect":
                    break
        except asyncio.CancelledError:
            return
        except Exception:  # a broken transport is a disconnect too
            pass
        self.disconnected = True
        unfinished = [s.rid for s in self._subs if not (s.finished or s.aborted)]
        if unfinished:
            logger.info("client disconnected; aborting %s", ", ".join(unfinished))
        self._abort_unfinished()

    def abort_rid(self, rid: str) -> None:
        for sub in self._subs:
            if sub.rid == rid:
                self._abort(sub)

    def _abort_unfinished(self) -> None:
        for sub in self._subs:
            self._abort(sub)

    def _abort(self, sub: _SubStream) -> None:
        if sub.finished or sub.aborted:
            return
        sub.aborted = True
        if not sub.submitted:
            # NOTE: the Engine gets a request when its stream is first read (in _pump); an abort sent
            # before that would reach the scheduler first and be dropped, and the request would then
            # run to max_new_tokens for nobody. _pump sees `aborted` and never submits it instead.
            return
        try:
            self.engine.abort(sub.rid)
        except Exception:
            logger.exception("engine.abort(%s) failed", sub.rid)

    # ---------------------------------------------------------------- outputs
    def _observe(self, sub: _SubStream, chunk: dict) -> None:
        now = time.perf_counter()
        meta = chunk.get("meta_info") or {}
        sub.last = chunk
        tokens = int(meta.get("completion_tokens") or 0)
        if tokens > sub.tokens_seen:
            if self.log_metrics:
                if sub.last_token_at is None:
                    self.metrics.observe_first_token(now - sub.started_at)
                else:
                    new = tokens - sub.tokens_seen
                    self.metrics.observe_inter_token((now - sub.last_token_at) / new, new)
            sub.tokens_seen, sub.last_token_at = tokens, now
        if meta.get("finish_reason") is not None and not sub.finished:
            sub.finished = sub.counted = True
            if self.log_metrics:
                self.metrics.observe_finished(meta, now - sub.started_at)

    async def _sub_chunks(self, index: int) -> AsyncIterator[dict]:
        """One stream's delta chunks, observed (metrics) on the way."""
        sub = self._subs[index]
        try:
            if sub.leader is not None:
                first_token = self._subs[sub.leader].first_token
                assert first_token is not None
                await first_token.wait()
                if not sub.aborted:
                    await self._open(sub)
            if sub.aborted:  # aborted before the Engine got it: end it here, as the scheduler would
                sub.started_at = sub.started_at or time.perf_counter()  # a follower never opened
                chunk = _aborted_before_start(sub)
                self._observe(sub, chunk)
                yield chunk
                return
            # No await between the check above and the first read, which hands the request to the
            # Engine: an abort from now on reaches the scheduler after the request.
            sub.submitted = True
            async for chunk in sub.iterator:
                self._observe(sub, chunk)
                if sub.first_token is not None:
                    sub.first_token.set()
                yield chunk
        finally:
            if sub.first_token is not None:  # never leave the other samples waiting
                sub.first_token.set()
            if sub.iterator is not None:  # now, not when collected: the Engine aborts an unfinished stream
                await sub.iterator.aclose()

    async def _pump(self, index: int, queue: asyncio.Queue) -> None:
        try:
            async with aclosing(self._sub_chunks(index)) as chunks:
                async for chunk in chunks:
                    await queue.put((index, chunk))
            await queue.put((index, None))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # hand the error to the consumer
            await queue.put((index, e))

    def _ended(self, index: int) -> None:
        sub = self._subs[index]
        sub.finished = True
        self._release(sub)

    async def chunks(self) -> AsyncIterator[tuple[int, dict]]:
        """(index, delta chunk) from all streams, interleaved as they arrive (engine/streams.py)."""
        if len(self._subs) == 1:
            # NOTE: one stream (most requests) is read right here, not through a task and a queue: two
            # task switches less per token, which counted at hundreds of streams.
            async with aclosing(self._sub_chunks(0)) as chunks:
                async for chunk in chunks:
                    yield 0, chunk
            self._ended(0)
            return
        queue: asyncio.Queue = asyncio.Queue()
        self._pumps = [asyncio.create_task(self._pump(i, queue)) for i in range(len(self._subs))]
        remaining = len(self._subs)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
                self._ended(index)
                continue
            if isinstance(item, BaseException):
                raise item
            yield index, item

    async def results(self) -> list[dict]:
        """Final (complete) output of every stream, in call order."""
        outputs = [CumulativeOutput() for _ in self._subs]
        async for index, chunk in self.chunks():
            outputs[index].add(chunk)
        missing = [s.rid for s in self._subs if s.last is None]
        if missing and self.disconnected:  # nobody is listening; don't log a spurious failure
            return [out.chunk() if s.last is not None else {} for s, out in zip(self._subs, outputs)]
        if missing:
            raise RuntimeError(f"the engine returned no output for {', '.join(missing)}")
        return [out.chunk() for out in outputs]


# A request read whole gets its first token and its end from the scheduler, nothing between: each chunk between
# cost the scheduler a delta and this process a message, a detokenized delta and a metrics update (~57 us a token
# on the AMD EPYC's server process: 2.1 against 1.2 ms a 16-token request).
FINAL_ONLY_INTERVAL = 1 << 30


def _final_only(call: dict[str, Any]) -> dict[str, Any]:
    """`call` with its stream_interval FINAL_ONLY_INTERVAL where it set none."""
    params = call.get("sampling_params")
    if isinstance(params, dict):
        if params.get("stream_interval") is not None:
            return call
        return {**call, "sampling_params": {**params, "stream_interval": FINAL_ONLY_INTERVAL}}
    if params is None or params.stream_interval is not None:
        return call
    return {**call, "sampling_params": dataclasses.replace(params, stream_interval=FINAL_ONLY_INTERVAL)}


def _aborted_before_start(sub: _SubStream) -> dict:
    """The final output of a request aborted before the Engine got it (the scheduler's shape)."""
    ids = sub.call.get("input_ids")
    return {
        "text": "",
        "output_ids": [],
        "meta_info": {
            "id": sub.rid,
            "prompt_tokens": len(ids) if ids else 0,
            "completion_tokens": 0,
            "cached_tokens": 0,
            "finish_reason": {"type": "abort", "message": "aborted by the client"},
            "e2e_latency": time.perf_counter() - sub.started_at,
        },
    }
