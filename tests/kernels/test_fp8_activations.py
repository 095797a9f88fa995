"""The FP8 layer's input in one launch (runtime/kernels/fp8_activations.py): RMSNorm (+ residual) and
SiLU-and-mul quantized to FP8 per row, against the two launches they replace (rmsnorm.py / activation.py,
then fp8_quant.quantize_rows_fp8). The fused kernels must give the composition's codes and scales bit for
bit, and the residual fused_add_rmsnorm's. On the CPU both sides run in Triton's interpreter, whose own
roundings (bf16 by truncation, some FP8 conversions a step off) are then the same on both sides, so equality
is exact there too; on a GPU at the 8B widths, the compiled kernels."""

from __future__ import annotations

import importlib

import pytest
import torch
from plait.runtime.quant.fp8 import FP8_MAX, MIN_AMAX

torch.set_num_threads(1)

DTYPES = [torch.bfloat16, torch.float16]


def fa():
    return importlib.import_module("plait.runtime.kernels.fp8_activations")  # after conftest chose the interpreter


def _kernels():
    from plait.runtime import kernels

    return kernels


def _quantize(x: torch.Tensor, static: torch.Tensor | None):
    return importlib.import_module("plait.runtime.kernels.fp8_quant").quantize_rows_fp8(x, static, FP8_MAX, MIN_AMAX)


def _assert_same(got: tuple[torch.Tensor, torch.Tensor], ref: tuple[torch.Tensor, torch.Tensor]) -> None:
    codes, scales = got
    ref_codes, ref_scales = ref
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == ref_codes.shape
    assert scales.dtype == torch.float32 and scales.shape == ref_scales.shape
    assert torch.equal(scales.view(torch.int32), ref_scales.view(torch.int32))
    mismatched = (codes.view(torch.uint8) != ref_codes.view(torch.uint8)).sum().item()
    assert mismatched == 0, f"{mismatched} of {codes.numel()} codes differ"


def _rows(m: int, k: int, dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 7919 + m * 1000 + k)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-2, 1, m)[:, None]  # rows of different ranges
    x[m // 2] = 0  # a padding row: the min_amax scale, codes 0
    return x.to(dtype).to(device)


def _norm_case(m: int, d: int, dtype: torch.dtype, residual: bool, device: str = "cpu", w_dtype=None):
    x = _rows(m, d, dtype, device, seed=1)
    gen = torch.Generator().manual_seed(d)
    w = (1 + 0.5 * torch.randn(d, generator=gen)).to(w_dtype or dtype).to(device)
    res = _rows(m, d, dtype, device, seed=2) if residual else None
    return x, w, res


def _check_norm(x, w, res, static, eps=1e-6) -> None:
    k = _kernels()
    if res is None:
        ref = _quantize(k.rmsnorm(x, w, eps), static)
        got = k.rmsnorm_fp8(x, w, eps, static_scale=static)
    else:
        ref_res = res.clone()
        ref = _quantize(k.fused_add_rmsnorm(x, ref_res, w, eps)[0], static)
        got = k.rmsnorm_fp8(x, w, eps, residual=res, static_scale=static)
        assert torch.equal(res.view(torch.int16), ref_res.view(torch.int16))
    _assert_same(got, ref)


def _check_silu(gate_up, static) -> None:
    k = _kernels()
    _assert_same(k.silu_and_mul_fp8(gate_up, static_scale=static), _quantize(k.silu_and_mul(gate_up), static))


# ---------------------------------------------------------------- interpreter


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,d", [(1, 64), (3, 200), (17, 64), (17, 200)])
@pytest.mark.parametrize("residual", [False, True])
def test_rmsnorm_fp8_is_the_composition(dtype, m, d, residual):
    x, w, res = _norm_case(m, d, dtype, residual)
    _check_norm(x, w, res, None)
    if res is not None:
        res = _rows(m, d, dtype, "cpu", seed=2)  # the first check added x into it
    _check_norm(x, w, res, torch.tensor([0.005]))  # static: the wide rows clamp to +-448


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.float16])
def test_rmsnorm_fp8_with_a_wider_or_other_weight(w_dtype):
    """A float32 weight (or bf16 x with an fp16 one) makes rmsnorm's output float32: not rounded to x's dtype."""
    x, w, res = _norm_case(5, 96, torch.bfloat16, True, w_dtype=w_dtype)
    _check_norm(x, w, res, None)


