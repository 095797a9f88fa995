"""Overlap scheduling: steps launched on the device before the previous one is read back.

A mixin of `Scheduler` (scheduler.py), separate because it is one concept: keeping the GPU fed while
the host works. Two pipelines, never both in flight at once:

- Decode: decode step i+1 is launched with step i's sampled tokens as its input (read on the device),
  then step i is read back and processed (`_step_overlapped`).
- Prefill: while prefill i computes, the next prefill batch is admitted and launched, and only then
  prefill i is read back and processed (`_step_after_prefill`). What a prefill's results change on
  the host without its sampled tokens (each request's kv length, its prefix in the radix tree, the
  chunked request, the running list) is committed at launch (`_commit_prefill`, which a prefill run synchronously gets too), so the
  admission of prefill i+1 sees prefill i as if it had been processed: its requests count as running
  (their KV reserve), and its prefixes are in the tree (a request the in-batch dedup held back hits
  them instead of computing them again). The device writes prefill i's KV before any later kernel
  reads it (one stream), so prefill i+1 may use it. When no prefill can be admitted, prefill i is
  read back and a decode batch is built as usual; a decode step is never launched from a prefill
  still in flight.

Only steps whose sampling needs nothing from the host are launched ahead (`ModelRunner.can_overlap`:
no logprobs, grammar or penalties); the others run synchronously (`ModelRunner.run`). On the CPU a
launch runs synchronously, but the bookkeeping is the same as on a GPU (tests set `overlap = True`).
"""

from __future__ import annotations

import time
from typing import Optional

from .batch import ScheduleBatch


