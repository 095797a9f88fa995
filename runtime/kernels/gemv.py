"""Skinny matmul y = x @ W^T for a handful of rows (decode at small batch), bandwidth-bound.

With M <= 8 rows of x, a linear layer reads every weight once and does two FLOPs per weight per row,
so its time is the weight bytes over memory bandwidth. Each program owns BLOCK_N output columns (rows
of W) and walks the whole K axis, so W is read exactly once, in long contiguous runs, and no partial
sums leave the program (no split-K reduction, no atomics, no extra launch). Products are accumulated
in float32 and rounded to the output dtype once.

W is (N, K) with unit stride on K (nn.Linear's layout); x is (M, K) with unit stride on K.
`gemv_config` holds the tile shape; `pick_gemv_config` is the default choice per (N, K).

FP8 weights (`weight_scale` given: W float8_e4m3fn codes with one float32 scale per row, quant/fp8.py) are
read as they are stored, half of bf16's bytes, widened to float32 in registers; the row scale multiplies each
sum once at the end.

Programmatic dependent launch (see launch.py): the kernel may be launched while the previous kernel
finishes. Each program loads its first weight tile before it waits (weights are constant, so that load
may overlap the previous kernel's tail), then waits for it before loading x, which may be its output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .launch import linear_operands, next_power_of_2, pdl_launch_args, pdl_wait_then_release

MAX_ROWS = 8  # above this the tensor-core GEMM of the matmul library is the better tool


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 8
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 3


@triton.jit
def _gemv_kernel(
    X,
    W,
    Scale,
    B,
    Y,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    W_FP8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
    offs_m = tl.arange(0, BLOCK_M)  # (BM,)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_rows = W + offs_n.to(tl.int64)[:, None] * stride_wn  # (BN, 1) row starts
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_first = 0
    if USE_PDL:
        # The first K tile is peeled off the loop: its weights load before the wait.
        offs_k = tl.arange(0, BLOCK_K)  # (BK,)
        k_mask = offs_k < K
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)  # (BN, BK)
        pdl_wait_then_release(USE_PDL)
        x = tl.load(
            X + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0
        )  # (BM, BK)
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)  # (BM, BN)
        k_first = BLOCK_K
    for k0 in range(k_first, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)  # (BK,)
        k_mask = offs_k < K
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)  # (BN, BK)
        x = tl.load(
            X + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0
        )  # (BM, BK)
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)  # (BM, BN)
    if W_FP8:
        acc = acc * tl.load(Scale + offs_n, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(
        Y + offs_m[:, None] * stride_ym + offs_n[None, :],
        acc.to(Y.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


def pick_gemv_config(n: int, k: int, fp8: bool = False) -> GemvConfig:
    """Tiles by shape, from benchmarks/kernels/bench_gemv.py's sweeps (one row, bf16, the Llama-3.1-8B and
    3.2-1B shapes): long K runs per load, and few enough rows a program that every SM gets work.

    K <= 4,096 (every matrix but down) takes a whole row per tile: a program then has all its loads in
    flight at once instead of walking 1,024-wide tiles one after another. Two rows a program at K = 4,096
    (N <= 32k), four otherwise. A long K (down: 14,336 or 8,192) takes 2,048-wide tiles, 8 rows a program
    when N >= 4,096 and 2 below, so that both shapes have >= 512 programs. Each beat cuBLAS.

    FP8 weights (`fp8`, from benchmarks/kernels/sweep_fp8_gemv.py on an H100): 4 rows of 2,048-wide tiles a
    program on every 8B shape (QKV / O / gate-up / down at one row 12.8 / 9.7 / 42.8 / 24.7 us against the bf16
    tiles' 13.0 / 10.1 / 45.7 / 26.3)."""
    if fp8:
        return GemvConfig(block_n=4, block_k=min(2048, next_power_of_2(k)), num_warps=4, num_stages=2)
    if k <= 4096:
        block_n = 2 if (k >= 4096 and n <= 32768) else 4
        return GemvConfig(block_n=block_n, block_k=next_power_of_2(k), num_warps=4, num_stages=2)
    return GemvConfig(block_n=8 if n >= 4096 else 2, block_k=2048, num_warps=4, num_stages=1)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    config: Optional[GemvConfig] = None,
    out_dtype: Optional[torch.dtype] = None,
    out: Optional[torch.Tensor] = None,
    weight_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """x (M, K) @ weight (N, K)^T (+ bias (N,)) -> (M, N) in out_dtype (default x's), 1 <= M <= MAX_ROWS.
    With `out` ((M, N), unit stride on N, any row stride; its dtype is the output dtype) the kernel
    writes there and returns it: e.g. a CUDA graph's logits buffer, with no copy after. `weight_scale`
    ((N,) float32): `weight` holds float8_e4m3fn codes, W = codes * weight_scale[:, None]."""
    m, n, k, y = linear_operands("gemv", x, weight, bias, out, out_dtype, MAX_ROWS)
    if weight_scale is not None:
        if weight.dtype != torch.float8_e4m3fn:
            raise ValueError(f"gemv with a weight_scale expects float8_e4m3fn weights, got {weight.dtype}")
        if weight_scale.dtype != torch.float32 or tuple(weight_scale.shape) != (n,):
            raise ValueError(
                f"gemv weight_scale must be float32 ({n},), got {weight_scale.dtype} {tuple(weight_scale.shape)}"
            )
    cfg = config or pick_gemv_config(n, k, fp8=weight_scale is not None)
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x,
        weight,
        weight_scale if weight_scale is not None else weight,
        bias if bias is not None else weight,
        y,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        HAS_BIAS=bias is not None,
        W_FP8=weight_scale is not None,
        BLOCK_M=max(1, next_power_of_2(m)),
        BLOCK_N=cfg.block_n,
        BLOCK_K=min(cfg.block_k, next_power_of_2(k)),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl_launch_args(x.device),
    )
    return y
