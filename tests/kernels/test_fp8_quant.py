"""An FP8 layer's activation quantization as one Triton kernel (runtime/kernels/fp8_quant.py) against the torch
ops it replaces (quant/fp8.quantize_rows' CPU path): per-row and static scales, rows longer than one block, an
all-zero row, clamping under a static scale. CPU interpreter at small sizes; on a GPU at the 8B shapes, where
the codes must be torch's exactly (the interpreter rounds some float32 -> FP8 conversions that carry into the
exponent to half the value and some others one step off: there at most 5% of codes may be off in those ways)."""

from __future__ import annotations

import importlib

import pytest
import torch
from plait.runtime.quant.fp8 import FP8_MAX, MIN_AMAX, quantize_rows

torch.set_num_threads(1)


def fq():
    return importlib.import_module("plait.runtime.kernels.fp8_quant")  # after conftest chose the interpreter


def _rows(m: int, k: int, device: str, dtype=torch.bfloat16) -> torch.Tensor:
    gen = torch.Generator().manual_seed(m * 1000 + k)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-2, 1, m)[:, None]  # rows of different ranges
    x[m // 2] = 0  # a padding row: a tiny scale, codes 0
    return x.to(dtype).to(device)


def _check(x: torch.Tensor, static: torch.Tensor | None, exact: bool, **variant) -> None:
    codes, scales = fq().quantize_rows_fp8(x, static, FP8_MAX, MIN_AMAX, **variant)
    ref_codes, ref_scales = quantize_rows(x.cpu(), None if static is None else static.cpu())
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == x.shape and scales.shape == (x.shape[0], 1)
    torch.testing.assert_close(scales.cpu(), ref_scales, rtol=0, atol=0)
    got, ref = codes.cpu().float(), ref_codes.float()
    if exact:
        assert torch.equal(got, ref)
    else:  # the interpreter rounds some conversions off by one step, and a carry into a power of two to half of it
        wrong = got != ref
        step = torch.maximum(ref.abs() / 8, torch.full_like(ref, 2**-9))
        assert torch.all(((got - ref).abs() <= step) | (2 * got == ref))
        assert wrong.float().mean() < 0.05


def _on_grid(m: int, k: int) -> torch.Tensor:
    """Rows whose scaled values are FP8 codes exactly (amax 448 times a power of two): no rounding at all."""
    gen = torch.Generator().manual_seed(k)
    grid = torch.randint(-126, 127, (m, k), dtype=torch.int8, generator=gen).view(torch.float8_e4m3fn).float()
    grid = grid.nan_to_num(0.0).clamp(-448, 448)
    grid[:, 0] = 448.0
    return (grid * 2.0 ** torch.arange(-4, m - 4)[:, None]).to(torch.bfloat16)


@pytest.mark.parametrize("m,k", [(5, 96), (3, 5000)])  # 5,000: two blocks of 4,096, the second ragged
def test_quantize_rows_kernel_matches_torch(m, k):
    _check(_on_grid(m, k), None, exact=True)
    x = _rows(m, k, "cpu")
    _check(x, None, exact=False)
    _check(x.float(), None, exact=False)
    _check(x, torch.tensor([0.01]), exact=False)  # static: large rows clamp to +-448


@pytest.mark.parametrize("mul_inverse", [False, True])
def test_quantize_rows_in_one_pass(mul_inverse):
    """The row read once (held whole) gives the two-pass kernel's scales and codes; codes from x * (1 / scale)
    too, on rows whose quotients are exact (on the grid), and within a code step elsewhere."""
    variant = dict(one_pass=True, mul_inverse=mul_inverse)
    _check(_on_grid(5, 5000), None, exact=True, **variant)
    _check(_rows(3, 5000, "cpu"), None, exact=False, **variant)
    _check(_rows(3, 96, "cpu"), torch.tensor([0.01]), exact=False, **variant)


def test_quantize_rows_kernel_refuses_a_strided_x():
    x = _rows(4, 64, "cpu")
    with pytest.raises(ValueError, match="unit stride"):
        fq().quantize_rows_fp8(x.t(), None, FP8_MAX, MIN_AMAX)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [4096, 14336])
def test_gpu_quantize_rows_is_torch_exactly(k):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    x = _rows(256, k, "cuda")
    _check(x, None, exact=True)
    _check(x, torch.tensor([0.01], device="cuda"), exact=True)
    _check(x, None, exact=True, one_pass=True)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [4096, 14336])
def test_gpu_quantize_rows_by_the_inverse_scale(k):
    """Codes from x * (1 / scale): the scales torch's, a code one step off only where the float32 quotient and
    product round across an FP8 rounding boundary (4.6e-4 of the codes at K=4096, one H100)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    x = _rows(256, k, "cuda")
    codes, scales = fq().quantize_rows_fp8(x, None, FP8_MAX, MIN_AMAX, one_pass=True, mul_inverse=True)
    ref_codes, ref_scales = quantize_rows(x.cpu())
    torch.testing.assert_close(scales.cpu(), ref_scales, rtol=0, atol=0)
    got, ref = codes.cpu().float(), ref_codes.float()
    assert torch.all((got - ref).abs() <= torch.maximum(ref.abs() / 8, torch.full_like(ref, 2**-9)))
    assert float((got != ref).float().mean()) < 2e-3


def test_scale_rows_cols_puts_both_scales_and_the_bias_back():
    """kernels/fp8_epilogue.py: y * row_scale * col_scale + bias in float32, into a new tensor of out_dtype or in
    place; mismatched scales refused by name."""
    from plait.runtime.kernels.fp8_epilogue import scale_rows_cols

    gen = torch.Generator().manual_seed(0)
    y = (torch.randn(3, 2100, generator=gen) * 300).to(torch.bfloat16)  # two column blocks
    rows, cols, bias = torch.rand(3, 1, generator=gen), torch.rand(2100, generator=gen), torch.randn(2100)
    ref = y.float() * rows * cols + bias.to(torch.bfloat16).float()
    got = scale_rows_cols(y, rows, cols, bias.to(torch.bfloat16), out_dtype=torch.float32)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-4)
    same = y.clone()
    assert scale_rows_cols(same, rows.view(3), cols, out=same) is same
    torch.testing.assert_close(same.float(), y.float() * rows * cols, rtol=1e-2, atol=0)
    with pytest.raises(ValueError, match="scales must be"):
        scale_rows_cols(y, rows, cols[:-1])
    with pytest.raises(ValueError, match="float32"):
        scale_rows_cols(y, rows.double(), cols)
