"""Shared-prefix ("cascade") decode attention, host side: which requests share a prefix in the paged
req_to_token table (prefix_groups.py) and the work plan the prefix kernel runs (cascade_plan.py).
The kernels and graph hooks are in test_cascade_attention.py."""

import numpy as np
import pytest
import torch
from plait.runtime.attention.cascade_plan import CascadeConfig, CascadePlanner, build_plan
from plait.runtime.attention.prefix_groups import PrefixGroup, find_prefix_groups
from plait.runtime.attention.triton_ops import PrefixConfig

# 16-row tiles (4 members at GQA 4), 16-token KV blocks, prefixes split every 16 tokens, 5 persistent programs.
TINY_PREFIX = PrefixConfig(block_m=16, block_n=16, min_split_len=16, max_splits=4, target_programs=32, num_programs=5)


def _table(rows_slots, width=64):
    """Host req_to_token rows from lists of slots; stale junk (slot 999) past each list."""
    t = np.full((len(rows_slots) + 1, width), 999, dtype=np.int32)
    for r, s in enumerate(rows_slots):
        t[r + 1, : len(s)] = s
    return t


def test_groups_by_document_not_by_a_shared_header():
    hdr = [1, 2, 3]  # a chat header every request shares (the first slot alone would group them all)
    doc_a, doc_b = list(range(10, 40)), list(range(40, 70))
    rows = [
        hdr + doc_a + [100],
        hdr + doc_b + [101],
        hdr + doc_a + [102, 103],
        hdr + doc_b + [104],
        hdr + doc_a + [105],
        hdr + [106, 107],
    ]
    t = _table(rows)
    lens = np.array([len(r) for r in rows]) - 1  # the last slot is the request's new token
    groups = find_prefix_groups(t, np.arange(1, 7), lens, min_prefix_len=8)
    assert [(g.prefix_len, g.members.tolist()) for g in groups] == [(33, [0, 2, 4]), (33, [1, 3])]
    # With one request per document the header is all there is to share: (6 - 1) * 3 tokens.
    groups = find_prefix_groups(t, np.arange(1, 7), lens, min_prefix_len=2)
    assert [(g.prefix_len, g.members.tolist()) for g in groups] == [(33, [0, 2, 4]), (33, [1, 3])]
    one_each = _table([hdr + doc_a + [100], hdr + doc_b + [101], hdr + [102, 103]])
    groups = find_prefix_groups(one_each, np.arange(1, 4), np.array([33, 33, 4]), min_prefix_len=2)
    assert [(g.prefix_len, g.members.tolist()) for g in groups] == [(3, [0, 1, 2])]


def test_a_parent_group_beats_small_subgroups():
    base = list(range(100, 150))  # 50 tokens shared by all six
    rows = [base + [1, 2, 3, 4] + [200 + i] for i in range(2)] + [base + [5, 6] + [300 + i] for i in range(4)]
    lens = np.array([len(r) - 1 for r in rows])
    groups = find_prefix_groups(_table(rows), np.arange(1, 7), lens, min_prefix_len=8)
    # All six over 50 tokens saves 250; the subgroups 1 * 54 + 3 * 52 = 210.
    assert [(g.prefix_len, g.members.tolist()) for g in groups] == [(50, list(range(6)))]


def test_lengths_bound_the_prefix_and_stale_slots_never_match():
    rows = [list(range(1, 31)), list(range(1, 31)), list(range(1, 13))]  # identical slots, shorter third
    t = _table(rows)  # past each row's length: the same junk in every row
    groups = find_prefix_groups(t, np.arange(1, 4), np.array([30, 30, 12]), min_prefix_len=4)
    assert [(g.prefix_len, g.members.tolist()) for g in groups] == [(30, [0, 1])]  # 1 * 30 > 2 * 12
    groups = find_prefix_groups(t, np.arange(1, 4), np.array([15, 18, 12]), min_prefix_len=4)
    assert [(g.prefix_len, g.members.tolist()) for g in groups] == [(12, [0, 1, 2])]  # 2 * 12 > 1 * 15
    assert find_prefix_groups(t, np.arange(1, 4), np.array([30, 30, 12]), min_prefix_len=31) == []
    assert find_prefix_groups(_table([[1, 2, 3], [4, 5, 6]]), np.array([1, 2]), np.array([3, 3]), 1) == []
    with pytest.raises(ValueError, match="min_group_size"):
        find_prefix_groups(t, np.arange(1, 4), np.array([30, 30, 12]), 4, min_group_size=1)


