"""HiRadixCache: the radix cache over the device pool and a host tier, exact state with fake token ids.

The "device" pool is a tiny CPU KVPool (one layer, one KV head, head dim 1) whose K at a slot holds the token
id written there, so a test can read back where each token's K/V went in either tier.
"""

import pytest
import torch
from plait.runtime.kvcache.hiradix_cache import HiRadixCache
from plait.runtime.kvcache.host_tier import HostTier
from plait.runtime.kvcache.memory_pool import KVPool, TokenAllocator


def make(num_slots=8, host_slots=16, policy="write_back", page_size=1):
    alloc = TokenAllocator(num_slots, "cpu")
    pool = KVPool(num_slots, 1, 1, 1, torch.float32, "cpu")
    return HiRadixCache(alloc, HostTier(pool, host_slots), page_size, policy), pool


def put(cache, pool, tokens, old=None):
    """A request computes `tokens` (K = the token id) into fresh slots and finishes."""
    kv = cache.allocator.alloc(len(tokens))
    assert kv is not None
    pool.k_buffer[0][kv, 0, 0] = torch.tensor(tokens, dtype=torch.float32)
    pool.v_buffer[0][kv, 0, 0] = -torch.tensor(tokens, dtype=torch.float32)
    cache.cache_finished_req(tokens, kv, old)
    return kv


def device_tokens(pool, kv):
    return pool.k_buffer[0][kv, 0, 0].long().tolist()


def tiers(cache):
    """Depth-first (key, tier) per node: "D" device, "H" host, "DH" both."""
    out = []

    def visit(node):
        for ck in sorted(node.children):
            c = node.children[ck]
            out.append((c.key, ("D" if c.value is not None else "") + ("H" if c.host_value is not None else "")))
            visit(c)

    visit(cache.root)
    return out


def test_eviction_demotes_and_a_match_loads_back():
    cache, pool = make()
    put(cache, pool, [1, 2, 3, 4])
    put(cache, pool, [5, 6, 7, 8])
    assert cache.allocator.available() == 0
    assert cache.evict(4) == 4  # the least recently used leaf, [1..4], goes to the host
    assert tiers(cache) == [((1, 2, 3, 4), "H"), ((5, 6, 7, 8), "D")]
    assert (cache.evictable_size(), cache.host.used(), cache.allocator.available()) == (4, 4, 4)
    cache.check_integrity()
    assert cache.peek_prefix_len([1, 2, 3, 4, 9]) == 4  # a host hit is a hit

    m = cache.match_prefix([1, 2, 3, 4, 9])
    assert m.num_tokens == 4 and device_tokens(pool, m.kv_indices) == [1, 2, 3, 4]
    assert pool.v_buffer[0][m.kv_indices, 0, 0].tolist() == [-1.0, -2.0, -3.0, -4.0]
    assert tiers(cache) == [((1, 2, 3, 4), "DH"), ((5, 6, 7, 8), "D")]
    assert cache.host.stats.loaded_tokens == 4 and cache.host.stats.num_loads == 1
    assert cache.hit_stats.matched_tokens == 4
    cache.check_integrity()


def test_load_back_makes_room_by_demoting_and_keeps_the_path():
    cache, pool = make()
    put(cache, pool, [1, 2, 3, 4])
    put(cache, pool, [5, 6, 7, 8])
    cache.evict(4)
    put(cache, pool, [9, 10, 11, 12])  # device full again: [5..8], [9..12]
    m = cache.match_prefix([1, 2, 3, 4])  # no free slot: [5..8] (LRU) is demoted to make room
    assert device_tokens(pool, m.kv_indices) == [1, 2, 3, 4]
    assert dict(tiers(cache)) == {(1, 2, 3, 4): "DH", (5, 6, 7, 8): "H", (9, 10, 11, 12): "D"}
    cache.check_integrity()


def test_a_split_host_node_splits_in_both_tiers():
    cache, pool = make()
    put(cache, pool, [1, 2, 3, 4])
    cache.evict(4)
    m = cache.match_prefix([1, 2, 7])  # partial: the host-only edge splits, its upper half loads back
    assert m.num_tokens == 2 and device_tokens(pool, m.kv_indices) == [1, 2]
    assert tiers(cache) == [((1, 2), "DH"), ((3, 4), "H")]
    cache.check_integrity()
    m = cache.match_prefix([1, 2, 3, 4])
    assert device_tokens(pool, m.kv_indices) == [1, 2, 3, 4]
    cache.check_integrity()


