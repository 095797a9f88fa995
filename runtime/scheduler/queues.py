"""Where each live request is: the scheduler's queues, and the only code that moves a request between them.

Every request the scheduler holds has a `ReqStatus`, and is in exactly the container its status names:

    GRAMMAR_PENDING  `grammar_pending`  its grammar is compiling
    WAITING          `waiting`          queued for admission (the schedule policy orders it)
    PREFILLING       `prefilling`       admitted to the prefill batch being built or run, not yet committed
    CHUNKED          `chunked`          part of its prompt computed; the rest goes in the next prefill (at most one)
    RUNNING          `running`          decoding, one token per step
    JUMP_TAIL        `jump_tails`       running, but its grammar-forced tail needs a prefill first
    FINISHED         (none)             ended and released; no longer in `by_rid`

`check` verifies that (and the scheduler calls it from `check_integrity`). A request that finished while in a
batch (stopped, aborted by its client) keeps its status until the scheduler releases it.
"""

from __future__ import annotations

import enum
from typing import Iterable, Optional

from ..request import Req


class ReqStatus(enum.Enum):
    GRAMMAR_PENDING = "grammar-pending"
    WAITING = "waiting"
    PREFILLING = "prefilling"
    CHUNKED = "chunked"
    RUNNING = "running"
    JUMP_TAIL = "jump-tail"
    FINISHED = "finished"


# Statuses whose requests hold KV memory (a request slot, a locked prefix, private slots).
HOLDS_KV = frozenset({ReqStatus.PREFILLING, ReqStatus.CHUNKED, ReqStatus.RUNNING, ReqStatus.JUMP_TAIL})


