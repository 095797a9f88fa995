"""Decode matmul with FP8 weights: y = x @ (W * scale[:, None])^T for 1-256 rows, W float8_e4m3fn (N, K)
with one float32 scale per output channel, x and y in bf16/fp16, or x in FP8 too (codes with one float32
scale per row, `x_scale`: then the tiles go to the FP8 tensor cores as they are).

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

from typing import Optional

import torch
import triton

from .decode_gemm import DecodeGemmConfig, SplitKWorkspace, launch_decode_gemm
from .launch import interpreter_enabled, linear_operands

MAX_ROWS = 256  # the x tile is BLOCK_M wide; above it `torch._scaled_mm`'s tiles are the right ones


def pick_fp8_gemm_config(n: int, k: int, rows: int, x_fp8: bool = False) -> DecodeGemmConfig:
    """Tiles by shape, from benchmarks/kernels/bench_fp8_linear.py --sweep (H100, Llama-3.1-8B's matrices at 1,
    16 and 64 rows): 64-row tiles of 128-wide K steps, 3 stages, and K split until there are ~512 programs
    (~384 above 32 rows, where each reads a wider x tile). An FP8 tile holds half the bytes of a bf16 one, so
    a program streams too little to hide its latency unless many run per SM: QKV splits in 4, O and down in 8
    (4 above 32 rows), gate-up's 448 tiles run unsplit. A split keeps at least 512 of K (4 steps)."""
    tiles = triton.cdiv(n, 64)
    target = 512 if rows <= 32 else 384
    split = 1 << max(0, (target // tiles).bit_length() - 1)  # a power of two: K's tiles divide evenly
    return DecodeGemmConfig(block_n=64, block_k=128, split_k=min(split, max(1, k // 512)), num_warps=4, num_stages=3)


def fp8_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    config: Optional[DecodeGemmConfig] = None,
    workspace: Optional[SplitKWorkspace] = None,
    out_dtype: Optional[torch.dtype] = None,
    out: Optional[torch.Tensor] = None,
    x_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """x (M, K) bf16/fp16 @ (weight (N, K) float8_e4m3fn * weight_scale (N,) float32)^T (+ bias (N,)) ->
    (M, N) in out_dtype (default x's; bf16 for FP8 x), 1 <= M <= MAX_ROWS. x may be float8_e4m3fn codes with
    `x_scale` ((M, 1) float32, quant/fp8.quantize_rows). config: default pick_fp8_gemm_config; a split_k
    > 1 needs a `workspace`. With `out` ((M, N), unit stride on N) the kernel writes there and returns it."""
    x_fp8 = x.dtype == torch.float8_e4m3fn
    if x_fp8 and out is None and out_dtype is None:
        out_dtype = torch.bfloat16
    m, n, k, out = linear_operands("fp8_gemm", x, weight, bias, out, out_dtype, MAX_ROWS)
    if weight.dtype != torch.float8_e4m3fn or x.dtype not in (torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        raise ValueError(
            f"fp8_gemm expects float8_e4m3fn weights and bf16/fp16/float8_e4m3fn x, got {weight.dtype} and {x.dtype}"
        )
    if weight_scale.dtype != torch.float32 or tuple(weight_scale.shape) != (n,):
        raise ValueError(
            f"fp8_gemm weight_scale must be float32 ({n},), got {weight_scale.dtype} {tuple(weight_scale.shape)}"
        )
    if x_fp8 != (x_scale is not None):
        raise ValueError("fp8_gemm takes x_scale exactly when x holds float8_e4m3fn codes")
    if x_scale is not None and (x_scale.dtype != torch.float32 or x_scale.numel() != m or not x_scale.is_contiguous()):
        raise ValueError(
            f"fp8_gemm x_scale must be contiguous float32 ({m}, 1), got {x_scale.dtype} {tuple(x_scale.shape)}"
        )
    config = config or pick_fp8_gemm_config(n, k, m, x_fp8)
    # NOTE: Triton's CPU interpreter miscomputes a bf16 dot of operands widened from FP8 (a float32 one is
    # right), so tests under TRITON_INTERPRET take float32 products; CUDA takes the tensor cores'.
    launch_decode_gemm(
        x, weight, weight_scale, bias, out, config, workspace, "fp8_gemm", interpreter_enabled(), x_scale=x_scale
    )
    return out
