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
time to first token, and the final cumulative chunk is the complete result.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

from starlette.requests import Request

from .errors import APIError
from .metrics import ServerMetrics

logger = logging.getLogger("plait.server")


def new_rid() -> str:
    return uuid.uuid4().hex


class AdmissionControl:
    """Tracks open generations (by rid); refuses new ones past the limit (None = unlimited)."""

    def __init__(self, limit: Optional[int], metrics: ServerMetrics) -> None:
        self.limit = limit
        self.open_rids: set[str] = set()
        self._metrics = metrics

    def admit(self, rids: list[str]) -> None:
        n_open = len(self.open_rids)
        if self.limit is not None and n_open + len(rids) > self.limit:
            self._metrics.observe_rejected()
            raise APIError(503, f"server is at capacity ({n_open} requests open, limit {self.limit} = "
                                f"max_running_requests + max_queued_requests); retry later")
        duplicate = next((r for r in rids if r in self.open_rids), None)
        if duplicate is not None or len(set(rids)) != len(rids):
            raise APIError(400, f"rid {duplicate or rids} is already in use", param="rid")
        self.open_rids.update(rids)
        self._metrics.set_in_flight(len(self.open_rids))

    def release(self, rid: str) -> None:
        self.open_rids.discard(rid)
        self._metrics.set_in_flight(len(self.open_rids))


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
    async def start(self, runs: list[list[dict[str, Any]]]) -> None:
        """Hand the calls (kwargs of `Engine.async_generate`, `rid` included) to the Engine.

        `runs` groups the calls that share a prompt (the n samples of one prompt). Only the first
        sample of a run starts now; the others start once it has produced its first token, i.e. once
        the prompt is prefilled and in the prefix cache, so the prompt is computed once, not n times.
        Outputs are indexed in the order of the flattened runs.
        """
        self._subs = []
        for run in runs:
            leader = len(self._subs)
            for j, call in enumerate(run):
                self._subs.append(_SubStream(rid=call["rid"], call=call, leader=leader if j else None))
            if len(run) > 1:
                self._subs[leader].first_token = asyncio.Event()
        self.admission.admit([s.rid for s in self._subs])
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
        result = self.engine.async_generate(**sub.call, stream=True)
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
        meta["finish_reason"] = {"type": "abort", "message": "the client disconnected" if self.disconnected
                                 else "the response ended early"}
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

    def _abort_unfinished(self) -> None:
        for sub in self._subs:
            if not (sub.finished or sub.aborted):
                sub.aborted = True
                if sub.iterator is None:
                    continue  # a follower that never reached the Engine
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

    async def _pump(self, index: int, queue: asyncio.Queue) -> None:
        sub = self._subs[index]
        try:
            if sub.leader is not None:
                first_token = self._subs[sub.leader].first_token
                assert first_token is not None
                await first_token.wait()
                if sub.aborted:
                    await queue.put((index, None))
                    return
                await self._open(sub)
            async for chunk in sub.iterator:
                self._observe(sub, chunk)
                if sub.first_token is not None:
                    sub.first_token.set()
                await queue.put((index, chunk))
            await queue.put((index, None))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # hand the error to the consumer
            await queue.put((index, e))
        finally:
            if sub.first_token is not None:  # never leave the other samples waiting
                sub.first_token.set()

    async def chunks(self) -> AsyncIterator[tuple[int, dict]]:
        """(index, cumulative chunk) from all streams, interleaved as they arrive."""
        queue: asyncio.Queue = asyncio.Queue()
        self._pumps = [asyncio.create_task(self._pump(i, queue)) for i in range(len(self._subs))]
        remaining = len(self._subs)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
                sub = self._subs[index]
                sub.finished = True
                self._release(sub)
                continue
            if isinstance(item, BaseException):
                raise item
            yield index, item

    async def results(self) -> list[dict]:
        """Final (complete) output of every stream, in call order."""
        async for _ in self.chunks():
            pass
        missing = [s.rid for s in self._subs if s.last is None]
        if missing and self.disconnected:  # nobody is listening; don't log a spurious failure
            return [s.last or {} for s in self._subs]
        if missing:
            raise RuntimeError(f"the engine returned no output for {', '.join(missing)}")
        return [s.last for s in self._subs]  # type: ignore[misc]
