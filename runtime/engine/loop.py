"""The Engine's background side: the asyncio loop (on its own thread) where the tokenizer manager runs,
the one way callers' work gets onto it, and the shutdown that ends both and the scheduler process.

Shutdown is the delicate part, because callers may be anywhere: blocked in `generate` on another
thread, awaiting on their own loop, half-way through a stream, or about to call in. Every piece of
work enters through `submit`/`call_soon` under one lock, so once `closed` is set nothing new reaches
the loop; the shutdown then fails what is in flight with a clear error, lets it unwind, and only then
stops the loop. No caller is left waiting on a loop that no longer runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import queue
import shutil
import subprocess
import threading
from typing import Any, Callable, Coroutine

from .tokenizer_manager import SHUTDOWN_SEND_S, EngineUnavailableError, TokenizerManager

logger = logging.getLogger("plait.engine")

SHUT_DOWN = "the engine is shut down"
FORKED = (
    "this Engine was created in process {owner}; a forked child (pid {pid}) cannot use it: its background "
    "thread and sockets stay in the parent. Create an Engine in the child, or have the child send its "
    "requests to one process (e.g. `plait serve`)"
)
ON_LOOP = (
    "a blocking Engine call from the engine's own event loop would wait for itself: await the async_ method, "
    "or call it through asyncio.to_thread"
)
DRAIN_S = 5.0  # how long requests in flight get to unwind (each needs one pass of the loop) before they are cancelled
WAIT_SLICE_S = 0.25

# NOTE: a wait without a timeout can sleep through Ctrl-C. When SIGINT's C handler runs just before the main
# thread blocks (between CPython's non-blocking lock try and its sleep, or on another thread), the handler's
# flag is set but nothing wakes the sleeper: the KeyboardInterrupt came only when the wait ended, a 2,000-token
# generate later (test_ctrl_c_latched_before_a_blocking_wait_still_ends_it). A caller's blocking waits therefore
# sleep in slices, between which the interpreter runs a pending handler.


def result_interruptibly(fut: concurrent.futures.Future) -> Any:
    """`fut.result()`, waited for in slices (see the note above)."""
    while not fut.done():
        concurrent.futures.wait([fut], timeout=WAIT_SLICE_S)
    return fut.result()


def get_interruptibly(q: queue.Queue) -> Any:
    """`q.get()`, waited for in slices (see the note above)."""
    while True:
        try:
            return q.get(timeout=WAIT_SLICE_S)
        except queue.Empty:
            continue


def in_background(fn, *args) -> concurrent.futures.Future:
    """`fn(*args)` on a daemon thread (one that must not hold up the interpreter's exit if its caller fails)."""
    fut: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits for it
            fut.set_exception(e)

    threading.Thread(target=run, name="plait-background-load", daemon=True).start()
    return fut


class EngineLoop:
    """An event loop on a daemon thread, with thread-safe, shutdown-aware bridges onto it."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self.owner_pid = os.getpid()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    @property
    def closed(self) -> bool:
        return self._closed

    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def in_owner_process(self) -> bool:
        return os.getpid() == self.owner_pid

    def check_open(self) -> None:
        if not self.in_owner_process():
            # NOTE: fork copies the loop object but not its thread: work handed to it would wait forever.
            raise RuntimeError(FORKED.format(owner=self.owner_pid, pid=os.getpid()))
        if self._closed:
            raise EngineUnavailableError(SHUT_DOWN)

    def submit(self, coro: Coroutine) -> concurrent.futures.Future:
        """Run `coro` on the loop; RuntimeError once the engine is shut down."""
        with self._lock:
            try:
                self.check_open()
            except RuntimeError:
                coro.close()
                raise
            return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call_soon(self, fn: Callable, *args: Any) -> bool:
        """Queue `fn(*args)` on the loop (in order with `submit`); False once the engine is shut down."""
        with self._lock:
            if self._closed or not self.in_owner_process():
                return False
            self.loop.call_soon_threadsafe(fn, *args)
            return True

    def call(self, coro: Coroutine) -> Any:
        return self.result(self.submit(coro))

    async def acall(self, coro: Coroutine) -> Any:
        return await self.aresult(self.submit(coro))

    def result(self, fut: concurrent.futures.Future) -> Any:
        """Block until `fut` is done. The caller's own interruption (Ctrl-C) cancels the work on the loop."""
        if self.in_loop_thread():
            # (code running on the loop itself, e.g. an HTTP route served there, would wait for itself forever)
            fut.cancel()
            raise RuntimeError(ON_LOOP)
        try:
            return result_interruptibly(fut)
        except concurrent.futures.CancelledError:
            if self._closed:  # cancelled by a shutdown that did not see it unwind in time
                raise EngineUnavailableError(SHUT_DOWN) from None
            raise
        except BaseException:
            fut.cancel()  # e.g. KeyboardInterrupt while waiting: abort the requests instead of letting them run on
            raise

    async def aresult(self, fut: concurrent.futures.Future) -> Any:
        """Await `fut` from another loop. Cancelling the awaiting task cancels the work on our loop."""
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            caller_cancelled = task is not None and getattr(task, "cancelling", lambda: 0)()  # (3.11+)
            if fut.cancelled() and self._closed and not caller_cancelled:
                raise EngineUnavailableError(SHUT_DOWN) from None
            raise

    def close(self, tm: TokenizerManager) -> None:
        """Fail everything in flight with EngineUnavailableError(SHUT_DOWN), tell the scheduler to exit, stop the loop.
        Idempotent. Not from the loop's own thread (it waits for the loop)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        fut = asyncio.run_coroutine_threadsafe(_drain(tm), self.loop)
        try:
            fut.result(DRAIN_S + SHUTDOWN_SEND_S + 5)
        except Exception:  # noqa: BLE001 - shutting down regardless
            logger.exception("the engine's shutdown did not finish cleanly")
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self.loop.close()  # its selector and self-pipe: three file descriptors per engine otherwise


async def _drain(tm: TokenizerManager) -> None:
    tm.fail_all(SHUT_DOWN)
    mine = {asyncio.current_task(), *tm.own_tasks}
    in_flight = [t for t in asyncio.all_tasks() if t not in mine]
    if in_flight:
        _, stuck = await asyncio.wait(in_flight, timeout=DRAIN_S)
        for t in stuck:
            t.cancel()
        if stuck:
            logger.warning("%d engine tasks did not end at shutdown; cancelled", len(stuck))
            await asyncio.wait(stuck, timeout=1.0)
    await tm.close()


def stop_scheduler_process(proc: subprocess.Popen, tmpdir: str, patience_s: float) -> None:
    """Wait up to `patience_s` for the scheduler process to exit by itself, then terminate (and kill) it."""
    try:
        proc.wait(timeout=patience_s)
    except subprocess.TimeoutExpired:
        logger.warning("the scheduler process (pid %d) did not exit; terminating it", proc.pid)
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    shutil.rmtree(tmpdir, ignore_errors=True)


def abort_request(loop: EngineLoop, tm: TokenizerManager, rid: str) -> None:
    """Stop request `rid` (or every sample of an n > 1 request), from any thread. Nothing to do once shut down."""
    if not loop.closed:
        try:
            loop.submit(tm.abort(rid))
        except RuntimeError:  # shut down since the check: every request has ended already
            pass


def release_engine(loop: EngineLoop, tm: TokenizerManager, proc: subprocess.Popen, tmpdir: str) -> None:
    """Everything an Engine holds, given back: what `Engine.shutdown()` does, and what runs when an engine
    is garbage-collected or the interpreter exits without it. Must not refer to the Engine itself."""
    if not loop.in_owner_process():
        # A forked child exiting: the loop, the scheduler process and the socket folder are the parent's,
        # and still in use there (the child would wait for a loop thread it does not have, then delete them).
        return
    if loop.in_loop_thread():  # collected on the loop's own thread: it cannot wait for itself there
        threading.Thread(target=release_engine, args=(loop, tm, proc, tmpdir), daemon=True).start()
        return
    loop.close(tm)
    # A scheduler asked for a kernel trace (PLAIT_SCHEDULER_TRACE) writes it at shutdown: give it time.
    stop_scheduler_process(proc, tmpdir, 300 if os.environ.get("PLAIT_SCHEDULER_TRACE") else 10)
