"""A request's draft tree: node 0 is its last committed token (the root), every other node a draft token
that follows its parent. A chain is the tree whose node i has parent i - 1.

Nodes are in topological order (a parent before its children), so in a verify step node i sits at
req_to_token position prefix + i and at sequence position prefix + depth(i); it attends to the prefix
and to its own ancestors (`ancestor_mask`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np


@dataclass
class DraftTree:
    tokens: list[int]  # (n,) node 0: the root
    parents: list[int]  # (n,) parent index of each node; -1 for the root
    _children: Optional[list[list[int]]] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.tokens or self.parents[0] != -1:
            raise ValueError("a draft tree starts with its root (parent -1)")
        for i, p in enumerate(self.parents[1:], 1):
            if not 0 <= p < i:
                raise ValueError(f"node {i}'s parent {p} does not come before it")

    @classmethod
    def chain(cls, root: int, drafts: Sequence[int]) -> "DraftTree":
        return cls([root, *drafts], list(range(-1, len(drafts))))

    @property
    def size(self) -> int:
        return len(self.tokens)

    @property
    def num_drafts(self) -> int:
        return len(self.tokens) - 1

    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def children(self) -> list[list[int]]:
        if self._children is None:
            kids: list[list[int]] = [[] for _ in self.tokens]
            for i, p in enumerate(self.parents[1:], 1):
                kids[p].append(i)
            self._children = kids
        return self._children

    def depths(self) -> np.ndarray:
        """(n,) int64 depth of each node (the root: 0)."""
        d = np.zeros(len(self.parents), dtype=np.int64)
        for i, p in enumerate(self.parents[1:], 1):
            d[i] = d[p] + 1
        return d

    def ancestor_mask(self) -> np.ndarray:
        """(n, n) bool: [e, c] when node c is node e or one of its ancestors."""
        n = len(self.parents)
        mask = np.zeros((n, n), dtype=bool)
        for i, p in enumerate(self.parents):
            if p >= 0:
                mask[i] = mask[p]
            mask[i, i] = True
        return mask

    def path_tokens(self, node: int) -> list[int]:
        """The draft tokens from the root (excluded) down to `node` (included)."""
        out = []
        while node > 0:
            out.append(self.tokens[node])
            node = self.parents[node]
        return out[::-1]


def merge_chains(root: int, chains: Sequence[Sequence[int]], max_nodes: int) -> DraftTree:
    """One tree (a trie) of several draft chains after `root`, at most `max_nodes` nodes with the root;
    chains earlier in the list keep their nodes first."""
    tokens, parents = [root], [-1]
    child_of: dict[tuple[int, int], int] = {}
    for chain in chains:
        node = 0
        for tok in chain:
            nxt = child_of.get((node, tok))
            if nxt is None:
                if len(tokens) >= max_nodes:
                    break
                nxt = child_of[(node, tok)] = len(tokens)
                tokens.append(tok)
                parents.append(node)
            node = nxt
    return DraftTree(tokens, parents)
