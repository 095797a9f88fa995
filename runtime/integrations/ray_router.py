"""Prefix-aware request routing for plait on Ray Serve, on Ray Serve's public request-router API.

Ray Serve calls `choose_replicas` for each call made through a deployment handle, with the call's
arguments; the ingress (ray_serve.py) calls a replica with `(route, body)`, so the router reads the
prompt there, as `plait router` does (router/app.py's `routing_key`: the prompt's text, a chat's
messages, or token ids):

- a request naming its program's group (plait's native `/generate` with `"group"`: a run_batch, a
  program's forks) goes where the first of its group went, while that replica lives: the group shares
  a prefix the program pinned there;
- any other request goes by `plait router`'s cache-aware policy (router/policy.py): to the replica sent
  the longest prefix of it while loads are close (a conversation's next turn starts with its last, so
  it follows it), else to the least loaded; `policy="round_robin"` is the baseline.

Ray Serve then sends the request to the first replica of the ranks returned that has room (its
`max_ongoing_requests`), so a full replica spills over to the next rank instead of queueing.
"""

from __future__ import annotations

import collections
from typing import Any, Hashable, Optional, Sequence

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from ..router.app import routing_key
from ..router.policy import CacheAwarePolicy, RoundRobinPolicy

ROUTING_POLICIES = ("cache_aware", "round_robin")


def request_key(args: Sequence[Any]) -> tuple[Optional[str], Sequence[Hashable]]:
    """(the program group, the prefix key) of a replica call `(route, body, ...)`; (None, ()) for a call
    that is not a generation (health, flush, stats)."""
    if len(args) < 2 or not isinstance(args[0], str) or not isinstance(args[1], dict):
        return None, ()
    route, body = args[0], args[1]
    group = body.get("group") if route == "/generate" else None
    return (group if isinstance(group, str) and group else None), routing_key(route, body)


class PlaitPrefixRouter(RequestRouter):
    """Ray Serve's `RequestRouter` with plait's routing (module docstring). Configured through
    `request_router_kwargs`: `policy` ("cache_aware" or "round_robin") and the cache-aware policy's
    thresholds (`balance_abs_threshold`, `balance_rel_threshold`, `cache_threshold`, `max_tree_items`)."""

    MAX_GROUPS = 100_000  # groups remembered (least recent forgotten first)

    def initialize_state(self, policy: str = "cache_aware", **thresholds: Any) -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"policy must be one of {list(ROUTING_POLICIES)}, got {policy!r}")
        self.policy = CacheAwarePolicy(**thresholds) if policy == "cache_aware" else RoundRobinPolicy()
        self.groups: collections.OrderedDict[str, str] = collections.OrderedDict()
        self.in_flight: collections.Counter[str] = collections.Counter()
        self.by_request: dict[str, str] = {}

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: Optional[PendingRequest] = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        group, key = request_key(pending_request.args if pending_request is not None else ())
        chosen = self.groups.get(group) if group else None
        if chosen not in by_id:
            ids = sorted(by_id)
            chosen = self.policy.choose(key, ids, dict(self.in_flight)).replica
            if group:
                self.groups[group] = chosen
                while len(self.groups) > self.MAX_GROUPS:
                    self.groups.popitem(last=False)
        elif group:
            self.groups.move_to_end(group)
        rest = [r for rid, r in by_id.items() if rid != chosen]
        return [[by_id[chosen]], rest] if rest else [[by_id[chosen]]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self.in_flight[replica_id.unique_id] += 1
        self.by_request[pending_request.metadata.internal_request_id] = replica_id.unique_id

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        replica = self.by_request.pop(internal_request_id, replica_id.unique_id)
        if self.in_flight[replica] > 0:
            self.in_flight[replica] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.forget(replica_id.unique_id)
        self.in_flight.pop(replica_id.unique_id, None)