def test_plan_tables_cover_each_tile_and_split_once():
    groups = [PrefixGroup(100, np.array([0, 2, 3, 5, 6, 7, 9])), PrefixGroup(17, np.array([1, 4]))]
    rows = np.arange(20, 30)
    planner = CascadePlanner(CascadeConfig(min_batch_size=2), TINY_PREFIX, 8, 2)  # GQA 4: 4 members per tile
    layout = planner.layout(12)
    plan = build_plan(groups, rows, layout, planner.members_per_tile, planner.target_work, TINY_PREFIX)
    t = layout.views(torch.from_numpy(plan.packed))
    g = t.groups[:2].numpy()
    # member_start, count, prefix, row, split_len, splits, slot_base
    assert g[:, :4].tolist() == [[0, 7, 100, 20], [7, 2, 17, 21]]
    split_len, splits = g[:, 4], g[:, 5]
    assert all(sl % TINY_PREFIX.block_n == 0 for sl in split_len)
    assert all((s - 1) * sl < p <= s * sl for s, sl, p in zip(splits, split_len, [100, 17]))  # none empty
    assert splits.tolist() == [4, 1]  # 16 work items wanted; 17 tokens is one 16+ split only
    work = t.work[: int(t.work_len)].numpy().tolist()
    expected = sorted((0, tile, s) for tile in range(2) for s in range(4)) + [(1, 0, 0)]
    assert sorted(map(tuple, work)) == expected and plan.num_work == len(work) <= layout.max_work
    info = t.req_info.numpy()
    assert info[[8, 10, 11], :].tolist() == [[0, 0, 0]] * 3  # ungrouped and padding rows
    assert info[[0, 2, 9], 0].tolist() == [100, 100, 100] and info[[1, 4], 0].tolist() == [17, 17]
    used = sorted(s for b in range(10) for s in range(info[b, 1], info[b, 1] + info[b, 2]) if info[b, 2])
    assert used == list(range(plan.num_partials)) == list(range(7 * 4 + 2))
    # A partial budget makes the splits fewer rather than overflowing the static scratch.
    tight = build_plan(groups, rows, layout, planner.members_per_tile, planner.target_work, TINY_PREFIX, 12)
    assert tight.num_partials <= 12


def test_planner_reuses_groups_while_requests_stay():
    rows_slots = [list(range(1, 41)) + [100 + i] for i in range(4)] + [list(range(200, 230))]
    t = _table(rows_slots)
    planner = CascadePlanner(CascadeConfig(min_prefix_len=8, min_saved_tokens=0, min_batch_size=2), TINY_PREFIX, 4, 4)
    rows, lens = np.array([1, 2, 3, 4, 5]), np.array([41, 41, 41, 41, 30])
    p1 = planner.plan(t, rows, lens, planner.layout(8))
    assert [(g.prefix_len, g.members.tolist()) for g in p1.groups] == [(40, [0, 1, 2, 3])]
    assert planner.plan(t, rows, lens + 1, planner.layout(8)) is p1  # next step: same plan object
    # Two requests finished: the group shrinks without reading the table again (junk there now).
    t[1:, :] = 7
    p2 = planner.plan(t, np.array([5, 2, 4]), np.array([31, 42, 42]), planner.layout(8))
    assert [(g.prefix_len, g.members.tolist()) for g in p2.groups] == [(40, [1, 2])]
    assert planner.recomputes == 1
    assert planner.plan(t, np.array([5, 4]), np.array([32, 43]), planner.layout(8)) is None  # group of one
    # A row the cached groups never saw, or an EXTEND step: found again from the table.
    t = _table(rows_slots)
    p3 = planner.plan(t, np.array([1, 2, 3]), np.array([41, 41, 41]), planner.layout(8))
    assert planner.recomputes == 2 and [g.members.tolist() for g in p3.groups] == [[0, 1, 2]]
    planner.invalidate()
    planner.plan(t, np.array([1, 2, 3]), np.array([41, 41, 41]), planner.layout(8))
    assert planner.recomputes == 3
    # Below the batch's savings threshold: no plan.
    strict = CascadePlanner(CascadeConfig(min_prefix_len=8, min_saved_tokens=200), TINY_PREFIX, 4, 4)
    assert strict.plan(t, rows, lens, strict.layout(8)) is None
