"""Building a prefill batch: which waiting requests are admitted this step, and with how much.

A mixin of `Scheduler` (scheduler.py), separate because it is one concept: admission. In order: the
chunked request continues, jump-forward tails go next, then the waiting queue (ordered by the
schedule policy) is admitted while the token and memory budgets allow, the prefix cache supplies each
request's cached prefix, and a request that shares a long uncached prefix with one already in this
batch waits a step (its prefix is then cached: computed once, not twice). The first request of an
empty batch may be chunked.
"""

from __future__ import annotations

from typing import Optional

import torch

from .forward_batch import ForwardMode
from .schedule_batch import Req, ScheduleBatch
from .schedule_policy import PrefillBudget, order_waiting_queue

# A waiting request that shares at least this many not-yet-cached tokens with one being prefilled
# waits one step, then hits the cache instead of computing the same prefix again.
IN_BATCH_DEDUP_MIN_TOKENS = 32


class PrefillAdmissionMixin:
    def _running_reserve(self) -> float:
        return sum(r.remaining_new_tokens() for r in self.running) * self.new_token_ratio

    def _get_prefill_batch(self) -> Optional[ScheduleBatch]:
        if not self.waiting and self.chunked_req is None and not self.jump_queue:
            return None
        sa = self.server_args
        budget = PrefillBudget(sa.max_prefill_tokens, sa.chunked_prefill_size,
                               self.allocator.available() + self.cache.evictable_size() - self._running_reserve())
        reqs, prefix_lens, extend_lens = [], [], []
        free_req_slots = self.req_to_token.available()

        continuing = self.chunked_req
        if continuing is not None:  # continue the chunked prefill first
            r = continuing
            # Bounded by the memory that really exists (free + evictable), not the reserve-adjusted budget:
            # the chunk's earlier part already holds memory, so it must be able to finish.
            room = self.allocator.available() + self.cache.evictable_size()
            ext = min(len(r.fill_ids) - r.kv_len, budget.rem_chunk_tokens, room)
            if ext <= 0:
                if self.running:
                    return None  # decode first; finishing (or retracted) requests free memory
                self._retract_chunked()
                return None
            reqs.append(r), prefix_lens.append(r.kv_len), extend_lens.append(ext)
            budget.take(ext, 0)
            self.chunked_req = None

        jumped = []
        for r in self.jump_queue:  # jump-forward tails: the requests already hold their prefix's KV
            if r.finished:
                continue
            ext = len(r.fill_ids) - r.kv_len
            if ext > min(budget.rem_chunk_tokens, budget.rem_input_tokens,
                         self.allocator.available() + self.cache.evictable_size()):
                break
            reqs.append(r), prefix_lens.append(r.kv_len), extend_lens.append(ext)
            budget.take(ext, 0)
            jumped.append(r)
        if jumped:
            ids = set(map(id, jumped))
            self.jump_queue = [r for r in self.jump_queue if id(r) not in ids]
        elif self.jump_queue and not self.running and continuing is None and not reqs:
            for r in self.jump_queue:  # nothing else can free memory: start them over
                self._release(r)
                r.reset_for_retract()
                self.waiting.insert(0, r)
            self.jump_queue = []
        self.waiting = order_waiting_queue(sa.schedule_policy, self.waiting, self.cache)
        admitted = []
        prefix_rows: list[tuple[int, torch.Tensor]] = []  # (req slot, cached prefix kv slots), written at once
        in_flight: list[list[int]] = []  # token ids being prefilled in this step
        for r in self.waiting:
            if len(self.running) + len(reqs) >= self.model_runner.max_running_requests or free_req_slots == 0:
                break
            matchable = self._matchable_ids(r)
            if in_flight and self._shares_in_flight_prefix(matchable, in_flight):
                continue  # next step its prefix is in the tree: prefill it once, not twice
            match = self.cache.match_prefix(matchable)
            pre = match.num_tokens
            ext = len(r.fill_ids) - pre
            reserve = r.remaining_new_tokens() * self.new_token_ratio
            if budget.fits_whole(ext, reserve):
                take = ext
            elif (not reqs and budget.rem_chunk_tokens > 0
                  and min(budget.rem_chunk_tokens, budget.rem_input_tokens) + reserve <= budget.rem_memory):
                take = min(budget.rem_chunk_tokens, budget.rem_input_tokens)  # first request: chunk it
            else:
                break
            if take <= 0:
                break
            evictable_before = self.cache.evictable_size()
            self._assign_slot_and_prefix(r, match)
            if match.num_tokens:
                prefix_rows.append((r.req_pool_idx, match.kv_indices))
            # Locking the matched prefix turned some evictable slots into protected ones.
            budget.rem_memory -= evictable_before - self.cache.evictable_size()
            free_req_slots -= 1
            budget.take(take, reserve)
            reqs.append(r), prefix_lens.append(pre), extend_lens.append(take)
            admitted.append(r)
            in_flight.append(r.fill_ids[:pre + take])
            if take < ext:
                break
        self.req_to_token.write_rows(prefix_rows)
        if admitted:
            ids = set(map(id, admitted))
            self.waiting = [r for r in self.waiting if id(r) not in ids]
        if not reqs:
            return None
        loc = self._alloc(sum(extend_lens))
        if loc is None:  # the budget overestimated what eviction can free: undo, fall back to decode
            for r in admitted:
                self._release(r)
                r.reset_for_retract()
            self.waiting = admitted + self.waiting
            self.jump_queue = jumped + self.jump_queue
            self.chunked_req = continuing
            if continuing is not None and not self.running:
                self._retract_chunked()
            return None
        for r, pre, ext in zip(reqs, prefix_lens, extend_lens):
            r.prefix_len_this_step, r.extend_len_this_step = pre, ext
        # NOTE: the model runner writes `loc` into req_to_token on the device (one indexed write).
        return ScheduleBatch(ForwardMode.EXTEND, reqs, prefix_lens, extend_lens, loc)

    def _shares_in_flight_prefix(self, ids: list[int], in_flight: list[list[int]]) -> bool:
        """Does `ids` share a long uncached prefix with a request already in this prefill batch?"""
        if self.server_args.disable_radix_cache:
            return False
        need = self._peek(ids) + IN_BATCH_DEDUP_MIN_TOKENS  # shared tokens that would make it wait
        if len(ids) < need:
            return False
        # NOTE: the window just past the cached part rejects most pairs in O(32): comparing whole
        # prefixes cost O(cached) per pair, and a few-shot batch has ~10^4 pairs sharing 2,000 tokens.
        window = ids[need - IN_BATCH_DEDUP_MIN_TOKENS:need]
        return any(other[need - IN_BATCH_DEDUP_MIN_TOKENS:need] == window and other[:need] == ids[:need]
                   for other in in_flight)

    def _peek(self, ids: list[int]) -> int:
        peek = getattr(self.cache, "peek_prefix_len", None)
        return peek(ids) if peek is not None else self.cache.match_prefix(ids).num_tokens

    def _matchable_ids(self, r: Req) -> list[int]:
        # Leave at least one token to compute (its logits give the next token), and recompute the
        # prompt positions whose logprobs were asked for.
        limit = len(r.fill_ids) - 1
        if r.needs_input_logprobs():
            limit = min(limit, max(r.input_logprob_next - 1, 0))
        return r.fill_ids[:limit]

    def _assign_slot_and_prefix(self, r: Req, match) -> None:
        """The request's table row and its lock on the cached prefix (the caller writes the prefix's
        slots into the row: one table write for the whole batch)."""
        r.req_pool_idx = self.req_to_token.alloc()
        self.cache.inc_lock(match.node)
        r.last_node = match.node
        r.kv_len = r.cache_len = match.num_tokens
        if r.num_retractions == 0:
            r.cached_tokens = match.num_tokens
            self.stats["cached_tokens"] += match.num_tokens
            self.stats["prompt_tokens"] += len(r.origin_input_ids)
