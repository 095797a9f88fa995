"""The prefix-cache interface the scheduler talks to, and the no-sharing implementation.

Slot accounting invariant (checked by `check_integrity`): every kv slot 1..N is in exactly one of
  - the allocator's free list,
  - the cache, unlocked (`evictable_size`),
  - the cache, locked by a running request (`protected_size`),
  - a running request's private tail (tokens not yet inserted into the cache).
When the scheduler is idle the last set is empty, so free + evictable + protected == total.

Requests hold an opaque `node` handle returned by `match_prefix`/`cache_unfinished_req`; the cache
keeps the path from that node to the root locked until the request hands it back through
`cache_finished_req` (or `release`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from .memory_pool import TokenAllocator

_EMPTY = torch.empty(0, dtype=torch.int64)


@dataclass
class MatchResult:
    kv_indices: torch.Tensor  # (num_matched,) int64 kv slots of the cached prefix
    node: Any  # handle to lock / pass back; None when nothing matched
    host_tokens: Optional[int] = None  # of those, how many this match loaded back from a host tier (None: no tier)
    # Some of them are still being copied onto the device (a host tier's held load): no step may read them yet.
    loading: bool = False

    @property
    def num_tokens(self) -> int:
        return int(self.kv_indices.numel())


@dataclass(eq=False)
class PrefixPeek:
    """A read-only lookup (`peek_prefix`): how much of `token_ids` is cached, and where the walk ended
    (`node`, fully matched, then `m` tokens into its child `child`, if any). It stays valid while the
    cache would still end that walk there (`peek_is_current`)."""

    token_ids: Sequence[int]
    num_tokens: int
    queried: int
    node: Any = None
    child: Any = None
    m: int = 0


@dataclass(eq=False)
class PinHandle:
    """A locked cached prefix (see `PrefixCache.pin`). `num_tokens` is how much of it was cached."""

    node: Any
    num_tokens: int
    active: bool = True


@dataclass
class PrefixHitStats:
    """Tokens asked for in `match_prefix` vs tokens found cached; the scheduler reports the rate."""

    num_queries: int = 0
    queried_tokens: int = 0
    matched_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.matched_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def reset(self) -> None:
        self.num_queries = self.queried_tokens = self.matched_tokens = 0


class PrefixCache(ABC):
    """Maps token sequences to kv slots. All methods run on the scheduler thread; this interface is
    everything the scheduler calls on a cache."""

    allocator: TokenAllocator
    hit_stats: PrefixHitStats

    @abstractmethod
    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        """Longest cached prefix of `token_ids` (whole pages when page_size > 1). Does not lock."""

    @abstractmethod
    def peek_prefix(self, token_ids: Sequence[int]) -> PrefixPeek:
        """How much of `token_ids` is cached, without splitting, touching LRU times or hit stats (for
        ranking waiting requests); the peek remembers where its walk ended for `match_peeked`."""

    @abstractmethod
    def peek_is_current(self, peek: PrefixPeek) -> bool:
        """Would a walk of `peek.token_ids` now end where the peek's did? O(1)."""

    @abstractmethod
    def match_peeked(self, peek: PrefixPeek) -> MatchResult:
        """`match_prefix(peek.token_ids)`, reusing the peek's walk while it is current."""

    @abstractmethod
    def peek_prefix_of(self, peek: PrefixPeek, token_ids: Sequence[int]) -> PrefixPeek:
        """`peek_prefix(token_ids)` for `token_ids` a prefix of `peek.token_ids`, reusing its walk."""

    def poll_loads(self, wait: bool = False) -> None:
        """Take in the copies onto the device that have finished (a host tier's held loads; `wait`: all of
        them). A cache without a tier has none."""
        return None

    def loads_pending(self) -> bool:
        """Whether copies onto the device are still landing (what they hold locked is freed after)."""
        return False

    def peek_prefix_len(self, token_ids: Sequence[int]) -> int:
        return self.peek_prefix(token_ids).num_tokens

    @abstractmethod
    def inc_lock(self, node: Any) -> None:
        """Protect `node` and its ancestors from eviction (counted; pairs with dec_lock)."""

    @abstractmethod
    def dec_lock(self, node: Any) -> None:
        """Undo one inc_lock."""

    @abstractmethod
    def cache_unfinished_req(
        self, token_ids: Sequence[int], kv_indices: torch.Tensor, old_node: Any
    ) -> tuple[torch.Tensor, Any]:
        """Insert a running request's computed tokens (after a prefill chunk).

        `kv_indices[i]` holds the kv of `token_ids[i]`. Returns the kv indices the request should use
        from now on (duplicate slots already in the tree are freed and replaced by the tree's) and the
        new locked node; `old_node` is unlocked.
        """

    @abstractmethod
    def cache_finished_req(self, token_ids: Sequence[int], kv_indices: torch.Tensor, old_node: Any) -> None:
        """A request is done: keep what is worth caching, free the rest, unlock `old_node`.

        `kv_indices` covers exactly `token_ids` (tokens whose kv was computed).
        """

    @abstractmethod
    def pin(self, token_ids: Sequence[int]) -> Optional[PinHandle]:
        """Lock the cached part of `token_ids` against eviction until `unpin`; None when the cache keeps
        nothing (no sharing). Only what is already cached can be pinned."""

    @abstractmethod
    def unpin(self, handle: PinHandle) -> None: ...

    @abstractmethod
    def locked_tokens(self, handles: Sequence[PinHandle]) -> int:
        """Cached tokens the handles keep locked (overlapping paths counted once)."""

    @abstractmethod
    def cached_len(self, num_tokens: int) -> int:
        """How many of a request's first `num_tokens` computed tokens an insert puts in the cache (the
        rest stay the request's private memory): whole pages, or none for a cache that shares nothing."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` unlocked slots if possible (LRU leaves first); returns freed."""

    @abstractmethod
    def evictable_size(self) -> int: ...

    @abstractmethod
    def protected_size(self) -> int: ...

    @abstractmethod
    def reset(self) -> None:
        """Drop everything cached (slots go back to the allocator). Only when nothing is locked."""

    def total_size(self) -> int:
        return self.evictable_size() + self.protected_size()

    def tier_stats(self) -> dict:
        """What a cache with tiers below the device pool reports of them (get_stats); nothing otherwise."""
        return {}

    def check_integrity(self, num_private: int = 0, full: bool = True) -> None:
        """Raise AssertionError unless free + evictable + protected + private == total slots.

        `full=False` asks only for this count (cheap: the scheduler runs it whenever it goes idle);
        subclasses check their structures too when `full`."""
        a = self.allocator
        total = a.available() + self.evictable_size() + self.protected_size() + num_private
        if total != a.num_slots:
            raise AssertionError(
                f"KV slot leak: free {a.available()} + evictable {self.evictable_size()} + protected "
                f"{self.protected_size()} + private {num_private} = {total} != {a.num_slots}"
            )


