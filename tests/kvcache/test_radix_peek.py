"""Reusable radix lookups (RadixCache's peeks, runtime/kvcache/radix_cache.py): a peek turned into a match,
or into the lookup of a prefix of its ids, gives exactly what a fresh walk gives, and goes stale exactly
when the tree would no longer end its walk where it did."""

import random

import pytest
from test_radix_cache import make, put


def test_match_peeked_reuses_the_walk_and_redoes_a_stale_one():
    _, cache = make()
    put(cache, [1, 2, 3, 4])
    peek = cache.peek_prefix([1, 2, 3, 9])
    assert peek.num_tokens == 3 and cache.dump() == [(0, (1, 2, 3, 4), (1, 2, 3, 4), 0)]
    m = cache.match_peeked(peek)
    assert m.kv_indices.tolist() == [1, 2, 3] and m.node.key == (1, 2, 3)
    assert cache.dump() == [(0, (1, 2, 3), (1, 2, 3), 0), (1, (4,), (4,), 0)]
    assert (cache.hit_stats.num_queries, cache.hit_stats.queried_tokens) == (1, 4)
    # The tree changes shape between the peek and the match: the walk is done again.
    peek = cache.peek_prefix([1, 2, 5, 6])
    put(cache, [1, 7])  # splits the edge the peek ended in
    m = cache.match_peeked(peek)
    assert m.kv_indices.tolist() == [1, 2] and m.node.key == (2,)
    assert m.node.parent.key == (1,)
    cache.check_integrity()
    # Also after a reset that rebuilt as many edges as before.
    peek = cache.peek_prefix([1, 7])
    cache.reset()
    slots = put(cache, [1, 8])
    assert cache.match_peeked(peek).kv_indices.tolist() == slots[:1]


def test_peek_prefix_of_reuses_a_longer_peek_only_where_the_walk_is_the_same():
    _, cache = make()
    put(cache, [1, 2, 3, 4])
    put(cache, [5, 6])
    for whole, prefix in (
        ([1, 2, 9, 9, 9], [1, 2, 9, 9]),  # stopped mid-edge on a shared token
        ([5, 6, 7, 8], [5, 6, 7]),  # stopped at a node, no child for 7
        ([1, 2, 3, 4, 5], [1, 2, 3, 4]),  # the prefix ends where the match did
        ([1, 2, 3, 4, 5], [1, 2, 3]),  # the prefix ends inside the match
        ([8, 8], [8]),
    ):
        peek = cache.peek_prefix(whole)
        got, fresh = cache.peek_prefix_of(peek, prefix), cache.peek_prefix(prefix)
        assert (got.num_tokens, got.queried, got.node, got.child, got.m) == (
            fresh.num_tokens,
            fresh.queried,
            fresh.node,
            fresh.child,
            fresh.m,
        ), (whole, prefix)
        assert got.token_ids is prefix
    # Reused (the same walk's end) only when the match ended before the prefix's end.
    peek = cache.peek_prefix([1, 2, 9, 9, 9])
    assert cache.peek_prefix_of(peek, [1, 2, 9, 9]).child is peek.child
    # A change of shape in between: walked again.
    peek = cache.peek_prefix([1, 2, 9, 9])
    put(cache, [1, 7])
    got = cache.peek_prefix_of(peek, [1, 2, 9])
    assert (got.num_tokens, got.node.key, got.child.key, got.m) == (2, (1,), (2, 3, 4), 1)
    m = cache.match_peeked(got)
    assert m.num_tokens == 2 and m.kv_indices.tolist() == [1, 2]
    cache.check_integrity()


def test_peek_prefix_of_with_pages_agrees_with_a_fresh_peek():
    _, cache = make(num_slots=64, page_size=2)
    put(cache, [1, 2, 3, 4, 5, 6])
    for whole in ([1, 2, 3, 9, 9, 9, 9], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9]):
        for n in range(len(whole) + 1):
            peek = cache.peek_prefix(whole)
            got, fresh = cache.peek_prefix_of(peek, whole[:n]), cache.peek_prefix(whole[:n])
            assert (got.num_tokens, got.queried, got.node, got.child, got.m) == (
                fresh.num_tokens,
                fresh.queried,
                fresh.node,
                fresh.child,
                fresh.m,
            ), (whole, n)


