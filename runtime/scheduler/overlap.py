"""Running steps, and overlap scheduling: steps launched on the device before the previous one is read back.

The part that owns what is in flight. Two pipelines, never both in flight at once:

- Decode: decode step i+1 is launched with step i's sampled tokens as its input (read on the device),
  then step i is read back and processed (`step_decode_in_flight`).
- Prefill: while prefill i computes, the next prefill batch is admitted and launched, and only then
  prefill i is read back and processed (`step_prefill_in_flight`). What a prefill's results change on
  the host without its sampled tokens is committed at launch (`StepResults.commit_prefill`), so the
  admission of prefill i+1 sees prefill i as if it had been processed: its requests count as running
  (their KV reserve), and its prefixes are in the tree. The device writes prefill i's KV before any
  later kernel reads it (one stream), so prefill i+1 may use it. When no prefill can be admitted,
  prefill i is read back and a decode batch is built as usual; a decode step is never launched from a
  prefill still in flight.

Only steps whose sampling needs nothing from the host are launched ahead (no row
`needs_host_sampling`: no logprobs, grammar, penalties or pending min_new_tokens); the others run
synchronously (`runner.run`). A VERIFY step (speculative decoding) always runs synchronously, and no
decode step is launched ahead of one that may verify drafts (its drafts depend on the tokens in flight). On the CPU a
launch runs synchronously, but the bookkeeping is the same
as on a GPU (tests set `overlap = True`).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

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
    ):
        self.runner = runner
        self.queues = queues
        self.kv = kv
        self.results = results
        self.timer = timer
        self.overlap = overlap
        self.pipeline_prefills = pipeline_prefills
        self.spec = spec
        self.pending: Optional[tuple[ScheduleBatch, Any]] = None  # a decode step in flight
        self.pending_prefill: Optional[tuple[ScheduleBatch, Any]] = None  # a prefill step in flight

    def in_flight(self) -> bool:
        return self.pending is not None or self.pending_prefill is not None

    def clear(self) -> None:
        self.pending = self.pending_prefill = None

    # ------------------------------------------------------------------ launching
    def launch(self, batch: ScheduleBatch, t0: float) -> ScheduleBatch:
        """Run `batch` (built, nothing in flight), or launch it and leave it in flight."""
        kind = "prefill" if batch.mode.is_extend() else ("verify" if batch.mode.is_verify() else "decode")
        started = self.timer.begin()
        if self.overlap and batch.mode.is_decode() and self._launchable(batch):
            self.pending = (batch, self.runner.launch(batch.to_step()))
            self.timer.launched(kind, started)
            self.timer.decode_restarts += 1
            # The step's slots are private until it is read back (the integrity check counts them).
            for r, slot in zip(batch.reqs, batch.out_cache_loc.tolist()):
                r.inflight_slot = slot
        elif self._can_pipeline_prefill(batch):
            self._launch_prefill(batch, started)
        else:
            self._run_now(batch, kind, started)
        self._count(batch, t0)
        return batch

    def _run_now(self, batch: ScheduleBatch, kind: str, started) -> None:
        step = batch.to_step()
        t_run = time.perf_counter()
        out = self.runner.run(step)
        self.spec.observe_step(batch, time.perf_counter() - t_run)
        self.timer.launched(kind, started)
        t_read = time.perf_counter()
        if batch.mode.is_extend():
            self.results.commit_prefill(batch)
        self.results.process(batch, out)
        self.timer.phase("results", time.perf_counter() - t_read)

    @staticmethod
    def _launchable(batch: ScheduleBatch) -> bool:
        return not any(r.sampling.needs_host_sampling() for r in batch.reqs)

    def _count(self, batch: ScheduleBatch, t0: float) -> None:
        if batch.mode.is_extend():
            self.timer.count("prefill", len(batch.reqs), sum(batch.extend_lens), time.perf_counter() - t0)
        elif batch.mode.is_verify():
            self.timer.count("verify", len(batch.reqs), len(batch.out_cache_loc), time.perf_counter() - t0)
        else:
            self.timer.count("decode", len(batch.reqs), len(batch.reqs), time.perf_counter() - t0)

    # ------------------------------------------------------------------ prefill pipeline
    def _can_pipeline_prefill(self, batch: ScheduleBatch) -> bool:
        # NOTE: a logprob request needs host sampling, so no request here wants prompt logprobs either.
        return self.overlap and self.pipeline_prefills and batch.mode.is_extend() and self._launchable(batch)

    def step_prefill_in_flight(
        self, batch: Optional[ScheduleBatch], t0: float, decode_batch: Callable[[], Optional[ScheduleBatch]]
    ) -> ScheduleBatch:
        """A step while a prefill is in flight: `batch` is the next prefill batch, admitted meanwhile
        (None: none could be). Launch it, then read back and process the one in flight; without one,
        process the one in flight, then build a decode batch (`decode_batch`)."""
        prev, handle = self.pending_prefill
        self.pending_prefill = None
        if batch is None:
            t_admit = time.perf_counter() - t0
            self._read_prefill(prev, handle)
            t_decode = time.perf_counter()
            batch = decode_batch()
            self.timer.phase("admit", t_admit + time.perf_counter() - t_decode)
            if batch is None:  # the last step of a pipeline: read back, nothing launched
                self.timer.totals["prefill"]["wall_s"] += time.perf_counter() - t0
                return prev
            return self.launch(batch, t0)
        self.timer.phase("admit", time.perf_counter() - t0)
        started = self.timer.begin()
        if self._can_pipeline_prefill(batch):
            # NOTE: committed before `prev` is processed, as `prev` was before this batch's admission;
            # the running list keeps launch order, which is the order processing would give.
            self._launch_prefill(batch, started)
            self._read_prefill(prev, handle)
        else:  # this batch must be read back at once: `prev` first (it comes first on the device too)
            out = self.runner.run(batch.to_step())
            self.timer.launched("prefill", started)
            self._read_prefill(prev, handle)
            t_read = time.perf_counter()
            self.results.commit_prefill(batch)
            self.results.process(batch, out)
            self.timer.phase("results", time.perf_counter() - t_read)
        self._count(batch, t0)
        return batch

    def _launch_prefill(self, batch: ScheduleBatch, started) -> None:
        """Launch a prefill batch, leave it in flight, and commit what its results change on the host
        without its sampled tokens (timed as result processing)."""
        self.pending_prefill = (batch, self.runner.launch(batch.to_step()))
        self.timer.launched("prefill", started)
        t_commit = time.perf_counter()
        self.results.commit_prefill(batch)
        self.timer.phase("results", time.perf_counter() - t_commit)

    def _read_prefill(self, batch: ScheduleBatch, handle) -> None:
        t_read = time.perf_counter()
        self.results.process(batch, self.runner.resolve(handle))
        self.timer.phase("results", time.perf_counter() - t_read)

    # ------------------------------------------------------------------ decode pipeline
    def step_decode_in_flight(self, t0: float, max_running_requests: int, context_len: int) -> ScheduleBatch:
        """Launch the next decode step on the device, then process the one in flight.

        While the GPU computes step i+1 (its input tokens are step i's samples, read on the device), the
        CPU reads step i's tokens, checks stops and streams outputs. A request that finishes at step i
        got one extra token computed in step i+1: it is dropped and its slot freed; step i+2 goes on
        without it.
        """
        batch, handle = self.pending
        self.pending = None
        keep = self._pipeline_rows(batch, max_running_requests, context_len)
        nxt = None
        if keep is not None:
            loc = self.kv.alloc(len(keep))
            if loc is not None:
                nxt = batch.next_decode(loc, keep)
                for r, slot in zip(nxt.reqs, loc.tolist()):
                    r.inflight_slot = slot
                started = self.timer.begin()
                self.pending = (nxt, self.runner.launch(nxt.to_step(ahead=1, ids_from_prev=True), prev=handle))
                self.timer.launched("decode", started)
        t_read = time.perf_counter()
        self.results.process(batch, self.runner.resolve(handle))
        self.timer.phase("results", time.perf_counter() - t_read)
        if nxt is not None:
            self._count(nxt, t0)
        else:  # the last step of a pipeline: read back, nothing launched
            self.timer.totals["decode"]["wall_s"] += time.perf_counter() - t0
        return batch

    def _pipeline_rows(self, batch: ScheduleBatch, max_running_requests: int, context_len: int) -> Optional[list[int]]:
        """The rows of `batch` whose requests go on into a decode step launched now, before `batch`'s
        results are read; None when that step must wait (the requests that finished while `batch`
        was in flight are left out: they were released already)."""
        q = self.queues
        if q.grammar_pending or q.chunked is not None:
            return None
        # Waiting requests that could be admitted get their prefill first (one step later otherwise).
        if q.waiting and len(q.running) < max_running_requests:
            return None
        # NOTE: every request of `batch` passed `_launchable` when it was first launched, and that stays
        # true (its inputs are fixed per request, or, as min_new_tokens, only grow more permissive).
        keep = [j for j, r in enumerate(batch.reqs) if r.finished_reason is None]
        if not keep or self.spec.may_speculate([batch.reqs[j] for j in keep]):
            return None
        # batch.seq_lens_host = each request's length now (the token then in flight is counted).
        if int(batch.seq_lens_host[keep].max()) >= context_len - 1:
            return None
        return keep
