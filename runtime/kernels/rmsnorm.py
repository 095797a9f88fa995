"""RMSNorm and fused residual-add + RMSNorm as one Triton launch each.

Numerics follow transformers' LlamaRMSNorm (and `layers.rms_norm_torch`) step for step:
    s   = (x + residual) rounded to x.dtype            (fused variant only; written back into residual)
    h   = float32(s)
    n   = h * (1 / sqrt(sum(h * h) / D + eps))         float32; the sqrt and both divisions correctly
                                                       rounded (torch's CPU rsqrt is 1/sqrt too)
    out = (weight * n.to(x.dtype)) rounded to promote(weight.dtype, x.dtype)
The cast of `n` to the input dtype *before* the weight multiply is what makes greedy tokens match:
the product of two bf16/fp16 values is exact in float32, so `out` equals the torch result bit for
bit whenever `n` rounds the same way (it can differ by the last fp32 bit of the mean, whose
summation order differs).

Rows: x is (M, D) or (M, N, D) with any row strides and unit stride on D — e.g. the (T, H, D) query
view of a fused QKV output for Qwen3's per-head q/k norm, which needs no copy. Each program takes
BLOCK_ROWS rows of one BLOCK_D tile (BLOCK_D >= D), so wide rows (hidden 576..8192) get one row per
program and narrow ones (head_dim 64/128) get many. No host syncs: everything the launch needs is
shape metadata, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .launch import check_device, next_power_of_2, pdl_launch_args, pdl_wait_then_release

# NOTE: one tile must hold a whole row (the reduction is not looped); 64K fp32 values already spill
# registers badly, and no supported model is wider than 8192.
MAX_ROW = 65536


@triton.jit
def load_norm_input(X, Residual, x_offs, r_offs, cols, mask, HAS_RESIDUAL: tl.constexpr):
    """Rows of x (R, BD) in the input dtype, 0 where masked; with a residual, `residual += x` in place and the
    sum returned. x_offs, r_offs (R,): where each row starts in X and Residual; cols (BD,)."""
    x = tl.load(X + x_offs[:, None] + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r_ptrs = Residual + r_offs[:, None] + cols[None, :]
        res = tl.load(r_ptrs, mask=mask, other=0.0)
        # NOTE: rounded to the input dtype before normalising, exactly like `x + residual` in torch.
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x.dtype)
        tl.store(r_ptrs, x, mask=mask)
    return x


@triton.jit
def normalize_rows(x, W, cols, eps, DIM: tl.constexpr):
    """x (R, BD) in the input dtype, 0 past DIM -> (R, BD) float32 `weight * n.to(x.dtype)`: the module
    docstring's `out` before its rounding to promote(weight.dtype, x.dtype), which is the caller's to do.
    NOTE: the mean of squares is summed in the order of the tile's layout (its shape and num_warps), so a
    kernel that must give rmsnorm's output bit for bit launches the tiles `row_tiles` picks."""
    h = x.to(tl.float32)
    sum_sq = tl.sum(h * h, axis=1)  # (R,)
    # NOTE: div_rn/sqrt_rn, not `/` and rsqrt: Triton lowers those to approximate PTX instructions.
    mean_sq = tl.div_rn(sum_sq, tl.full(sum_sq.shape, DIM, tl.float32))  # (R,)
    inv_rms = tl.div_rn(1.0, tl.sqrt_rn(mean_sq + eps))  # (R,)
    normed = (h * inv_rms[:, None]).to(x.dtype)
    w = tl.load(W + cols, mask=cols < DIM, other=0.0).to(tl.float32)  # (BD,)
    return w[None, :] * normed.to(tl.float32)


# NOTE: n_rows only bounds a mask: not specialized, so that no row count (a prefill's token count, its
# number of requests) compiles a variant that start-up's warm-up did not (see compile_watch.py).
@triton.jit(do_not_specialize=["n_rows"])
def _rmsnorm_kernel(
    X,
    Residual,
    W,
    Out,
    n_rows,
    heads,
    eps,
    stride_xm,
    stride_xn,
    stride_rm,
    stride_rn,
    DIM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_wait_then_release(USE_PDL)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # (R,)
    cols = tl.arange(0, BLOCK_D)  # (BD,)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols < DIM)[None, :]  # (R, BD)
    # A flat row index r covers x[r // heads, r % heads, :] (heads == 1 for 2-D inputs).
    m, n = rows // heads, rows % heads
    x = load_norm_input(
        X, Residual, m * stride_xm + n * stride_xn, m * stride_rm + n * stride_rn, cols, mask, HAS_RESIDUAL
    )
    out = normalize_rows(x, W, cols, eps, DIM)
    tl.store(Out + rows[:, None] * DIM + cols[None, :], out.to(Out.dtype.element_ty), mask=mask)


def row_tiles(dim: int, n_rows: int) -> tuple[int, int, int]:
    """(BLOCK_D, BLOCK_ROWS, num_warps) of a launch over n_rows rows of dim elements: ~4K elements a
    program, so one row at hidden sizes and a group of heads at head_dim 64/128."""
    block_d = next_power_of_2(dim)
    block_rows = min(max(1, 4096 // block_d), next_power_of_2(n_rows))
    return block_d, block_rows, min(16, max(1, block_rows * block_d // 256))


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x (D,), (M, D) or (M, N, D); returns a new contiguous tensor."""
    return _launch(x, None, weight, eps)


def fused_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`residual += x` in place, then RMSNorm of the sum; returns (out, residual)."""
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError(
            f"residual must match x in shape, dtype and device: got {tuple(residual.shape)} "
            f"{residual.dtype} {residual.device} vs {tuple(x.shape)} {x.dtype} {x.device}"
        )
    return _launch(x, residual, weight, eps), residual


def _launch(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float) -> torch.Tensor:
    check_device("rmsnorm", x, residual, weight)
    if x.dim() == 1:  # a single row: a (1, D) view, so an in-place residual stays the caller's
        out = _launch(x.unsqueeze(0), None if residual is None else residual.unsqueeze(0), weight, eps)
        return out.squeeze(0)
    if x.dim() not in (2, 3):
        raise ValueError(f"rmsnorm expects x of shape (D,), (M, D) or (M, N, D), got {tuple(x.shape)}")
    dim = x.shape[-1]
    if weight.shape != (dim,):
        raise ValueError(f"rmsnorm weight must have shape ({dim},), got {tuple(weight.shape)}")
    if dim > MAX_ROW:
        raise ValueError(f"rmsnorm supports rows up to {MAX_ROW} elements, got {dim}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if residual is not None and residual.stride(-1) != 1:
        raise ValueError("residual must have unit stride on its last dim (it is updated in place)")
    weight = weight.contiguous()
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    heads = x.shape[1] if x.dim() == 3 else 1
    n_rows = x.numel() // dim
    if n_rows == 0:
        return out

    def row_strides(t: torch.Tensor) -> tuple[int, int]:
        return (t.stride(0), t.stride(1)) if t.dim() == 3 else (t.stride(0), 0)

    block_d, block_rows, num_warps = row_tiles(dim, n_rows)
    res = residual if residual is not None else x
    _rmsnorm_kernel[(triton.cdiv(n_rows, block_rows),)](
        x,
        res,
        weight,
        out,
        n_rows,
        heads,
        eps,
        *row_strides(x),
        *row_strides(res),
        DIM=dim,
        HAS_RESIDUAL=residual is not None,
        BLOCK_ROWS=block_rows,
        BLOCK_D=block_d,
        num_warps=num_warps,
        **pdl_launch_args(x.device),
    )
    return out
