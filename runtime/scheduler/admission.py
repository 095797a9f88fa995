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

from ..forward_batch import ForwardMode
from ..kvcache.prefix_cache import MatchResult
from ..request import FinishReason, Req
from .batch import ScheduleBatch
from .policy import PrefillBudget, order_waiting_queue

# A waiting request that shares at least this many not-yet-cached tokens with one being prefilled
# waits one step, then hits the cache instead of computing the same prefix again.
IN_BATCH_DEDUP_MIN_TOKENS = 32
# Distinct dedup windows indexed per batch (see InFlightPrefixes); past that, a linear scan.
MAX_INDEXED_WINDOWS = 8


def token_prefix(r: Req, n: int) -> list[int]:
    """`r.fill_ids[:n]` with one list copy instead of two (a 2,000-token prompt: ~2.5 us each), or
    none: the whole prompt is the request's own list (read it, never change it)."""
    origin = r.origin_input_ids
    if n == len(origin):
        return origin
    if n < len(origin):
        return origin[:n]
    return origin + r.output_ids[:n - len(origin)]


class InFlightPrefixes:
    """The token ids of the requests admitted to this prefill batch so far, for the in-batch dedup
    check: does a waiting request share its first `need` tokens with one of them?

    NOTE: a few-shot batch admits ~160 requests that share a 2,000-token prefix, and comparing each
    with every earlier one was ~13k window compares per batch. The admitted sequences are indexed by
    their tokens [need - window, need) for each `need` asked about (one per cached-prefix length, so
    usually one), and a check is a dict lookup.
    """

    def __init__(self, window: int):
        self.window = window
        self._seqs: list[tuple[list[int], int]] = []  # (token ids, how many of them are in flight)
        self._index: dict[int, dict[tuple, list[int]]] = {}  # need -> window tokens -> indices in _seqs

    def __bool__(self) -> bool:
        return bool(self._seqs)

    def add(self, ids: list[int], length: int) -> None:
        """`ids[:length]` is being prefilled (`ids` is not copied: it must not change meanwhile)."""
        i = len(self._seqs)
        self._seqs.append((ids, length))
        for need, index in self._index.items():
            if length >= need:
                index.setdefault(tuple(ids[need - self.window:need]), []).append(i)

    def shares(self, ids: list[int], need: int) -> bool:
        """Is `ids[:need]` (len(ids) >= need >= window) the start of a sequence in flight?"""
        w = self.window
        index = self._index.get(need)
        if index is None:
            if len(self._index) >= MAX_INDEXED_WINDOWS:
                window = ids[need - w:need]
                return any(length >= need and other[need - w:need] == window and other[:need] == ids[:need]
                           for other, length in self._seqs)
            index = self._index[need] = {}
            for i, (other, length) in enumerate(self._seqs):
                if length >= need:
                    index.setdefault(tuple(other[need - w:need]), []).append(i)
        hits = index.get(tuple(ids[need - w:need]))
        if not hits:
            return False
        head = ids[:need]
        return any(self._seqs[i][0][:need] == head for i in hits)


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
            ext = min(r.seq_len - r.kv_len, budget.rem_chunk_tokens, room)
            if ext <= 0:
                if self.running:
                    return None  # decode first; finishing (or retracted) requests free memory
                if not self.jump_queue:
                    # NOTE: nothing else holds memory: pins hold the rest, and it can never finish
                    # (retracted, it was admitted again and stopped here again, forever).
                    self._refuse_for_memory(r)
                    return None
                self._retract_chunked()
                return None
            reqs.append(r), prefix_lens.append(r.kv_len), extend_lens.append(ext)
            budget.take(ext, 0)
            self.chunked_req = None

        jumped = []
        for r in self.jump_queue:  # jump-forward tails: the requests already hold their prefix's KV
            if r.finished:
                continue
            ext = r.seq_len - r.kv_len
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
        peeks: dict = {}  # id(request) -> the ranking's lookup of its sequence (lpm), reused by the match
        self.waiting = order_waiting_queue(sa.schedule_policy, self.waiting, self.cache, peeks)
        admitted = []
        prefix_rows: list[tuple[int, torch.Tensor]] = []  # (req slot, cached prefix kv slots), written at once
        # NOTE: requests that matched the same node pass one tensor, which write_rows uploads once.
        prefix_kv: dict = {}  # matched node -> its kv slots
        in_flight = InFlightPrefixes(IN_BATCH_DEDUP_MIN_TOKENS)  # token ids being prefilled in this step
        refused = None  # the request that did not fit, if one stopped the admission
        for r in self.waiting:
            if len(self.running) + len(reqs) >= self.model_runner.max_running_requests or free_req_slots == 0:
                break
            matchable = self._matchable_ids(r)
            match = self._match_unless_in_flight(matchable, in_flight, peeks.get(id(r)))
            if match is None:
                continue  # next step its prefix is in the tree: prefill it once, not twice
            pre = match.num_tokens
            ext = r.seq_len - pre
            reserve = r.remaining_new_tokens() * self.new_token_ratio
            # NOTE: locking the matched prefix takes its evictable slots out of eviction's reach, so the
            # budget must see that before the fit check (checked after, a batch whose prefixes locked
            # every evictable slot could not be allocated: undone and admitted again, forever).
            evictable_before = self.cache.evictable_size()
            self.cache.inc_lock(match.node)
            locked = evictable_before - self.cache.evictable_size()
            # NOTE: with nothing else running or admitted, the reserve protects nobody but this request
            # (the decode step aborts it if it outgrows the pool); checked against it, a prompt that fits
            # but whose max_new_tokens would not was never admitted and waited forever.
            check_reserve = reserve if (self.running or reqs) else 0.0
            take = self._admitted_tokens(budget, ext, check_reserve, locked, first=not reqs)
            if take <= 0:
                self.cache.dec_lock(match.node)
                refused = r
                break
            self._assign_slot_and_prefix(r, match)
            if match.num_tokens:
                prefix_rows.append((r.req_pool_idx, prefix_kv.setdefault(match.node, match.kv_indices)))
            free_req_slots -= 1
            budget.take(take, reserve, locked)
            reqs.append(r), prefix_lens.append(pre), extend_lens.append(take)
            admitted.append(r)
            in_flight.add(r.origin_input_ids if pre + take <= len(r.origin_input_ids) else r.fill_ids, pre + take)
            if take < ext:
                break
        self.req_to_token.write_rows(prefix_rows)
        if admitted:
            ids = set(map(id, admitted))
            self.waiting = [r for r in self.waiting if id(r) not in ids]
        if not reqs:
            if refused is not None and not (self.running or self.jump_queue or self.pending_prefill):
                # NOTE: alone it gets every slot that is neither free nor evictable: pins hold them all
                # (with its own cached prefix). Waiting would never end; an error tells the caller why.
                self.waiting.remove(refused)
                self._refuse_for_memory(refused)
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

    def _match_unless_in_flight(self, ids: list[int], in_flight: InFlightPrefixes,
                                ranked=None) -> Optional[MatchResult]:
        """The cached prefix of `ids`, or None when `ids` shares a long uncached prefix with a request
        already in this prefill batch (it waits a step). `ranked`: the lpm ranking's lookup of the
        request's whole sequence (`ids` is a prefix of it), reused where it still holds."""
        if ranked is not None:  # lpm ranked it: the tree is a RadixCache
            peek = self.cache.peek_prefix_of(ranked, ids)
        elif not in_flight or self.server_args.disable_radix_cache:
            return self.cache.match_prefix(ids)
        else:
            # NOTE: the peek's walk is reused by the match (nothing changes the tree in between).
            peek = self.cache.peek_prefix(ids)
        if not in_flight:
            return self.cache.match_peeked(peek)
        need = peek.num_tokens + IN_BATCH_DEDUP_MIN_TOKENS  # shared tokens that would make it wait
        # NOTE: only the window just past the cached part is looked up; whole prefixes are compared
        # for the sequences that share it.
        if len(ids) >= need and in_flight.shares(ids, need):
            return None
        return self.cache.match_peeked(peek)

    def _matchable_ids(self, r: Req) -> list[int]:
        # Leave at least one token to compute (its logits give the next token), and recompute the
        # prompt positions whose logprobs were asked for.
        limit = r.seq_len - 1
        if r.needs_input_logprobs():
            limit = min(limit, max(r.input_logprob_next - 1, 0))
        return token_prefix(r, limit)

    def _refuse_for_memory(self, r: Req) -> None:
        """End a request that cannot run even alone (the chunked one, or one taken off the waiting queue)."""
        if self.chunked_req is r:
            self.chunked_req = None
        self._finish_now(r, FinishReason("abort", message=self._out_of_memory_message(r)), release=True)

    @staticmethod
    def _admitted_tokens(budget: PrefillBudget, ext: int, reserve: float, locked: int, first: bool) -> int:
        """How many of a request's `ext` new tokens this batch takes: all, a first chunk (the batch's
        first request only), or 0 (it waits)."""
        if budget.fits_whole(ext, reserve, locked):
            return ext
        chunk = min(budget.rem_chunk_tokens, budget.rem_input_tokens)
        if first and chunk > 0 and chunk + reserve + locked <= budget.rem_memory:
            return chunk
        return 0

    def _assign_slot_and_prefix(self, r: Req, match) -> None:
        """The request's table row and its cached prefix, which the caller has locked (the caller
        writes the prefix's slots into the row: one table write for the whole batch)."""
        r.req_pool_idx = self.req_to_token.alloc()
        r.rank_peek = None  # it holds tree nodes
        r.last_node = match.node
        r.kv_len = r.cache_len = match.num_tokens
        if r.num_retractions == 0:
            r.cached_tokens = match.num_tokens
            self.stats["cached_tokens"] += match.num_tokens
            self.stats["prompt_tokens"] += len(r.origin_input_ids)
