"""Exact-state tests of RadixCache with a real TokenAllocator and fake token ids (no model).

The allocator hands out slots 1, 2, 3, ... in order, so expected kv slots are written out literally.
"""

import pytest
import torch
from plait.runtime.kvcache.memory_pool import TokenAllocator
from plait.runtime.kvcache.radix_cache import PinHandle, RadixCache


def make(num_slots=32, page_size=1):
    alloc = TokenAllocator(num_slots, "cpu")
    alloc.reuse_freed_first = False  # never-used slots first, as on a GPU: the dumps below name slots
    return alloc, RadixCache(alloc, page_size=page_size)


def put(cache, tokens):
    """A request that matched nothing computes every token and finishes."""
    kv = cache.allocator.alloc(len(tokens))
    cache.cache_finished_req(tokens, kv, None)
    return kv.tolist()


def free_set(cache):
    return cache.allocator.free_slot_set()


def test_empty_cache_matches_nothing():
    _, cache = make()
    m = cache.match_prefix([1, 2, 3])
    assert m.kv_indices.tolist() == [] and m.node is None and m.num_tokens == 0
    assert m.kv_indices.dtype == torch.int64
    cache.check_integrity()


def test_insert_then_match():
    alloc, cache = make()
    assert put(cache, [1, 2, 3, 4]) == [1, 2, 3, 4]
    assert cache.dump() == [(0, (1, 2, 3, 4), (1, 2, 3, 4), 0)]
    assert (cache.evictable_size(), cache.protected_size(), alloc.available()) == (4, 0, 28)
    m = cache.match_prefix([1, 2, 3, 4, 5])
    assert m.kv_indices.tolist() == [1, 2, 3, 4]
    assert m.node.key == (1, 2, 3, 4)
    assert cache.match_prefix([2, 3]).num_tokens == 0
    cache.check_integrity()


def test_match_splits_edge_on_partial_match():
    _, cache = make()
    put(cache, [1, 2, 3, 4])
    m = cache.match_prefix([1, 2, 9])
    assert m.kv_indices.tolist() == [1, 2]
    assert m.node.key == (1, 2)
    assert cache.dump() == [(0, (1, 2), (1, 2), 0), (1, (3, 4), (3, 4), 0)]
    assert cache.evictable_size() == 4
    cache.check_integrity()


def test_insert_branches_and_frees_duplicate_slots():
    alloc, cache = make()
    put(cache, [1, 2, 3, 4])
    assert put(cache, [1, 2, 7, 8]) == [5, 6, 7, 8]
    # Tokens 1,2 were already cached in slots 1,2: the second request's slots 5,6 are duplicates.
    assert cache.dump() == [(0, (1, 2), (1, 2), 0), (1, (3, 4), (3, 4), 0), (1, (7, 8), (7, 8), 0)]
    assert {5, 6} <= free_set(cache)
    assert alloc.available() == 32 - 6 and cache.evictable_size() == 6
    cache.check_integrity()


def test_inserting_a_cached_sequence_again_frees_all_its_slots():
    alloc, cache = make()
    put(cache, [1, 2, 3])
    put(cache, [1, 2, 3])
    assert cache.dump() == [(0, (1, 2, 3), (1, 2, 3), 0)]
    assert {4, 5, 6} <= free_set(cache) and alloc.available() == 29
    cache.check_integrity()


def test_lock_counts_move_sizes_between_evictable_and_protected():
    _, cache = make()
    put(cache, [1, 2, 3, 4, 5, 6])
    m = cache.match_prefix([1, 2, 3])
    cache.inc_lock(m.node)
    assert (cache.evictable_size(), cache.protected_size()) == (3, 3)
    cache.inc_lock(m.node)
    assert cache.dump() == [(0, (1, 2, 3), (1, 2, 3), 2), (1, (4, 5, 6), (4, 5, 6), 0)]
    cache.check_integrity()
    cache.dec_lock(m.node)
    assert cache.protected_size() == 3
    cache.dec_lock(m.node)
    assert (cache.evictable_size(), cache.protected_size()) == (6, 0)
    with pytest.raises(RuntimeError, match="unlocked"):
        cache.dec_lock(m.node)
    cache.check_integrity()


def test_split_under_a_lock_keeps_the_lock_on_both_halves():
    _, cache = make()
    put(cache, [1, 2, 3, 4])
    m = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock(m.node)
    cache.match_prefix([1, 2, 5])  # splits the locked edge
    assert cache.dump() == [(0, (1, 2), (1, 2), 1), (1, (3, 4), (3, 4), 1)]
    assert cache.protected_size() == 4
    cache.dec_lock(m.node)  # the handle still names the end of the same path
    assert cache.evictable_size() == 4 and cache.protected_size() == 0
    cache.check_integrity()