class RequestQueues:
    def __init__(self) -> None:
        self.waiting: list[Req] = []
        self.grammar_pending: list[Req] = []
        self.prefilling: dict[int, Req] = {}  # id(req) -> req
        self.chunked: Optional[Req] = None
        self.running: list[Req] = []
        self.jump_tails: list[Req] = []
        self.by_rid: dict[str, Req] = {}  # every live request (not FINISHED)

    # ---- views ----
    def is_idle(self) -> bool:
        return not (
            self.waiting
            or self.grammar_pending
            or self.prefilling
            or self.chunked is not None
            or self.running
            or self.jump_tails
        )

    def holding_kv(self) -> list[Req]:
        """Requests that hold KV memory between steps (running, jump tails, the chunked one)."""
        held = self.running + self.jump_tails
        if self.chunked is not None:
            held.append(self.chunked)
        return held

    def num_running(self) -> int:
        return len(self.running) + len(self.jump_tails) + (self.chunked is not None)

    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.grammar_pending)

    def get(self, rid: str) -> Optional[Req]:
        return self.by_rid.get(rid)

    # ---- arrival ----
    def add(self, req: Req, grammar_pending: bool) -> None:
        self.by_rid[req.rid] = req
        if grammar_pending:
            req.status = ReqStatus.GRAMMAR_PENDING
            self.grammar_pending.append(req)
        else:
            req.status = ReqStatus.WAITING
            self.waiting.append(req)

    def register(self, req: Req) -> None:
        """A request known by rid but not queued (ended at intake, before it held anything)."""
        self.by_rid[req.rid] = req

    def grammars_done(self, ready: list[Req], still: list[Req]) -> None:
        """The grammar-pending requests split by the intake: `ready` go to the waiting queue, `still` keep
        waiting for their compile (the others ended)."""
        for r in ready:
            r.status = ReqStatus.WAITING
        self.waiting.extend(ready)
        self.grammar_pending = still

    # ---- admission ----
    def _to_prefilling(self, r: Req) -> None:
        r.status = ReqStatus.PREFILLING
        self.prefilling[id(r)] = r

    def set_waiting_order(self, ordered: list[Req]) -> None:
        """The waiting queue in the schedule policy's order (the same requests)."""
        self.waiting = ordered

    def take_chunked(self) -> Req:
        r = self.chunked
        assert r is not None, "no chunked request to take"
        self.chunked = None
        self._to_prefilling(r)
        return r

    def take_jump_tails(self, taken: list[Req]) -> None:
        """`taken` (the head of `jump_tails`, in order) go into the prefill batch."""
        ids = set(map(id, taken))
        self.jump_tails = [r for r in self.jump_tails if id(r) not in ids]
        for r in taken:
            self._to_prefilling(r)

    def admit(self, admitted: list[Req]) -> None:
        """`admitted` (waiting requests) go into the prefill batch."""
        if not admitted:
            return
        ids = set(map(id, admitted))
        self.waiting = [r for r in self.waiting if id(r) not in ids]
        for r in admitted:
            self._to_prefilling(r)

    def undo_admission(self, admitted: list[Req], jumped: list[Req], continuing: Optional[Req]) -> None:
        """A prefill batch that could not be allocated: its requests go back where they came from
        (admitted ones to the front of the waiting queue, having let go of their memory)."""
        for r in admitted + jumped + ([continuing] if continuing is not None else []):
            del self.prefilling[id(r)]
        for r in admitted:
            r.status = ReqStatus.WAITING
        self.waiting = admitted + self.waiting
        for r in jumped:
            r.status = ReqStatus.JUMP_TAIL
        self.jump_tails = jumped + self.jump_tails
        if continuing is not None:
            continuing.status = ReqStatus.CHUNKED
            self.chunked = continuing

    def commit_prefill(self, r: Req, complete: bool) -> None:
        """A request of a launched prefill batch: CHUNKED while part of its sequence is still to compute,
        else RUNNING (finished or not: its first token is not read yet)."""
        del self.prefilling[id(r)]
        if complete:
            r.status = ReqStatus.RUNNING
            self.running.append(r)
        else:
            r.status = ReqStatus.CHUNKED
            self.chunked = r

    # ---- after a step ----
    def to_jump_tails(self, reqs: list[Req]) -> None:
        """Running requests whose grammar forced a tail: they wait for its prefill (taken off `running` by
        the next `drop_from_running`)."""
        for r in reqs:
            r.status = ReqStatus.JUMP_TAIL
        self.jump_tails.extend(reqs)

    def drop_from_running(self) -> None:
        """Take the requests that are no longer RUNNING (finished, jumped) off the running list."""
        self.running = [r for r in self.running if r.status is ReqStatus.RUNNING]

    # ---- leaving ----
    def remove(self, r: Req) -> None:
        """Take `r` out of the container its status names (its status is then the caller's to set)."""
        st = r.status
        if st is ReqStatus.WAITING:
            self.waiting.remove(r)
        elif st is ReqStatus.GRAMMAR_PENDING:
            self.grammar_pending.remove(r)
        elif st is ReqStatus.PREFILLING:
            self.prefilling.pop(id(r), None)
        elif st is ReqStatus.CHUNKED:
            if self.chunked is r:
                self.chunked = None
        elif st is ReqStatus.JUMP_TAIL:
            self.jump_tails.remove(r)
        # RUNNING: taken off the list in bulk by `drop_from_running` (a step ends many at once).

    def finished(self, r: Req) -> None:
        """`r` ended and let go of its memory. A RUNNING one leaves `running` at the next `drop_from_running`."""
        if r.status is not ReqStatus.RUNNING:
            self.remove(r)
        r.status = ReqStatus.FINISHED
        self.by_rid.pop(r.rid, None)

    def start_over(self, r: Req) -> None:
        """`r` gave its memory back (retraction): first in the waiting queue, to be prefilled again."""
        if r.status is ReqStatus.RUNNING:
            self.running.remove(r)
        else:
            self.remove(r)
        r.status = ReqStatus.WAITING
        self.waiting.insert(0, r)

    def clear(self) -> list[Req]:
        """Every live request, the queues emptied (a step failed: the caller ends them all)."""
        live = list(
            {
                id(r): r
                for r in (
                    self.running
                    + self.waiting
                    + self.grammar_pending
                    + self.jump_tails
                    + list(self.prefilling.values())
                    + ([self.chunked] if self.chunked else [])
                    + list(self.by_rid.values())
                )
            }.values()
        )
        RequestQueues.__init__(self)
        return live

    # ---- integrity ----
    def check(self) -> None:
        """Raise AssertionError unless every live request is in exactly the container its status names."""
        seen: dict[int, str] = {}

        def place(reqs: Iterable[Req], where: str, status: ReqStatus) -> None:
            for r in reqs:
                if id(r) in seen:
                    raise AssertionError(f"request {r.rid} is in {seen[id(r)]} and in {where}")
                seen[id(r)] = where
                if r.status is not status and not (status is ReqStatus.RUNNING and r.finished):
                    raise AssertionError(f"request {r.rid} is in {where} with status {r.status}")

        place(self.waiting, "waiting", ReqStatus.WAITING)
        place(self.grammar_pending, "grammar_pending", ReqStatus.GRAMMAR_PENDING)
        place(self.prefilling.values(), "prefilling", ReqStatus.PREFILLING)
        place([self.chunked] if self.chunked is not None else [], "chunked", ReqStatus.CHUNKED)
        place(self.running, "running", ReqStatus.RUNNING)
        place(self.jump_tails, "jump_tails", ReqStatus.JUMP_TAIL)
        for rid, r in self.by_rid.items():
            if id(r) not in seen:
                raise AssertionError(f"live request {rid} ({r.status}) is in no queue")
        if len(seen) != len(self.by_rid):
            live = {id(r) for r in self.by_rid.values()}
            stray = [where for i, where in seen.items() if i not in live]
            raise AssertionError(f"{len(stray)} requests in {sorted(set(stray))} are not live")