def test_host_lru_eviction_drops_the_oldest_host_only_leaf():
    cache, pool = make(num_slots=4, host_slots=8)
    put(cache, pool, [1, 2, 3, 4])
    cache.evict(4)
    put(cache, pool, [5, 6, 7, 8])
    cache.evict(4)
    put(cache, pool, [9, 10, 11, 12])
    cache.evict(4)  # the host holds 8: [1..4] (least recent) leaves the tree
    assert tiers(cache) == [((5, 6, 7, 8), "H"), ((9, 10, 11, 12), "H")]
    assert cache.host.stats.evicted_tokens == 4
    assert cache.match_prefix([1, 2, 3, 4]).num_tokens == 0
    assert device_tokens(pool, cache.match_prefix([5, 6, 7, 8]).kv_indices) == [5, 6, 7, 8]
    cache.check_integrity()


def test_a_leaf_the_host_cannot_take_is_dropped_with_what_is_below_it():
    cache, pool = make(num_slots=8, host_slots=2)
    put(cache, pool, [1, 2, 3, 4])
    assert cache.evict(4) == 4
    assert tiers(cache) == [] and cache.host.used() == 0 and cache.allocator.available() == 8
    cache.check_integrity()


def test_write_through_copies_at_insert_and_eviction_copies_nothing():
    cache, pool = make(policy="write_through")
    put(cache, pool, [1, 2, 3, 4])
    assert tiers(cache) == [((1, 2, 3, 4), "DH")] and cache.host.stats.saved_tokens == 4
    cache.evict(4)
    assert tiers(cache) == [((1, 2, 3, 4), "H")] and cache.host.stats.saved_tokens == 4
    assert device_tokens(pool, cache.match_prefix([1, 2, 3, 4]).kv_indices) == [1, 2, 3, 4]
    cache.check_integrity()


def test_a_request_that_computed_a_host_only_prefix_gives_it_device_slots():
    cache, pool = make()
    put(cache, pool, [1, 2, 3, 4])
    cache.evict(4)
    kv = put(cache, pool, [1, 2, 3, 4, 5])  # computed without matching (it raced the demotion)
    assert tiers(cache) == [((1, 2, 3, 4), "DH"), ((5,), "D")]
    assert cache.match_prefix([1, 2, 3, 4, 5]).kv_indices.tolist() == kv.tolist()
    cache.check_integrity()


def test_pins_and_locks_keep_a_path_on_the_device():
    cache, pool = make()
    put(cache, pool, [1, 2, 3, 4])
    cache.evict(4)
    handle = cache.pin([1, 2, 3, 4])  # a pin loads the prefix back, then locks it
    assert handle.num_tokens == 4 and tiers(cache) == [((1, 2, 3, 4), "DH")]
    assert cache.evict(8) == 0 and cache.protected_size() == 4
    cache.check_integrity()
    cache.unpin(handle)
    assert cache.evict(8) == 4
    cache.check_integrity()


def test_a_load_that_cannot_fit_ends_the_match_at_what_did():
    cache, pool = make(num_slots=6, host_slots=16)
    put(cache, pool, [1, 2, 3, 4, 5, 6])
    cache.match_prefix([1, 2, 3])  # two edges: [1, 2, 3] and [4, 5, 6]
    cache.evict(6)
    assert tiers(cache) == [((1, 2, 3), "H"), ((4, 5, 6), "H")]
    held = cache.allocator.alloc(3)  # a running request's private slots: 3 are left
    m = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert m.num_tokens == 3 and device_tokens(pool, m.kv_indices) == [1, 2, 3]
    assert tiers(cache) == [((1, 2, 3), "DH"), ((4, 5, 6), "H")]
    cache.check_integrity(num_private=3)
    cache.allocator.free(held)
    m = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert device_tokens(pool, m.kv_indices) == [1, 2, 3, 4, 5, 6]
    cache.check_integrity()


