"""The tensor-core decode matmul (runtime/kernels/decode_gemm.py) against float64 matmul: unsplit and
split-K (the last-arriving program reduces), deterministic run to run, counters back to zero after
every launch. CPU interpreter at small sizes in float32 (the interpreter's dot does not take bf16), the
GPU at the real decode shapes in bf16."""

from __future__ import annotations

import importlib

import pytest
import torch
from plait.runtime.kernel_choices import KernelChoices, using

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
    ws = m.SplitKWorkspace()
    cfg = m.DecodeGemmConfig(block_n=64, block_k=block_k, split_k=split)
    y1 = m.decode_gemm(x, w, cfg, ws)
    y2 = m.decode_gemm(x, w, cfg, ws)
    assert y1.shape == (rows, n)
    assert rel_err(y1, x.double() @ w.double().T) < 1e-6
    assert torch.equal(y1, y2)  # the split-K reduction adds in a fixed order
    assert int(ws.counters.abs().sum()) == 0  # every tile's last program put its counter back


def test_decode_gemm_bias_and_default_config():
    m = dg()
    gen = torch.Generator().manual_seed(7)
    x, w, b = torch.randn(6, 4096, generator=gen), torch.randn(96, 4096, generator=gen), torch.randn(96, generator=gen)
    cfg = m.pick_decode_gemm_config(96, 4096, 6)
    assert cfg.split_k > 1  # 2 tiles of 64 rows: K is split so that more programs stream W
    ws = m.SplitKWorkspace()
    assert rel_err(m.decode_gemm(x, w, workspace=ws, bias=b), x.double() @ w.double().T + b.double()) < 1e-6
    unsplit = m.DecodeGemmConfig(block_n=64, block_k=256)
    assert rel_err(m.decode_gemm(x, w, unsplit, bias=b), x.double() @ w.double().T + b.double()) < 1e-6
    with pytest.raises(ValueError, match="bias"):
        m.decode_gemm(x, w, unsplit, bias=torch.randn(95))


def test_decode_gemm_output_buffer_and_bad_input():
    m = dg()
    x, w = torch.randn(5, 64), torch.randn(70, 64)
    out = torch.full((5, 70), float("nan"))
    cfg = m.DecodeGemmConfig(block_n=64, block_k=32, split_k=2)
    assert m.decode_gemm(x, w, cfg, m.SplitKWorkspace(), out=out) is out
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
@pytest.mark.parametrize("rows", [2, 16, 33, 64])
@pytest.mark.parametrize(
    "n,k", [(6144, 4096), (4096, 14336), (28672, 4096), (128256, 4096), (3072, 2048), (2048, 8192)]
)
def test_gpu_decode_gemm_bf16_real_shapes(rows, n, k):
    m = dg()
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    ws = m.SplitKWorkspace()
    for cfg in (None, m.DecodeGemmConfig(block_n=128, block_k=64, split_k=4)):  # the default, a forced split
        y = m.decode_gemm(x, w, cfg, ws)
        assert rel_err(y, x.double() @ w.double().T) < 1e-2
        assert torch.equal(y, m.decode_gemm(x, w, cfg, ws))
        assert int(ws.counters.abs().sum()) == 0


@pytest.mark.gpu
def test_gpu_model_linears_take_decode_gemm_for_a_few_rows(monkeypatch):
    from plait.runtime.models.layers import DECODE_GEMM_ROWS, share_split_k_workspace, skinny_linear

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4096, 6144, bias=True),
        torch.nn.Linear(14336, 4096, bias=False),
        torch.nn.Embedding(128256, 4096),
    ).to("cuda", torch.bfloat16)
    share_split_k_workspace(model)
    shared = model[0].split_k_workspace
    assert model[1].split_k_workspace is shared and model[2].split_k_workspace is shared
    for rows in (2, 9, DECODE_GEMM_ROWS, 64):
        for layer in model:
            x = torch.randn(rows, layer.weight.shape[1], device="cuda", dtype=torch.bfloat16)
            ref = x.double() @ layer.weight.double().T + (
                layer.bias.double() if getattr(layer, "bias", None) is not None else 0
            )
            y = skinny_linear(x, layer, out_dtype=torch.float32)
            assert y.dtype == torch.float32 and rel_err(y, ref) < 1e-2
            with using(KernelChoices(decode_gemm=False)):  # the matmul library: same values within rounding
                assert rel_err(skinny_linear(x, layer, out_dtype=torch.float32), ref) < 1e-2
    assert shared.counters is not None and int(shared.counters.abs().sum()) == 0  # the split-K path ran


def test_split_k_workspace_grows_without_freeing_what_earlier_launches_hold():
    # A CUDA graph captured before the workspace grew holds the old buffers' addresses: they must stay
    # allocated (and the old counters zero) after the growth.
    m = dg()
    ws = m.SplitKWorkspace()
    x, w = torch.randn(4, 256), torch.randn(96, 256)
    cfg = m.DecodeGemmConfig(block_n=64, block_k=32, split_k=2)
    m.decode_gemm(x, w, cfg, ws)
    old_partials, old_counters = ws.partials, ws.counters
    big = m.decode_gemm(
        torch.randn(40, 256), torch.randn(300, 256), m.DecodeGemmConfig(block_n=64, block_k=32, split_k=4), ws
    )
    assert ws.partials.numel() > old_partials.numel() and ws.counters.numel() > old_counters.numel()
    assert any(t is old_partials for t in ws._outgrown) and any(t is old_counters for t in ws._outgrown)
    assert int(old_counters.abs().sum()) == 0 and big.shape == (40, 300)


@pytest.mark.gpu
def test_gpu_graph_captured_before_the_workspace_grew_still_replays_right():
    # Graphs up to 8 rows, then an eager step of 20 rows grows the shared workspace: replaying the
    # 8-row graph afterwards must still find its own (zeroed) counters and scratch.
    from plait.runtime.models.layers import share_split_k_workspace, skinny_linear

    torch.manual_seed(0)
    down = torch.nn.Linear(14336, 4096, bias=False).to("cuda", torch.bfloat16)  # split-K at <= 32 rows
    share_split_k_workspace(down)
    x8 = torch.randn(8, 14336, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        skinny_linear(x8, down)  # warm-up outside the capture, as the engine's graph runner does
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y8 = skinny_linear(x8, down)
    before = down.split_k_workspace.partials
    x20 = torch.randn(20, 14336, device="cuda", dtype=torch.bfloat16)
    y20 = skinny_linear(x20, down)  # eager, 32-row tiles: more partial sums than the 8-row graph needed
    assert down.split_k_workspace.partials is not before
    assert rel_err(y20, x20.double() @ down.weight.double().T) < 1e-2
    for _ in range(3):
        x8.copy_(torch.randn_like(x8))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(y8, x8.double() @ down.weight.double().T) < 1e-2