def test_a_peek_survives_splits_elsewhere_but_not_of_its_own_edge():
    _, cache = make()
    a = put(cache, [1, 2, 3, 4])
    b = put(cache, [5, 6, 7, 8])
    peek_a = cache.peek_prefix([1, 2, 3, 9])  # ends 3 tokens into (1, 2, 3, 4)
    peek_b = cache.peek_prefix([5, 6, 7, 8, 9])  # ends at the node (5, 6, 7, 8)
    peek_c = cache.peek_prefix([5, 6, 9])  # ends 2 tokens into (5, 6, 7, 8)
    # A match splits (5, 6, 7, 8) after 5 (no edge added): peek_a still holds, peek_b's path is the same.
    assert cache.match_prefix([5, 9]).kv_indices.tolist() == b[:1]
    for peek, want in ((peek_a, a[:3]), (peek_b, b), (peek_c, b[:2])):
        assert cache.match_peeked(peek).kv_indices.tolist() == want
    # Its own edge split after 2 tokens (by peek_c's match) and again after 1: redone from the root.
    peek_d = cache.peek_prefix([1, 2, 3, 9])
    assert cache.match_prefix([1, 7]).kv_indices.tolist() == a[:1]
    m = cache.match_peeked(peek_d)
    assert m.kv_indices.tolist() == a[:3] and m.node.key == (2, 3)
    cache.check_integrity()
    assert cache.dump() == [
        (0, (1,), (1,), 0),
        (1, (2, 3), (2, 3), 0),
        (2, (4,), (4,), 0),
        (0, (5,), (5,), 0),
        (1, (6,), (6,), 0),
        (2, (7, 8), (7, 8), 0),
    ]


@pytest.mark.parametrize("page_size", [1, 2])
def test_a_current_peek_always_agrees_with_a_fresh_walk(page_size):
    # Random inserts, matches (splits), evictions and resets between peeks and their checks: whenever
    # peek_is_current says yes, a fresh walk ends at the same place; after an insert under the peek's
    # end it says no.
    rng = random.Random(page_size)
    _, cache = make(num_slots=400, page_size=page_size)
    seqs = [[rng.randrange(4) for _ in range(rng.randrange(1, 12))] for _ in range(60)]
    peeks, checked = [], 0
    for step in range(600):
        op = rng.random()
        ids = rng.choice(seqs)
        if op < 0.3 and cache.allocator.available() >= len(ids):
            put(cache, ids)
        elif op < 0.45:
            cache.match_prefix(ids)
        elif op < 0.5:
            cache.evict(rng.randrange(1, 8))
        elif op < 0.51:
            cache.reset()
        else:
            peeks.append(cache.peek_prefix(ids))
        for peek in peeks[-20:]:
            if cache.peek_is_current(peek):
                fresh = cache.peek_prefix(peek.token_ids)
                assert (peek.num_tokens, peek.node, peek.child, peek.m) == (
                    fresh.num_tokens,
                    fresh.node,
                    fresh.child,
                    fresh.m,
                ), step
                checked += 1
    assert checked > 500
    cache.check_integrity()


def test_a_peek_that_found_no_edge_is_stale_once_one_is_inserted():
    _, cache = make()
    put(cache, [1, 2])
    peek = cache.peek_prefix([1, 2, 3, 4])
    assert cache.peek_is_current(peek) and peek.num_tokens == 2
    put(cache, [1, 2, 5])  # another edge below (1, 2): the peek holds
    assert cache.peek_is_current(peek)
    slots = put(cache, [1, 2, 3])
    assert not cache.peek_is_current(peek)
    assert cache.match_peeked(peek).kv_indices.tolist() == [1, 2] + slots[2:]
    peek = cache.peek_prefix([1, 2, 3, 4])
    cache.evict(100)
    assert not cache.peek_is_current(peek) and cache.match_peeked(peek).num_tokens == 0
