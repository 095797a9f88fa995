"""torch_native's decode rows on the CPU in groups of similar lengths (`_length_groups`): which rows go
together, and that the grouped attention is the one padded batch's, row for row."""

from __future__ import annotations

import pytest
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


def test_half_precision_attention_widens_to_float32_on_a_cpu_without_amx(monkeypatch):
    import plait.runtime.attention.torch_native as tn
    import plait.runtime.quant.cpu_features as features

    def with_flags(flags):
        monkeypatch.setattr(features, "cpu_features", lambda: features.CpuFeatures(flags, "AVX512"))

    q = torch.zeros(2, 6, 16, dtype=torch.bfloat16)
    with_flags(("avx512f", "avx512_bf16"))  # AMD EPYC: bf16 dot products, no matrix tiles
    # A request's extend (query heads unfolded) widens; folded attention (decode rows, padded batches) keeps
    # bf16, fp16 widens.
    assert tn.scores_dtype(q) == torch.float32 and tn.scores_dtype(q.float()) == torch.float32
    assert tn.folded_dtype(q) == torch.bfloat16 and tn.folded_dtype(q.half()) == torch.float32
    with_flags(("avx512f", "avx512_bf16", "amx_tile", "amx_bf16"))  # Intel Xeon with AMX: bf16 stays
    assert tn.scores_dtype(q) == torch.bfloat16 and tn.folded_dtype(q.half()) == torch.float16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_rows_fold_query_heads_by_kv_head(dtype):
    """Decode rows attend with each kv head's query heads as the query axis: the same attention as the query
    heads unfolded with enable_gqa (float32: to rounding; bf16: within bf16's precision of the float64 answer)."""
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, slots, lens = 6, 2, 16, 512, [300, 40, 7]
    k_buf = torch.randn(slots, kv_heads, dim, generator=g).to(dtype)
    v_buf = torch.randn(slots, kv_heads, dim, generator=g).to(dtype)
    table = torch.zeros(len(lens), max(lens), dtype=torch.int32)
    for b, n in enumerate(lens):
        table[b, :n] = torch.randperm(slots - 1, generator=g)[:n].to(torch.int32) + 1
    md = TorchNativeAttnBackend(AttentionContext("cpu"))._decode_metadata(
        table, torch.arange(len(lens)), torch.tensor(lens), max(lens)
    )
    layer = AttentionLayerSpec(0, heads, kv_heads, dim, dim**-0.5)
    q = torch.randn(len(lens), heads, dim, generator=g).to(dtype)
    out = _attend_one_token(q, _LayerKV(k_buf, v_buf, None), md, layer)
    assert out.dtype == dtype and out.shape == (len(lens), heads * dim)
    for b, n in enumerate(lens):  # each row alone, unfolded, in float64
        keys = table[b, :n].long()
        k = k_buf[keys].double().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)  # (H, n, D)
        v = v_buf[keys].double().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        p = torch.softmax((q[b].double()[:, None, :] @ k.transpose(1, 2)) * layer.scaling, -1)  # (H, 1, n)
        ref = (p @ v).reshape(-1)
        bound = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[b].double(), ref, rtol=0, atol=bound)
