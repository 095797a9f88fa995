"""Decode matmul y = x @ W^T for 2-64 rows: tensor cores, weights streamed once, deterministic split-K.

At batch 2-64 a decode step's linear layers are still bound by reading the weights (64 rows make 64
FLOPs per weight byte, under a Hopper GPU's ~200 FLOP/byte ridge), but the skinny matmul (gemv.py) does its
products on the CUDA cores and only pays at one row, while the matmul library's tiles are built for
large M. Here the roles are swapped: W's rows are the tensor-core M axis (BLOCK_N of them, >= 64 so
Hopper's warpgroup MMA applies) and x's few rows the narrow N axis (BLOCK_M, padded to >= 16), so a
tile computes y^T = W_tile @ x^T. Measured (bench_decode_gemm.py, 8B, weight-only step of every layer's
matrices + LM head): faster than cuBLAS from 4 to 32 rows; at 64 rows only the LM head still gains, at 128
cuBLAS is faster everywhere.

Small matrices (8B's O and down: 4,096 output rows) give only 32-64 tiles of W rows, fewer than the
132 SMs; SPLIT_K programs share a tile's K axis. Each writes its float32 partial sum to a workspace and
bumps the tile's arrival counter; the last to arrive adds the partials in split order (the same order
every time: results do not depend on which program finished first), writes y, and puts the counter
back to zero for the next launch (so the kernel replays inside a CUDA graph).

W is (N, K) with unit stride on K; x is (M, K) with unit stride on K.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .launch import linear_operands, next_power_of_2


@dataclass(frozen=True)
class DecodeGemmConfig:
    block_n: int = 128  # rows of W per tile (the MMA's M: >= 64 for Hopper's warpgroup MMA)
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


class SplitKWorkspace:
    """Float32 partial sums and per-tile arrival counters for split-K launches, on the device of the
    launches that use it (allocated on first use). The counters are zero between launches (the last
    program of each tile resets its own), so one workspace serves every launch of a stream, one after
    another, CUDA-graph replays included.

    It grows to the largest launch it has seen. A buffer it outgrows is kept, never freed: a CUDA graph
    captured before the growth holds its address (e.g. graphs up to batch 8, then an eager step at
    batch 20 that needs more partials) and must still find its own zeroed counters and scratch there."""

    def __init__(self):
        self.partials: Optional[torch.Tensor] = None
        self.counters: Optional[torch.Tensor] = None
        self._outgrown: list[torch.Tensor] = []

    def reserve(self, device: torch.device, partial_elems: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.partials is None or self.partials.device != device or self.partials.numel() < partial_elems:
            if self.partials is not None:
                self._outgrown.append(self.partials)
            self.partials = torch.empty(partial_elems, dtype=torch.float32, device=device)
        if self.counters is None or self.counters.device != device or self.counters.numel() < tiles:
            if self.counters is not None:
                self._outgrown.append(self.counters)
            self.counters = torch.zeros(tiles, dtype=torch.int32, device=device)
        return self.partials, self.counters


# NOTE: M (the row count) is not specialized: Triton would compile one variant for M == 1, one for M a
# multiple of 16 and one for the rest, per tile shape. Decode batches are padded to graph buckets and
# compile at capture, but a prefill's LM head takes one row per request (any count up to 64), so a
# first batch of, say, 27 requests waited for its compile. M only bounds a mask here.
@triton.jit(do_not_specialize=["M"])
def _decode_gemm_kernel(
    X,
    XScale,
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
    W_FP8: tl.constexpr,
    X_FP8: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # NOTE: SPLIT_K is a runtime value (one compiled kernel serves every split of a tile shape).
    # W_FP8: W holds float8_e4m3fn codes with one float32 scale per row (fp8_gemm.py): each tile is widened to
    # x's dtype in registers (FP8 codes are exact in bf16 and fp16) and the scale multiplies the sums once.
    # X_FP8 (with W_FP8): x holds FP8 codes too, one float32 scale per row (XScale): the tiles go to the FP8
    # tensor cores as they are, and both scales multiply the sums once.
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
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # y^T tile
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)  # (BK,)
        k_mask = offs_k < k_hi
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)  # (BN, BK)
        xt = tl.load(x_cols + offs_k[:, None], mask=k_mask[:, None] & m_mask[None, :], other=0.0)  # (BK, BM)
        if DOT_F32:
            acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc)
        elif X_FP8:
            acc = tl.dot(w, xt, acc)
        elif W_FP8:
            acc = tl.dot(w.to(xt.dtype), xt, acc)
        else:
            acc = tl.dot(w, xt, acc)
    y_ptrs = Y + offs_m[None, :] * stride_ym + offs_n[:, None]  # (BN, BM)
    y_mask = n_mask[:, None] & m_mask[None, :]
    if W_FP8:
        scale = tl.load(Scale + offs_n, mask=n_mask, other=0.0)[:, None]  # (BN, 1) float32
        if X_FP8:
            scale = scale * tl.load(XScale + offs_m, mask=m_mask, other=0.0)[None, :]  # (BN, BM)
    if SPLIT_K == 1:
        if W_FP8:
            acc = acc * scale
        if HAS_BIAS:
            acc += tl.load(B + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=y_mask)
    else:
        # Partials laid out (tile, split, BN, BM): one tile's splits are contiguous.
        tile_base = Partials + pid_n.to(tl.int64) * (SPLIT_K * BLOCK_N * BLOCK_M)
        inner = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + offs_m[None, :]  # (BN, BM)
        tl.store(tile_base + pid_k * (BLOCK_N * BLOCK_M) + inner, acc)
        # NOTE: the barrier makes every thread's partial stores precede the release of the arrival count,
        # so the program that sees the last arrival also sees all partials.
        tl.debug_barrier()
        arrived = tl.atomic_add(Counters + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in range(SPLIT_K):  # fixed order: deterministic sums
                total += tl.load(tile_base + s * (BLOCK_N * BLOCK_M) + inner, cache_modifier=".cg")
            if W_FP8:
                total = total * scale
            if HAS_BIAS:
                total += tl.load(B + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
            tl.store(y_ptrs, total.to(Y.dtype.element_ty), mask=y_mask)
            tl.atomic_xchg(Counters + pid_n, 0, sem="relaxed", scope="gpu")


MAX_ROWS = 64  # the x tile is BLOCK_M wide; above this the matmul library's own tiles are right (measured)


def pick_decode_gemm_config(n: int, k: int, rows: int) -> DecodeGemmConfig:
    """Tiles by shape, from benchmarks/kernels/bench_decode_gemm.py's sweeps (bf16, Llama-3.1-8B shapes, 4-64
    rows; each choice beat cuBLAS at 16 rows): wide matrices (gate_up, the LM head) take 128-row tiles of
    128-wide K steps, one program per tile; the others 64-row tiles of 256-wide K steps, 4 stages. A program
    keeps ~128 KB of W in flight, so even 64 programs on 132 SMs stream near full bandwidth (O: 64 tiles
    unsplit beat 128 split ones); K is split in two when long (down: halves of 7,168). Fewer than 64 tiles
    (the 1B shapes, 8 rows) split K into up to ~128 programs (QKV, split in two, stays a little behind
    cuBLAS)."""
    if n >= 16384:
        return DecodeGemmConfig(block_n=128, block_k=128, split_k=1, num_warps=4, num_stages=3 if rows <= 16 else 4)
    tiles = triton.cdiv(n, 64)
    if tiles >= 64:
        split, stages = (2 if k > 8192 else 1), 4
    else:  # few, short tiles (the 1B shapes: O 32 tiles of 2,048, down 32 of 8,192): up to ~128 programs
        # NOTE: a power of two, so K's tiles divide evenly (1B QKV split 3 over 8 tiles was far slower than 2).
        split = 1 << (triton.cdiv(128, tiles).bit_length() - 1)
        stages = 3 if split >= 4 else 4
    # NOTE: above 32 rows the x tile doubles; 256-wide K steps would need 256 KB of shared memory.
    return DecodeGemmConfig(
        block_n=64,
        block_k=256 if rows <= 32 else 128,
        split_k=min(split, max(1, k // 512)),
        num_warps=4,
        num_stages=stages,
    )


def decode_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    config: Optional[DecodeGemmConfig] = None,
    workspace: Optional[SplitKWorkspace] = None,
    out_dtype: Optional[torch.dtype] = None,
    out: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """x (M, K) @ weight (N, K)^T (+ bias (N,)) -> (M, N) in out_dtype (default x's), 1 <= M <= MAX_ROWS.
    config: default pick_decode_gemm_config. A split_k > 1 needs a `workspace` (SplitKWorkspace). With
    `out` ((M, N), unit stride on N) the kernel writes there and returns it."""
    m, n, k, out = linear_operands("decode_gemm", x, weight, bias, out, out_dtype, MAX_ROWS)
    config = config or pick_decode_gemm_config(n, k, m)
    launch_decode_gemm(x, weight, None, bias, out, config, workspace, "decode_gemm")
    return out


def launch_decode_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    out: torch.Tensor,
    config: DecodeGemmConfig,
    workspace: Optional[SplitKWorkspace],
    name: str,
    dot_f32: bool = False,
    x_scale: Optional[torch.Tensor] = None,
) -> None:
    """out (M, N) = x (M, K) @ weight (N, K)^T (weight_scale (N,): FP8 codes' row scales; None: a float W)
    (+ bias), operands checked by the caller; K split as `config` says, over `workspace`. x_scale ((M,) or
    (M, 1) float32, with weight_scale): x holds FP8 codes, x = codes * x_scale."""
    m, k = x.shape
    n = weight.shape[0]
    block_m = max(16, next_power_of_2(m))
    tiles = triton.cdiv(n, config.block_n)
    k_tiles = triton.cdiv(k, config.block_k)
    split = max(1, min(config.split_k, k_tiles))
    k_per_split = triton.cdiv(k_tiles, split) * config.block_k
    split = triton.cdiv(k, k_per_split)  # no empty split
    if split > 1 and workspace is None:
        raise ValueError(f"{name} with split_k > 1 needs a SplitKWorkspace")
    if workspace is not None:  # also unsplit: the same pointer types, one compiled kernel
        partial_elems = tiles * split * config.block_n * block_m if split > 1 else 1
        partials, counters = workspace.reserve(x.device, partial_elems, tiles)
    else:
        partials, counters = out, out  # never touched when unsplit
    _decode_gemm_kernel[(tiles, split)](
        x,
        x_scale if x_scale is not None else x,
        weight,
        weight_scale if weight_scale is not None else weight,
        bias if bias is not None else weight,
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
        W_FP8=weight_scale is not None,
        X_FP8=x_scale is not None,
        DOT_F32=dot_f32,
        BLOCK_M=block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
