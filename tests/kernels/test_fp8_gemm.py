"""The FP8-weight decode matmul (runtime/kernels/fp8_gemm.py) against float64 over the dequantized weights:
unsplit and split-K, bias, `out`, deterministic, counters back to zero. CPU interpreter at small sizes
(its dot in float32: see the kernel's DOT_F32), the GPU at Llama-3.1-8B shapes in bf16, an FP8 layer's
dispatch by rows (quant/fp8_rows.py) and a CUDA graph of it."""

from __future__ import annotations

import importlib

import pytest
import torch
from plait.runtime.quant.fp8 import Fp8Linear, quantize_per_channel

torch.set_num_threads(1)


def fg():
    return importlib.import_module("plait.runtime.kernels.fp8_gemm")  # after conftest chose the interpreter


def _operands(rows, n, k, device="cpu", dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    codes, scales = quantize_per_channel(torch.randn(n, k, generator=gen) * 0.02)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    ref = x.double() @ (codes.double() * scales.double()[:, None]).T  # (rows, n)
    return x.to(device), codes.to(device), scales.to(device), bias.to(device), ref.to(device)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("rows", [1, 9, 40])
@pytest.mark.parametrize("n,k,block_k,split", [(70, 96, 32, 1), (130, 512, 64, 3)])
def test_fp8_gemm_matches_float64(rows, n, k, block_k, split):
    m = fg()
    from plait.runtime.kernels.decode_gemm import SplitKWorkspace

    x, codes, scales, bias, ref = _operands(rows, n, k, seed=rows * 100 + n)
    ws = SplitKWorkspace()
    cfg = m.DecodeGemmConfig(block_n=64, block_k=block_k, split_k=split)
    y1 = m.fp8_gemm(x, codes, scales, config=cfg, workspace=ws)
    y2 = m.fp8_gemm(x, codes, scales, config=cfg, workspace=ws)
    assert y1.shape == (rows, n) and y1.dtype == torch.bfloat16
    assert rel_err(y1, ref) < 1e-2  # bf16 output rounding
    assert torch.equal(y1, y2)  # the split-K reduction adds in a fixed order
    assert int(ws.counters.abs().sum()) == 0
    out = torch.empty(rows, n, dtype=torch.float32)
    got = m.fp8_gemm(x, codes, scales, bias=bias, config=cfg, workspace=ws, out=out)
    assert got is out and rel_err(out, ref + bias.double()) < 1e-5


def test_fp8_gemm_refuses_wrong_operands():
    m = fg()
    x, codes, scales, _, _ = _operands(2, 64, 64)
    with pytest.raises(ValueError, match="float8_e4m3fn weights"):
        m.fp8_gemm(x, codes.float(), scales)
    with pytest.raises(ValueError, match="weight_scale must be float32"):
        m.fp8_gemm(x, codes, scales[:10])
    with pytest.raises(ValueError, match="handles 1..256 rows"):
        m.fp8_gemm(torch.zeros(257, 64, dtype=torch.bfloat16), codes, scales)
    with pytest.raises(ValueError, match="x_scale exactly when x holds float8_e4m3fn"):
        m.fp8_gemm(x, codes, scales, x_scale=torch.ones(2, 1))
    with pytest.raises(ValueError, match="x_scale exactly when x holds float8_e4m3fn"):
        m.fp8_gemm(x.to(torch.float8_e4m3fn), codes, scales)


@pytest.mark.parametrize("rows", [3, 80])
def test_fp8_gemm_with_fp8_rows_matches_float64(rows):
    """x as FP8 codes with a scale per row (what `quantize_rows` gives): both scales applied once, at the end,
    to sums of the codes' exact products; the reference is the product of the two dequantized operands."""
    m = fg()
    from plait.runtime.kernels.decode_gemm import SplitKWorkspace
    from plait.runtime.quant.fp8 import quantize_rows

    x, codes, scales, bias, _ = _operands(rows, 130, 512, seed=rows)
    x_codes, x_scales = quantize_rows(x.float())
    ref = (x_codes.double() * x_scales.double()) @ (codes.double() * scales.double()[:, None]).T
    ws = SplitKWorkspace()
    for split in (1, 2):
        cfg = m.DecodeGemmConfig(block_n=64, block_k=64, split_k=split)
        y = m.fp8_gemm(x_codes, codes, scales, config=cfg, workspace=ws, x_scale=x_scales)
        assert y.shape == (rows, 130) and y.dtype == torch.bfloat16
        assert rel_err(y, ref) < 1e-2, split
        out = torch.empty(rows, 130, dtype=torch.float32)
        m.fp8_gemm(x_codes, codes, scales, bias=bias, config=cfg, workspace=ws, x_scale=x_scales, out=out)
        assert rel_err(out, ref + bias.double()) < 1e-5, split
    assert int(ws.counters.abs().sum()) == 0


@pytest.mark.parametrize("rows", [1, 3])
def test_gemv_with_fp8_weights_matches_float64(rows):
    """The skinny matmul reading FP8 codes (half the bytes) with their row scales, against float64."""
    from plait.runtime.kernels.gemv import GemvConfig, gemv

    x, codes, scales, bias, ref = _operands(rows, 70, 96, seed=7 + rows)
    x = x.float()
    ref = x.double() @ (codes.double() * scales.double()[:, None]).T
    for cfg in (None, GemvConfig(block_n=16, block_k=32)):
        y = gemv(x, codes, bias=bias.float(), config=cfg, weight_scale=scales)
        assert rel_err(y, ref + bias.double()) < 1e-5, cfg
    with pytest.raises(ValueError, match="expects float8_e4m3fn weights"):
        gemv(x, codes.float(), weight_scale=scales)
    with pytest.raises(ValueError, match="weight_scale must be float32"):
        gemv(x, codes, weight_scale=scales[:5])


LLAMA_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate_up, down: (N, K)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 32, 64, 128, 256])
@pytest.mark.parametrize("n,k", LLAMA_8B)
def test_gpu_fp8_gemm_real_shapes(rows, n, k):
    """bf16 rows at the picked tiles and a forced split; from 16 rows FP8 rows too (both operands on the FP8 tensor
    cores); at one row the FP8-reading skinny matmul."""
    m = fg()
    from plait.runtime.kernels.decode_gemm import SplitKWorkspace
    from plait.runtime.kernels.gemv import gemv
    from plait.runtime.quant.fp8 import quantize_rows

    x, codes, scales, bias, ref = _operands(rows, n, k, device="cuda")
    ws = SplitKWorkspace()
    # the default, and a forced split (2 stages above 64 rows: 4 stages of 256-row bf16 x tiles overflow shared memory)
    forced = m.DecodeGemmConfig(block_n=128, block_k=128, split_k=4, num_stages=4 if rows <= 64 else 2)
    for cfg in (None, forced):
        y = m.fp8_gemm(x, codes, scales, config=cfg, workspace=ws)
        assert rel_err(y, ref) < 1e-2, cfg
        assert int(ws.counters.abs().sum()) == 0
    if rows >= 16:
        x_codes, x_scales = quantize_rows(x)
        ref8 = (x_codes.double() * x_scales.double()) @ (codes.double() * scales.double()[:, None]).T
        y = m.fp8_gemm(x_codes, codes, scales, workspace=ws, x_scale=x_scales)
        assert y.dtype == torch.bfloat16 and rel_err(y, ref8) < 1e-2
    if rows == 1:
        assert rel_err(gemv(x, codes, weight_scale=scales), ref) < 1e-2