def test_rmsnorm_fp8_on_row_views():
    """x and the residual as row-strided views (unit stride on D), like a slice of a wider buffer."""
    x = _rows(6, 160, torch.bfloat16, "cpu", seed=3)[:, :128]
    res = _rows(6, 192, torch.bfloat16, "cpu", seed=4)[:, 64:]
    w = torch.ones(128, dtype=torch.bfloat16)
    _check_norm(x, w, res, None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,inter", [(1, 96), (3, 300), (17, 96)])
def test_silu_and_mul_fp8_is_the_composition(dtype, t, inter):
    gate_up = _rows(t, 2 * inter, dtype, "cpu", seed=5) * 2
    _check_silu(gate_up, None)
    _check_silu(gate_up, torch.tensor([0.002]))


def test_silu_and_mul_fp8_loops_over_chunks(monkeypatch):
    """Rows longer than a chunk: 2,100 takes two of the real 2,048 (the second ragged); 300 five of 64."""
    gate_up = _rows(3, 2 * 2100, torch.bfloat16, "cpu", seed=6) * 2
    _check_silu(gate_up, None)
    _check_silu(gate_up, torch.tensor([0.002]))
    monkeypatch.setattr(fa(), "SILU_BLOCK", 64)
    gate_up = _rows(4, 2 * 300, torch.float16, "cpu", seed=7) * 2
    _check_silu(gate_up, None)
    _check_silu(gate_up, torch.tensor([0.002]))


def test_no_rows():
    codes, scales = _kernels().rmsnorm_fp8(torch.empty(0, 64, dtype=torch.bfloat16), torch.ones(64), 1e-6)
    assert codes.shape == (0, 64) and scales.shape == (0, 1)
    codes, scales = _kernels().silu_and_mul_fp8(torch.empty(0, 64, dtype=torch.bfloat16))
    assert codes.shape == (0, 32) and scales.shape == (0, 1)


def test_bad_input_names_the_problem():
    k = _kernels()
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    w = torch.ones(64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"weight must be \(64,\)"):
        k.rmsnorm_fp8(x, torch.ones(32, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(ValueError, match="unit stride on D"):
        k.rmsnorm_fp8(torch.randn(64, 4, dtype=torch.bfloat16).t(), w, 1e-6)
    with pytest.raises(ValueError, match=r"shape \(M, D\)"):
        k.rmsnorm_fp8(x.view(2, 2, 64), w, 1e-6)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        k.rmsnorm_fp8(x.float(), w, 1e-6)
    with pytest.raises(ValueError, match="residual must match x"):
        k.rmsnorm_fp8(x, w, 1e-6, residual=torch.zeros(4, 64))
    with pytest.raises(ValueError, match="residual must have unit stride"):
        k.rmsnorm_fp8(x, w, 1e-6, residual=torch.zeros(64, 4, dtype=torch.bfloat16).t())
    with pytest.raises(ValueError, match=r"static_scale must be a \(1,\) float32"):
        k.rmsnorm_fp8(x, w, 1e-6, static_scale=torch.tensor(0.01))
    gate_up = torch.randn(4, 96, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="even last dim"):
        k.silu_and_mul_fp8(gate_up[:, :95])
    with pytest.raises(ValueError, match=r"\(T, 2I\)"):
        k.silu_and_mul_fp8(gate_up.view(2, 2, 96))
    with pytest.raises(ValueError, match="unit stride"):
        k.silu_and_mul_fp8(torch.randn(96, 4, dtype=torch.bfloat16).t())
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        k.silu_and_mul_fp8(gate_up.float())
    with pytest.raises(ValueError, match=r"static_scale must be a \(1,\) float32"):
        k.silu_and_mul_fp8(gate_up, static_scale=torch.tensor([0.01], dtype=torch.float64))


# ---------------------------------------------------------------- GPU, the 8B widths

gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("rows", [1, 64, 256])
@pytest.mark.parametrize("hidden", [4096, 2048])  # 2,048 (1B/3B): rmsnorm groups two rows a program
def test_gpu_rmsnorm_fp8_is_the_composition_exactly(rows, hidden):
    for residual in (False, True):
        x, w, res = _norm_case(rows, hidden, torch.bfloat16, residual, device="cuda")
        x = x * 4  # beside the row ranges, values beyond bf16's small ones
        _check_norm(x, w, res, None, eps=1e-5)
        if res is not None:
            res = _rows(rows, hidden, torch.bfloat16, "cuda", seed=2)
        _check_norm(x, w, res, torch.tensor([0.005], device="cuda"), eps=1e-5)


@gpu
@pytest.mark.parametrize("rows", [1, 64, 256])
def test_gpu_silu_and_mul_fp8_is_the_composition_exactly(rows):
    gate_up = _rows(rows, 2 * 14336, torch.bfloat16, "cuda", seed=8) * 4
    _check_silu(gate_up, None)
    _check_silu(gate_up, torch.tensor([0.002], device="cuda"))


@gpu
def test_gpu_fp8_activations_capture_in_cuda_graph():
    # Capturing fails on a host sync; replaying with new inputs proves nothing was baked in.
    k = _kernels()
    x, residual = (torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    gate_up = torch.randn(8, 2 * 14336, device="cuda", dtype=torch.bfloat16)

    def step():
        return k.rmsnorm_fp8(x, w, 1e-5, residual=residual), k.silu_and_mul_fp8(gate_up)

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        norm_out, silu_out = step()
    for seed in (1, 2):
        torch.manual_seed(seed)
        x.normal_(), residual.normal_(), gate_up.normal_()
        expect_res = residual.clone()
        expect_norm = _quantize(k.fused_add_rmsnorm(x, expect_res, w, 1e-5)[0], None)
        expect_silu = _quantize(k.silu_and_mul(gate_up), None)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(residual, expect_res)
        _assert_same(norm_out, expect_norm)
        _assert_same(silu_out, expect_silu)
