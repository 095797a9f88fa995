"""An FP8 linear layer's input made in the launch that makes the activation: RMSNorm (with the residual add)
or SiLU-and-mul, then per-row FP8 quantization, writing float8_e4m3fn codes (M, K) and float32 scales (M, 1)
without the bf16 round trip through memory.

Unfused, an FP8 layer's input is two launches: rmsnorm.py / activation.py write the bf16 activation and
fp8_quant.quantize_rows_fp8 reads it back. On an H100 each launch costs 3-4 us even at one row, which at decode
is more than the work. Here one kernel does both, and its results are the composition's bit for bit:
    codes, scales == quantize_rows_fp8(rmsnorm(x, w, eps), static_scale, max_code, min_amax)
                     (fused_add_rmsnorm with a residual, which is updated in place the same way)
    codes, scales == quantize_rows_fp8(silu_and_mul(gate_up), static_scale, max_code, min_amax)
because the activation comes from the same @triton.jit helpers (rmsnorm.load_norm_input and normalize_rows,
activation.silu_mul), is rounded to the dtype the unfused kernel would have stored, and is quantized with
fp8_quant's arithmetic: scale = max(amax, min_amax) / max_code per row (or the static scale for every row),
codes = clamp(value / scale, +-max_code) rounded to nearest even, both divisions IEEE (div_rn).

No host syncs (shape metadata only), so both can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .activation import silu_mul
from .fp8_quant import row_scale, scaled_codes
from .launch import check_device, next_power_of_2, pdl_launch_args, pdl_wait_then_release
from .rmsnorm import MAX_ROW, load_norm_input, normalize_rows, row_tiles

# SiLU-and-mul's rows are the MLP's intermediate size (14,336 for Llama-3.1-8B, 28,672 for 70B): too wide to
# hold whole in registers, so the kernel loops over chunks of this many elements; 2,048 divides both.
SILU_BLOCK = 2048

_INPUT_DTYPES = (torch.bfloat16, torch.float16)


# NOTE: n_rows only bounds a mask: not specialized, as in rmsnorm.py, so no row count compiles a new variant.
@triton.jit(do_not_specialize=["n_rows"])
def _rmsnorm_fp8_kernel(
    X,
    Residual,
    W,
    Codes,
    Scales,
    StaticScale,
    n_rows,
    eps,
    stride_xm,
    stride_rm,
    DIM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ROUND_TO_X: tl.constexpr,
    STATIC: tl.constexpr,
    MAX_CODE: tl.constexpr,
    MIN_AMAX: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_wait_then_release(USE_PDL)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # (R,)
    cols = tl.arange(0, BLOCK_D)  # (BD,)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols < DIM)[None, :]  # (R, BD)
    x = load_norm_input(X, Residual, rows * stride_xm, rows * stride_rm, cols, mask, HAS_RESIDUAL)
    y = normalize_rows(x, W, cols, eps, DIM)  # (R, BD) float32, 0 past DIM
    # rmsnorm stores promote(weight.dtype, x.dtype): x's dtype when the weight's is the same (the value the
    # quantizer would read back), else float32, which y already is.
    if ROUND_TO_X:
        y = y.to(x.dtype).to(tl.float32)
    if STATIC:
        scale = tl.load(StaticScale + tl.zeros_like(rows))  # (R,) the one scale, for every row
    else:
        scale = row_scale(tl.max(tl.abs(y), axis=1), MIN_AMAX, MAX_CODE)  # (R,)
    tl.store(Scales + rows, scale, mask=row_mask)
    q = scaled_codes(y, scale[:, None], MAX_CODE)
    tl.store(Codes + rows[:, None] * DIM + cols[None, :], q.to(Codes.dtype.element_ty), mask=mask)


# The row is read twice, a chunk at a time: once for its amax (skipped under a static scale), once to write
# the codes, the activation recomputed rather than kept (the second read of a decode batch's rows hits L2).
# Holding the row whole would read it once, but 14K-28K elements in registers spill, and the loop has no
# limit on the intermediate size.
@triton.jit
def _silu_and_mul_fp8_kernel(
    GateUp,
    Codes,
    Scales,
    StaticScale,
    inter,
    stride_in,
    stride_c,
    STATIC: tl.constexpr,
    MAX_CODE: tl.constexpr,
    MIN_AMAX: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_wait_then_release(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    gate_row = GateUp + row * stride_in
    up_row = gate_row + inter
    c_row = Codes + row * stride_c
    if STATIC:
        scale = tl.load(StaticScale)
    else:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, inter, BLOCK):
            cols = k0 + tl.arange(0, BLOCK)
            mask = cols < inter
            gate = tl.load(gate_row + cols, mask=mask, other=0.0)
            up = tl.load(up_row + cols, mask=mask, other=0.0)
            amax = tl.maximum(amax, tl.abs(silu_mul(gate, up).to(tl.float32)))  # masked lanes: silu(0) * 0 = 0
        scale = row_scale(tl.max(amax, axis=0), MIN_AMAX, MAX_CODE)
    tl.store(Scales + row, scale)
    for k0 in range(0, inter, BLOCK):
        cols = k0 + tl.arange(0, BLOCK)
        mask = cols < inter
        gate = tl.load(gate_row + cols, mask=mask, other=0.0)
        up = tl.load(up_row + cols, mask=mask, other=0.0)
        q = scaled_codes(silu_mul(gate, up).to(tl.float32), scale, MAX_CODE)
        tl.store(c_row + cols, q.to(Codes.dtype.element_ty), mask=mask)


def rmsnorm_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: Optional[torch.Tensor] = None,
    static_scale: Optional[torch.Tensor] = None,
    max_code: float = 448.0,
    min_amax: float = 1e-12,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x (M, D) bf16/fp16 (unit stride on D), with `residual += x` in place first when a residual
    (M, D) is given, quantized to FP8 per row -> (codes (M, D) float8_e4m3fn, scales (M, 1) float32).
    static_scale: a (1,) float32 scale for every row; None: max(amax, min_amax) / max_code per row. Bit for
    bit `quantize_rows_fp8(rmsnorm(x, weight, eps), ...)` (fused_add_rmsnorm's output with a residual)."""
    check_device("rmsnorm_fp8", x, weight, residual, static_scale)
    if x.dim() != 2:
        raise ValueError(f"rmsnorm_fp8 expects x of shape (M, D), got {tuple(x.shape)}")
    m, dim = x.shape
    if x.dtype not in _INPUT_DTYPES:
        raise ValueError(f"rmsnorm_fp8 expects x in bfloat16 or float16, got {x.dtype}")
    if x.stride(1) != 1:
        raise ValueError(f"rmsnorm_fp8 needs x with unit stride on D, got strides {x.stride()}")
    if weight.shape != (dim,) or weight.dtype not in (*_INPUT_DTYPES, torch.float32):
        raise ValueError(
            f"rmsnorm_fp8 weight must be ({dim},) bfloat16, float16 or float32, "
            f"got {tuple(weight.shape)} {weight.dtype}"
        )
    if dim > MAX_ROW:
        raise ValueError(f"rmsnorm_fp8 supports rows up to {MAX_ROW} elements, got {dim}")
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(
                f"residual must match x in shape and dtype: got {tuple(residual.shape)} {residual.dtype} "
                f"vs {tuple(x.shape)} {x.dtype}"
            )
        if residual.stride(1) != 1:
            raise ValueError("residual must have unit stride on D (it is updated in place)")
    _check_static_scale("rmsnorm_fp8", static_scale)
    weight = weight.contiguous()
    codes = torch.empty((m, dim), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return codes, scales
    # NOTE: rmsnorm's tiles (row groups and warps), not one row a program regardless: the mean of squares is
    # summed in the order the tile's layout gives, and only the same layout gives rmsnorm's norm bit for bit.
    # At hidden sizes of 4,096 and up that is one row a program anyway.
    block_d, block_rows, num_warps = row_tiles(dim, m)
    res = residual if residual is not None else x
    _rmsnorm_fp8_kernel[(triton.cdiv(m, block_rows),)](
        x,
        res,
        weight,
        codes,
        scales,
        static_scale if static_scale is not None else scales,
        m,
        eps,
        x.stride(0),
        res.stride(0),
        DIM=dim,
        HAS_RESIDUAL=residual is not None,
        ROUND_TO_X=torch.promote_types(x.dtype, weight.dtype) == x.dtype,
        STATIC=static_scale is not None,
        MAX_CODE=max_code,
        MIN_AMAX=min_amax,
        BLOCK_ROWS=block_rows,
        BLOCK_D=block_d,
        num_warps=num_warps,
        **pdl_launch_args(x.device),
    )
    return codes, scales


def silu_and_mul_fp8(
    gate_up: torch.Tensor,
    static_scale: Optional[torch.Tensor] = None,
    max_code: float = 448.0,
    min_amax: float = 1e-12,
) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up (T, 2I) bf16/fp16 ([gate | up] per row, unit stride on the last dim) -> silu(gate) * up
    quantized to FP8 per row: (codes (T, I) float8_e4m3fn, scales (T, 1) float32). static_scale as in
    rmsnorm_fp8. Bit for bit `quantize_rows_fp8(silu_and_mul(gate_up), ...)`."""
    check_device("silu_and_mul_fp8", gate_up, static_scale)
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"silu_and_mul_fp8 expects gate_up (T, 2I) with an even last dim, got {tuple(gate_up.shape)}")
    if gate_up.dtype not in _INPUT_DTYPES:
        raise ValueError(f"silu_and_mul_fp8 expects gate_up in bfloat16 or float16, got {gate_up.dtype}")
    if gate_up.stride(1) != 1:
        raise ValueError(f"silu_and_mul_fp8 needs gate_up with unit stride on its last dim, got {gate_up.stride()}")
    _check_static_scale("silu_and_mul_fp8", static_scale)
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    codes = torch.empty((rows, inter), dtype=torch.float8_e4m3fn, device=gate_up.device)
    scales = torch.empty((rows, 1), dtype=torch.float32, device=gate_up.device)
    if rows == 0:
        return codes, scales
    block = min(SILU_BLOCK, next_power_of_2(max(inter, 1)))
    _silu_and_mul_fp8_kernel[(rows,)](
        gate_up,
        codes,
        scales,
        static_scale if static_scale is not None else scales,
        inter,
        gate_up.stride(0),
        codes.stride(0),
        STATIC=static_scale is not None,
        MAX_CODE=max_code,
        MIN_AMAX=min_amax,
        BLOCK=block,
        num_warps=4 if block <= 1024 else 8,
        **pdl_launch_args(gate_up.device),
    )
    return codes, scales


def _check_static_scale(op: str, static_scale: Optional[torch.Tensor]) -> None:
    if static_scale is not None and (static_scale.shape != (1,) or static_scale.dtype != torch.float32):
        raise ValueError(
            f"{op}: static_scale must be a (1,) float32 tensor, got {tuple(static_scale.shape)} {static_scale.dtype}"
        )
