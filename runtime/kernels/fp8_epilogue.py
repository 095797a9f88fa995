"""The scales an FP8 matmul run with unit scales leaves to apply: y (M, N) -> y * row_scale[m] * col_scale[n]
(+ bias[n]), in one pass over y.

Why the matmul leaves them: cuBLASLt's FP8 matmul (`torch._scaled_mm` with one float32 scale per operand) is the
fastest FP8 matmul on Hopper at a decode step's 16-256 rows, ~1.2-1.6x the rowwise-scaled kernel torch picks for
a scale per token and per channel (benchmarks/RESULTS.md, issue 38). plait's FP8 layers keep a scale per output
channel and their activations one per token, so the product is taken with unit scales and this kernel puts both
back: a decode step's output is a few hundred KB, one read and one write. The matmul's result is rounded to
bf16 before the scales are applied, half an ulp of bf16 beside FP8's own error.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .launch import check_device, next_power_of_2, pdl_launch_args, pdl_wait_then_release

MAX_BLOCK = 2048  # output columns a program takes


@triton.jit(do_not_specialize=["n"])
def _scale_rows_cols_kernel(
    Y,
    RowScale,
    ColScale,
    Bias,
    Out,
    n,
    stride_y,
    stride_o,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_wait_then_release(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    y = tl.load(Y + row * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
    scaled = y * tl.load(RowScale + row) * tl.load(ColScale + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        scaled += tl.load(Bias + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + cols, scaled.to(Out.dtype.element_ty), mask=mask)


def scale_rows_cols(
    y: torch.Tensor,
    row_scale: torch.Tensor,
    col_scale: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """y (M, N) (unit stride on N) times row_scale (M, 1) or (M,) float32 and col_scale (N,) float32, plus bias
    (N,), computed in float32 and written to `out` (M, N) (y itself is fine: in place), else to a new tensor of
    `out_dtype` (default y's). No host sync (runs inside CUDA graphs)."""
    check_device("scale_rows_cols", y, row_scale, col_scale, bias, out)
    if y.dim() != 2 or y.stride(1) != 1:
        raise ValueError(f"scale_rows_cols expects a 2-D y with unit stride on N, got {tuple(y.shape)}")
    m, n = y.shape
    if row_scale.numel() != m or col_scale.shape != (n,):
        raise ValueError(
            f"scales must be ({m}, 1) or ({m},) and ({n},) for y of {(m, n)}; "
            f"got {tuple(row_scale.shape)} and {tuple(col_scale.shape)}"
        )
    if row_scale.dtype != torch.float32 or col_scale.dtype != torch.float32:
        raise ValueError(f"scales must be float32, got {row_scale.dtype} and {col_scale.dtype}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be ({n},), got {tuple(bias.shape)}")
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype or y.dtype, device=y.device)
    elif out.shape != (m, n) or out.stride(1) != 1:
        raise ValueError(f"out must be ({m}, {n}) with unit stride on N, got {tuple(out.shape)}")
    if m == 0 or n == 0:
        return out
    block = min(MAX_BLOCK, next_power_of_2(n))
    _scale_rows_cols_kernel[(m, triton.cdiv(n, block))](
        y,
        row_scale.contiguous(),
        col_scale.contiguous(),
        bias if bias is not None else col_scale,
        out,
        n,
        y.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK=block,
        num_warps=4 if block <= 1024 else 8,
        **pdl_launch_args(y.device),
    )
    return out
