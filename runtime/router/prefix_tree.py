"""The router's guess of what each replica has cached: one radix tree over the prompts it sent, each node
marked with the replicas that were sent that prefix (and when).

Approximate by design: a replica evicts on its own, and the router never asks; the tree only
remembers what it routed, with a budget of items per replica (the least recently used of a replica's
leaves are forgotten first). Keys are sequences of hashable items: the characters of a text prompt,
or token ids (a prompt sent as input_ids). The two never match each other, which is right: the router
cannot know how a text tokenizes.
"""

from __future__ import annotations

import itertools
from typing import Hashable, Optional, Sequence

Key = Sequence[Hashable]


class _Node:
    __slots__ = ("edge", "children", "parent", "seen")

    def __init__(self, edge: Key, parent: Optional["_Node"]):
        self.edge = edge  # the items from the parent to this node
        self.children: dict[Hashable, _Node] = {}  # first item of the child's edge -> child
        self.parent = parent
        self.seen: dict[str, int] = {}  # replica -> the tick it last was sent this prefix


def _common(a: Key, b: Key) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixTree:
    def __init__(self, max_items_per_replica: int = 1 << 20):
        self.root = _Node((), None)
        self.max_items = max_items_per_replica
        self.size: dict[str, int] = {}  # replica -> items of the prefixes it holds (its nodes' edges)
        self._ticks = itertools.count(1)

    def match(self, key: Key) -> dict[str, int]:
        """replica -> how many leading items of `key` it was sent (replicas with none left out)."""
        best: dict[str, int] = {}
        node, depth = self.root, 0
        while depth < len(key):
            child = node.children.get(key[depth])
            if child is None:
                break
            n = _common(child.edge, key[depth:])
            for replica in child.seen:
                best[replica] = depth + n
            if n < len(child.edge):
                break
            node, depth = child, depth + n
        return best

    def insert(self, key: Key, replica: str) -> None:
        """`replica` was sent `key`: every prefix of it is marked as the replica's (now)."""
        tick = next(self._ticks)
        node, depth = self.root, 0
        while depth < len(key):
            child = node.children.get(key[depth])
            if child is None:
                child = _Node(key[depth:], node)
                node.children[key[depth]] = child
            else:
                n = _common(child.edge, key[depth:])
                if n < len(child.edge):
                    child = self._split(child, n)
            if replica not in child.seen:
                self.size[replica] = self.size.get(replica, 0) + len(child.edge)
            child.seen[replica] = tick
            node, depth = child, depth + len(child.edge)
        if self.size.get(replica, 0) > self.max_items:
            self._evict(replica, self.size[replica] - self.max_items)

    def remove_replica(self, replica: str) -> None:
        """Forget everything sent to `replica` (it died: its cache went with it)."""
        for node in list(self._nodes()):
            if node.seen.pop(replica, None) is not None and not node.seen and not node.children:
                self._drop(node)
        self.size.pop(replica, None)

    def _split(self, child: _Node, n: int) -> _Node:
        """Cut `child`'s edge after n items: the new middle node (holding the same replicas) is returned."""
        parent = child.parent
        middle = _Node(child.edge[:n], parent)
        middle.seen = dict(child.seen)
        parent.children[middle.edge[0]] = middle
        child.edge = child.edge[n:]
        child.parent = middle
        middle.children[child.edge[0]] = child
        # (the replicas' sizes are unchanged: the two edges together are the old one)
        return middle

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _evict(self, replica: str, items: int) -> None:
        """Forget at least `items` of `replica`'s least recently sent prefixes, from the leaves up."""
        while items > 0:
            # The replica's own leaves: nodes it holds with no child that it holds too.
            leaves = [
                n
                for n in self._nodes()
                if replica in n.seen and not any(replica in c.seen for c in n.children.values())
            ]
            if not leaves:
                return
            leaves.sort(key=lambda n: n.seen[replica])
            for node in leaves:
                del node.seen[replica]
                self.size[replica] -= len(node.edge)
                items -= len(node.edge)
                if not node.seen and not node.children:
                    self._drop(node)
                if items <= 0:
                    return

    def _drop(self, node: _Node) -> None:
        parent = node.parent
        del parent.children[node.edge[0]]
        # A parent left with one child and the same replicas is merged with it (keeps the tree compact).
        if (
            parent is not self.root
            and len(parent.children) == 1
            and not parent.seen.keys() ^ next(iter(parent.children.values())).seen.keys()
        ):
            only = next(iter(parent.children.values()))
            only.edge = _concat(parent.edge, only.edge)
            only.parent = parent.parent
            only.seen = {r: max(t, parent.seen[r]) for r, t in only.seen.items()}
            parent.parent.children[only.edge[0]] = only
        elif parent is not self.root and not parent.children and not parent.seen:
            self._drop(parent)

    def replica_items(self, replica: str) -> int:
        return self.size.get(replica, 0)


def _concat(a: Key, b: Key) -> Key:
    if isinstance(a, str) and isinstance(b, str):
        return a + b
    return tuple(a) + tuple(b)
