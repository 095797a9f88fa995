"""Decode matmul with FP8 weights: y = x @ (W * scale[:, None])^T for 1-64 rows, W float8_e4m3fn (N, K)
with one float32 scale per output channel, x and y in bf16/fp16.

A decode step's few rows are bound by reading the weights, so the gain of FP8 there is its half of
bf16's bytes, not FP8 arithmetic: each tile of W is loaded as FP8, widened to x's dtype in registers and
fed to the tensor cores with x as it is (no activation quantization: decode rows keep bf16 accuracy), and
the channel scale multiplies the float32 sums once at the end. The layout is decode_gemm.py's: W's rows
are the MMA's M axis (BLOCK_N >= 64), x's rows the narrow N axis (BLOCK_M padded to >= 16), so a tile
computes y^T = W_tile @ x^T; split-K partials go through decode_gemm's `SplitKWorkspace` (deterministic
sums in split order, counters reset by the last program: CUDA-graph replayable). No host sync.

W is (N, K) with unit stride on K; x is (M, K) with unit stride on K.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .decode_gemm import SplitKWorkspace
from .launch import interpreter_enabled, linear_operands, next_power_of_2


@dataclass(frozen=True)
class Fp8GemmConfig:
    block_n: int = 64  # rows of W per tile (the MMA's M)
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(
    X,
    W,
    Scale,
    B,
    Y,
    Partials,
    Counters,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    K_PER_SPLIT,
    SPLIT_K,
    HAS_BIAS: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,) rows of W = columns of y
    offs_m = tl.arange(0, BLOCK_M)  # (BM,) rows of x
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_rows = W + offs_n.to(tl.int64)[:, None] * stride_wn  # (BN, 1)
    x_cols = X + offs_m[None, :] * stride_xm  # (1, BM)
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # y^T tile, unscaled
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)  # (BK,)
        k_mask = offs_k < k_hi
        xt = tl.load(x_cols + offs_k[:, None], mask=k_mask[:, None] & m_mask[None, :], other=0.0)  # (BK, BM)
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)  # (BN, BK) fp8
        if DOT_F32:
            acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc)
        else:
            acc = tl.dot(w.to(xt.dtype), xt, acc)  # FP8 codes are exact in bf16 and fp16
    scale = tl.load(Scale + offs_n, mask=n_mask, other=0.0)[:, None]  # (BN, 1) float32
    y_ptrs = Y + offs_m[None, :] * stride_ym + offs_n[:, None]  # (BN, BM)
    y_mask = n_mask[:, None] & m_mask[None, :]
    if SPLIT_K == 1:
        acc = acc * scale
        if HAS_BIAS:
            acc += tl.load(B + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=y_mask)
    else:
        # Partials laid out (tile, split, BN, BM), as decode_gemm's.
        tile_base = Partials + pid_n.to(tl.int64) * (SPLIT_K * BLOCK_N * BLOCK_M)
        inner = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + offs_m[None, :]  # (BN, BM)
        tl.store(tile_base + pid_k * (BLOCK_N * BLOCK_M) + inner, acc)
        # NOTE: every thread's partial stores precede the release of the arrival count.
        tl.debug_barrier()
        arrived = tl.atomic_add(Counters + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in range(SPLIT_K):  # fixed order: deterministic sums
                total += tl.load(tile_base + s * (BLOCK_N * BLOCK_M) + inner, cache_modifier=".cg")
            total = total * scale
            if HAS_BIAS:
                total += tl.load(B + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
            tl.store(y_ptrs, total.to(Y.dtype.element_ty), mask=y_mask)
            tl.atomic_xchg(Counters + pid_n, 0, sem="relaxed", scope="gpu")


MAX_ROWS = 64  # the x tile is BLOCK_M wide; above it `torch._scaled_mm` (FP8 tensor cores) is the path


def pick_fp8_gemm_config(n: int, k: int, rows: int) -> Fp8GemmConfig:
    """Tiles by shape, a first choice from reading (not yet swept: benchmarks/kernels/bench_fp8_linear.py
    measures it): decode_gemm's tiles with twice the K per step, since an FP8 tile of the same bytes holds
    twice the columns (a program keeps ~64 KB of W in flight per stage). Wide matrices (gate_up, above 16K
    rows) take 128-row tiles unsplit; the others 64-row tiles, K split in two when long (down: 14,336), and
    few tiles (small models) split K up to ~128 programs."""
    # NOTE: K steps shrink as the x tile widens, so the stages of W and x tiles stay inside shared memory.
    if n >= 16384:
        return Fp8GemmConfig(block_n=128, block_k=128 if rows > 32 else 256, split_k=1, num_warps=4, num_stages=3)
    tiles = triton.cdiv(n, 64)
    if tiles >= 64:
        split = 2 if k > 8192 else 1
    else:
        split = 1 << (triton.cdiv(128, tiles).bit_length() - 1)  # a power of two: K's tiles divide evenly
    return Fp8GemmConfig(
        block_n=64,
        block_k=512 if rows <= 16 else 256,
        split_k=min(split, max(1, k // 1024)),
        num_warps=4,
        num_stages=3 if split >= 4 else 4,
    )


def fp8_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    config: Optional[Fp8GemmConfig] = None,
    workspace: Optional[SplitKWorkspace] = None,
    out_dtype: Optional[torch.dtype] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """x (M, K) bf16/fp16 @ (weight (N, K) float8_e4m3fn * weight_scale (N,) float32)^T (+ bias (N,)) ->
    (M, N) in out_dtype (default x's), 1 <= M <= MAX_ROWS. config: default pick_fp8_gemm_config; a split_k
    > 1 needs a `workspace`. With `out` ((M, N), unit stride on N) the kernel writes there and returns it."""
    m, n, k, out = linear_operands("fp8_gemm", x, weight, bias, out, out_dtype, MAX_ROWS)
    if weight.dtype != torch.float8_e4m3fn or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"fp8_gemm expects float8_e4m3fn weights and bf16/fp16 x, got {weight.dtype} and {x.dtype}")
    if weight_scale.dtype != torch.float32 or tuple(weight_scale.shape) != (n,):
        raise ValueError(
            f"fp8_gemm weight_scale must be float32 ({n},), got {weight_scale.dtype} {tuple(weight_scale.shape)}"
        )
    config = config or pick_fp8_gemm_config(n, k, m)
    block_m = max(16, next_power_of_2(m))
    tiles = triton.cdiv(n, config.block_n)
    k_tiles = triton.cdiv(k, config.block_k)
    split = max(1, min(config.split_k, k_tiles))
    k_per_split = triton.cdiv(k_tiles, split) * config.block_k
    split = triton.cdiv(k, k_per_split)  # no empty split
    if split > 1 and workspace is None:
        raise ValueError("fp8_gemm with split_k > 1 needs a SplitKWorkspace")
    if workspace is not None:  # also unsplit: the same pointer types, one compiled kernel
        partial_elems = tiles * split * config.block_n * block_m if split > 1 else 1
        partials, counters = workspace.reserve(x.device, partial_elems, tiles)
    else:
        partials, counters = out, out  # never touched when unsplit
    _fp8_gemm_kernel[(tiles, split)](
        x,
        weight,
        weight_scale,
        bias if bias is not None else weight_scale,
        out,
        partials,
        counters,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        k_per_split,
        split,
        HAS_BIAS=bias is not None,
        # NOTE: Triton's CPU interpreter miscomputes a bf16 dot of operands widened from FP8 (a float32 one
        # is right), so tests under TRITON_INTERPRET take float32 products; CUDA takes the tensor cores'.
        DOT_F32=interpreter_enabled(),
        BLOCK_M=block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out
