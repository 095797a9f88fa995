"""RadixCache: RadixAttention's radix tree from token ids to kv slots, behind `PrefixCache`.

Each edge (node) holds a run of token ids (`key`) and the kv slots that hold their K/V (`value`,
int64, one slot per token). A path from the root spells a cached prefix; its slots are the
concatenation of the values along the path.

Invariants (checked by `check_integrity`):
  - every non-root node has a non-empty key of whole pages, `len(value) == len(key)`, and sits in its
    parent's `children` under the first page of its key;
  - `lock_ref` counts the running requests / pins whose path goes through the node, so a parent is
    locked at least as often as any child; locked nodes (`lock_ref > 0`) are `protected`, the others
    `evictable`, and the two counters equal the sizes recomputed from the tree;
  - every slot in the tree appears once, is not on the allocator's free list, and is in 1..num_slots.

Splits keep the *original* node object as the deeper half, so a handle a request holds keeps naming
the end of the same path after someone else splits an edge above it.

Access times come from a logical clock (one tick per match/insert), not wall time, so LRU order is
deterministic and tests can pin exact eviction order.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Optional, Sequence, cast

import torch

from .block_events import CacheEventListener
from .memory_pool import TokenAllocator
from .prefix_cache import MatchResult, PinHandle, PrefixCache, PrefixHitStats, PrefixPeek
from .radix_checks import check_tree
from .radix_keys import aligned, as_key, checked_pair, child_key, common_len, key_slice
from .radix_node import TreeNode, split_slots

_EMPTY = torch.empty(0, dtype=torch.int64)


class RadixCache(PrefixCache):
    """`listener` (optional): told of each edge added, leaf evicted, reset; not of splits (no path changes)."""

    def __init__(self, allocator: TokenAllocator, page_size: int = 1, listener: Optional[CacheEventListener] = None):
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        self.allocator = allocator
        self.page_size = page_size
        self.listener = listener
        self.hit_stats = PrefixHitStats()
        self._new_tree()

    def _new_tree(self) -> None:
        self.root = TreeNode((), _EMPTY, None, 0)
        self._evictable = 0
        self._protected = 0
        self._clock = 0

    # ---- lookups -------------------------------------------------------------------------------

    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        key = as_key(token_ids)
        node, child, m, _ = self._walk(key[: aligned(len(key), self.page_size)])
        return self._matched(len(key), node, child, m)

    def peek_prefix_len(self, token_ids: Sequence[int]) -> int:
        key = as_key(token_ids)
        return self._walk(key[: aligned(len(key), self.page_size)])[3]

    # NOTE: every admission step ranks the waiting queue by cached-prefix length (lpm) and then matches
    # the requests it admits; with ~1,000-2,000-token shared prefixes each walk compares that many
    # tokens. A peek remembers where its walk ended, and while the tree would still end it there
    # (`peek_is_current`, O(1)) it becomes a match or the lookup of a prefix of the same ids without
    # comparing the tokens again.
    def peek_prefix(self, token_ids: Sequence[int]) -> PrefixPeek:
        key = as_key(token_ids)
        node, child, m, pos = self._walk(key[: aligned(len(key), self.page_size)])
        return PrefixPeek(token_ids, pos, len(key), node, child, m)

    def match_peeked(self, peek: PrefixPeek) -> MatchResult:
        if not self.peek_is_current(peek):
            return self.match_prefix(peek.token_ids)
        return self._matched(peek.queried, peek.node, peek.child, peek.m)

    def peek_prefix_of(self, peek: PrefixPeek, token_ids: Sequence[int]) -> PrefixPeek:
        # The peek's walk is reused when it is still current and its match ended before the prefix's
        # (page-aligned) end: it stopped on a token both share, so the prefix's walk ends there too.
        n = len(token_ids)
        if not self.peek_is_current(peek) or n > peek.queried or peek.num_tokens >= aligned(n, self.page_size):
            return self.peek_prefix(token_ids)
        return PrefixPeek(token_ids, peek.num_tokens, n, peek.node, peek.child, peek.m)

    def peek_is_current(self, peek: PrefixPeek) -> bool:
        # NOTE: a path spells the same tokens after any split, edges are never merged or extended, and
        # nodes leave the tree leaves first (then `parent` is None) or all at once (`reset`: a new root).
        # So the walk still reaches the peek's node while that is attached; from there it takes the same
        # edge `child` (unless that was split or evicted: its parent changed), or, where the peek found no
        # edge for its next page, it does so again unless an insert added one.
        node = peek.node
        if node is not self.root and node.parent is None:
            return False
        if peek.child is not None:
            return peek.child.parent is node
        pos = peek.num_tokens
        if pos + self.page_size > peek.queried:
            return True  # the walk ended with the ids
        page = key_slice(peek.token_ids, pos, pos + self.page_size)
        return node.children.get(child_key(page, 0, self.page_size)) is None

    # ---- locking -------------------------------------------------------------------------------

    def inc_lock(self, node: Optional[TreeNode]) -> None:
        for n in self._path_to_root(node):
            if n.lock_ref == 0 and n.value is not None:  # (the counters count device slots only)
                self._evictable -= len(n.key)
                self._protected += len(n.key)
            n.lock_ref += 1

    def dec_lock(self, node: Optional[TreeNode]) -> None:
        path = self._path_to_root(node)
        # Ancestors are locked at least as often as `node`, so checking the first suffices.
        if path and path[0].lock_ref <= 0:
            raise RuntimeError(f"dec_lock on an unlocked node {path[0]!r} (unbalanced lock/unlock)")
        for n in path:
            n.lock_ref -= 1
            if n.lock_ref == 0 and n.value is not None:
                self._protected -= len(n.key)
                self._evictable += len(n.key)

    def pin(self, token_ids: Sequence[int]) -> PinHandle:
        """Lock the cached part of `token_ids` against eviction until `unpin`.

        Only what is already cached can be pinned (prefill it first, e.g. `Engine.cache_prefix`);
        the handle's `num_tokens` says how many tokens that was. Does not count in `hit_stats`.
        """
        key = as_key(token_ids)
        node, child, m, _ = self._walk(key[: aligned(len(key), self.page_size)])
        node, values = self._commit(node, child, m)
        handle = PinHandle(self._handle(node), sum(len(v) for v in values))
        self.inc_lock(handle.node)
        return handle

    def unpin(self, handle: PinHandle) -> None:
        if not isinstance(handle, PinHandle):
            raise TypeError(f"unpin expects a PinHandle from pin(), got {type(handle).__name__}")
        if not handle.active:
            raise RuntimeError("unpin: this PinHandle was already released")
        handle.active = False
        self.dec_lock(handle.node)

    def locked_tokens(self, handles) -> int:
        nodes = {}
        for handle in handles:
            for node in self._path_to_root(handle.node):
                nodes[id(node)] = len(node.key)
        return sum(nodes.values())

    def cached_len(self, num_tokens: int) -> int:
        return aligned(num_tokens, self.page_size)

    # ---- inserting -----------------------------------------------------------------------------

    def cache_unfinished_req(self, token_ids, kv_indices, old_node):
        num, kv = checked_pair(token_ids, kv_indices)
        n = aligned(num, self.page_size)
        start, pos = self._resume_point(old_node, kv, n)
        node, tree_kv = self._insert(key_slice(token_ids, pos, n), kv[pos:n], start)
        self.inc_lock(self._handle(node))  # lock the new path before releasing the old one
        self.dec_lock(old_node)
        if tree_kv is None:
            # NOTE: the usual case (no token was already in the tree): the request keeps its own slots,
            # and gets its tensor back (1-D int64 on the CPU) so a caller can skip comparing.
            return kv, self._handle(node)
        # The path to `start` holds the request's own slots (checked); the unaligned tail (page_size > 1)
        # stays the request's private memory.
        return torch.cat([kv[:pos], tree_kv, kv[n:]]), self._handle(node)

    def cache_finished_req(self, token_ids, kv_indices, old_node) -> None:
        num, kv = checked_pair(token_ids, kv_indices)
        n = aligned(num, self.page_size)
        start, pos = self._resume_point(old_node, kv, n)
        self._insert(key_slice(token_ids, pos, n), kv[pos:n], start)
        if n < num:
            self.allocator.free(kv[n:])
        self.dec_lock(old_node)

    # ---- eviction and reset --------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        if num_tokens <= 0:
            return 0
        tiebreak = itertools.count()  # never compare TreeNodes when access times tie
        heap = [
            (n.last_access, next(tiebreak), n)
            for n in self._iter_nodes()
            if n is not self.root and not n.children and n.lock_ref == 0
        ]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            if self.listener is not None:  # (told while the leaf still spells its path)
                self.listener.removed(leaf)
            del parent.children[child_key(leaf.key, 0, self.page_size)]
            leaf.parent = None  # detached: a stale handle to it is now detectably invalid
            self.allocator.free(leaf.value)
            freed += len(leaf.key)
            self._evictable -= len(leaf.key)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, next(tiebreak), parent))
        return freed

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def reset(self) -> None:
        if self._protected:
            raise RuntimeError(
                f"cannot reset the prefix cache: {self._protected} cached tokens are locked by running requests or pins"
            )
        for node in self._iter_nodes():
            if node is not self.root:
                if node.value is not None:
                    self.allocator.free(node.value)
                node.parent = None
        self._new_tree()
        if self.listener is not None:
            self.listener.cleared()

    # ---- checks and introspection --------------------------------------------------------------

    def check_integrity(self, num_private: int = 0, full: bool = True) -> None:
        super().check_integrity(num_private)
        if full:
            check_tree(self)

    def dump(self) -> list[tuple[int, tuple, tuple, int]]:
        """Depth-first `(depth, key, slots, lock_ref)` per node, children in key order (for tests)."""
        out = []

        def visit(node: TreeNode, depth: int) -> None:
            for ck in sorted(node.children):
                child = node.children[ck]
                slots = () if child.value is None else tuple(child.value.tolist())
                out.append((depth, child.key, slots, child.lock_ref))
                visit(child, depth + 1)

        visit(self.root, 0)
        return out

    # ---- internals -----------------------------------------------------------------------------

    def _walk(self, key: tuple) -> tuple[TreeNode, Optional[TreeNode], int, int]:
        """Read-only walk of `key` (page-aligned): the deepest node whose path `key` starts with, the
        child edge it then shares `m` (whole pages, < the edge) more tokens with (or None), and the
        number of tokens matched."""
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(child_key(key, pos, self.page_size))
            if child is None:
                break
            m = common_len(child.key, key, pos, self.page_size)
            if m < len(child.key):
                return node, child, m, pos + m
            node, pos = child, pos + m
        return node, None, 0, pos

    def _commit(self, node: TreeNode, child: Optional[TreeNode], m: int) -> tuple[TreeNode, list[torch.Tensor]]:
        """A walk's match: the partial edge split (its upper half ends the path), LRU times touched;
        returns the path's last node and its edges' slots, root first."""
        self._clock += 1
        end = self._split(child, m) if child is not None else node
        values, above = [], end
        while above is not self.root:
            above.last_access = self._clock
            values.append(cast(torch.Tensor, above.value))  # (on the device: a tiered cache loads a path first)
            above = cast(TreeNode, above.parent)  # an attached node: only the root has no parent
        values.reverse()
        return end, values

    def _matched(self, queried: int, node: TreeNode, child: Optional[TreeNode], m: int) -> MatchResult:
        node, values = self._commit(node, child, m)
        kv = torch.cat(values) if values else _EMPTY
        self.hit_stats.num_queries += 1
        self.hit_stats.queried_tokens += queried
        self.hit_stats.matched_tokens += int(kv.numel())
        return MatchResult(kv, self._handle(node))

    def _resume_point(self, old_node: Optional[TreeNode], kv: torch.Tensor, n: int) -> tuple[TreeNode, int]:
        """Where inserting a request's first `n` tokens can start: at `old_node` (the handle it holds,
        from matching or inserting a prefix of those same tokens), `pos` tokens in, instead of the root.

        NOTE: walking from the root compared the whole cached prefix again, token by token, twice per
        request (after its prefill and at its end). The request's slots for that
        path are compared with the tree's instead (one C call per edge); if they differ (slots the request
        computed itself), the walk starts from the root, which frees them as duplicates.
        """
        path = self._path_to_root(old_node)  # deepest first
        depth = sum(len(p.key) for p in path)
        if old_node is None or depth > n:  # (no path: old_node is None or the root)
            return self.root, 0
        pos = 0
        for p in reversed(path):
            if not torch.equal(cast(torch.Tensor, p.value), kv[pos : pos + len(p.key)]):  # (locked: on the device)
                return self.root, 0
            pos += len(p.key)
        return old_node, pos

    def _insert(
        self, key: tuple, value: torch.Tensor, start: Optional[TreeNode] = None
    ) -> tuple[TreeNode, Optional[torch.Tensor]]:
        """Add `key -> value` below `start` (default: the root); returns the path's last node and the
        tree's slots for all of `key`, or None where those are `value` itself (no duplicates). `start`
        and its ancestors count as accessed.

        Where the tree already held a token, the caller's slot for it is a duplicate computation:
        it goes back to the allocator and the tree's slot replaces it.
        """
        self._clock += 1
        node = self.root if start is None else start
        above = node
        while above is not self.root:  # as if the walk had come down from the root
            above.last_access = self._clock
            above = cast(TreeNode, above.parent)  # an attached node: only the root has no parent
        pos, tree_values, duplicates = 0, [], []
        while pos < len(key):
            child = node.children.get(child_key(key, pos, self.page_size))
            if child is None:
                leaf = TreeNode(key[pos:], value[pos:].clone(), node, self._clock)
                node.children[child_key(key, pos, self.page_size)] = leaf
                self._evictable += len(leaf.key)
                self._stored(leaf)
                tree_values.append(cast(torch.Tensor, leaf.value))
                node = leaf
                break
            m = common_len(child.key, key, pos, self.page_size)
            if m < len(child.key):
                child = self._split(child, m)
            child.last_access = self._clock
            mine = value[pos : pos + m]
            if child.value is None:  # only in the host tier: the request's slots become its device copy
                child.value = mine.clone()
                self._evictable += m  # (an unlocked node: only a path already on the device is locked)
            elif not torch.equal(mine, child.value):
                duplicates.append(mine[mine != child.value])
            tree_values.append(cast(torch.Tensor, child.value))
            node, pos = child, pos + m
        if not duplicates:
            return node, None
        for dup in duplicates:
            self.allocator.free(dup)
        return node, torch.cat(tree_values)

    def _stored(self, leaf: TreeNode) -> None:
        """A new edge holds a request's computed tokens."""
        if self.listener is not None:
            self.listener.stored(leaf)

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """Cut `child`'s edge after `m` tokens (in each tier it is in); returns the new upper node (child stays
        below)."""
        parent = cast(TreeNode, child.parent)  # an edge in the tree
        upper = TreeNode(child.key[:m], None, parent, child.last_access)
        upper.value, child.value = split_slots(child.value, m)
        upper.host_value, child.host_value = split_slots(child.host_value, m)
        # Same locks as the child: every lock through the child goes through the upper half too,
        # so the evictable/protected counters do not change.
        upper.lock_ref = child.lock_ref
        child.key = child.key[m:]
        child.parent = upper
        upper.children[child_key(child.key, 0, self.page_size)] = child
        parent.children[child_key(upper.key, 0, self.page_size)] = upper
        return upper

    def _handle(self, node: TreeNode) -> Optional[TreeNode]:
        return None if node is self.root else node

    def _path_to_root(self, node: Optional[TreeNode]) -> list[TreeNode]:
        path = []
        while node is not None and node is not self.root:
            path.append(node)
            node = node.parent
        if path and node is None:
            raise RuntimeError(
                f"{path[0]!r} is no longer in the tree (evicted or reset while "
                "unlocked): lock a node right after match_prefix returns it"
            )
        return path

    def _iter_nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
