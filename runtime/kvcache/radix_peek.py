"""Read-only radix lookups that can be reused: `peek_prefix` remembers where its walk ended, and while the
tree would still end that walk there (`peek_is_current`, O(1)) the scheduler turns it into a match
(`match_peeked`) or into the lookup of a prefix of the same ids (`peek_prefix_of`) without comparing the
tokens again.

Why: every admission step ranks the waiting queue by cached-prefix length (lpm) and then matches the
requests it admits; with ~1,000-2,000-token shared prefixes each walk compares that many tokens, and the
same walk was repeated for ranking, admitting and again at the next step. A mixin of `RadixCache`
(radix_cache.py), which owns the tree and the `_walk` / `_matched` primitives these use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

from .prefix_cache import MatchResult
from .radix_keys import as_key, key_slice

if TYPE_CHECKING:
    from .radix_cache import TreeNode


@dataclass(eq=False)
class PrefixPeek:
    """A read-only lookup (`RadixCache.peek_prefix`): how much of `token_ids` is cached, and where the
    walk ended (`node`, fully matched, then `m` tokens into its child `child`, if any). It stays valid
    while the tree still ends that walk there (`RadixCache.peek_is_current`)."""

    token_ids: Sequence[int]
    num_tokens: int
    queried: int
    node: TreeNode
    child: Optional[TreeNode]
    m: int


class RadixPeekMixin:
    """Peeks for `RadixCache` (needs its `root`, `page_size`, `_walk`, `_matched`, `_aligned`, `_child_key`)."""

    def peek_prefix(self, token_ids: Sequence[int]) -> PrefixPeek:
        """`peek_prefix_len`, keeping where the walk ended for `match_peeked`."""
        key = as_key(token_ids)
        node, child, m, pos = self._walk(key[: self._aligned(len(key))])
        return PrefixPeek(token_ids, pos, len(key), node, child, m)

    def match_peeked(self, peek: PrefixPeek) -> MatchResult:
        """`match_prefix(peek.token_ids)`, without comparing the tokens again when no edge was added or
        removed since the peek, nor the edge it ended in split (~16 us per 2,000 cached tokens)."""
        if not self.peek_is_current(peek):
            return self.match_prefix(peek.token_ids)
        return self._matched(peek.queried, peek.node, peek.child, peek.m)

    def peek_prefix_of(self, peek: PrefixPeek, token_ids: Sequence[int]) -> PrefixPeek:
        """`peek_prefix(token_ids)` for `token_ids` a prefix of `peek.token_ids` (the scheduler ranks
        whole sequences, then matches all but their last token), reusing the peek's walk when it is
        still current and its match ended before the prefix's (page-aligned) end: it stopped on a
        token both share, so the prefix's walk ends at the same place."""
        n = len(token_ids)
        if not self.peek_is_current(peek) or n > peek.queried or peek.num_tokens >= self._aligned(n):
            return self.peek_prefix(token_ids)
        return PrefixPeek(token_ids, peek.num_tokens, n, peek.node, peek.child, peek.m)

    def peek_is_current(self, peek: PrefixPeek) -> bool:
        """Would a walk of `peek.token_ids` now end where the peek's did? O(1), whatever changed since.

        NOTE: a path spells the same tokens after any split, edges are never merged or extended, and
        nodes leave the tree leaves first (then `parent` is None) or all at once (`reset`: a new root).
        So the walk still reaches the peek's node while that is attached; from there it takes the same
        edge `child` (unless that was split or evicted: its parent changed), or, where the peek found no
        edge for its next page, it does so again unless an insert added one.
        """
        node = peek.node
        if node is not self.root and node.parent is None:
            return False
        if peek.child is not None:
            return peek.child.parent is node
        pos = peek.num_tokens
        if pos + self.page_size > peek.queried:
            return True  # the walk ended with the ids
        page = key_slice(peek.token_ids, pos, pos + self.page_size)
        return node.children.get(self._child_key(page, 0)) is None
