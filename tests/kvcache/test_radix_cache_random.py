"""A randomized property test of RadixCache: random request workloads (matches, inserts, locks,
evictions; page sizes 1, 2, 4) against a plain reference model of the cached prefixes, with the
integrity check after every step. Exact-state tests are in test_radix_cache.py."""

import random

import pytest
import torch
from plait.runtime.kvcache.memory_pool import TokenAllocator
from plait.runtime.kvcache.radix_cache import RadixCache


def tree_contents(cache):
    """{token prefix ending at a page boundary: kv slots of that last page}, rebuilt from `dump()`.

    Pages, not tokens, are the unit: with page_size > 1 sibling pages may share their first tokens.
    """
    ps, out, path = cache.page_size, {}, []
    for depth, key, slots, _ in cache.dump():
        del path[depth:]
        prefix = path[-1] if path else ()
        for i in range(0, len(key), ps):
            out[prefix + key[: i + ps]] = slots[i : i + ps]
        path.append(prefix + key)
    return out


class Req:
    def __init__(self, tokens, kv, node, in_tree):
        self.tokens, self.kv, self.node, self.in_tree = tokens, kv, node, in_tree


def run_random_workload(seed, page_size, num_slots=48, steps=250):
    rng = random.Random(seed)
    alloc = TokenAllocator(num_slots, "cpu")
    cache = RadixCache(alloc, page_size=page_size)
    ref = {}  # the reference model: page-aligned prefix -> slots of its last page, prefix-closed
    running, pins = [], []
    bases = [tuple(rng.randrange(3) for _ in range(10)) for _ in range(3)]

    def ref_match(tokens):
        k = 0
        while k + page_size <= len(tokens) and tuple(tokens[: k + page_size]) in ref:
            k += page_size
        return [s for i in range(page_size, k + 1, page_size) for s in ref[tuple(tokens[:i])]]

    def ref_insert(tokens, kv):
        """Returns the slots the tree should now hold for `tokens` and the duplicates."""
        expected, dups = [], []
        for i in range(0, len(tokens), page_size):
            prefix, page = tuple(tokens[: i + page_size]), tuple(kv[i : i + page_size])
            if prefix in ref:
                dups += [mine for mine, cached in zip(page, ref[prefix]) if mine != cached]
            else:
                ref[prefix] = page
            expected += ref[prefix]
        return expected, dups

    def random_tokens():
        base = rng.choice(bases)
        return list(base[: rng.randrange(len(base) + 1)]) + [rng.randrange(3) for _ in range(rng.randrange(4))]

    def alloc_with_evict(n):
        if alloc.available() < n:
            do_evict(n - alloc.available())
        return alloc.alloc(n)

    def locked_paths():
        return [r.tokens[: r.in_tree] for r in running] + [t for _, t in pins]

    def do_evict(n):
        before = dict(ref)
        evictable = cache.evictable_size()
        freed = cache.evict(n)
        after = tree_contents(cache)
        removed = set(before) - set(after)
        assert all(before[p] == s for p, s in after.items())
        assert freed == page_size * len(removed) and freed >= min(n, evictable)
        assert {s for p in removed for s in before[p]} <= alloc.free_slot_set()
        for path in locked_paths():  # nothing on a locked path may go
            assert all(tuple(path[:i]) in after for i in range(page_size, len(path) + 1, page_size))
        ref.clear()
        ref.update(after)

    def check():
        private = [s for r in running for s in r.kv[r.in_tree :].tolist()]
        cache.check_integrity(num_private=len(private))
        contents = tree_contents(cache)
        assert contents == ref
        free = alloc.free_slot_set()
        everything = list(free) + [s for page in contents.values() for s in page] + private
        assert sorted(everything) == list(range(1, num_slots + 1)), "slot lost or counted twice"
        protected = {tuple(p[:i]) for p in locked_paths() for i in range(page_size, len(p) + 1, page_size)}
        assert cache.protected_size() == page_size * len(protected)

    for _ in range(steps):
        op = rng.choice(
            ["start", "start", "extend", "unfinished", "finish", "finish", "evict", "pin", "unpin", "match"]
        )
        if op == "start" and len(running) < 4:
            tokens = random_tokens() or [0]
            m = cache.match_prefix(tokens)
            assert m.kv_indices.tolist() == ref_match(tokens)
            cache.inc_lock(m.node)
            new = alloc_with_evict(len(tokens) - m.num_tokens)
            if new is None:
                cache.dec_lock(m.node)
            else:
                running.append(Req(tokens, torch.cat([m.kv_indices, new]), m.node, m.num_tokens))
        elif op == "extend" and running:
            r = rng.choice(running)
            k = rng.randrange(1, 4)
            new = alloc_with_evict(k)
            if new is not None:
                r.tokens += [rng.randrange(3) for _ in range(k)]
                r.kv = torch.cat([r.kv, new])
        elif op == "unfinished" and running:
            r = rng.choice(running)
            n = len(r.tokens) - len(r.tokens) % page_size
            expected, dups = ref_insert(r.tokens[:n], r.kv[:n].tolist())
            kv, r.node = cache.cache_unfinished_req(r.tokens, r.kv, r.node)
            assert kv.tolist() == expected + r.kv[n:].tolist()
            assert set(dups) <= alloc.free_slot_set()
            r.kv, r.in_tree = kv, n
        elif op == "finish" and running:
            r = running.pop(rng.randrange(len(running)))
            n = len(r.tokens) - len(r.tokens) % page_size
            _, dups = ref_insert(r.tokens[:n], r.kv[:n].tolist())
            cache.cache_finished_req(r.tokens, r.kv, r.node)
            assert set(dups) | set(r.kv[n:].tolist()) <= alloc.free_slot_set()
        elif op == "evict":
            do_evict(rng.randrange(0, 20))
        elif op == "pin" and len(pins) < 3:
            tokens = random_tokens()
            handle = cache.pin(tokens)
            assert handle.num_tokens == len(ref_match(tokens))
            pins.append((handle, tokens[: handle.num_tokens]))
        elif op == "unpin" and pins:
            cache.unpin(pins.pop(rng.randrange(len(pins)))[0])
        elif op == "match":
            tokens = random_tokens()
            assert cache.match_prefix(tokens).kv_indices.tolist() == ref_match(tokens)
        check()

    for r in running:
        cache.cache_finished_req(r.tokens, r.kv, r.node)
    for handle, _ in pins:
        cache.unpin(handle)
    assert cache.protected_size() == 0
    cache.evict(num_slots)
    assert cache.dump() == [] and alloc.available() == num_slots
    cache.check_integrity()


@pytest.mark.parametrize("page_size", [1, 2, 4])
@pytest.mark.parametrize("seed", range(8))
def test_random_workload_matches_reference_and_never_leaks(seed, page_size):
    run_random_workload(seed, page_size)
