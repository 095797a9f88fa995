"""The scheduler's KV memory: free slots, the prefix cache over them, each request's row of req_to_token,
and the prefixes clients pinned.

Slot accounting (checked by `check`): every kv slot is free, in the cache (evictable or locked), or a
request's private slot (computed, not yet in the cache: `kv_len - cache_len` per request holding KV, plus
the slot of a decode step launched but not read back). Requests see their memory through `Req`'s
`req_pool_idx`, `kv_len`, `cache_len` and `last_node`; only this part changes them.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Optional

import numpy as np
import torch

from ..kvcache.memory_pool import ReqToTokenPool, TokenAllocator
from ..kvcache.prefix_cache import MatchResult, PinHandle, PrefixCache
from ..request import Req

logger = logging.getLogger("plait.scheduler")


def token_prefix(r: Req, n: int) -> list[int]:
    """`r.cache_fill_ids[:n]` (the ids as the prefix cache keys them: `fill_ids` but for a request with an
    adapter or a cache salt) with one list copy instead of two (a 2,000-token prompt: ~2.5 us each), or
    none: the whole prompt is the request's own list (read it, never change it)."""
    origin = r.cache_prompt
    if n == len(origin):
        return origin
    if n < len(origin):
        return origin[:n]
    return origin + r.output_ids[: n - len(origin)]


