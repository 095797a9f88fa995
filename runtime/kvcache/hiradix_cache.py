"""HiRadixCache: the radix cache over two tiers, the device KV pool and a host tier under it (HostTier).

A node's K/V are on the device (`value`), in the host tier (`host_value`), or both. What changes from
RadixCache:
  - device eviction demotes: an evicted leaf's K/V are copied to the host tier (when it has room, after
    dropping its least recently used host-only leaves) instead of being lost; a leaf the host cannot take
    is dropped with the host-only nodes below it;
  - a match (or a pin) whose path reaches host-only nodes loads them back into freshly allocated device
    slots before it returns, so the caller sees a device prefix as from any match (the copy is queued
    before any step that reads it: host_tier.py); where the device cannot make room for all of them, the
    match ends at the last one it could load;
  - `write_through`: every new edge is also copied to the host when inserted (after the prefill that
    computed it), so its eviction later costs no copy; `write_back`: copied only when evicted;
  - `hold_loads` (one GPU): a load runs on the copy stream alone and its nodes stay locked and marked
    loading until its event says it is done (`poll_loads`); a match through a loading node says so
    (`MatchResult.loading`) and the scheduler leaves that request out of the step, so the steps of everyone
    else never wait for the copy. Without it, the step that first reads the nodes waits on the device.
Invariants added to RadixCache's (checked by `check_integrity`): the device-resident nodes form a subtree
at the root (a host-only node has only host-only nodes below it); host-only nodes are never locked (a lock
is taken on a device path: a match loads it first); every host slot is in one node at most, never both in
a node and free; the evictable and protected counters count device slots only.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Optional

import torch

from .block_events import CacheEventListener
from .hicache_args import WRITE_POLICIES
from .host_tier import HostTier
from .memory_pool import TokenAllocator
from .prefix_cache import MatchResult
from .radix_cache import RadixCache
from .radix_keys import child_key
from .radix_node import TreeNode

HOST_EVICTION_BATCH = 64  # a host eviction frees at least this share (1/64) of the host tier


class HiRadixCache(RadixCache):
    def __init__(
        self,
        allocator: TokenAllocator,
        host: HostTier,
        page_size: int = 1,
        write_policy: str = "write_through",
        listener: Optional[CacheEventListener] = None,
        hold_loads: bool = False,
    ):
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"hicache_write_policy must be one of {list(WRITE_POLICIES)}, got {write_policy!r}")
        super().__init__(allocator, page_size, listener)
        self.host = host
        self.write_through = write_policy == "write_through"
        self.hold_loads = hold_loads
        # Loads in flight under hold_loads: (their event, the deepest node loaded: locked until done, the
        # device slots written), oldest first; and which device slots are still landing, for `_matched` (by
        # slot, not node: a later match may split a loaded node's edge).
        self._pending: list[tuple[object, TreeNode, torch.Tensor]] = []
        self._landing = torch.zeros(allocator.num_slots + 1, dtype=torch.bool) if hold_loads else None

    # ---- loading back on a match ---------------------------------------------------------------

    def _commit(self, node: TreeNode, child: Optional[TreeNode], m: int) -> tuple[TreeNode, list[torch.Tensor]]:
        end = self._split(child, m) if child is not None else node
        return super()._commit(self._load_back(end), None, 0)

    def _matched(self, queried: int, node: TreeNode, child: Optional[TreeNode], m: int) -> MatchResult:
        before = self.host.stats.loaded_tokens
        match = super()._matched(queried, node, child, m)
        match.host_tokens = self.host.stats.loaded_tokens - before
        if self._pending and self._landing is not None:
            match.loading = bool(self._landing[match.kv_indices].any())
        return match

    def loads_pending(self) -> bool:
        return bool(self._pending)

    def poll_loads(self, wait: bool = False) -> None:
        """Unlock the loads that are done (all of them, waiting for each, with `wait`)."""
        still = []
        for done, deepest, slots in self._pending:
            if wait:
                done.synchronize()  # type: ignore[attr-defined]  # (a torch.cuda.Event, or a test's stand-in)
            elif not done.query():  # type: ignore[attr-defined]
                still.append((done, deepest, slots))
                continue
            self.dec_lock(deepest)
            self._landing[slots] = False  # type: ignore[index]  # (set where loads are held)
        self._pending = still

    def _load_back(self, end: TreeNode) -> TreeNode:
        """Bring the host-only nodes at the end of `end`'s path onto the device (as many as the device can take,
        root side first); returns the path's last device-resident node (or the root)."""
        tail: list[TreeNode] = []  # host-only nodes, deepest first
        node = end
        while node is not self.root and node.value is None:
            tail.append(node)
            node = node.parent  # type: ignore[assignment]  # (attached: only the root has no parent)
        if not tail:
            return end
        tail.reverse()
        need = sum(len(n.key) for n in tail)
        # NOTE: locked while the device makes room, so neither eviction's demotions nor the host evictions
        # they cause can take the path (host-only nodes hold no device slots: locking them moves no counter).
        self.inc_lock(end)
        try:
            if self.allocator.available() < need:
                self.evict(need - self.allocator.available())
            room, k, take = self.allocator.available(), 0, 0
            while k < len(tail) and take + len(tail[k].key) <= room:
                take += len(tail[k].key)
                k += 1
            if k:
                slots = self.allocator.alloc(take)
                assert slots is not None  # (`room` slots are free)
                host_slots = torch.cat([n.host_value for n in tail[:k]])  # type: ignore[misc]
                done = self.host.load(host_slots, slots, hold=self.hold_loads)
                at = 0
                for n in tail[:k]:
                    n.value = slots[at : at + len(n.key)].clone()
                    at += len(n.key)
                self._protected += take  # (locked above; unlocked below, they become evictable)
                self.host.stats.num_loads += 1
                if done is not None and self._landing is not None:  # copying still: locked and marked until
                    self.inc_lock(tail[k - 1])  # `poll_loads` sees it done
                    self._pending.append((done, tail[k - 1], slots))
                    self._landing[slots] = True
        finally:
            self.dec_lock(end)
        return tail[k - 1] if k else node

    # ---- copying to the host -------------------------------------------------------------------

    def _stored(self, leaf: TreeNode) -> None:
        super()._stored(leaf)
        if self.write_through:
            self._back_up(leaf)

    def _back_up(self, node: TreeNode) -> bool:
        """Copy a device node's K/V into the host tier (making room there by host LRU); False when it cannot."""
        n = len(node.key)
        slots = self.host.alloc(n)
        if slots is None:
            # NOTE: each host eviction walks the whole tree; with write_through a full host tier is asked for
            # room at every insert, so it makes room for many at once.
            self._evict_host(max(n - self.host.available(), self.host.num_slots // HOST_EVICTION_BATCH))
            slots = self.host.alloc(n)
            if slots is None:
                return False
        self.host.save(node.value, slots)  # type: ignore[arg-type]  # (a device node)
        node.host_value = slots
        return True

    # ---- eviction ------------------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` device slots if possible, least recently used device leaves first: each
        one is demoted to the host tier (already there under write_through), or dropped where the host
        cannot take it."""
        if num_tokens <= 0:
            return 0
        tiebreak = itertools.count()
        heap = [(n.last_access, next(tiebreak), n) for n in self._device_nodes() if self._device_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            if leaf.host_value is None and not self._back_up(leaf):
                self._drop(leaf)
            self.allocator.free(leaf.value)
            leaf.value = None
            freed += len(leaf.key)
            self._evictable -= len(leaf.key)
            if self._device_leaf(parent):
                heapq.heappush(heap, (parent.last_access, next(tiebreak), parent))
        return freed

    def _device_nodes(self):
        """The device-resident nodes (and the root): a walk that skips the host-only subtrees."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(c for c in node.children.values() if c.value is not None)

    def _device_leaf(self, node: Optional[TreeNode]) -> bool:
        """An unlocked device node with nothing on the device below it (the device tier's leaves)."""
        if node is None or node is self.root or node.value is None or node.lock_ref:
            return False
        return all(c.value is None for c in node.children.values())

    def _evict_host(self, num_tokens: int) -> int:
        """Free at least `num_tokens` host slots if possible, least recently used first: a copy of a node
        also on the device is dropped (it stays cached there), a host-only leaf leaves the tree."""
        tiebreak = itertools.count()
        heap = [
            (n.last_access, next(tiebreak), n)
            for n in self._iter_nodes()
            if n.host_value is not None and (n.value is not None or (not n.children and not n.lock_ref))
        ]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            freed += len(node.key)
            if node.value is not None:
                self._free_host(node)
                continue
            parent = node.parent
            self._drop(node)
            if parent is not self.root and parent.value is None and not parent.children and not parent.lock_ref:
                heapq.heappush(heap, (parent.last_access, next(tiebreak), parent))
        return freed

    def _drop(self, node: TreeNode) -> None:
        """Take `node` and the (host-only) nodes below it out of the tree, their host slots freed; the
        caller frees its device slots."""
        for child in list(node.children.values()):
            self._drop(child)
        if self.listener is not None:  # (told while the leaf still spells its path)
            self.listener.removed(node)
        parent = node.parent
        del parent.children[child_key(node.key, 0, self.page_size)]  # type: ignore[union-attr]
        node.parent = None
        if node.host_value is not None:
            self._free_host(node)

    def _free_host(self, node: TreeNode) -> None:
        self.host.free(node.host_value)  # type: ignore[arg-type]
        self.host.stats.evicted_tokens += len(node.key)
        node.host_value = None

    def reset(self) -> None:
        self.poll_loads(wait=True)
        super().reset()
        self.host.clear()

    # ---- checks and stats ----------------------------------------------------------------------

    def check_integrity(self, num_private: int = 0, full: bool = True) -> None:
        super().check_integrity(num_private, full)
        if full:
            self._check_host()

    def _check_host(self) -> None:
        runs = [n.host_value for n in self._iter_nodes() if n.host_value is not None]
        for n in self._iter_nodes():
            if n.host_value is not None and n.host_value.shape != (len(n.key),):
                raise AssertionError(f"{n!r}: host slots {tuple(n.host_value.shape)} do not match its key")
        cached = torch.cat(runs) if runs else torch.empty(0, dtype=torch.int64)
        free = self.host.allocator.free_slots()
        size = self.host.num_slots
        if cached.numel() + free.numel() != size:
            raise AssertionError(f"host slot leak: {cached.numel()} cached + {free.numel()} free != {size}")
        counts = torch.bincount(torch.cat([cached, free]), minlength=size + 1)
        if int(counts[0]) or int(counts.max()) > 1:
            raise AssertionError("a host slot is cached twice, both cached and free, or slot 0")

    def tier_stats(self) -> dict:
        """The host tier's use and traffic (get_stats)."""
        return {"hicache_write_policy": "write_through" if self.write_through else "write_back", **self.host.usage()}
