"""What the scheduler does when the KV pool runs short: decode batches that make room first, requests that
start over (retraction), and the one request that cannot fit even alone ending with an abort that says why.

It owns the admission reserve's ratio: the fraction of max_new_tokens a running request is still expected
to decode. It decays while nothing is retracted and jumps back up after a retraction (as SGLang does).
"""

from __future__ import annotations

import logging
from typing import Optional

from ..forward_batch import ForwardMode
from ..request import FinishReason, Req
from .batch import DecodeRows, ScheduleBatch
from .finish import Finisher
from .kv_manager import KVManager
from .queues import ReqStatus, RequestQueues

logger = logging.getLogger("plait.scheduler")

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001


class KVShortage:
    def __init__(
        self, queues: RequestQueues, kv: KVManager, finisher: Finisher, stats: dict, conservativeness: float = 1.0
    ):
        self.queues = queues
        self.kv = kv
        self.finisher = finisher
        self.stats = stats
        # SGLang's schedule_conservativeness: below 1 admits more against the same pool (and retracts more).
        self.init_ratio = min(1.0, INIT_NEW_TOKEN_RATIO * conservativeness)
        self.min_ratio = min(self.init_ratio, MIN_NEW_TOKEN_RATIO * conservativeness)
        self.new_token_ratio = self.init_ratio

    def running_reserve(self) -> float:
        """Slots the running requests are expected to need before they finish."""
        return sum(r.remaining_new_tokens() for r in self.queues.running) * self.new_token_ratio

    def reserve_of(self, r: Req) -> float:
        return r.remaining_new_tokens() * self.new_token_ratio

    def decode_batch(self) -> Optional[ScheduleBatch]:
        """One token for every running request, retracting others until the slots exist; None when
        nothing runs (or the last one running was aborted: its sequence outgrew the pool)."""
        q, kv = self.queues, self.kv
        if not q.running:
            return None
        kv.make_free(len(q.running))
        while kv.available() < len(q.running):
            # NOTE: a half-prefilled request or a jump-forward tail holds KV too, and has generated no
            # token since (the fewest-outputs victim): it goes first. Left holding its memory, the last
            # running request would be aborted for lack of memory that was not its own fault.
            if q.chunked is not None:
                self.retract_chunked()
            elif q.jump_tails:
                self.retract_jump_tails()
            elif len(q.running) == 1:
                victim = q.running[0]
                self.finisher.end(victim, FinishReason("abort", message=self.kv.out_of_memory_message(victim)))
                q.drop_from_running()
                return None
            else:
                self.retract_one()
            kv.make_free(len(q.running))
        loc = kv.alloc(len(q.running))  # written into req_to_token by the step runner
        self.new_token_ratio = max(self.min_ratio, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        return ScheduleBatch(ForwardMode.DECODE, list(q.running), out_cache_loc=loc)

    def decode_batch_ahead(self, prev: ScheduleBatch) -> Optional[ScheduleBatch]:
        """One token for every running request, one token past `prev`, the step in flight: a request whose
        token `prev` samples takes it on the device. Nobody is retracted (a request may have a token in
        flight): the caller checked that the pool has the slots."""
        running = self.queues.running
        if not running:
            return None
        if prev.mode.is_decode():
            # NOTE: the steady state (the same requests, step after step) derives its rows from prev's
            # arrays instead of reading every request again.
            keep = [j for j, r in enumerate(prev.reqs) if r.status is ReqStatus.RUNNING]
            if len(keep) == len(running):
                return prev.next_decode(self._alloc_ahead(len(keep)), keep)
        index = prev.sample_index()
        # A request decodes when its next input token is known: sampled by `prev`, or the last one of its
        # host state. (A prefill-only request `prev` committed as running has none: it ends when read.)
        reqs = [r for r in running if id(r) in index or r.kv_len < len(r.origin_input_ids) + len(r.output_ids)]
        if not reqs:
            return None
        rows = DecodeRows.of(reqs, index)
        return ScheduleBatch(ForwardMode.DECODE, reqs, out_cache_loc=self._alloc_ahead(len(reqs)), decode=rows)

    def _alloc_ahead(self, n: int):
        loc = self.kv.alloc(n)
        if loc is None:
            raise RuntimeError("decode_batch_ahead: the caller checked for room, yet the slots are not there")
        self.new_token_ratio = max(self.min_ratio, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        return loc

    # ---- starting over ----
    def start_over(self, r: Req, counted: bool = True) -> None:
        """Give back r's KV and put it first in the waiting queue, to be prefilled again later."""
        self.kv.release(r)
        r.reset_for_retract()
        self.queues.start_over(r)
        if counted:
            self.stats["num_retractions"] += 1

    def retract_chunked(self) -> None:
        """A half-prefilled request that cannot get memory with nothing else running: start it over."""
        r = self.queues.chunked
        assert r is not None, "no chunked request to retract"
        self.start_over(r)
        logger.info("retracted chunked request %s for lack of KV memory", r.rid)

    def retract_jump_tails(self, counted: bool = True) -> None:
        """Start the requests waiting for their jump-forward tail's prefill over (they hold KV)."""
        for r in list(self.queues.jump_tails):
            self.start_over(r, counted)

    def retract_one(self) -> None:
        # The request with the fewest generated tokens loses the least work (ties: the longest prompt
        # frees the most memory).
        victim = min(self.queues.running, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
        self.start_over(victim)
        self.new_token_ratio = self.init_ratio
        logger.info("retracted %s (%d output tokens) for lack of KV memory", victim.rid, len(victim.output_ids))

    def refuse(self, r: Req) -> None:
        """End a request that cannot run even alone (the chunked one, or one off the waiting queue)."""
        self.finisher.end(r, FinishReason("abort", message=self.kv.out_of_memory_message(r)))