class KVManager:
    def __init__(self, allocator: TokenAllocator, req_to_token: ReqToTokenPool, cache: PrefixCache):
        self.allocator = allocator
        self.req_to_token = req_to_token
        self.cache = cache
        self.pins: dict[int, PinHandle] = {}
        self.pin_expiry: dict[int, float] = {}  # pin id -> monotonic deadline (pins made with a ttl)
        self._pin_ids = itertools.count(1)

    # ---- slots ----
    @property
    def total(self) -> int:
        return self.allocator.num_slots

    def available(self) -> int:
        return self.allocator.available()

    def room(self) -> int:
        """Slots a request could get now: free ones, and cached ones eviction can free."""
        return self.allocator.available() + self.cache.evictable_size()

    def make_free(self, n: int) -> None:
        """Evict cached slots until `n` are free (or nothing more can be evicted). Prefixes still landing from
        the host tier (held loads) are waited for first when nothing else can give the room: they are about to
        be evictable, and a running request must not be retracted for memory that is only in transit."""
        short = n - self.allocator.available()
        if short > 0:
            self.cache.evict(short)
            short = n - self.allocator.available()
            if short > 0 and self.cache.loads_pending():
                self.cache.poll_loads(wait=True)
                self.cache.evict(short)

    def alloc(self, n: int) -> Optional[torch.Tensor]:
        """`n` free slots, evicting cached ones if needed; None when even that cannot give them."""
        loc = self.allocator.alloc(n)
        if loc is None:
            self.make_free(n)
            loc = self.allocator.alloc(n)
        return loc

    def free_slot(self, slot: int) -> None:
        self.allocator.free(torch.tensor([slot]))

    # ---- a request's memory ----
    def lock(self, match: MatchResult) -> int:
        """Lock a matched prefix against eviction; returns the evictable slots that took out of reach."""
        before = self.cache.evictable_size()
        self.cache.inc_lock(match.node)
        return before - self.cache.evictable_size()

    def unlock(self, match: MatchResult) -> None:
        self.cache.dec_lock(match.node)

    def free_rows(self) -> int:
        return self.req_to_token.available()

    def assign(self, r: Req, match: MatchResult) -> None:
        """The request's table row and its cached prefix, which the caller has locked (the caller writes
        the prefix's slots into the row with `write_prefix_rows`: one table write for a whole batch)."""
        r.req_pool_idx = self.req_to_token.alloc()
        r.rank_peek = None  # it holds tree nodes
        r.last_node = match.node
        r.kv_len = r.cache_len = match.num_tokens

    def write_prefix_rows(self, rows: list[tuple[int, torch.Tensor]]) -> None:
        """(request row, cached prefix slots) of a prefill batch's requests, written from position 0."""
        self.req_to_token.write_rows(rows)

    def insert_progress(self, r: Req) -> None:
        """The request's computed tokens into the prefix cache (after a prefill): they become shared."""
        ids = token_prefix(r, r.kv_len)
        row = r.req_pool_idx
        assert row is not None  # (a prefilled request holds its table row)
        kv = self.req_to_token.read(row, r.kv_len)
        new_kv, node = self.cache.cache_unfinished_req(ids, kv, r.last_node)
        # NOTE: the row changes only where the tree already held a token this request computed too
        # (rare: prefills of one prefix are deduplicated), so the usual case writes nothing.
        if new_kv is not kv and not torch.equal(new_kv, kv):
            self.req_to_token.write(row, 0, new_kv)
        r.last_node = node
        r.cache_len = self.cache.cached_len(r.kv_len)

    def keep_tree_paths(self, kept: list[tuple[Req, np.ndarray, list[int]]]) -> None:
        """After a VERIFY step, per request: (the request, its tree nodes' slots (n,), the nodes it keeps:
        its root, then the accepted drafts it committed, in order down the tree). The kept nodes' slots
        become the request's next positions after its computed KV (kv_len grows by as many); every other
        node's slot goes back to the allocator, never to the prefix cache. The table is rewritten only
        where the path is not the tree's first nodes (a chain's never is)."""
        freed: list[int] = []
        for r, seg, path in kept:
            if path != list(range(len(path))):
                assert r.req_pool_idx is not None  # (a request in a step holds its table row)
                self.req_to_token.write(r.req_pool_idx, r.kv_len, torch.from_numpy(seg[path]))
            keep = set(path)
            freed.extend(int(seg[j]) for j in range(len(seg)) if j not in keep)
            r.kv_len += len(path)
        if freed:
            self.allocator.free(torch.tensor(freed, dtype=torch.int64))

    def release(self, r: Req) -> None:
        """Give the request's KV back: the computed part to the cache, the rest to the allocator."""
        if r.inflight_slot is not None:  # overlap: a step computed past the end; its slot is unused
            self.free_slot(r.inflight_slot)
            r.inflight_slot = None
        if r.req_pool_idx is None:
            return
        # NOTE: read from the host mirror: a device read would wait for the step in flight.
        kv = self.req_to_token.read(r.req_pool_idx, r.kv_len)
        self.cache.cache_finished_req(token_prefix(r, r.kv_len), kv, r.last_node)
        self.req_to_token.free(r.req_pool_idx)
        r.req_pool_idx = None
        r.last_node = None

    # ---- pins ----
    def pin(self, token_ids: list[int], ttl: Optional[float]) -> dict:
        """Lock the cached part of `token_ids` until `unpin` (or `ttl` seconds). Only an integer id crosses
        the process boundary; a pin with a ttl expires on its own, so a client that dies without unpinning
        cannot hold KV forever."""
        # NOTE: the ttl is checked before the pin is taken: a bad one failing after it would leave a pin
        # whose id the caller never got. NaN would never expire.
        if ttl is not None and not float(ttl) > 0:
            raise ValueError(f"ttl must be > 0 seconds, got {ttl!r}")
        handle = self.cache.pin(token_ids)
        if handle is None:  # a cache that shares nothing keeps nothing to pin
            return {"pin_id": None, "pinned_tokens": 0}
        pin_id = next(self._pin_ids)
        self.pins[pin_id] = handle
        if ttl is not None:
            self.pin_expiry[pin_id] = time.monotonic() + float(ttl)
        return {"pin_id": pin_id, "pinned_tokens": handle.num_tokens}

    def unpin(self, pin_id: int) -> bool:
        handle = self.pins.pop(pin_id, None)
        self.pin_expiry.pop(pin_id, None)
        if handle is None:
            return False
        self.cache.unpin(handle)
        return True

    def expire_pins(self) -> None:
        if not self.pin_expiry:
            return
        now = time.monotonic()
        for pin_id in [p for p, t in self.pin_expiry.items() if t <= now]:
            logger.info("pin %d expired (its client never unpinned it)", pin_id)
            self.unpin(pin_id)

    def pinned_tokens(self) -> int:
        """Cached tokens that pins keep locked (their paths may overlap: counted once)."""
        return self.cache.locked_tokens(list(self.pins.values()))

    def flush(self) -> None:
        """Drop every pin and everything cached (only when no request holds KV)."""
        for handle in self.pins.values():
            self.cache.unpin(handle)
        self.pins.clear()
        self.pin_expiry.clear()
        self.cache.reset()

    # ---- accounting ----
    def out_of_memory_message(self, r: Req) -> str:
        """Why a request that runs alone cannot go on: its sequence outgrew what the pool can give it."""
        pinned = self.pinned_tokens()
        held = f", {pinned} of them held by pinned prefixes" if pinned else ""
        return (
            f"out of KV memory: the request needs {r.seq_len + 1} tokens of KV cache, the pool holds "
            f"{self.total}{held} (raise max_total_tokens, or lower max_new_tokens)"
        )

    def check(self, holding: list[Req], full: bool = True) -> None:
        """Raise AssertionError unless free + cached + the requests' private slots == every slot."""
        private = sum(r.kv_len - r.cache_len + (r.inflight_slot is not None) for r in holding)
        self.cache.check_integrity(num_private=private, full=full)

    def usage(self) -> dict:
        total, free, evictable = self.total, self.allocator.available(), self.cache.evictable_size()
        return {
            "max_total_tokens": total,
            "free_tokens": free,
            "evictable_tokens": evictable,
            "protected_tokens": self.cache.protected_size(),
            "kv_used_tokens": total - free - evictable,
            "token_usage": (total - free - evictable) / total,
            **self.cache.tier_stats(),
        }
