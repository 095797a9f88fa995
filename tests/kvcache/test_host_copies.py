"""Rank 0's host-tier copies replayed on another rank's pool and shard (kvcache/host_copies.py): after any
sequence of saves and loads on rank 0, replayed in order, the other rank's device pool and host shard hold
its own K/V at exactly the slots where rank 0's hold rank 0's."""

from __future__ import annotations

import torch
from plait.runtime.kvcache.host_copies import HostCopyLog
from plait.runtime.kvcache.host_tier import HostTier
from plait.runtime.kvcache.memory_pool import KVPool


def filled_pool(scale: float) -> KVPool:
    """A pool of 12 slots, 2 layers, 1 KV head of 3: every value a function of its slot, times `scale`."""
    pool = KVPool(12, 2, 1, 3, torch.float32, "cpu")
    for layer, (k, v) in enumerate(zip(pool.k_buffer, pool.v_buffer)):
        rows = torch.arange(13, dtype=torch.float32)[:, None, None] + 100 * layer  # (13, 1, 1)
        k.copy_(scale * rows.expand_as(k))
        v.copy_(-scale * rows.expand_as(v))
    return pool


def slots(*s: int) -> torch.Tensor:
    return torch.tensor(s, dtype=torch.int64)


def test_replayed_copies_leave_every_rank_with_its_own_kv_at_the_same_slots():
    rank0, rank1 = filled_pool(1.0), filled_pool(2.0)  # (rank 1's shard: other values, the same slots)
    rank0.host_copies = log = HostCopyLog()
    host0, host1 = HostTier(rank0, 8), HostTier(rank1, 8)
    host0.chunk_tokens = 2  # (copies in several chunks: the log keeps whole copies)
    host0.save(slots(3, 4, 5), slots(1, 2, 3))
    host0.save(slots(9), slots(6))
    host0.load(slots(1, 2, 3), slots(9, 10, 11))  # over slot 9, saved just before
    host0.save(slots(10), slots(7))
    copies = log.take()
    assert [(c.to_host, c.device_slots.tolist(), c.host_slots.tolist()) for c in copies] == [
        (True, [3, 4, 5], [1, 2, 3]),
        (True, [9], [6]),
        (False, [9, 10, 11], [1, 2, 3]),
        (True, [10], [7]),
    ]
    assert log.take() == []
    assert rank1.host_copies is None  # (a follower records nothing)
    host1.replay(copies)
    assert torch.equal(host1.buffer, 2 * host0.buffer)
    for a, b in zip((*rank0.k_buffer, *rank0.v_buffer), (*rank1.k_buffer, *rank1.v_buffer)):
        assert torch.equal(b, 2 * a)
    assert torch.equal(rank0.k_buffer[1][9:12, 0, 0], torch.tensor([103.0, 104.0, 105.0]))
    assert host1.buffer[6, 0, 0, 0, 0] == 18.0  # slot 9's K, saved before the load overwrote it
