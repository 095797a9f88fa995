"""The router's approximate prefix tree and its policies, alone (no server): exact matches, splits, the
per-replica budget forgetting the least recently sent prefixes first, a dead replica forgotten; the
cache-aware choice (longest prefix, the emptiest tree for a new prefix, the least loaded past both
balance thresholds) and round-robin."""

from __future__ import annotations

import pytest
from plait.runtime.router.app import routing_key
from plait.runtime.router.args import RouterArgs
from plait.runtime.router.policy import CacheAwarePolicy, RoundRobinPolicy
from plait.runtime.router.prefix_tree import PrefixTree


def test_match_gives_each_replica_its_longest_prefix():
    tree = PrefixTree()
    tree.insert("hello world", "a")
    tree.insert("hello there", "b")
    tree.insert("help", "a")
    assert tree.match("hello world!") == {"a": 11, "b": 6}
    assert tree.match("hello there, you") == {"a": 6, "b": 11}
    assert tree.match("helping") == {"a": 4, "b": 3}
    assert tree.match("xyz") == {}
    assert tree.match((1, 2, 3)) == {}  # token ids never match characters
    tree.insert((1, 2, 3, 4), "b")
    assert tree.match([1, 2, 3, 9]) == {"b": 3}
    # Sizes count each replica's distinct items once.
    assert tree.replica_items("a") == len("hello world") + len("p")
    assert tree.replica_items("b") == len("hello there") + 4


def test_the_budget_forgets_a_replicas_least_recent_prefixes_first():
    tree = PrefixTree(max_items_per_replica=20)
    tree.insert("aaaaaaaaaa", "r")  # 10 items
    tree.insert("bbbbbbbbbb", "r")  # 20
    tree.insert("aaaaaaaaaa", "r")  # "a..." is now the more recent
    tree.insert("cccccccccc", "r")  # 30 > 20: "b..." goes
    assert tree.match("bbbbbbbbbb") == {}
    assert tree.match("aaaaaaaaaa") == {"r": 10} and tree.match("cccccccccc") == {"r": 10}
    assert tree.replica_items("r") == 20
    tree.insert("aaaaaaaaaa", "other")  # another replica's budget is its own
    assert tree.match("aaaaaaaaaa") == {"r": 10, "other": 10}


def test_a_removed_replica_is_forgotten_and_the_tree_stays_compact():
    tree = PrefixTree()
    tree.insert("shared prefix one", "a")
    tree.insert("shared prefix two", "b")
    tree.remove_replica("b")
    assert tree.match("shared prefix two") == {"a": len("shared prefix ")}
    assert tree.replica_items("b") == 0
    # What is left is a's path alone: one edge from the root.
    assert len(tree.root.children) == 1 and next(iter(tree.root.children.values())).edge == "shared prefix one"


def test_cache_aware_prefers_the_longest_prefix_then_room_then_balance():
    policy = CacheAwarePolicy(balance_abs_threshold=4, balance_rel_threshold=1.5, cache_threshold=0.5)
    replicas = ["a", "b"]
    idle = {"a": 0, "b": 0}
    first = policy.choose("system one: be kind. user: hi", replicas, idle)
    assert first.reason == "new"
    second = policy.choose("system two: be brief. user: hi", replicas, idle)
    assert second.reason == "new" and second.replica != first.replica  # the emptier tree
    again = policy.choose("system one: be kind. user: hi. user: more", replicas, idle)
    assert (again.replica, again.reason) == (first.replica, "prefix") and again.matched > 20
    # Loads apart by more than 4 and 1.5x: the least loaded wins over the prefix.
    busy = {first.replica: 10, second.replica: 1}
    balanced = policy.choose("system one: be kind. user: hi again", replicas, busy)
    assert (balanced.replica, balanced.reason) == (second.replica, "balance")
    # Apart by more than 4 but not 1.5x: still the prefix.
    close = {first.replica: 12, second.replica: 10}
    assert policy.choose("system one: be kind. user: hi. user: more and more", replicas, close).replica == first.replica
    policy.forget(first.replica)  # (it died: its cache went with it)
    assert policy.tree.replica_items(first.replica) == 0
    after = policy.choose("system one: be kind. user: hi. user: more and more", replicas, idle)
    assert after.replica == second.replica  # which holds the part it was balanced onto


def test_round_robin_takes_turns():
    policy = RoundRobinPolicy()
    assert [policy.choose("x", ["a", "b", "c"], {}).replica for _ in range(4)] == ["a", "b", "c", "a"]


def test_routing_keys_of_each_route():
    assert routing_key("/generate", {"text": "hi"}) == "hi"
    assert routing_key("/generate", {"input_ids": [1, 2]}) == (1, 2)
    assert routing_key("/generate", {"text": ["first", "second"]}) == "first"
    assert routing_key("/v1/completions", {"prompt": [[3, 4], [5]]}) == (3, 4)
    chat = {
        "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "U"}]}]
    }
    assert routing_key("/v1/chat/completions", chat) == "<system>S<user>U"
    assert routing_key("/generate", None) == () and routing_key("/v1/completions", {"prompt": 5}) == ()


def test_router_settings_are_checked():
    with pytest.raises(ValueError, match="at least one worker URL"):
        RouterArgs()
    with pytest.raises(ValueError, match="must start with http"):
        RouterArgs(worker_urls=["localhost:30000"])
    with pytest.raises(ValueError, match="worker URLs repeat"):
        RouterArgs(worker_urls=["http://a:1", "http://a:1"])
    with pytest.raises(ValueError, match="policy must be one of"):
        RouterArgs(worker_urls=["http://a:1"], policy="random")
