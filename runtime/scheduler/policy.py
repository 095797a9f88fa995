"""Waiting-queue order and the prefill admission budget.

- `fcfs`: arrival order.
- `lpm`: longest cached prefix first (a request whose prefix is in the tree costs the least prefill
  and frees the least memory); falls back to FCFS on long queues where matching everything costs more
  than it saves. A request that has waited `MAX_REORDERED_WAIT_S` goes first whatever its prefix, so a
  stream of cache hits cannot starve a prompt that shares nothing.
- `dfs-weight`: requests of one program / fork group (and, within that, sharing prefixes) run
  together, so siblings share one prefill batch and the subtree stays hot.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

from ..kvcache.prefix_cache import PrefixCache
from ..request import Req

LPM_MAX_QUEUE = 128
# Seconds a waiting request may be passed over for cache hits (lpm, dfs-weight) before it goes first.
MAX_REORDERED_WAIT_S = 1.0


def order_waiting_queue(policy: str, waiting: list[Req], cache: PrefixCache, peeks: Optional[dict] = None) -> list[Req]:
    """The waiting queue in admission order: by priority (lower first) where requests set one, then by the
    schedule policy. With `peeks` (a dict), lpm leaves each ranked request's lookup there under
    `id(request)` (the admission reuses it)."""
    ordered = _policy_order(policy, waiting, cache, peeks)
    if any(r.priority for r in waiting):
        ordered = sorted(ordered, key=lambda r: r.priority)  # stable: the policy's order within a priority
    return ordered


def _policy_order(policy: str, waiting: list[Req], cache: PrefixCache, peeks: Optional[dict]) -> list[Req]:
    if policy == "fcfs" or len(waiting) <= 1:
        return waiting
    if policy == "lpm":
        if len(waiting) > LPM_MAX_QUEUE:
            return waiting
        # A read-only lookup: ranking must not split tree nodes or refresh LRU times.
        if peeks is not None:
            peek = _kept_peeks(cache, peeks)
        else:
            peek = lambda ids, r: cache.peek_prefix_len(ids)  # noqa: E731
        # NOTE: a request without outputs is ranked on its prompt list itself (cache_fill_ids is a copy).
        overdue = time.monotonic() - MAX_REORDERED_WAIT_S
        scored = [
            (
                r.created > overdue,
                0 if r.created <= overdue else -peek(r.cache_fill_ids if r.output_ids else r.cache_prompt, r),
                i,
                r,
            )
            for i, r in enumerate(waiting)
        ]
        scored.sort(key=lambda t: (t[0], t[1], t[2]))
        return [r for _, _, _, r in scored]
    if policy == "dfs-weight":
        # Group by program; groups ordered by their first arrival; within a group, shared prefixes
        # adjacent (lexicographic token order puts siblings of one prefix next to each other).
        first_seen: dict[str, int] = {}
        for i, r in enumerate(waiting):
            first_seen.setdefault(r.group or r.rid, i)
        overdue = time.monotonic() - MAX_REORDERED_WAIT_S
        return sorted(waiting, key=lambda r: (r.created > overdue, first_seen[r.group or r.rid], r.fill_ids[:64]))
    raise ValueError(f"unknown schedule policy {policy!r}")


def _kept_peeks(cache, peeks: dict):
    """lpm's lookup of a waiting request's ids, as a prefix length: its last lookup (`Req.rank_peek`)
    while the tree would still end that walk there, else a new one; each also left in `peeks`.

    NOTE: every admission step ranks the whole queue (up to 128 requests of ~1,000 tokens, a tree walk
    each), and the admission that follows matches most of them again; both reuse these walks.
    """
    current = cache.peek_is_current

    def peek(ids, r: Req) -> int:
        found = r.rank_peek
        if found is None or found.token_ids is not ids or not current(found):
            found = r.rank_peek = cache.peek_prefix(ids)
        peeks[id(r)] = found
        return found.num_tokens

    return peek


@dataclass
class PrefillBudget:
    """Token budgets for one prefill step and the memory the admitted requests will need."""

    rem_input_tokens: int  # max_prefill_tokens left in this step
    rem_chunk_tokens: int  # chunked_prefill_size left in this step
    rem_memory: float  # free + evictable slots, minus what running requests are expected to decode

    # `locked`: evictable slots that admitting the request protects (its cached prefix, now locked).
    def fits_whole(self, extend_len: int, reserve: float, locked: int = 0) -> bool:
        return (
            extend_len <= self.rem_input_tokens
            and extend_len <= self.rem_chunk_tokens
            and extend_len + reserve + locked <= self.rem_memory
        )

    def take(self, extend_len: int, reserve: float, locked: int = 0) -> None:
        self.rem_input_tokens -= extend_len
        self.rem_chunk_tokens -= extend_len
        self.rem_memory -= extend_len + reserve + locked
