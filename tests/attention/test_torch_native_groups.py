"""torch_native's decode rows on the CPU in groups of similar lengths (`_length_groups`): which rows go
together, and that the grouped attention is the one padded batch's, row for row."""

from __future__ import annotations

import torch
from plait.runtime.attention.base import AttentionLayerSpec
from plait.runtime.attention.context import AttentionContext
from plait.runtime.attention.torch_native import (
    MAX_GROUPED_ROWS,
    TorchNativeAttnBackend,
    _attend_one_token,
    _LayerKV,
    _length_groups,
)


def test_similar_lengths_stay_one_group_and_ragged_ones_split_by_length():
    assert _length_groups([100] * 8) is None
    assert _length_groups([700]) is None
    groups = _length_groups([2000, 1900, 30, 20, 25, 1950])
    assert sorted(i for g in groups for i in g) == list(range(6))  # every row once
    assert {frozenset(g) for g in groups} == {frozenset({0, 1, 5}), frozenset({2, 3, 4})}
    assert _length_groups([2000] + [10] * MAX_GROUPED_ROWS) is None  # past the limit: one batch


def test_grouped_decode_attention_equals_the_one_padded_batch():
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, slots = 6, 2, 16, 2048
    lens = [700, 12, 650, 9, 30]
    k_buf = torch.randn(slots, kv_heads, dim, generator=g)
    v_buf = torch.randn(slots, kv_heads, dim, generator=g)
    table = torch.zeros(len(lens), max(lens), dtype=torch.int32)
    for b, n in enumerate(lens):  # scattered slots, never the dummy slot 0
        table[b, :n] = torch.randperm(slots - 1, generator=g)[:n].to(torch.int32) + 1
    rows, seq_lens = torch.arange(len(lens)), torch.tensor(lens)
    backend = TorchNativeAttnBackend(AttentionContext("cpu"))
    grouped = backend._decode_metadata(table, rows, seq_lens, max(lens), lens)
    whole = backend._decode_metadata(table, rows, seq_lens, max(lens))
    assert grouped.groups is not None and len(grouped.groups) == 2 and whole.groups is None
    q = torch.randn(len(lens), heads, dim, generator=g)
    kv = _LayerKV(k_buf, v_buf, None)
    layer = AttentionLayerSpec(0, heads, kv_heads, dim, dim**-0.5)
    out = _attend_one_token(q, kv, grouped, layer)  # (B, H * D)
    assert out.shape == (len(lens), heads * dim)
    torch.testing.assert_close(out, _attend_one_token(q, kv, whole, layer), rtol=1e-5, atol=1e-6)