class OverlapScheduleMixin:
    def _launch(self, batch: ScheduleBatch, t0: float) -> ScheduleBatch:
        """Run `batch` (built, nothing in flight), or launch it and leave it in flight."""
        mr = self.model_runner
        kind = "prefill" if batch.mode.is_extend() else "decode"
        started = self.timer.begin()
        if self.overlap and batch.mode.is_decode() and all(map(mr.can_overlap, batch.reqs)):
            self.pending = (batch, mr.launch_decode(batch))
            self.timer.launched(kind, started)
            self.timer.decode_restarts += 1
            # The step's slots are private until it is read back (the integrity check counts them).
            for r, slot in zip(batch.reqs, batch.out_cache_loc.tolist()):
                r.inflight_slot = slot
        elif self._can_pipeline_prefill(batch):
            self._launch_prefill(batch, started)
        else:
            out = mr.run(batch)
            self.timer.launched(kind, started)
            t_read = time.perf_counter()
            if batch.mode.is_extend():
                self._commit_prefill(batch)
            self._process_result(batch, out)
            self.timer.phase("results", time.perf_counter() - t_read)
        self._count(batch, t0)
        return batch

    # ------------------------------------------------------------------ prefill pipeline
    def _can_pipeline_prefill(self, batch: ScheduleBatch) -> bool:
        # NOTE: can_overlap rejects logprob requests, so no request here wants prompt logprobs either.
        return (self.overlap and self.pipeline_prefills and batch.mode.is_extend()
                and all(map(self.model_runner.can_overlap, batch.reqs)))

    def _step_after_prefill(self, batch: Optional[ScheduleBatch], t0: float) -> ScheduleBatch:
        """A step while a prefill is in flight: `batch` is the next prefill batch, admitted meanwhile
        (None: none could be). Launch it, then read back and process the one in flight; without one,
        process the one in flight, then build a decode batch."""
        prev, handle = self.pending_prefill
        self.pending_prefill = None
        if batch is None:
            t_admit = time.perf_counter() - t0
            self._read_prefill(prev, handle)
            t_decode = time.perf_counter()
            batch = self._get_decode_batch()
            self.timer.phase("admit", t_admit + time.perf_counter() - t_decode)
            if batch is None:  # the last step of a pipeline: read back, nothing launched
                self.timer.totals["prefill"]["wall_s"] += time.perf_counter() - t0
                return prev
            return self._launch(batch, t0)
        self.timer.phase("admit", time.perf_counter() - t0)
        started = self.timer.begin()
        if self._can_pipeline_prefill(batch):
            # NOTE: committed before `prev` is processed, as `prev` was before this batch's admission;
            # the running list keeps launch order, which is the order processing would give.
            self._launch_prefill(batch, started)
            self._read_prefill(prev, handle)
        else:  # this batch must be read back at once: `prev` first (it comes first on the device too)
            out = self.model_runner.run(batch)
            self.timer.launched("prefill", started)
            self._read_prefill(prev, handle)
            t_read = time.perf_counter()
            self._commit_prefill(batch)
            self._process_result(batch, out)
            self.timer.phase("results", time.perf_counter() - t_read)
        self._count(batch, t0)
        return batch

    def _launch_prefill(self, batch: ScheduleBatch, started) -> None:
        """Launch a prefill batch, leave it in flight, and commit what its results change on the host
        without its sampled tokens (timed as result processing)."""
        self.pending_prefill = (batch, self.model_runner.launch_prefill(batch))
        self.timer.launched("prefill", started)
        t_commit = time.perf_counter()
        self._commit_prefill(batch)
        self.timer.phase("results", time.perf_counter() - t_commit)

    def _read_prefill(self, batch: ScheduleBatch, handle) -> None:
        t_read = time.perf_counter()
        self._process_result(batch, self.model_runner.resolve(handle))
        self.timer.phase("results", time.perf_counter() - t_read)

    # ------------------------------------------------------------------ decode pipeline
    def _step_overlapped(self, t0: float) -> ScheduleBatch:
        """Launch the next decode step on the device, then process the one in flight.

        While the GPU computes step i+1 (its input tokens are step i's samples, read on the device), the
        CPU reads step i's tokens, checks stops and streams outputs. A request that finishes at step i
        got one extra token computed in step i+1: it is dropped and its slot freed; step i+2 goes on
        without it.
        """
        batch, handle = self.pending
        self.pending = None
        keep = self._pipeline_rows(batch)
        nxt, started = None, None
        if keep is not None:
            loc = self._alloc(len(keep))
            if loc is not None:
                nxt = batch.next_decode(loc, keep)
                for r, slot in zip(nxt.reqs, loc.tolist()):
                    r.inflight_slot = slot
                started = self.timer.begin()
                self.pending = (nxt, self.model_runner.launch_decode(nxt, prev=handle))
                self.timer.launched("decode", started)
        t_read = time.perf_counter()
        self._process_result(batch, self.model_runner.resolve(handle))
        self.timer.phase("results", time.perf_counter() - t_read)
        if nxt is not None:
            self._count(nxt, t0)
        else:  # the last step of a pipeline: read back, nothing launched
            self.timer.totals["decode"]["wall_s"] += time.perf_counter() - t0
        return batch

    def _pipeline_rows(self, batch: ScheduleBatch) -> Optional[list[int]]:
        """The rows of `batch` whose requests go on into a decode step launched now, before `batch`'s
        results are read; None when that step must wait (the requests that finished while `batch`
        was in flight are left out: they were released already)."""
        if self.grammar_pending or self.chunked_req is not None:
            return None
        # Waiting requests that could be admitted get their prefill first (one step later otherwise).
        if self.waiting and len(self.running) < self.model_runner.max_running_requests:
            return None
        # NOTE: every request of `batch` passed `can_overlap` when it was first launched, and that stays
        # true (its inputs are fixed per request, or, as min_new_tokens, only grow more permissive).
        keep = [j for j, r in enumerate(batch.reqs) if r.finished_reason is None]
        if not keep:
            return None
        # batch.seq_lens_host = each request's length now (the token then in flight is counted).
        if int(batch.seq_lens_host[keep].max()) >= self.model_runner.context_len - 1:
            return None
        return keep