def test_locked_path_survives_eviction():
    alloc, cache = make()
    put(cache, [1, 2, 3])
    put(cache, [1, 2, 4])
    m = cache.match_prefix([1, 2, 4])
    cache.inc_lock(m.node)
    assert cache.evict(100) == 1  # only the unlocked leaf (3)
    assert cache.dump() == [(0, (1, 2), (1, 2), 1), (1, (4,), (6,), 1)]
    assert 3 in free_set(cache)
    cache.dec_lock(m.node)
    assert cache.evict(100) == 3 and alloc.available() == 32
    assert cache.dump() == []
    cache.check_integrity()


def test_evicts_least_recently_used_leaf_first():
    _, cache = make()
    put(cache, [1, 2])  # slots 1,2
    put(cache, [3, 4])  # slots 3,4
    put(cache, [5, 6])  # slots 5,6
    cache.match_prefix([1, 2])  # [1,2] is now the most recently used
    assert cache.evict(2) == 2
    assert cache.dump() == [(0, (1, 2), (1, 2), 0), (0, (5, 6), (5, 6), 0)]
    assert cache.evict(1) == 2  # a whole leaf goes even when fewer tokens were asked for
    assert cache.dump() == [(0, (1, 2), (1, 2), 0)]
    cache.check_integrity()


def test_parent_that_becomes_a_leaf_is_evicted_next():
    alloc, cache = make()
    put(cache, [1, 2, 3, 4])
    put(cache, [1, 2, 5, 6])
    put(cache, [9])
    cache.match_prefix([9])  # newest: the whole [1,2] subtree is older
    assert cache.evict(5) == 6  # (3,4), (5,6), then their parent (1,2)
    assert cache.dump() == [(0, (9,), (9,), 0)]
    assert cache.evict(0) == 0
    cache.check_integrity()
    assert alloc.available() == 31


def test_request_lifecycle_moves_lock_to_the_new_node():
    alloc, cache = make()
    put(cache, [1, 2, 3, 4])
    tokens = [1, 2, 3, 4, 5, 6]
    m = cache.match_prefix(tokens)
    cache.inc_lock(m.node)
    kv = torch.cat([m.kv_indices, alloc.alloc(2)])  # slots 5,6 for the uncached tail
    cache.check_integrity(num_private=2)
    kv, node = cache.cache_unfinished_req(tokens, kv, m.node)
    assert kv.tolist() == [1, 2, 3, 4, 5, 6]
    assert cache.dump() == [(0, (1, 2, 3, 4), (1, 2, 3, 4), 1), (1, (5, 6), (5, 6), 1)]
    assert cache.protected_size() == 6
    cache.check_integrity(num_private=0)
    # Decode one token, then finish.
    kv = torch.cat([kv, alloc.alloc(1)])
    cache.check_integrity(num_private=1)
    cache.cache_finished_req(tokens + [7], kv, node)
    # A new edge under the old leaf (edges are never extended in place: a handle names a fixed path).
    assert cache.dump() == [(0, (1, 2, 3, 4), (1, 2, 3, 4), 0), (1, (5, 6), (5, 6), 0), (2, (7,), (7,), 0)]
    assert (cache.evictable_size(), cache.protected_size()) == (7, 0)
    cache.check_integrity()


def test_concurrent_prefill_of_same_prefix_reuses_first_writers_slots():
    alloc, cache = make()
    tokens = [4, 5, 6]
    kv_b, kv_c = alloc.alloc(3), alloc.alloc(3)  # both computed before either inserted
    kv_b, node_b = cache.cache_unfinished_req(tokens, kv_b, None)
    cache.check_integrity(num_private=3)
    kv_c, node_c = cache.cache_unfinished_req(tokens, kv_c, None)
    assert kv_b.tolist() == kv_c.tolist() == [1, 2, 3]
    assert node_b is node_c and node_b.lock_ref == 2
    assert {4, 5, 6} <= free_set(cache)
    cache.check_integrity(num_private=0)
    cache.cache_finished_req(tokens, kv_b, node_b)
    cache.cache_finished_req(tokens, kv_c, node_c)
    assert cache.dump() == [(0, (4, 5, 6), (1, 2, 3), 0)]
    cache.check_integrity()


