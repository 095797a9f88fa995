"""KV-memory primitives with exact-state assertions: the token-slot allocator, the cache without
sharing, the host rows a step uploads, and the request-to-token table's row writes (both copies)."""

from __future__ import annotations

import pytest
import torch
from plait.runtime.kvcache.memory_pool import TokenAllocator
from plait.runtime.kvcache.prefix_cache import NoSharingCache
from plait.runtime.sampling_params import SamplingParams


def test_allocator_free_list_exact():
    a = TokenAllocator(8, "cpu")
    x = a.alloc(3)
    assert x.tolist() == [1, 2, 3] and a.available() == 5
    assert a.alloc(6) is None and a.available() == 5
    a.free(torch.tensor([2]))
    assert a.free_slot_set() == {2, 4, 5, 6, 7, 8}
    assert 0 not in a.free_slot_set()  # slot 0 is the dummy, never handed out


def test_allocator_reuses_freed_runs_only_when_needed():
    a = TokenAllocator(6, "cpu")
    a.reuse_freed_first = False  # as on a GPU
    first = a.alloc(4)  # [1..4]
    a.free(first[:2])
    a.free(first[3:])
    assert a.available() == 5
    assert a.alloc(2).tolist() == [5, 6]  # never-used slots go first
    assert a.available() == 3
    got = a.alloc(3)  # now the freed runs are needed: each comes back exactly once
    assert sorted(got.tolist()) == [1, 2, 4] and a.available() == 0
    assert a.alloc(1) is None
    a.free(got)
    assert a.free_slot_set() == {1, 2, 4} and a.available() == 3


def test_cpu_allocator_hands_out_the_latest_freed_slots_first():
    """On the CPU the pool's unwritten pages cost a page fault at first write: freed slots go out again before
    never-used ones, the most recently freed run first, each slot exactly once."""
    a = TokenAllocator(10, "cpu")
    assert a.reuse_freed_first and not TokenAllocator(10, "meta").reuse_freed_first
    first = a.alloc(5)  # [1..5]
    a.free(first[:2])  # [1, 2]
    a.free(first[3:])  # [4, 5]
    assert a.alloc(1).tolist() == [4]  # part of the latest run; its rest stays next in line
    assert a.alloc(3).tolist() == [5, 1, 2]
    assert a.alloc(2).tolist() == [6, 7] and a.available() == 3  # then never-used slots
    a.free(torch.tensor([6]))
    assert a.alloc(4).tolist() == [6, 8, 9, 10] and a.available() == 0 and a.alloc(1) is None
    a.free(torch.tensor([3, 1]))
    assert a.free_slot_set() == {1, 3} and a.available() == 2


def test_no_sharing_cache_returns_every_slot():
    a = TokenAllocator(10, "cpu")
    c = NoSharingCache(a)
    kv = a.alloc(4)
    assert c.match_prefix([1, 2, 3]).num_tokens == 0
    c.check_integrity(num_private=4)
    c.cache_finished_req([1, 2, 3, 4], kv, None)
    c.check_integrity()
    assert a.available() == 10


def test_host_rows_of_extend_and_decode_steps_exact():
    from plait.runtime.forward_batch import ForwardMode
    from plait.runtime.request import Req
    from plait.runtime.scheduler.batch import ScheduleBatch

    a = Req("a", [10, 11, 12, 13], SamplingParams())
    b = Req("b", [20, 21], SamplingParams())
    b.output_ids[:] = [22, 23]  # a retracted request: its outputs are prefilled again
    a.req_pool_idx, b.req_pool_idx = 3, 5
    ext = ScheduleBatch(ForwardMode.EXTEND, [a, b], [1, 0], [3, 4], torch.tensor([7, 8, 9, 40, 41, 42, 43]))
    step = ext.to_step()
    tokens, per_req = step.token_rows, step.req_rows
    assert tokens.tolist() == [
        [11, 12, 13, 20, 21, 22, 23],
        [1, 2, 3, 0, 1, 2, 3],
        [7, 8, 9, 40, 41, 42, 43],
        [3, 3, 3, 5, 5, 5, 5],
    ]
    assert per_req.tolist() == [[3, 5], [4, 4], [1, 0], [3, 4], [0, 3]]
    assert [x.tolist() for x in ext.kv_writes] == [
        [3, 3, 3, 5, 5, 5, 5],
        [1, 2, 3, 0, 1, 2, 3],
        [7, 8, 9, 40, 41, 42, 43],
    ]
    a.output_ids[:] = [14]
    dec = ScheduleBatch(ForwardMode.DECODE, [a, b], out_cache_loc=torch.tensor([50, 51]))
    rows = dec.decode_host_rows()
    assert rows.tolist() == [[14, 23], [4, 3], [3, 5], [5, 4], [50, 51]]
    assert dec.to_step().prev_src is None
    # Overlap: the next step is launched before this one's tokens are read; it derives its rows.
    nxt = dec.next_decode(torch.tensor([60, 61]))
    assert nxt.decode_host_rows().tolist() == [[0, 0], [5, 4], [3, 5], [6, 5], [60, 61]]
    assert nxt.to_step().prev_src.tolist() == [0, 1]
    # `a` finished meanwhile: the step after goes on with `b` alone, whose input is row 1's sample.
    last = nxt.next_decode(torch.tensor([70]), keep=[1])
    assert last.reqs == [b]
    assert last.decode_host_rows().tolist() == [[0], [5], [5], [6], [70]]
    assert last.to_step().prev_src.tolist() == [1]


