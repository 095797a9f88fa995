"""Program-aware prefix pins: keep what a running program will extend again in the runtime's cache.

A program's requests arrive one after another; between two of them (while the program's Python runs,
or while its next request waits in a busy queue) nothing protects its context from LRU eviction. The
frontend knows better: the program's state will be extended again, and a fork's prefix will be read
by every branch. So while a program runs it pins

- each fork's shared prefix, until join (or the program's end);
- each branch's state after a gen/select, moved forward after the next one, when the state is long
  enough to be worth keeping and the program will continue (`ProgramPins.after_request`);
- in run_batch, each shared segment until its last program ends (`batch_plan`).

Pins never make a program wait: the calls run on a small thread pool of the backend, in order per
program (a program's serial queue). A state pin that is overtaken by the next one before it was
sent is skipped. Everything is released when the program ends. The runtime cannot evict pinned
tokens, so all pins of one backend share a budget (`PIN_BUDGET_FRACTION` of the KV pool): past it a
pin is given back at once, and memory for other requests always remains.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional

logger = logging.getLogger(__name__)

PIN_BUDGET_FRACTION = 0.25
PIN_THREADS = 8
# A program state shorter than this is cheaper to prefill again than to keep pinned between requests.
MIN_STATE_PIN_CHARS = 256
# State pins are taken only while less than this share of the runtime's KV pool is free: with room to spare
# nothing is evicted between a program's requests, and each pin is a call (its text tokenized, the prefix
# tree walked and locked) that agents of many short requests paid 12-15% of their time for
# (benchmarks/RESULTS.md, paper_programs). A reading of the room is trusted for ROOM_READING_S.
STATE_PIN_FREE_SHARE = 0.5
ROOM_READING_S = 0.25


@dataclass(frozen=True)
class PrefixPin:
    """A pin the runtime granted: its id and how many cached tokens it locks."""

    pin_id: Any
    tokens: int


class PinService:
    """One backend's pin machinery: the thread pool and the token budget all its programs share."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self._lock = threading.Lock()
        self._pool: Optional[ThreadPoolExecutor] = None
        self._budget: Optional[int] = None
        self._kv_pool: Optional[int] = None
        self._budget_known = False
        self.pinned_tokens = 0
        self._room_read_at = float("-inf")
        self._short_of_room = True

    def submit(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(PIN_THREADS, thread_name_prefix="plait-pins")
            pool = self._pool
        try:
            pool.submit(fn)
        except RuntimeError:
            # NOTE: the backend or the interpreter is shutting down ("cannot schedule new futures after
            # shutdown"): a program thread still running asks to pin or release a prefix of an engine that
            # is going away with its pins. Nothing to do, and nothing the user should see.
            return

    def _limit(self) -> Optional[int]:
        if not self._budget_known:
            self._kv_pool = self.backend.kv_pool_tokens()
            self._budget = int(self._kv_pool * PIN_BUDGET_FRACTION) if self._kv_pool else None
            self._budget_known = True
        return self._budget

    def take(self, tokens: int, superseded: int = 0) -> bool:
        """Count a new pin of `tokens` against the budget; `superseded`: tokens of pins about to be
        released that the new one covers (a state pin moving forward), which do not count twice."""
        limit = self._limit()
        with self._lock:
            if limit is not None and self.pinned_tokens - superseded + tokens > limit:
                return False
            self.pinned_tokens += tokens
            return True

    def short_of_room(self) -> bool:
        """Whether the runtime's cache may evict a program's state before its next request (less than
        STATE_PIN_FREE_SHARE of the pool free, or a runtime that does not say)."""
        now = time.monotonic()
        with self._lock:
            if now - self._room_read_at < ROOM_READING_S:
                return self._short_of_room
            self._room_read_at = now
        self._limit()
        try:
            free = self.backend.kv_free_tokens()
        except Exception:  # a server without the figure, or one going away: a hint must not break the program
            free = None
        short = free is None or not self._kv_pool or free < STATE_PIN_FREE_SHARE * self._kv_pool
        with self._lock:
            self._short_of_room = short
        return short

    def give_back(self, tokens: int) -> None:
        with self._lock:
            self.pinned_tokens -= tokens

    def shutdown(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


class PinTicket:
    """One requested pin: queued, then held (`pin` set) or skipped, then released."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.cancelled = False  # overtaken before it was sent: skip it
        self.pin: Optional[PrefixPin] = None


class ProgramPins:
    """The pins of one program and its forks, released together when the program ends."""

    def __init__(self, service: PinService) -> None:
        self.service = service
        self._lock = threading.Lock()
        self._ops: collections.deque = collections.deque()
        self._draining = False
        self._idle = threading.Event()
        self._idle.set()
        self._held: list[PinTicket] = []
        self._state_pins: dict[str, PinTicket] = {}
        self._closed = False

    # ---- what the program asks for (never blocks) ----
    def pin(self, text: str) -> Optional[PinTicket]:
        if self._closed or not text:
            return None
        ticket = PinTicket(text)
        self._enqueue(lambda: self._do_pin(ticket))
        return ticket

    def unpin(self, ticket: Optional[PinTicket]) -> None:
        if ticket is not None:
            ticket.cancelled = True
            self._enqueue(lambda: self._do_unpin(ticket))

    def move_state_pin(self, branch: str, text: str) -> None:
        """Pin `text` as `branch`'s state, then release the state pin it replaces."""
        with self._lock:
            old = self._state_pins.pop(branch, None)
        if old is not None:
            old.cancelled = True  # superseded: skipped if not sent yet, not counted twice if held
        new = self.pin(text)  # queued before the release below, so the shared part stays locked
        with self._lock:
            if new is not None:
                self._state_pins[branch] = new
        if old is not None:
            self._enqueue(lambda: self._do_unpin(old))

    def after_request(self, branch: str, text: str, will_extend: bool) -> None:
        """`branch`'s state is `text` after a gen/select: keep it cached until the branch's next request
        when one will follow (`will_extend`) and the state is long enough to pay; else let it go."""
        if will_extend and len(text) >= MIN_STATE_PIN_CHARS and self.service.short_of_room():
            self.move_state_pin(branch, text)
        else:
            self.drop_state_pin(branch)

    def drop_state_pin(self, branch: str) -> None:
        with self._lock:
            old = self._state_pins.pop(branch, None)
        self.unpin(old)

    def release_all(self, wait: bool = True) -> None:
        """Release every pin (the program ended); with wait, return once the runtime has them back."""
        with self._lock:
            self._closed = True
            self._state_pins.clear()
        self._enqueue(self._do_release_all)
        if wait:
            self._idle.wait()

    def wait_idle(self, timeout: Optional[float] = None) -> bool:
        return self._idle.wait(timeout)

    # ---- the serial queue on the service's pool ----
    def _enqueue(self, op: Callable[[], None]) -> None:
        with self._lock:
            self._ops.append(op)
            if self._draining:
                return
            self._draining = True
            self._idle.clear()
        self.service.submit(self._drain)

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._ops:
                    self._draining = False
                    self._idle.set()
                    return
                op = self._ops.popleft()
            try:
                op()
            except Exception:  # a hint that fails must not break the program
                logger.exception("a prefix pin call failed")

    def _do_pin(self, ticket: PinTicket) -> None:
        if ticket.cancelled:
            return
        pin = self.service.backend.pin_prefix(ticket.text)
        if pin is None:
            return
        with self._lock:
            superseded = sum(t.pin.tokens for t in self._held if t.cancelled and t.pin is not None)
        if not self.service.take(pin.tokens, superseded):
            self.service.backend.unpin_prefix(pin)  # over budget: keep memory for everyone else
            return
        ticket.pin = pin
        with self._lock:
            self._held.append(ticket)

    def _do_unpin(self, ticket: PinTicket) -> None:
        with self._lock:
            if ticket in self._held:
                self._held.remove(ticket)
        self._give_back(ticket)

    def _do_release_all(self) -> None:
        with self._lock:
            held, self._held = self._held, []
        for ticket in held:
            self._give_back(ticket)

    def _give_back(self, ticket: PinTicket) -> None:
        pin, ticket.pin = ticket.pin, None
        if pin is not None:
            self.service.give_back(pin.tokens)
            self.service.backend.unpin_prefix(pin)
