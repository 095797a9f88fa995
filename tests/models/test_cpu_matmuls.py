"""Half-precision matmuls on the CPU at rounded row counts (models/cpu_matmul.py: cpu_matmul_rows, cpu_linear) and their
start-up warm-up (executor/warmup.warm_up_cpu_matmuls): the products are the unpadded ones, row for row."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.model_step import tiny_llama
from plait.runtime.executor.warmup import warm_up_cpu_matmuls
from plait.runtime.models.cpu_matmul import cpu_linear, cpu_matmul_rows, pack_cpu_linears
from plait.runtime.models.layers import skinny_linear
from torch import nn


def test_row_counts_round_up_by_at_most_an_eighth():
    assert [cpu_matmul_rows(m) for m in (1, 7, 16)] == [1, 7, 16]  # a decode step's rows as they are
    assert [cpu_matmul_rows(m) for m in (17, 18, 33, 65, 433, 1000, 4097)] == [18, 18, 36, 72, 448, 1024, 4608]
    for m in range(1, 5000):
        assert m <= cpu_matmul_rows(m) <= m + m / 8
    assert len({cpu_matmul_rows(m) for m in range(1, 8193)}) == 16 + 8 * 9  # the counts a server meets


def test_prefill_rows_run_as_they_are_and_gathered_weight_rows_stay_rounded(monkeypatch):
    """cpu_linear pads activation rows below EXACT_ROWS_FROM only (a prefill's copy would cost more than a new
    kernel's build); a weight's rows gathered per step (the LM head's at a grammar's tokens) are rounded at any
    count. The product is the unpadded one either way."""
    import plait.runtime.models.cpu_matmul as cm

    seen = []
    plain = F.linear
    monkeypatch.setattr(cm.F, "linear", lambda x, w, b=None: seen.append((x.shape[0], w.shape[0])) or plain(x, w, b))
    weight = torch.randn(600, 48).bfloat16()
    for m, n, padded in ((433, 40, (448, 40)), (600, 40, (600, 40)), (5, 600, (5, 640))):
        x = torch.randn(m, 48).bfloat16()
        seen.clear()
        y = cm.cpu_linear(x, weight[:n])
        assert seen == [padded] and y.shape == (m, n)
        torch.testing.assert_close(y, plain(x, weight[:n]), atol=0.05, rtol=0.02)
    x32 = torch.zeros(433, 8)
    assert cpu_matmul_rows(433, x32) == 433 and cpu_matmul_rows(433, x32.bfloat16()) == 448  # float32: MKL's


@pytest.mark.parametrize("rows,n", [(5, 64), (17, 64), (433, 40), (70, 11)])
def test_cpu_linear_is_the_unpadded_product(rows, n):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 48, generator=gen).bfloat16()
    w, b = torch.randn(n, 48, generator=gen).bfloat16(), torch.randn(n, generator=gen).bfloat16()
    y = cpu_linear(x, w, b)
    assert y.shape == (rows, n) and y.dtype == torch.bfloat16
    ref = x.double() @ w.double().T + b.double()
    torch.testing.assert_close(y.double(), ref, atol=0.05, rtol=0.02)  # bf16 out
    torch.testing.assert_close(y, torch.cat([F.linear(x[i : i + 1], w, b) for i in range(rows)]), atol=0.02, rtol=0)


def test_skinny_linear_pads_half_precision_rows_on_the_cpu():
    layer = nn.Linear(48, 40).bfloat16()
    x = torch.randn(21, 48).bfloat16()
    y = skinny_linear(x, layer, out_dtype=torch.float32)
    assert y.shape == (21, 40) and y.dtype == torch.float32
    torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias).float(), atol=0.02, rtol=0)
    out = torch.empty(21, 40, dtype=torch.float32)
    assert skinny_linear(x, layer, out_dtype=torch.float32, out=out) is out and torch.equal(out, y)


def test_warm_up_multiplies_each_half_precision_weight_shape(monkeypatch):
    calls = []
    real = F.linear
    monkeypatch.setattr(F, "linear", lambda x, w, b=None: calls.append((x.shape[0], tuple(w.shape))) or real(x, w, b))
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8), nn.Linear(8, 16), nn.Embedding(30, 8)).bfloat16()
    warm_up_cpu_matmuls(model, max_rows=20)
    rows = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 18, 20]
    assert sorted(calls) == sorted((r, s) for s in [(16, 8), (8, 16), (30, 8)] for r in rows)  # shapes once each
    calls.clear()
    warm_up_cpu_matmuls(nn.Linear(8, 16), max_rows=20)  # float32: MKL builds nothing per shape
    assert calls == []


def test_packed_weights_give_the_plain_product():
    """pack_cpu_linears: bf16 linears get oneDNN's reordered weight, which skinny_linear multiplies by (the same
    product as F.linear's, within bf16's rounding); float32 layers, quantized ones and embeddings keep theirs."""
    model = nn.Sequential(nn.Linear(48, 40), nn.Linear(40, 24, bias=False)).bfloat16()
    plain = nn.Linear(48, 40)
    assert pack_cpu_linears(nn.Sequential(model, plain, nn.Embedding(9, 4).bfloat16())) == 2
    assert not hasattr(plain, "cpu_packed_weight")
    for rows in (1, 7, 21, 433):
        x = torch.randn(rows, 48).bfloat16()
        for layer, inp in ((model[0], x), (model[1], F.linear(x, model[0].weight, model[0].bias))):
            y = skinny_linear(inp, layer)
            assert y.shape == (rows, layer.out_features)
            torch.testing.assert_close(y, F.linear(inp, layer.weight, layer.bias), atol=0.05, rtol=0.02)


def test_a_tied_lm_head_is_packed_and_gives_the_plain_logits():
    """A model whose LM head is its token embedding gets the embedding packed too (the other embeddings stay
    plain): the logits are the plain product's within bf16's rounding, the lookups unchanged."""
    model = tiny_llama(torch.bfloat16, tie=True).eval()
    assert model.head() is model.embed_tokens
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert pack_cpu_linears(model) == linears + 1 and hasattr(model.embed_tokens, "cpu_packed_weight")
    hidden = torch.randn(5, 64).bfloat16()
    with torch.no_grad():
        logits = model.compute_logits(hidden)
        ids = torch.tensor([0, 299, 17])
        torch.testing.assert_close(model.embed_tokens(ids), model.embed_tokens.weight[ids], rtol=0, atol=0)
    assert logits.dtype == torch.float32 and logits.shape == (5, 300)
    torch.testing.assert_close(logits, F.linear(hidden, model.embed_tokens.weight).float(), atol=0.05, rtol=0.02)


def test_no_packed_copies_past_the_memory_share():
    model = nn.Sequential(nn.Linear(48, 40)).bfloat16()
    assert pack_cpu_linears(model, memory_share=0.0) == 0 and not hasattr(model[0], "cpu_packed_weight")