def test_host_rows_of_a_mixed_step_planned_past_a_step_in_flight():
    # A mixed step: `a` decodes one token past the step in flight (its input is that step's sample 1),
    # `b` decodes from its host state, `c` prefills 3 new tokens after 2 cached ones.
    from plait.runtime.forward_batch import ForwardMode
    from plait.runtime.request import Req
    from plait.runtime.scheduler.batch import DecodeRows, ScheduleBatch

    a, b, c = (
        Req(rid, ids, SamplingParams(max_new_tokens=8))
        for rid, ids in (("a", [11, 12, 13]), ("b", [20, 21]), ("c", [30, 31, 32, 33, 34]))
    )
    a.req_pool_idx, b.req_pool_idx, c.req_pool_idx = 3, 5, 6
    a.output_ids[:] = [14]
    b.output_ids[:] = [22, 23]
    rows = DecodeRows.of([a, b], prev_index={id(a): 1})
    assert rows.seq_lens.tolist() == [5, 4] and rows.input_ids.tolist() == [0, 23]
    assert rows.prev_src.tolist() == [1, -1]
    decode = ScheduleBatch(ForwardMode.DECODE, [a, b], out_cache_loc=torch.tensor([50, 51]), decode=rows)
    prefill = ScheduleBatch(ForwardMode.EXTEND, [c], [2], [3], torch.tensor([60, 61, 62]))
    step = ScheduleBatch.mixed(decode, prefill).to_step()
    assert step.mode.is_extend() and step.decode_rows == 2
    assert step.token_rows.tolist() == [
        [0, 23, 32, 33, 34],
        [4, 3, 2, 3, 4],
        [50, 51, 60, 61, 62],
        [3, 5, 6, 6, 6],
    ]
    assert step.prev_src.tolist() == [1, -1, -1, -1, -1]
    assert step.prefix_lens == [4, 3, 2] and step.extend_lens == [1, 1, 3] and step.seq_lens == [5, 4, 5]
    assert step.sample_rows == [0, 1, 4] and step.sampling_reqs == [0, 1, 2]
    assert ScheduleBatch.mixed(decode, prefill).to_step().following_ids == [-1, -1, -1]


def test_req_to_token_write_rows_updates_both_tables():
    from plait.runtime.kvcache.memory_pool import ReqToTokenPool

    pool = ReqToTokenPool(4, 16, "cpu")
    pool.write_rows([(1, torch.tensor([7, 8, 9])), (3, torch.tensor([5])), (2, torch.tensor([], dtype=torch.int64))])
    assert pool.req_to_token[1, :4].tolist() == [7, 8, 9, 0] and pool.req_to_token[3, :2].tolist() == [5, 0]
    assert (pool.host == pool.req_to_token.numpy()).all()
    pool.write_rows([])  # nothing to write is fine


def test_req_to_token_write_rows_uploads_a_shared_prefix_once_per_tensor():
    from plait.runtime.kvcache.memory_pool import ReqToTokenPool

    pool = ReqToTokenPool(6, 16, "cpu")
    shared, other = torch.tensor([4, 5, 6, 7]), torch.tensor([9, 10])
    pool.write_rows([(0, shared), (3, other), (5, shared), (2, shared)])
    rows = pool.req_to_token
    assert [rows[i, :5].tolist() for i in (0, 2, 5)] == [[4, 5, 6, 7, 0]] * 3
    assert rows[3, :3].tolist() == [9, 10, 0] and rows[1].sum() == rows[4].sum() == 0
    assert (pool.host == rows.numpy()).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned upload path needs a GPU")
def test_req_to_token_write_rows_on_the_gpu_matches_the_host_mirror():
    from plait.runtime.kvcache.memory_pool import ReqToTokenPool

    pool = ReqToTokenPool(8, 64, "cuda")
    shared = torch.arange(1, 41)
    for round_ in range(3):  # the pinned staging blocks are reused between rounds
        pool.write_rows([(i, shared + round_) for i in range(4)] + [(5, torch.arange(100, 100 + 7 * round_ + 1))])
        assert (pool.host == pool.req_to_token.cpu().numpy()).all(), round_


def test_cpu_pool_asks_for_huge_pages_over_its_whole_2mib_pages():
    """The CPU pool's buffers are advised as transparent huge pages (a 4 KiB fault each slot page was most of a
    fresh process's first long step): the advice covers exactly the whole huge pages inside the buffer, and the
    buffer still reads as zeros and takes writes."""
    import os
    import sys

    import numpy as np
    from plait.runtime.kvcache import host_pages
    from plait.runtime.kvcache.memory_pool import zeroed

    big = np.zeros(5 * host_pages.HUGE_PAGE + 12345, dtype=np.uint8)
    advised = host_pages.advise_huge_pages(big)
    start, end = big.ctypes.data, big.ctypes.data + big.nbytes
    whole = (end // host_pages.HUGE_PAGE - -(-start // host_pages.HUGE_PAGE)) * host_pages.HUGE_PAGE
    assert whole >= 4 * host_pages.HUGE_PAGE
    if sys.platform.startswith("linux") and os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"):
        assert advised == whole  # a kernel with transparent huge pages takes the advice
    else:
        assert advised in (0, whole)
    assert host_pages.advise_huge_pages(np.zeros(4096, dtype=np.uint8)) == 0  # no whole huge page inside

    pool = zeroed((3000, 3, 64), torch.bfloat16, "cpu")
    assert pool.shape == (3000, 3, 64) and pool.dtype == torch.bfloat16 and not pool.any()
    pool[1234] = 1.5
    assert float(pool[1234].sum()) == 1.5 * 3 * 64 and float(pool.sum()) == 1.5 * 3 * 64