def test_reset_empties_both_tiers():
    cache, pool = make(policy="write_through")
    put(cache, pool, [1, 2, 3, 4])
    put(cache, pool, [5, 6])
    cache.evict(2)
    cache.reset()
    assert tiers(cache) == [] and cache.host.used() == 0 and cache.allocator.available() == 8
    cache.check_integrity()


def test_integrity_catches_a_host_slot_leak():
    cache, pool = make()
    put(cache, pool, [1, 2, 3, 4])
    cache.evict(4)
    cache.host.allocator.alloc(1)  # a host slot neither cached nor free
    with pytest.raises(AssertionError, match="host slot leak"):
        cache.check_integrity()


def test_host_copies_are_page_contiguous_runs():
    from plait.runtime.kvcache.host_tier import _runs

    assert _runs(torch.tensor([1, 2, 3, 7, 8, 10])) == [(1, 4, 0), (7, 9, 3), (10, 11, 5)]
    pool = KVPool(4, 3, 2, 5, torch.float32, "cpu")
    host = HostTier(pool, 8)
    assert tuple(host.buffer.shape) == (9, 3, 2, 2, 5)  # (slots, layers, K/V, heads, dim): a token's layers together
    for layer in range(3):
        pool.k_buffer[layer][1:3] = torch.randn(2, 2, 5)
        pool.v_buffer[layer][1:3] = torch.randn(2, 2, 5)
    slots = host.alloc(2)
    host.save(torch.tensor([1, 2]), slots)
    host.load(slots, torch.tensor([4, 3]))
    for layer in range(3):
        assert torch.equal(pool.k_buffer[layer][4], pool.k_buffer[layer][1])
        assert torch.equal(pool.v_buffer[layer][3], pool.v_buffer[layer][2])
    assert host.stats.bytes_to_host == host.stats.bytes_to_device == 2 * host.bytes_per_token
    host.chunk_tokens = 3  # (a GPU's copies go in chunks: the same result, chunk by chunk)
    src, dst = torch.tensor([4, 1, 3, 2]), torch.tensor([2, 4, 1, 3])
    want = [pool.k_buffer[layer][src].clone() for layer in range(3)]
    slots = host.alloc(4)
    host.save(src, slots)
    host.load(slots, dst)
    assert all(torch.equal(pool.k_buffer[layer][dst], want[layer]) for layer in range(3))


def test_sizes_from_ratio_or_gigabytes():
    pool = KVPool(100, 2, 1, 4, torch.float32, "cpu")  # 64 bytes a token
    assert HostTier.sized(pool, 3.0, 0).num_slots == 300
    assert HostTier.sized(pool, 3.0, 64 * 10 / (1 << 30)).num_slots == 10


def test_a_host_tier_larger_than_the_host_memory_is_refused():
    from plait.runtime.kvcache.host_tier import host_memory_available

    pool = KVPool(100, 2, 1, 4, torch.float32, "cpu")
    free = host_memory_available()
    if free is None:
        pytest.skip("this OS does not say how much memory is available")
    with pytest.raises(ValueError, match="lower hicache_ratio or hicache_size"):
        HostTier.sized(pool, 0, 2 * free / (1 << 30))


class Told:
    """A CacheEventListener that writes down what it is told."""

    def __init__(self):
        self.calls = []

    def stored(self, node):
        self.calls.append(("stored", node.key))

    def removed(self, node):
        self.calls.append(("removed", node.key))

    def cleared(self):
        self.calls.append(("cleared",))


def test_kv_events_see_a_demoted_prefix_as_still_cached():
    """A router reading KV events keeps sending a prefix's requests here while the host tier holds it: a
    demotion is no removal; leaving the tree (host LRU) is."""
    told = Told()
    alloc = TokenAllocator(4, "cpu")
    cache = HiRadixCache(alloc, HostTier(KVPool(4, 1, 1, 1, torch.float32, "cpu"), 4), 1, "write_back", told)
    pool = cache.host.kv_pool
    put(cache, pool, [1, 2, 3, 4])
    cache.evict(4)
    assert told.calls == [("stored", (1, 2, 3, 4))]
    put(cache, pool, [5, 6, 7, 8])
    cache.evict(4)  # the host holds 4 tokens: [1..4] leaves the tree
    assert told.calls[1:] == [("stored", (5, 6, 7, 8)), ("removed", (1, 2, 3, 4))]
    cache.reset()
    assert told.calls[-1] == ("cleared",)