def test_page_size_2_matches_and_inserts_whole_pages_only():
    alloc, cache = make(page_size=2)
    put(cache, [1, 2, 3, 4, 5])  # the unaligned last token's slot (5) is freed
    assert cache.dump() == [(0, (1, 2, 3, 4), (1, 2, 3, 4), 0)]
    assert 5 in free_set(cache) and alloc.available() == 28
    assert cache.match_prefix([1, 2, 3]).kv_indices.tolist() == [1, 2]
    m = cache.match_prefix([1, 2, 3, 9])  # mismatch inside page 2 -> split at the page boundary
    assert m.kv_indices.tolist() == [1, 2]
    assert cache.dump() == [(0, (1, 2), (1, 2), 0), (1, (3, 4), (3, 4), 0)]
    assert cache.match_prefix([1, 9]).num_tokens == 0
    # Children of (1,2) are keyed by their whole first page: (3,4) and (3,5) are siblings.
    put(cache, [1, 2, 3, 5])
    assert cache.dump() == [(0, (1, 2), (1, 2), 0), (1, (3, 4), (3, 4), 0), (1, (3, 5), (8, 9), 0)]
    assert cache.match_prefix([1, 2, 3, 5, 7]).kv_indices.tolist() == [1, 2, 8, 9]
    cache.check_integrity()


def test_page_size_4_keeps_unaligned_tail_private():
    alloc, cache = make(page_size=4)
    tokens = list(range(10, 20))  # 10 tokens = 2 pages + 2
    kv, node = cache.cache_unfinished_req(tokens, alloc.alloc(10), None)
    assert kv.tolist() == list(range(1, 11))
    assert cache.dump() == [(0, tuple(range(10, 18)), tuple(range(1, 9)), 1)]
    cache.check_integrity(num_private=2)
    assert cache.match_prefix(tokens[:7]).kv_indices.tolist() == [1, 2, 3, 4]
    cache.check_integrity(num_private=2)
    cache.cache_finished_req(tokens, kv, node)
    assert {9, 10} <= free_set(cache)
    assert (cache.evictable_size(), cache.protected_size()) == (8, 0)
    cache.check_integrity()
    assert cache.evict(1) == 4  # the match split the edge into two pages; the leaf goes first
    assert cache.evict(1) == 4 and alloc.available() == 32


def test_reset_refuses_while_locked_and_then_frees_everything():
    alloc, cache = make()
    put(cache, [1, 2, 3])
    put(cache, [1, 4])
    m = cache.match_prefix([1, 4])
    cache.inc_lock(m.node)
    with pytest.raises(RuntimeError, match="locked"):
        cache.reset()
    cache.dec_lock(m.node)
    cache.reset()
    assert cache.dump() == [] and alloc.available() == 32
    assert cache.evictable_size() == cache.protected_size() == 0
    cache.check_integrity()
    with pytest.raises(RuntimeError, match="no longer in the tree"):
        cache.inc_lock(m.node)


def test_pin_protects_prefix_until_unpinned():
    alloc, cache = make()
    put(cache, [1, 2, 3, 4])
    handle = cache.pin([1, 2, 3, 4, 5, 6])
    assert isinstance(handle, PinHandle) and handle.num_tokens == 4
    assert cache.protected_size() == 4 and cache.evict(100) == 0
    cache.check_integrity()
    cache.unpin(handle)
    with pytest.raises(RuntimeError, match="already released"):
        cache.unpin(handle)
    with pytest.raises(TypeError, match="PinHandle"):
        cache.unpin(object())
    assert cache.evict(100) == 4 and alloc.available() == 32
    empty = cache.pin([7, 8])  # nothing cached: pins nothing, unpins cleanly
    assert empty.num_tokens == 0
    cache.unpin(empty)
    cache.check_integrity()


def test_hit_stats_and_peek():
    _, cache = make()
    put(cache, [1, 2, 3, 4])
    assert cache.peek_prefix_len([1, 2, 9]) == 2
    assert cache.dump() == [(0, (1, 2, 3, 4), (1, 2, 3, 4), 0)]  # peek does not split
    assert cache.hit_stats.num_queries == 0
    cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    cache.match_prefix([9, 9])
    stats = cache.hit_stats
    assert (stats.num_queries, stats.queried_tokens, stats.matched_tokens) == (2, 10, 4)
    assert stats.hit_rate == pytest.approx(0.4)
    stats.reset()
    assert stats.hit_rate == 0.0