@pytest.mark.gpu
def test_gpu_fp8_layer_dispatch_and_graph_capture(monkeypatch):
    from plait.runtime.models.layers import share_split_k_workspace, skinny_linear
    from plait.runtime.quant import fp8_rows
    from plait.runtime.quant.fp8_rows import FP8_DECODE_ROWS

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        Fp8Linear.from_float(torch.randn(14336 // 2, 4096, device="cuda") * 0.02, None, torch.bfloat16)
    )
    share_split_k_workspace(model)
    layer = model[0]
    for rows in (1, 2, 8, 16, 64, 65, 128, FP8_DECODE_ROWS, FP8_DECODE_ROWS + 1, 300):  # each path by rows
        x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
        ref = x.double() @ layer.dequantized().double().T
        y = skinny_linear(x, layer)
        assert y.dtype == torch.bfloat16 and rel_err(y, ref) < 0.05, rows  # _scaled_mm quantizes x too
    monkeypatch.setattr(fp8_rows, "FP8_UNIT_SCALED_FROM", 2)  # cuBLASLt at unit scales from 2 to 256 rows
    for rows in (2, 16, 64, 256):
        x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
        ref = x.double() @ layer.dequantized().double().T
        assert fp8_rows.fp8_path(rows) == "unit_scaled" and rel_err(skinny_linear(x, layer), ref) < 0.05, rows
    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    eager = skinny_linear(x, layer)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        skinny_linear(x, layer)  # warm-up (compile) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = skinny_linear(x, layer)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


@pytest.mark.parametrize("rows,path", [(1, "gemv"), (5, "unit_scaled"), (12, "decode"), (40, "decode_fp8_rows"),
                                       (70, "rowwise")])  # fmt: skip
def test_fp8_layer_routes_by_rows(rows, path, monkeypatch):
    """quant/fp8_rows' routing, each row count through the path its bounds name (the interpreter runs the kernels,
    torch's CPU `_scaled_mm` the FP8 products): every path near the product of the dequantized weight, in x's
    dtype, and into `out` when given."""
    fg()
    from plait.runtime.kernels.decode_gemm import SplitKWorkspace
    from plait.runtime.quant import fp8_rows

    bounds = dict(FP8_GEMV_ROWS=1, FP8_UNIT_SCALED_FROM=4, FP8_UNIT_SCALED_TO=8, FP8_DECODE_ROWS=64)
    for name, value in dict(bounds, FP8_ROWS_QUANTIZED_FROM=32).items():
        monkeypatch.setattr(fp8_rows, name, value)
    assert fp8_rows.fp8_path(rows) == path and fp8_rows.fp8_path(rows, decode_kernels=False) == "rowwise"
    torch.manual_seed(rows)
    layer = Fp8Linear.from_float(torch.randn(64, 96) * 0.02, torch.randn(64) * 0.1, torch.bfloat16)
    x = torch.randn(rows, 96).to(torch.bfloat16)
    ref = x.double() @ layer.dequantized().double().T + layer.bias.double()
    y = fp8_rows.fp8_linear_by_rows(x, layer, None, None, SplitKWorkspace())
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 64)
    assert rel_err(y, ref) < (1e-2 if path in ("gemv", "decode") else 0.05)  # the other paths quantize x too
    out = torch.empty(rows, 64, dtype=torch.float32)
    assert fp8_rows.fp8_linear_by_rows(x, layer, None, out, SplitKWorkspace()) is out and rel_err(out, ref) < 0.05


def test_fp8_rows_bounds_from_text(monkeypatch):
    from plait.runtime.quant import fp8_rows

    for name in ("FP8_GEMV_ROWS", "FP8_UNIT_SCALED_FROM", "FP8_UNIT_SCALED_TO", "FP8_DECODE_ROWS"):
        monkeypatch.setattr(fp8_rows, name, getattr(fp8_rows, name))
    fp8_rows.set_fp8_rows("gemv=2, unit_scaled_from=3,unit_scaled_to=200,decode=16")
    assert [fp8_rows.fp8_path(r) for r in (2, 3, 200, 201)] == ["gemv", "unit_scaled", "unit_scaled", "rowwise"]
    for bad in ("gemv=one", "rows=4", "decode=512", "gemv=9", "fused_row=16"):
        with pytest.raises(ValueError, match="PLAIT_FP8_ROWS"):
            fp8_rows.set_fp8_rows(bad)
