"""What the scheduler does when the KV pool runs short: requests start over (retraction), and one that
cannot fit even alone ends with an abort that says why.

A mixin of `Scheduler` (scheduler.py). It uses the scheduler's queues (`running`, `waiting`, `jump_queue`,
`chunked_req`), its `pins`, `allocator` and `_release`.
"""

from __future__ import annotations

import logging

from ..request import Req

logger = logging.getLogger("plait.scheduler")

# Expected fraction of max_new_tokens a running request will still decode (admission reserve).
# Decays while nothing is retracted; jumps back up after a retraction (as SGLang does).
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001


class KVShortageMixin:
    def _start_over(self, r: Req) -> None:
        """Give back r's KV and put it first in the waiting queue, to be prefilled again later."""
        self._release(r)
        r.reset_for_retract()
        self.waiting.insert(0, r)
        self.stats["num_retractions"] += 1

    def _retract_chunked(self) -> None:
        """A half-prefilled request that cannot get memory with nothing else running: start it over."""
        r = self.chunked_req
        self.chunked_req = None
        self._start_over(r)
        logger.info("retracted chunked request %s for lack of KV memory", r.rid)

    def _retract_jump_tails(self) -> None:
        """Start the requests waiting for their jump-forward tail's prefill over (they hold KV)."""
        for r in self.jump_queue:
            self._start_over(r)
        self.jump_queue = []

    def _retract_one(self) -> None:
        # The request with the fewest generated tokens loses the least work (ties: the longest prompt
        # frees the most memory).
        victim = min(self.running, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
        self.running.remove(victim)
        self._start_over(victim)
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        logger.info("retracted %s (%d output tokens) for lack of KV memory", victim.rid, len(victim.output_ids))

    def _out_of_memory_message(self, r: Req) -> str:
        """Why a request that runs alone cannot go on: its sequence outgrew what the pool can give it."""
        total, pinned = self.allocator.num_slots, self._pinned_tokens()
        held = f", {pinned} of them held by pinned prefixes" if pinned else ""
        return (f"out of KV memory: the request needs {r.seq_len + 1} tokens of KV cache, the pool holds "
                f"{total}{held} (raise max_total_tokens, or lower max_new_tokens)")

    def _pinned_tokens(self) -> int:
        """Cached tokens that pins keep locked (their paths may overlap: counted once)."""
        nodes = {}
        for handle in self.pins.values():
            node = getattr(handle, "node", None)
            while node is not None and node.parent is not None:
                nodes[id(node)] = len(node.key)
                node = node.parent
        return sum(nodes.values())
