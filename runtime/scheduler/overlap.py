"""Running steps, and overlap scheduling: a step launched on the device before the previous one is read back.

The part that owns what is in flight: at most one step, launched but not read back (`pending`). While it
computes, the scheduler plans the next step one token past it (`StepPlanner`: the decode rows of the
requests whose tokens it samples read them on the device), launches that, and only then reads the step
in flight back and processes it, so the CPU work hides behind the GPU's.

What a step changes on the host without its sampled tokens is committed when it is launched: a prefill
row's KV length, its computed prefix in the prefix cache, CHUNKED or RUNNING (`StepResults.commit_prefill`),
and a decode row's slot (`Req.inflight_slot`: its KV length grows when the token is read). So the next
plan sees the step in flight as if it had been processed: its requests count as running, and its prefixes
are in the tree (the device writes their KV before any later kernel reads it: one stream).

A request that finishes in the step read back got one more row in the step launched meanwhile: that row is
dropped and its slot freed. Only steps whose sampling needs nothing from the host are launched (no row
`needs_host_sampling`: no logprobs, grammar, penalties or pending min_new_tokens); the others run
synchronously (`runner.run`), after the step in flight, whose results are processed first. A VERIFY step
(speculative decoding) always runs synchronously. On the CPU a launch runs synchronously, but the
bookkeeping is the same as on a GPU (tests set `overlap = True`).
"""

from __future__ import annotations

import time
from typing import Any, Optional

from .adapters import SchedulerAdapters
from .batch import ScheduleBatch
from .kv_manager import KVManager
from .queues import RequestQueues
from .results import StepResults
from .speculation import Speculation
from .step_runner import StepRunner
from .step_timer import StepTimer


class StepPipeline:
    def __init__(
        self,
        runner: StepRunner,
        queues: RequestQueues,
        kv: KVManager,
        results: StepResults,
        timer: StepTimer,
        overlap: bool,
        pipeline_prefills: bool,
        spec: Speculation,
        adapters: Optional[SchedulerAdapters] = None,
    ):
        self.runner = runner
        self.queues = queues
        self.kv = kv
        self.results = results
        self.timer = timer
        self.overlap = overlap
        # Steps with prefill rows launched ahead too (else each is read back before the next is planned).
        self.pipeline_prefills = pipeline_prefills
        self.spec = spec
        self.adapters = adapters  # LoRA: each step's adapter slots
        self.pending: Optional[tuple[ScheduleBatch, Any]] = None  # the step in flight and its handle

    def in_flight(self) -> bool:
        return self.pending is not None

    @property
    def pending_prefill(self) -> Optional[tuple[ScheduleBatch, Any]]:
        """The step in flight when it has prefill rows."""
        return self.pending if self.pending is not None and self.pending[0].mode.is_extend() else None

    def clear(self) -> None:
        self.pending = None

    # ------------------------------------------------------------------ running
    def run(self, batch: ScheduleBatch, t0: float, prev: Optional[tuple[ScheduleBatch, Any]] = None) -> ScheduleBatch:
        """Run `batch`, planned one token past `prev` (the step in flight, or None): launch it and leave it
        in flight, or run it now; `prev` is read back and processed after `batch` was started, before
        `batch`'s own results."""
        kind = _kind(batch)
        started = self.timer.begin()
        handle = prev[1] if prev is not None else None
        step = batch.to_step()
        if self.adapters is not None:
            self.adapters.attach(step, batch.reqs)
        self._hold_decode_slots(batch)
        if self._launchable(batch):
            self.pending = (batch, self.runner.launch(step, prev=handle))
            self.timer.launched(kind, started)
            if batch.mode.is_decode() and prev is None:
                self.timer.decode_restarts += 1
            if batch.mode.is_extend():
                t_commit = time.perf_counter()
                self.results.commit_prefill(batch)
                self.timer.phase("results", time.perf_counter() - t_commit)
            if prev is not None:
                self._read(prev)
        else:
            t_run = time.perf_counter()
            out = self.runner.run(step, prev=handle)
            self.spec.observe_step(batch, time.perf_counter() - t_run)
            self.timer.launched(kind, started)
            if prev is not None:
                self._read(prev)
            t_read = time.perf_counter()
            if batch.mode.is_extend():
                self.results.commit_prefill(batch)
            self.results.process(batch, out)
            self.timer.phase("results", time.perf_counter() - t_read)
        self._count(batch, t0)
        return batch

    def read_back(self) -> Optional[ScheduleBatch]:
        """Read back and process the step in flight (nothing is launched meanwhile); returns it."""
        if self.pending is None:
            return None
        prev, self.pending = self.pending, None
        self._read(prev)
        return prev[0]

    def _launchable(self, batch: ScheduleBatch) -> bool:
        if not self.overlap or batch.mode.is_verify():
            return False
        if batch.mode.is_extend() and not self.pipeline_prefills:
            return False
        # NOTE: a logprob request needs host sampling, so no request here wants prompt logprobs either.
        return not any(r.sampling.needs_host_sampling() for r in batch.reqs)

    @staticmethod
    def _hold_decode_slots(batch: ScheduleBatch) -> None:
        """The step's decode slots are its requests' private slots until it is read back (a request that
        ends meanwhile, in the step read back before it, gives the slot back; the integrity check counts
        them)."""
        decode = batch.decode_reqs
        if decode:
            for r, slot in zip(decode, batch.slots[: len(decode)].tolist()):
                r.inflight_slot = slot

    def _read(self, prev: tuple[ScheduleBatch, Any]) -> None:
        t_read = time.perf_counter()
        self.results.process(prev[0], self.runner.resolve(prev[1]))
        self.timer.phase("results", time.perf_counter() - t_read)

    def _count(self, batch: ScheduleBatch, t0: float) -> None:
        wall = time.perf_counter() - t0
        if batch.mode.is_verify():
            self.timer.count("verify", len(batch.reqs), len(batch.slots), wall)
        elif batch.mode.is_decode():
            self.timer.count("decode", len(batch.reqs), len(batch.reqs), wall)
        else:
            kind = "mixed" if batch.num_decode else "prefill"
            self.timer.count(kind, len(batch.reqs), sum(batch.extend_lens), wall)


def _kind(batch: ScheduleBatch) -> str:
    if batch.mode.is_verify():
        return "verify"
    if batch.mode.is_decode():
        return "decode"
    return "mixed" if batch.num_decode else "prefill"