class NoSharingCache(PrefixCache):
    """`disable_radix_cache=True`: nothing is shared; finished requests free all their slots."""

    def __init__(self, allocator: TokenAllocator, page_size: int = 1):
        self.allocator = allocator
        self.page_size = page_size
        self.hit_stats = PrefixHitStats()

    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        return MatchResult(_EMPTY, None)

    def peek_prefix(self, token_ids: Sequence[int]) -> PrefixPeek:
        return PrefixPeek(token_ids, 0, len(token_ids))

    def peek_is_current(self, peek: PrefixPeek) -> bool:
        return True

    def match_peeked(self, peek: PrefixPeek) -> MatchResult:
        return MatchResult(_EMPTY, None)

    def peek_prefix_of(self, peek: PrefixPeek, token_ids: Sequence[int]) -> PrefixPeek:
        return PrefixPeek(token_ids, 0, len(token_ids))

    def pin(self, token_ids: Sequence[int]) -> Optional[PinHandle]:
        return None

    def unpin(self, handle: PinHandle) -> None:
        raise RuntimeError("unpin: a cache that shares nothing holds no pins")

    def locked_tokens(self, handles: Sequence[PinHandle]) -> int:
        return 0

    def cached_len(self, num_tokens: int) -> int:
        return 0

    def inc_lock(self, node: Any) -> None:
        pass

    def dec_lock(self, node: Any) -> None:
        pass

    def cache_unfinished_req(self, token_ids, kv_indices, old_node):
        return kv_indices, None

    def cache_finished_req(self, token_ids, kv_indices, old_node) -> None:
        self.allocator.free(kv_indices)

    def evict(self, num_tokens: int) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def reset(self) -> None:
        pass
