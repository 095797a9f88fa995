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
from typing import Any, Sequence

import torch

from .memory_pool import TokenAllocator


@dataclass
class MatchResult:
    kv_indices: torch.Tensor  # (num_matched,) int64 kv slots of the cached prefix
    node: Any  # handle to lock / pass back; None when nothing matched

    @property
    def num_tokens(self) -> int:
        return int(self.kv_indices.numel())


class PrefixCache(ABC):
    """Maps token sequences to kv slots. All methods run on the scheduler thread."""

    allocator: TokenAllocator

    @abstractmethod
    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        """Longest cached prefix of `token_ids` (whole pages when page_size > 1). Does not lock."""

    @abstractmethod
    def inc_lock(self, node: Any) -> None:
        """Protect `node` and its ancestors from eviction (counted; pairs with dec_lock)."""

    @abstractmethod
    def dec_lock(self, node: Any) -> None:
        """Undo one inc_lock."""

    @abstractmethod
    def cache_unfinished_req(self, token_ids: Sequence[int], kv_indices: torch.Tensor,
                             old_node: Any) -> tuple[torch.Tensor, Any]:
        """Insert a running request's computed tokens (after a prefill chunk).

        `kv_indices[i]` holds the kv of `token_ids[i]`. Returns the kv indices the request should use
        from now on (duplicate slots already in the tree are freed and replaced by the tree's) and the
        new locked node; `old_node` is unlocked.
        """

    @abstractmethod
    def cache_finished_req(self, token_ids: Sequence[int], kv_indices: torch.Tensor,
                           old_node: Any) -> None:
        """A request is done: keep what is worth caching, free the rest, unlock `old_node`.

        `kv_indices` covers exactly `token_ids` (tokens whose kv was computed).
        """

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

    def check_integrity(self, num_private: int = 0, full: bool = True) -> None:
        """Raise AssertionError unless free + evictable + protected + private == total slots.

        `full=False` asks only for this count (cheap: the scheduler runs it whenever it goes idle);
        subclasses check their structures too when `full`."""
        a = self.allocator
        total = a.available() + self.evictable_size() + self.protected_size() + num_private
        if total != a.num_slots:
            raise AssertionError(
                f"KV slot leak: free {a.available()} + evictable {self.evictable_size()} + protected "
                f"{self.protected_size()} + private {num_private} = {total} != {a.num_slots}")


class NoSharingCache(PrefixCache):
    """`disable_radix_cache=True`: nothing is shared; finished requests free all their slots."""

    def __init__(self, allocator: TokenAllocator, page_size: int = 1):
        self.allocator = allocator
        self.page_size = page_size

    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        return MatchResult(torch.empty(0, dtype=torch.int64), None)

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
