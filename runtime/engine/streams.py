"""A request's stream: its chunks carried from the engine's loop to the caller, in one of two shapes.

The tokenizer manager streams deltas (`RequestState.delta`): the text, ids and logprobs since the last chunk,
the totals in meta_info. Deltas are what plait's own consumers want (the OpenAI routes, the DSL), so they
stay deltas all the way there. `CumulativeOutput` folds them into SGLang's streaming shape, each chunk
holding everything so far, for the edges that promise it: `Engine.generate` / `async_generate` with
`stream=True` and the native /generate stream.

`RequestStreams` runs one request's stream on the engine's loop and hands its chunks to the caller's
thread or asyncio loop (a caller on the engine's loop itself reads the stream there); a caller that leaves
before the end aborts the request.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import weakref
from typing import Any, AsyncGenerator, AsyncIterator, Generator, Iterator, Sequence

from ..io_struct import TokenizedGenerateReq
from .loop import EngineLoop, abort_request, get_interruptibly
from .request_state import LOGPROB_KEYS
from .tokenizer_manager import TokenizerManager


class CumulativeOutput:
    """A request's output so far, folded from its stream's delta chunks."""

    __slots__ = ("text", "output_ids", "meta_info")

    def __init__(self) -> None:
        self.text = ""
        self.output_ids: list[int] = []
        self.meta_info: dict[str, Any] = {}

    def add(self, delta: dict[str, Any]) -> None:
        """Fold in the next delta chunk (its meta_info's totals replace the ones before)."""
        offset = delta.get("text_offset")
        if offset is not None and offset < len(self.text):  # (the end was cut: a stop regex matched in it)
            self.text = self.text[:offset]
        self.text += delta.get("text") or ""
        self.output_ids.extend(delta.get("output_ids") or ())
        meta = dict(delta.get("meta_info") or {})
        for key in LOGPROB_KEYS:
            if key in meta or key in self.meta_info:
                entries = self.meta_info.get(key, [])
                entries.extend(meta.get(key) or ())
                meta[key] = entries
        self.meta_info = meta

    def meta(self) -> dict[str, Any]:
        """meta_info so far (its lists copied: the caller may keep it while the output grows)."""
        return {key: list(v) if key in LOGPROB_KEYS else v for key, v in self.meta_info.items()}

    def chunk(self) -> dict[str, Any]:
        """SGLang's cumulative chunk: {"text", "output_ids", "meta_info"} so far (a copy, as `meta`)."""
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": self.meta()}


def cumulative(deltas: Generator[dict, None, None]) -> Iterator[dict]:
    """Delta chunks → SGLang's cumulative chunks (closing this closes `deltas`: its request is aborted)."""
    total = CumulativeOutput()
    try:
        for delta in deltas:
            total.add(delta)
            yield total.chunk()
    finally:
        deltas.close()


async def acumulative(deltas: AsyncGenerator[dict, None]) -> AsyncIterator[dict]:
    total = CumulativeOutput()
    try:
        async for delta in deltas:
            total.add(delta)
            yield total.chunk()
    finally:
        await deltas.aclose()


_END = object()  # the stream is over


def _unpack(msg: tuple):
    """A pump message -> the chunk, _END, or raises the error it carries."""
    kind, item = msg
    if kind == "error":
        raise item
    return item if kind == "chunk" else _END


class Mailbox:
    """Chunks for the streams of one caller's asyncio loop, posted on the engine's loop and handed over
    together: one wake-up of the caller's loop per pass of the engine's loop (a scheduler message's
    chunks for all its streams), not one per chunk."""

    def __init__(self, engine_loop: asyncio.AbstractEventLoop, caller_loop: asyncio.AbstractEventLoop) -> None:
        self._engine_loop = engine_loop
        self._caller_loop = caller_loop
        self._pending: list[tuple[asyncio.Queue, tuple]] = []  # (touched on the engine's loop only)
        self._closed = False

    def post(self, q: asyncio.Queue, msg: tuple) -> bool:
        """Queue `msg` for `q` (on the engine's loop); False once the caller's loop is closed (it left
        without closing its streams)."""
        if self._closed or self._caller_loop.is_closed():
            return False
        if not self._pending:
            self._engine_loop.call_soon(self._hand_over)  # after the chunks this pass of the loop posts
        self._pending.append((q, msg))
        return True

    def _hand_over(self) -> None:
        batch, self._pending = self._pending, []
        try:
            self._caller_loop.call_soon_threadsafe(_deliver, batch)
        except RuntimeError:  # the caller's loop closed meanwhile
            self._closed = True


def _deliver(batch: list[tuple[asyncio.Queue, tuple]]) -> None:
    for q, msg in batch:
        q.put_nowait(msg)


class RequestStreams:
    """One request's delta chunks, run on the engine's loop and handed to the caller's thread (`sync`) or
    asyncio loop (`asynchronous`)."""

    def __init__(self, loop: EngineLoop, manager: TokenizerManager) -> None:
        self.loop = loop
        self.manager = manager
        self._mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Mailbox] = weakref.WeakKeyDictionary()
        self._mailboxes_lock = threading.Lock()

    def _mailbox(self, caller_loop: asyncio.AbstractEventLoop) -> "Mailbox":
        with self._mailboxes_lock:
            mailbox = self._mailboxes.get(caller_loop)
            if mailbox is None:
                mailbox = self._mailboxes[caller_loop] = Mailbox(self.loop.loop, caller_loop)
            return mailbox

    def expect(self, rid: str) -> None:
        """A stream handed out is submitted only when first read: an abort meanwhile must end it then."""
        # (queued before any abort the caller sends next: the loop runs callbacks in order)
        self.loop.call_soon(self.manager.expect_stream, rid)

    def sync(self, req: TokenizedGenerateReq, warnings: Sequence[str]) -> Generator[dict, None, None]:
        self.expect(req.rid)
        q: queue.Queue = queue.Queue()

        def chunks():
            fut = self._pump(req, warnings, lambda msg: q.put(msg) or True)
            try:
                while (chunk := _unpack(get_interruptibly(q))) is not _END:
                    yield chunk
            finally:
                self._stop(fut, req)

        return chunks()

    def asynchronous(self, req: TokenizedGenerateReq, warnings: Sequence[str]) -> AsyncGenerator[dict, None]:
        """(call `expect(req.rid)` when handing it out: this runs only once it is read)"""
        if self.loop.in_loop_thread():
            return self._on_engine_loop(req, warnings)
        return self._across_threads(req, warnings)

    def _on_engine_loop(self, req: TokenizedGenerateReq, warnings: Sequence[str]) -> AsyncGenerator[dict, None]:
        """A caller on the engine's own loop (the HTTP server of `plait serve`) reads the tokenizer manager's
        stream itself.

        NOTE: with the caller on another thread every chunk crossed threads (a wake-up of the caller's
        loop per chunk, and two busy threads taking turns at the GIL); under hundreds of streams that
        hand-off was where the server fell behind and tokens reached clients in clumps."""
        self.loop.check_open()
        return self.manager.stream(req, warnings)

    async def _across_threads(self, req: TokenizedGenerateReq, warnings: Sequence[str]) -> AsyncGenerator[dict, None]:
        mailbox = self._mailbox(asyncio.get_running_loop())
        q: asyncio.Queue = asyncio.Queue()
        fut = self._pump(req, warnings, lambda msg: mailbox.post(q, msg))
        try:
            while (chunk := _unpack(await q.get())) is not _END:
                yield chunk
        finally:
            self._stop(fut, req)

    def _pump(self, req: TokenizedGenerateReq, warnings: Sequence[str], put):
        """Run one request on the engine's loop, handing ("chunk", c) ... ("end", None) or ("error", e)
        to `put` (safe to call from that loop's thread; False when nobody can receive any more)."""
        tm = self.manager

        async def pump():
            try:
                chunks = tm.stream(req, warnings)
                try:
                    async for chunk in chunks:
                        if not put(("chunk", chunk)):
                            return
                    put(("end", None))
                finally:
                    await chunks.aclose()  # now, not whenever it is collected: an unfinished stream aborts its request
            except asyncio.CancelledError:  # the consumer left, or a shutdown gave up waiting for this stream
                put(("error", RuntimeError("the stream was cancelled (the engine is shutting down)")))
                raise
            except Exception as e:  # noqa: BLE001 - forwarded to the consumer
                put(("error", e))

        return self.loop.submit(pump())

    def _stop(self, fut, req: TokenizedGenerateReq) -> None:
        if not fut.done():  # the consumer left early (e.g. a client disconnect): abort in the scheduler
            fut.cancel()
            abort_request(self.loop, self.manager, req.rid)
