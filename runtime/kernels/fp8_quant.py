"""Activations to FP8 in one pass: x (M, K) bf16/fp16 -> codes (M, K) float8_e4m3fn and scales (M, 1) float32,
one scale per row (amax / 448, dynamic per token) or a checkpoint's static per-tensor scale for every row.

An FP8 layer above the decode rows quantizes its input before `torch._scaled_mm`. Written as torch ops that
is seven kernels over a float32 copy of x (widen, abs, amax, clamp, two divides, narrow), which on the 8B
shape cost more than FP8's matmul saves (benchmarks/RESULTS.md, issue 38). Here one program per row reads
the row twice (its max, then its codes: the second read hits L2) and writes one byte per element.

The codes are torch's (quant/fp8.quantize_rows, which calls this on a GPU and passes its constants): the row
divided by its scale, clamped to +-max_code, rounded to nearest even.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .launch import check_device, next_power_of_2

MAX_BLOCK = 4096  # elements a program holds at a time; longer rows loop


# NOTE: IEEE divisions (div_rn), as torch's: Triton's `/` on float32 is approximate (scales 1 ulp off). These two
# are the whole arithmetic of a row's quantization, shared with the kernels that quantize their own output
# (fp8_activations.py), so that they give these codes bit for bit.
@triton.jit
def row_scale(amax, MIN_AMAX: tl.constexpr, MAX_CODE: tl.constexpr):
    """A row's scale from its largest magnitude: max(amax, MIN_AMAX) / MAX_CODE."""
    return tl.div_rn(tl.maximum(amax, MIN_AMAX), MAX_CODE)


@triton.jit
def scaled_codes(x, scale, MAX_CODE: tl.constexpr):
    """float32 values divided by their scale and clamped to +-MAX_CODE (the cast to FP8 rounds them)."""
    return tl.clamp(tl.div_rn(x, scale), -MAX_CODE, MAX_CODE)


@triton.jit(do_not_specialize=["K"])
def _quantize_rows_kernel(
    X,
    Codes,
    Scales,
    StaticScale,
    K,
    stride_x,
    stride_c,
    STATIC: tl.constexpr,
    MAX_CODE: tl.constexpr,
    MIN_AMAX: tl.constexpr,
    BLOCK: tl.constexpr,
    ONE_PASS: tl.constexpr,
    MUL_INVERSE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    c_row = Codes + row * stride_c
    if ONE_PASS:  # the whole row in one tile (BLOCK >= K): read once
        offs = tl.arange(0, BLOCK)
        mask = offs < K
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        if STATIC:
            scale = tl.load(StaticScale)
        else:
            scale = row_scale(tl.max(tl.abs(x), axis=0), MIN_AMAX, MAX_CODE)
        tl.store(Scales + row, scale)
        if MUL_INVERSE:
            q = tl.clamp(x * tl.div_rn(1.0, scale), -MAX_CODE, MAX_CODE)
        else:
            q = scaled_codes(x, scale, MAX_CODE)
        tl.store(c_row + offs, q.to(Codes.dtype.element_ty), mask=mask)
        return
    if STATIC:
        scale = tl.load(StaticScale)
    else:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = row_scale(tl.max(amax, axis=0), MIN_AMAX, MAX_CODE)
    tl.store(Scales + row, scale)
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        mask = offs < K
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        q = scaled_codes(x, scale, MAX_CODE)
        tl.store(c_row + offs, q.to(Codes.dtype.element_ty), mask=mask)


def quantize_rows_fp8(
    x: torch.Tensor,
    static_scale: Optional[torch.Tensor],
    max_code: float,
    min_amax: float,
    one_pass: bool = False,
    mul_inverse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) bf16/fp16/float32 with unit stride on K -> (codes (M, K) float8_e4m3fn, scales (M, 1) float32).
    static_scale: a (1,) float32 scale for every row (a checkpoint's calibrated input scale); None: per row,
    max(amax, min_amax) / max_code. No host sync (runs inside CUDA graphs). one_pass (rows up to 16,384): the row
    read once, held whole; mul_inverse: codes from x * (1 / scale) instead of x / scale (the two differ where
    the float32 quotient rounds across an FP8 rounding boundary). Both off: the kernel measured so far."""
    check_device("quantize_rows_fp8", x, static_scale)
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"quantize_rows_fp8 expects a 2-D x with unit stride on K, got {tuple(x.shape)}")
    m, k = x.shape
    codes = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return codes, scales
    one_pass = one_pass and k <= 4 * MAX_BLOCK
    block = next_power_of_2(k) if one_pass else min(MAX_BLOCK, next_power_of_2(k))
    _quantize_rows_kernel[(m,)](
        x,
        codes,
        scales,
        static_scale if static_scale is not None else scales,
        k,
        x.stride(0),
        codes.stride(0),
        STATIC=static_scale is not None,
        MAX_CODE=max_code,
        MIN_AMAX=min_amax,
        BLOCK=block,
        ONE_PASS=one_pass,
        MUL_INVERSE=mul_inverse,
        num_warps=4 if block <= 1024 else (8 if block <= 4096 else 16),
    )
    return codes, scales
