"""Which replica a request goes to.

`CacheAwarePolicy` (SGLang's router's rule): while the replicas' loads are close, a request goes to the
replica that was sent the longest prefix of it (its prefix cache most likely holds it), or, when no
replica holds enough of it, to the one whose cache holds least (room to keep this new prefix); once the
loads drift apart past both thresholds (absolute and relative), to the least loaded replica, so that
one popular prefix cannot pile everyone onto one replica. Either way the request's prefix is recorded
for the replica it went to. `RoundRobinPolicy` is the baseline the benchmark compares against.

Load is the requests the router has in flight on a replica.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Hashable, Sequence

from .args import RouterArgs
from .prefix_tree import PrefixTree


@dataclass
class Choice:
    replica: str
    reason: str  # "prefix" (longest match), "new" (no replica held enough), "balance", "round_robin"
    matched: int = 0  # items of the key the chosen replica was sent before


class RoundRobinPolicy:
    name = "round_robin"

    def __init__(self):
        self._turn = itertools.count()

    def choose(self, key: Sequence[Hashable], replicas: list[str], load: dict[str, int]) -> Choice:
        return Choice(replicas[next(self._turn) % len(replicas)], "round_robin")

    def forget(self, replica: str) -> None:
        pass


class CacheAwarePolicy:
    name = "cache_aware"

    def __init__(
        self,
        balance_abs_threshold: int = 32,
        balance_rel_threshold: float = 1.5,
        cache_threshold: float = 0.5,
        max_tree_items: int = 1 << 20,
    ):
        self.balance_abs = balance_abs_threshold
        self.balance_rel = balance_rel_threshold
        self.cache_threshold = cache_threshold
        self.tree = PrefixTree(max_tree_items)
        self._lock = threading.Lock()

    def choose(self, key: Sequence[Hashable], replicas: list[str], load: dict[str, int]) -> Choice:
        with self._lock:
            choice = self._choose(key, replicas, load)
            if key:
                self.tree.insert(key, choice.replica)
            return choice

    def _choose(self, key, replicas: list[str], load: dict[str, int]) -> Choice:
        loads = [load.get(r, 0) for r in replicas]
        hi, lo = max(loads), min(loads)
        matched = self.tree.match(key) if key else {}
        if hi - lo > self.balance_abs and hi > lo * self.balance_rel:
            least = min(replicas, key=lambda r: load.get(r, 0))
            return Choice(least, "balance", matched.get(least, 0))
        best = max(replicas, key=lambda r: (matched.get(r, 0), -load.get(r, 0)))
        if key and matched.get(best, 0) >= self.cache_threshold * len(key):
            return Choice(best, "prefix", matched[best])
        # Nobody holds enough of it: the replica with the most cache room (ties: the least loaded).
        roomiest = min(replicas, key=lambda r: (self.tree.replica_items(r), load.get(r, 0)))
        return Choice(roomiest, "new", matched.get(roomiest, 0))

    def forget(self, replica: str) -> None:
        with self._lock:
            self.tree.remove_replica(replica)


def make_policy(args: RouterArgs) -> "CacheAwarePolicy | RoundRobinPolicy":
    if args.policy == "round_robin":
        return RoundRobinPolicy()
    return CacheAwarePolicy(
        args.balance_abs_threshold, args.balance_rel_threshold, args.cache_threshold, args.max_tree_items
    )
