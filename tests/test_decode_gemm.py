"""The tensor-core decode matmul (runtime/kernels/decode_gemm.py) against float64 matmul: unsplit and
split-K (the last-arriving program reduces), deterministic run to run, counters back to zero after
every launch. CPU interpreter at small sizes in float32 (the interpreter's dot does not take bf16), the
GPU at the real decode shapes in bf16."""

from __future__ import annotations

import importlib

import pytest
import torch

torch.set_num_threads(1)


def dg():
    return importlib.import_module("plait.runtime.kernels.decode_gemm")  # after conftest chose the interpreter


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("rows", [1, 9, 40])
@pytest.mark.parametrize("n,k,block_k,split", [(70, 96, 32, 1), (130, 512, 64, 3), (64, 300, 32, 8)])
def test_decode_gemm_matches_float64(rows, n, k, block_k, split):
    m = dg()
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
    ws = m.SplitKWorkspace(torch.device("cpu"))
    cfg = m.DecodeGemmConfig(block_n=64, block_k=block_k, split_k=split)
    y1 = m.decode_gemm(x, w, cfg, ws)
    y2 = m.decode_gemm(x, w, cfg, ws)
    assert y1.shape == (rows, n)
    assert rel_err(y1, x.double() @ w.double().T) < 1e-6
    assert torch.equal(y1, y2)  # the split-K reduction adds in a fixed order
    assert int(ws.counters.abs().sum()) == 0  # every tile's last program put its counter back


def test_decode_gemm_output_buffer_and_bad_input():
    m = dg()
    x, w = torch.randn(5, 64), torch.randn(70, 64)
    out = torch.full((5, 70), float("nan"))
    cfg = m.DecodeGemmConfig(block_n=64, block_k=32, split_k=2)
    assert m.decode_gemm(x, w, cfg, m.SplitKWorkspace(torch.device("cpu")), out=out) is out
    assert rel_err(out, x.double() @ w.double().T) < 1e-6
    with pytest.raises(ValueError, match="SplitKWorkspace"):
        m.decode_gemm(x, w, cfg)
    with pytest.raises(ValueError, match="rows"):
        m.decode_gemm(torch.randn(m.MAX_ROWS + 1, 64), w, m.DecodeGemmConfig(block_n=64, block_k=32))
    with pytest.raises(ValueError, match="weight"):
        m.decode_gemm(torch.randn(2, 32), w, m.DecodeGemmConfig(block_n=64, block_k=32))
    with pytest.raises(ValueError, match="unit stride"):
        m.decode_gemm(torch.randn(64, 2).t(), w, m.DecodeGemmConfig(block_n=64, block_k=32))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [16, 64, 100])
@pytest.mark.parametrize("n,k,split", [(6144, 4096, 4), (4096, 14336, 8), (28672, 4096, 1), (128256, 4096, 1)])
def test_gpu_decode_gemm_bf16_real_shapes(rows, n, k, split):
    m = dg()
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    ws = m.SplitKWorkspace(x.device)
    cfg = m.DecodeGemmConfig(block_n=128, block_k=128, split_k=split)
    y = m.decode_gemm(x, w, cfg, ws)
    assert rel_err(y, x.double() @ w.double().T) < 1e-2
    assert torch.equal(y, m.decode_gemm(x, w, cfg, ws))
    assert int(ws.counters.abs().sum()) == 0
