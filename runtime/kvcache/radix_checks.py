"""The radix tree's invariants, checked in full (`RadixCache.check_integrity(full=True)`).

Every edge: parent pointers, page-aligned non-empty keys stored under their first page, one int64
slot per token, lock counts that never grow towards the leaves; where a host tier holds some edges
(`value` None), those are unlocked and nothing below them is on the device. Every slot: cached at most once,
never both cached and free, inside 1..num_slots. The size counters agree with the tree.
"""

from __future__ import annotations

import torch

from .radix_keys import child_key


def check_tree(cache) -> None:
    """Raise AssertionError naming the first broken invariant of a RadixCache."""
    _require(
        not cache.root.key and cache.root.parent is None and cache.root.lock_ref == 0,
        "root must have an empty key, no parent and no locks",
    )
    evictable = protected = 0
    slot_runs = []
    for node in cache._iter_nodes():
        for ck, child in node.children.items():
            where = f"node {child!r} (key starts {child.key[:8]})"
            _require(child.parent is node, f"{where}: parent pointer does not match")
            _require(
                len(child.key) > 0 and len(child.key) % cache.page_size == 0,
                f"{where}: key length {len(child.key)} is not a positive multiple of page_size {cache.page_size}",
            )
            _require(ck == child_key(child.key, 0, cache.page_size), f"{where}: stored under child key {ck}")
            _require(child.lock_ref >= 0, f"{where}: negative lock_ref {child.lock_ref}")
            _require(
                node is cache.root or child.lock_ref <= node.lock_ref,
                f"{where}: lock_ref {child.lock_ref} exceeds its parent's {node.lock_ref}",
            )
            if child.value is None:  # in the host tier only (hiradix_cache.py checks that tier)
                _require(child.host_value is not None, f"{where}: in neither tier")
                _require(child.lock_ref == 0, f"{where}: locked while only in the host tier")
                continue
            _require(
                child.value.dtype == torch.int64 and child.value.shape == (len(child.key),),
                f"{where}: value {child.value.dtype} {tuple(child.value.shape)} does not match its key",
            )
            _require(node is cache.root or node.value is not None, f"{where}: on the device below a host-only node")
            if child.lock_ref:
                protected += len(child.key)
            else:
                evictable += len(child.key)
            slot_runs.append(child.value)
    _require(
        evictable == cache._evictable and protected == cache._protected,
        f"size counters drifted: evictable {cache._evictable} (tree says {evictable}), "
        f"protected {cache._protected} (tree says {protected})",
    )
    # NOTE: counted with tensor ops: a set of Python ints over millions of free slots takes seconds.
    tree_slots = torch.cat(slot_runs) if slot_runs else torch.empty(0, dtype=torch.int64)
    free_slots = cache.allocator.free_slots()
    n = cache.allocator.num_slots
    _require(bool(((tree_slots >= 1) & (tree_slots <= n)).all()), "a cached kv slot is outside 1..num_slots")
    _require(bool(((free_slots >= 1) & (free_slots <= n)).all()), "a free kv slot is outside 1..num_slots")
    in_tree = torch.bincount(tree_slots, minlength=n + 1)
    in_free = torch.bincount(free_slots, minlength=n + 1)
    _require(int(in_tree.max()) <= 1, "a kv slot appears twice in the tree")
    _require(int(in_free.max()) <= 1, "a kv slot is twice on the free list")
    both = ((in_tree > 0) & (in_free > 0)).nonzero().flatten()
    _require(both.numel() == 0, f"kv slots both cached and free: {both[:8].tolist()}")


def _require(cond: bool, message: str) -> None:
    # Explicit raise, not `assert`: integrity checks must survive `python -O`.
    if not cond:
        raise AssertionError(message)
