"""Prefill admission: which requests the next prefill batch takes, and how many tokens each.

In order: the chunked request continues, jump-forward tails go next, then the waiting queue (ordered by
the schedule policy) is admitted while the token and memory budgets allow, the prefix cache supplies
each request's cached prefix, and a request that shares a long uncached prefix with one already in this
batch waits a step (its prefix is then cached: computed once, not twice). The first request of an empty
batch may be chunked. Requests move between queues only through `RequestQueues`; memory only through
the `KVManager`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from ..forward_batch import ForwardMode
from ..kvcache.prefix_cache import MatchResult, PrefixPeek
from ..request import Req
from .adapters import SchedulerAdapters
from .batch import ScheduleBatch
from .kv_manager import KVManager, token_prefix
from .policy import PrefillBudget, order_waiting_queue
from .queues import RequestQueues
from .retraction import KVShortage

# A waiting request that shares at least this many not-yet-cached tokens with one being prefilled
# waits one step, then hits the cache instead of computing the same prefix again. 16 catches a chat
# template's system prompt (SmolLM2's: ~20 tokens), which a batch of chat prompts shares and nothing else.
IN_BATCH_DEDUP_MIN_TOKENS = 16
# Distinct dedup windows indexed per batch (see InFlightPrefixes); past that, a linear scan.
MAX_INDEXED_WINDOWS = 8


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
                index.setdefault(tuple(ids[need - self.window : need]), []).append(i)

    def shares(self, ids: list[int], need: int) -> bool:
        """Is `ids[:need]` (len(ids) >= need >= window) the start of a sequence in flight?"""
        w = self.window
        index = self._index.get(need)
        if index is None:
            if len(self._index) >= MAX_INDEXED_WINDOWS:
                window = ids[need - w : need]
                return any(
                    length >= need and other[need - w : need] == window and other[:need] == ids[:need]
                    for other, length in self._seqs
                )
            index = self._index[need] = {}
            for i, (other, length) in enumerate(self._seqs):
                if length >= need:
                    index.setdefault(tuple(other[need - w : need]), []).append(i)
        hits = index.get(tuple(ids[need - w : need]))
        if not hits:
            return False
        head = ids[:need]
        return any(self._seqs[i][0][:need] == head for i in hits)


@dataclass
class PrefillPlan:
    """A prefill batch being admitted: its requests, each one's cached prefix and new tokens, and where
    each came from (to put them back if the batch cannot be allocated)."""

    reqs: list[Req] = field(default_factory=list)
    prefix_lens: list[int] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    continuing: Optional[Req] = None  # the chunked request, continued
    jumped: list[Req] = field(default_factory=list)  # jump-forward tails
    admitted: list[Req] = field(default_factory=list)  # from the waiting queue
    # (request row, cached prefix kv slots) of the admitted requests, written into the table at once.
    # NOTE: requests that matched the same node pass one tensor, which write_rows uploads once.
    prefix_rows: list[tuple[int, torch.Tensor]] = field(default_factory=list)

    def add(self, r: Req, prefix_len: int, extend_len: int) -> None:
        self.reqs.append(r)
        self.prefix_lens.append(prefix_len)
        self.extend_lens.append(extend_len)


class PrefillAdmission:
    def __init__(
        self,
        server_args,
        queues: RequestQueues,
        kv: KVManager,
        shortage: KVShortage,
        max_running_requests: int,
        stats: dict,
        adapters: Optional[SchedulerAdapters] = None,
    ):
        self.server_args = server_args
        self.queues = queues
        self.kv = kv
        self.shortage = shortage
        self.max_running_requests = max_running_requests
        self.stats = stats
        self.adapters = adapters  # LoRA: at most max_loras_per_batch distinct adapters in a step
        self.sharing = not server_args.disable_radix_cache
        # Tokens one step may take, decode rows included (vLLM's max_num_batched_tokens).
        self.step_tokens = server_args.max_num_batched_tokens or server_args.chunked_prefill_size
        # Tokens one prompt may prefill in a step (0: the whole budget): a long prompt leaves room for others.
        self.long_prefill = server_args.long_prefill_token_threshold

    def build(self, prefill_in_flight: bool = False, decode_tokens: int = 0) -> Optional[ScheduleBatch]:
        """The next prefill batch, its requests in PREFILLING and its new tokens' slots allocated; None
        when nothing can be admitted now (decode first, or nothing waits). `prefill_in_flight`: a step
        launched ahead will commit memory it holds; `decode_tokens`: tokens of the step's decode rows
        (a mixed step), taken from its token budget first."""
        q, kv, sa = self.queues, self.kv, self.server_args
        if not q.waiting and q.chunked is None and not q.jump_tails:
            return None
        # Prefixes whose copy from the host tier has landed may be read from now on. With nothing running
        # there is no step to go on meanwhile: the copies in flight are waited for (they hold memory).
        kv.cache.poll_loads(wait=not q.running)
        chunk = min(sa.chunked_prefill_size, self.step_tokens - decode_tokens)
        if chunk <= 0:
            return None  # the running requests' decode tokens fill the step
        budget = PrefillBudget(sa.max_prefill_tokens, chunk, kv.room() - self.shortage.running_reserve())
        plan = PrefillPlan()
        if q.chunked is not None and not self._continue_chunked(q.chunked, plan, budget):
            return None
        self._take_jump_tails(plan, budget)
        refused = self._admit_waiting(plan, budget)
        if not plan.reqs:
            held = kv.cache.loads_pending()  # copies landing hold memory that is free after them
            if refused is not None and not (q.running or q.jump_tails or prefill_in_flight or held):
                # NOTE: alone it gets every slot that is neither free nor evictable: pins hold them all
                # (with its own cached prefix). Waiting would never end; an error tells the caller why.
                self.shortage.refuse(refused)
            return None
        return self._allocate(plan)

    # ---- the steps ----
    def _continue_chunked(self, r: Req, plan: PrefillPlan, budget: PrefillBudget) -> bool:
        """The chunked request `r`'s next chunk first; False when the batch must not be built this step."""
        q = self.queues
        # Bounded by the memory that really exists (free + evictable), not the reserve-adjusted budget:
        # the chunk's earlier part already holds memory, so it must be able to finish.
        ext = min(r.seq_len - r.kv_len, budget.rem_chunk_tokens, self.kv.room(), self.long_prefill or r.seq_len)
        if ext <= 0:
            if q.running:
                return False  # decode first; finishing (or retracted) requests free memory
            if not q.jump_tails:
                # NOTE: nothing else holds memory: pins hold the rest, and it can never finish
                # (retracted, it would be admitted again and stop here again, forever).
                self.shortage.refuse(r)
                return False
            self.shortage.retract_chunked()
            return False
        q.take_chunked()
        plan.add(r, r.kv_len, ext)
        plan.continuing = r
        budget.take(ext, 0)
        return True

    def _take_jump_tails(self, plan: PrefillPlan, budget: PrefillBudget) -> None:
        """Jump-forward tails next: the requests already hold their prefix's KV."""
        q, kv = self.queues, self.kv
        for r in q.jump_tails:
            if r.finished:
                continue
            ext = r.seq_len - r.kv_len
            if ext > min(budget.rem_chunk_tokens, budget.rem_input_tokens, kv.room()):
                break
            plan.add(r, r.kv_len, ext)
            budget.take(ext, 0)
            plan.jumped.append(r)
        if plan.jumped:
            q.take_jump_tails(plan.jumped)
        elif q.jump_tails and not q.running and not plan.reqs:
            self.shortage.retract_jump_tails(counted=False)  # nothing else can free memory: start them over

    def _admit_waiting(self, plan: PrefillPlan, budget: PrefillBudget) -> Optional[Req]:
        """Waiting requests in policy order while they fit; returns the one that did not fit, if one
        stopped the admission."""
        q, kv = self.queues, self.kv
        peeks: dict = {}  # id(request) -> the ranking's lookup of its sequence (lpm), reused by the match
        q.set_waiting_order(order_waiting_queue(self.server_args.schedule_policy, q.waiting, kv.cache, peeks))
        prefix_kv: dict = {}  # matched node -> its kv slots
        in_flight = InFlightPrefixes(IN_BATCH_DEDUP_MIN_TOKENS)  # token ids being prefilled in this step
        free_rows = kv.free_rows()
        refused = None
        adapters = self.adapters
        active = adapters.active(q.running + q.jump_tails + plan.reqs) if adapters is not None else set()
        for r in q.waiting:
            if len(q.running) + len(plan.reqs) >= self.max_running_requests or free_rows == 0:
                break
            if adapters is not None and not adapters.admits(r, active):
                continue  # its adapter would be one too many in this step: it waits for a slot
            match = self._match_unless_in_flight(self._matchable_ids(r), in_flight, peeks.get(id(r)))
            if match is None:
                continue  # next step its prefix is in the tree: prefill it once, not twice
            pre = match.num_tokens
            ext = r.seq_len - pre
            reserve = self.shortage.reserve_of(r)
            # NOTE: locking the matched prefix takes its evictable slots out of eviction's reach, so the
            # budget must see that before the fit check (checked after, a batch whose prefixes locked
            # every evictable slot could not be allocated: undone and admitted again, forever).
            locked = kv.lock(match)
            # NOTE: with nothing else running or admitted, the reserve protects nobody but this request
            # (the decode step aborts it if it outgrows the pool); checked against it, a prompt that fits
            # but whose max_new_tokens would not was never admitted and waited forever.
            if plan.reqs and 0 < self.long_prefill < ext:
                # NOTE: only a batch's first prompt may be cut (one chunked request at a time): a long prompt
                # after it waits for a step of its own, and the ones behind it with it (none passes another,
                # so no order of the queue starves it).
                kv.unlock(match)
                break
            check_reserve = reserve if (q.running or plan.reqs) else 0.0
            take = admitted_tokens(budget, ext, check_reserve, locked, first=not plan.reqs)
            capped = 0 < self.long_prefill < take
            if capped:
                take = self.long_prefill
            if take <= 0:
                kv.unlock(match)
                refused = r
                break
            if match.loading:
                # Its prefix is still being copied back from the host tier: it waits, the others run meanwhile.
                # The room it will need is kept from the requests after it (as if admitted), and what this
                # match loaded still counts as its host hit when it is admitted.
                kv.unlock(match)
                budget.take(take, reserve, locked)
                r.host_tokens_loading += match.host_tokens or 0
                if take < ext:
                    break
                continue
            kv.assign(r, match)
            self._count_prompt(r, match)
            if match.num_tokens:
                assert r.req_pool_idx is not None  # `assign` gave it a table row
                plan.prefix_rows.append((r.req_pool_idx, prefix_kv.setdefault(match.node, match.kv_indices)))
            free_rows -= 1
            budget.take(take, reserve, locked)
            plan.add(r, pre, take)
            plan.admitted.append(r)
            in_flight.add(r.cache_prompt if pre + take <= len(r.cache_prompt) else r.cache_fill_ids, pre + take)
            if take < ext and not capped:
                break  # the step's budget (or memory) is spent
        kv.write_prefix_rows(plan.prefix_rows)
        q.admit(plan.admitted)
        return refused

    def _allocate(self, plan: PrefillPlan) -> Optional[ScheduleBatch]:
        """The plan's new tokens' slots; None (the plan undone) when eviction cannot free them."""
        loc = self.kv.alloc(sum(plan.extend_lens))
        if loc is None:  # the budget overestimated what eviction can free: undo, fall back to decode
            for r in plan.admitted:
                self.kv.release(r)
                r.reset_for_retract()
            self.queues.undo_admission(plan.admitted, plan.jumped, plan.continuing)
            if plan.continuing is not None and not self.queues.running:
                self.shortage.retract_chunked()
            return None
        for r, pre, ext in zip(plan.reqs, plan.prefix_lens, plan.extend_lens):
            r.prefix_len_this_step, r.extend_len_this_step = pre, ext
        # NOTE: the step runner writes `loc` into req_to_token on the device (one indexed write).
        return ScheduleBatch(ForwardMode.EXTEND, plan.reqs, plan.prefix_lens, plan.extend_lens, loc)

    # ---- matching ----
    def _match_unless_in_flight(
        self, ids: list[int], in_flight: InFlightPrefixes, ranked: Optional[PrefixPeek] = None
    ) -> Optional[MatchResult]:
        """The cached prefix of `ids`, or None when `ids` shares a long uncached prefix with a request
        already in this prefill batch (it waits a step). `ranked`: the lpm ranking's lookup of the
        request's whole sequence (`ids` is a prefix of it), reused where it still holds."""
        cache = self.kv.cache
        if not self.sharing:
            return cache.match_prefix(ids)  # nothing is ever cached: no request waits for a prefix
        if ranked is not None:
            peek = cache.peek_prefix_of(ranked, ids)
        elif not in_flight:
            return cache.match_prefix(ids)
        else:
            # NOTE: the peek's walk is reused by the match (nothing changes the tree in between).
            peek = cache.peek_prefix(ids)
        if not in_flight:
            return cache.match_peeked(peek)
        need = peek.num_tokens + IN_BATCH_DEDUP_MIN_TOKENS  # shared tokens that would make it wait
        # NOTE: only the window just past the cached part is looked up; whole prefixes are compared
        # for the sequences that share it.
        if len(ids) >= need and in_flight.shares(ids, need):
            return None
        return cache.match_peeked(peek)

    @staticmethod
    def _matchable_ids(r: Req) -> list[int]:
        # Leave at least one token to compute (its logits give the next token), and recompute the
        # prompt positions whose logprobs were asked for.
        limit = r.seq_len - 1
        if r.needs_input_logprobs():
            limit = min(limit, max(r.input_logprob_next - 1, 0))
        return token_prefix(r, limit)

    def _count_prompt(self, r: Req, match: MatchResult) -> None:
        if r.num_retractions == 0:  # a retracted request's prompt was counted at its first admission
            host = match.host_tokens
            if r.host_tokens_loading:  # loaded for it while it waited (a held load), matched since as device hits
                host, r.host_tokens_loading = min(match.num_tokens, (host or 0) + r.host_tokens_loading), 0
            r.cached_tokens, r.cached_tokens_host = match.num_tokens, host
            self.stats["cached_tokens"] += match.num_tokens
            self.stats["prompt_tokens"] += len(r.origin_input_ids)


def admitted_tokens(budget: PrefillBudget, ext: int, reserve: float, locked: int, first: bool) -> int:
    """How many of a request's `ext` new tokens this batch takes: all, a first chunk (the batch's first
    request only), or 0 (it waits)."""
    if budget.fits_whole(ext, reserve, locked):
        return ext
    chunk = min(budget.rem_chunk_tokens, budget.rem_input_tokens)
    if first and chunk > 0 and chunk + reserve + locked <= budget.rem_memory:
        return chunk
    return 0