def test_bad_input_is_rejected_with_a_clear_error():
    alloc, cache = make()
    with pytest.raises(ValueError, match="page_size"):
        RadixCache(alloc, page_size=0)
    with pytest.raises(ValueError, match="3 slots but token_ids has 2"):
        cache.cache_finished_req([1, 2], alloc.alloc(3), None)
    with pytest.raises(TypeError, match="sequence of ints"):
        cache.match_prefix(["a"])
    with pytest.raises(TypeError, match="torch.Tensor"):
        cache.cache_finished_req([1], [1], None)


def test_check_integrity_catches_leaks_and_drift():
    alloc, cache = make()
    put(cache, [1, 2])
    lost = alloc.alloc(1)  # a slot nobody accounts for
    with pytest.raises(AssertionError, match="leak"):
        cache.check_integrity()
    cache.check_integrity(num_private=1)
    alloc.free(lost)
    cache.check_integrity()

    # Corruptions that keep free + evictable + protected == total, so only the tree walk sees them.
    alloc, cache = make()
    put(cache, [1, 2])
    cache._evictable += 1
    alloc._free = alloc._free[1:]
    with pytest.raises(AssertionError, match="drifted"):
        cache.check_integrity()

    alloc, cache = make()
    put(cache, [1, 2])
    alloc._free = torch.cat([alloc._free[1:], torch.tensor([1])])  # slot 1 is cached: double free
    with pytest.raises(AssertionError, match="both cached and free"):
        cache.check_integrity()


def test_insert_resumes_at_the_requests_node_and_touches_its_path():
    alloc, cache = make()
    put(cache, [1, 2])
    m = cache.match_prefix([1, 2])
    cache.inc_lock(m.node)
    kv, node = cache.cache_unfinished_req([1, 2, 5], torch.cat([m.kv_indices, alloc.alloc(1)]), m.node)
    assert kv.tolist() == [1, 2, 3] and node.key == (5,) and node.parent is m.node
    cache.cache_finished_req([1, 2, 5], kv, node)
    m = cache.match_prefix([1, 2, 5])
    cache.inc_lock(m.node)
    put(cache, [3, 4])  # newer than [1, 2, 5] so far
    cache.cache_finished_req([1, 2, 5], m.kv_indices, m.node)  # nothing new: only touches its path
    # That insert counts as an access of [1, 2, 5]: [3, 4] is now the least recently used leaf.
    assert cache.evict(1) == 2
    assert cache.dump() == [(0, (1, 2), (1, 2), 0), (1, (5,), (3,), 0)]
    cache.check_integrity()


def test_insert_from_a_node_whose_slots_the_request_did_not_take_frees_them():
    alloc, cache = make()
    put(cache, [1, 2, 3, 4])
    m = cache.match_prefix([1, 2, 3, 4, 5])
    cache.inc_lock(m.node)
    mine = alloc.alloc(5)  # slots 5..9: the request computed the cached part again itself
    kv, node = cache.cache_unfinished_req([1, 2, 3, 4, 5], mine, m.node)
    assert kv.tolist() == [1, 2, 3, 4, 9]  # the tree's slots replace the duplicates
    assert {5, 6, 7, 8} <= free_set(cache)
    cache.check_integrity(num_private=0)
    cache.cache_finished_req([1, 2, 3, 4, 5], kv, node)
    cache.check_integrity()


def test_cache_unfinished_req_hands_back_the_requests_own_slots_when_nothing_was_cached():
    alloc, cache = make()
    kv = alloc.alloc(4)
    same, node = cache.cache_unfinished_req([1, 2, 3, 4], kv, None)
    assert same is kv and node.key == (1, 2, 3, 4)  # the caller can skip comparing
    # A second request computed the same tokens: it gets the tree's slots, in a new tensor.
    kv_b = alloc.alloc(5)
    got, node_b = cache.cache_unfinished_req([1, 2, 3, 4, 5], kv_b, None)
    assert got is not kv_b and got.tolist() == kv.tolist() + kv_b.tolist()[4:]
    assert set(kv_b.tolist()[:4]) <= free_set(cache)
    # A 2-D or int32 tensor is taken too (converted).
    kv_c = alloc.alloc(2).to(torch.int32).reshape(1, 2)
    got, node_c = cache.cache_unfinished_req([7, 8], kv_c, None)
    assert got.dtype == torch.int64 and got.tolist() == kv_c.reshape(-1).tolist()
    for n in (node, node_b, node_c):
        cache.dec_lock(n)
    cache.check_integrity()
