"""What the next step runs: a token budget, filled with the running requests' decode tokens first, then
prefill chunks, in one forward.

Each step every running request advances by one token (a decode row), and what is left of the step's
token budget (`max_num_batched_tokens`) goes to prefill: the chunked request's next chunk, jump-forward
tails, then waiting requests in policy order (`PrefillAdmission`). With both, the step is one EXTEND
forward whose first rows decode (a mixed step: `ScheduleBatch.mixed`), so a request's next token never
waits behind another's prefill. With `disable_mixed_chunk` a step is one phase, as before: a prefill
batch when requests wait and fit, else a decode batch. A decode step alone may become a VERIFY step of
draft trees (`Speculation.upgrade`).

A step may be planned while the previous one is still in flight (overlap scheduling): its decode rows
are one token past the host state, and those tokens come from the device (`DecodeRows`). Where that cannot
be done safely (the pool would have to retract a request whose token is in flight, speculation may
verify drafts of tokens not read yet, a request is at the end of its context), the step in flight is read
back first (`can_run_ahead`).
"""

from __future__ import annotations

from typing import Optional

from .admission import PrefillAdmission
from .batch import ScheduleBatch
from .kv_manager import KVManager
from .queues import RequestQueues
from .retraction import KVShortage
from .speculation import Speculation


class StepPlanner:
    def __init__(
        self,
        queues: RequestQueues,
        kv: KVManager,
        admission: PrefillAdmission,
        shortage: KVShortage,
        speculation: Speculation,
        context_len: int,
        mixing: bool,
    ):
        self.queues = queues
        self.kv = kv
        self.admission = admission
        self.shortage = shortage
        self.speculation = speculation
        self.context_len = context_len
        self.mixing = mixing

    def can_run_ahead(self, prev: ScheduleBatch) -> bool:
        """Whether the next step may be planned before `prev` (in flight) is read back."""
        running = self.queues.running
        if not running:
            return True
        if self.kv.room() < len(running):
            return False  # making room would retract a request whose token is in flight
        if prev.mode.is_decode() and len(prev.reqs) == len(running):
            seq_lens = prev.seq_lens_host
            assert seq_lens is not None  # prev was built (`to_step`), its decode rows with it
            longest = int(seq_lens.max())  # (counts the token in flight)
        else:
            longest = max(len(r.origin_input_ids) + len(r.output_ids) for r in running) + 1
        if longest >= self.context_len - 1:
            return False
        # NOTE: asked last, once per step planned ahead: it counts the step as decided without drafts. A step
        # with prefill rows never verifies: where one is likely next, it is planned ahead.
        q = self.queues
        prefill = (
            q.chunked is not None
            or bool(q.jump_tails)
            or (bool(q.waiting) and len(running) < self.admission.max_running_requests)
        )
        return not self.speculation.may_speculate(list(running), prefill_next=prefill)

    def plan(self, prev: Optional[ScheduleBatch] = None) -> Optional[ScheduleBatch]:
        """The next step (its requests' slots allocated), or None when nothing can run. `prev`: the step in
        flight, which `can_run_ahead` allowed planning past."""
        if not self.mixing:
            prefill = self.admission.build(prefill_in_flight=prev is not None)
            return prefill if prefill is not None else self._decode(prev, upgrade=True)
        decode = self._decode(prev, upgrade=False)
        decode_tokens = len(decode.reqs) if decode is not None else 0
        prefill = self.admission.build(prefill_in_flight=prev is not None, decode_tokens=decode_tokens)
        if prefill is None:
            return self.speculation.upgrade(decode) if decode is not None and prev is None else decode
        if decode is None:
            return prefill
        return ScheduleBatch.mixed(decode, prefill)

    def _decode(self, prev: Optional[ScheduleBatch], upgrade: bool) -> Optional[ScheduleBatch]:
        """One token for every running request (retracting others when the pool is short, unless a step is
        in flight); `upgrade`: as a VERIFY step where requests have drafts."""
        if prev is not None:
            return self.shortage.decode_batch_ahead(prev)
        batch = self.shortage.decode_batch()
        return self.speculation.upgrade(batch) if batch is not None and upgrade else batch
