"""Decode matmul y = x @ W^T for 9..64-odd rows: tensor cores, weights streamed once, deterministic split-K.

At batch 16-64 a decode step's linear layers are still bound by reading the weights (64 rows make 64
FLOPs per weight byte, under the H200's ~200 FLOP/byte ridge), but the skinny matmul (gemv.py) does its
products on the CUDA cores and is too slow there, while the matmul library's tiles are built for large M.
Here the roles are swapped: W's rows are the tensor-core M axis (BLOCK_N of them, >= 64 so Hopper's
warpgroup MMA applies) and x's few rows are the narrow N axis (BLOCK_M, padded to >= 16), so a tile
computes y^T = W_tile @ x^T.

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

from .launch import check_device, next_power_of_2


@dataclass(frozen=True)
class DecodeGemmConfig:
    block_n: int = 128  # rows of W per tile (the MMA's M: >= 64 for Hopper's warpgroup MMA)
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


class SplitKWorkspace:
    """Float32 partial sums and per-tile arrival counters for split-K launches on one device. The
    counters are zero between launches (the last program of each tile resets its own), so one workspace
    serves every launch of a stream, CUDA-graph replays included. Grows only outside graph capture."""

    def __init__(self, device: torch.device):
        self.device = device
        self.partials = torch.empty(0, dtype=torch.float32, device=device)
        self.counters = torch.zeros(0, dtype=torch.int32, device=device)

    def reserve(self, partial_elems: int, tiles: int) -> None:
        if self.partials.numel() < partial_elems:
            self.partials = torch.empty(partial_elems, dtype=torch.float32, device=self.device)
        if self.counters.numel() < tiles:
            self.counters = torch.zeros(tiles, dtype=torch.int32, device=self.device)


@triton.jit
def _decode_gemm_kernel(X, W, Y, Partials, Counters, M, N, K, stride_xm, stride_wn, stride_ym, K_PER_SPLIT,
                        SPLIT_K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # NOTE: SPLIT_K is a runtime value (one compiled kernel serves every split of a tile shape).
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
        acc = tl.dot(w, xt, acc)
    y_ptrs = Y + offs_m[None, :] * stride_ym + offs_n[:, None]  # (BN, BM)
    y_mask = n_mask[:, None] & m_mask[None, :]
    if SPLIT_K == 1:
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
            tl.store(y_ptrs, total.to(Y.dtype.element_ty), mask=y_mask)
            tl.atomic_xchg(Counters + pid_n, 0, sem="relaxed", scope="gpu")


MAX_ROWS = 128  # the x tile is BLOCK_M wide; above this the matmul library's own tiles are right


def decode_gemm(x: torch.Tensor, weight: torch.Tensor, config: DecodeGemmConfig,
                workspace: Optional[SplitKWorkspace] = None, out_dtype: Optional[torch.dtype] = None,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x (M, K) @ weight (N, K)^T -> (M, N) in out_dtype (default x's), 1 <= M <= MAX_ROWS. A config with
    split_k > 1 needs a `workspace` (SplitKWorkspace on x's device). With `out` ((M, N), unit stride on N)
    the kernel writes there and returns it."""
    check_device("decode_gemm", x, weight, out)
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"decode_gemm expects x (M, K) and weight (N, K); got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    m, k = x.shape
    n = weight.shape[0]
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"decode_gemm handles 1..{MAX_ROWS} rows, got {m}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("decode_gemm needs unit stride on K for x and weight")
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    elif tuple(out.shape) != (m, n) or out.stride(1) != 1:
        raise ValueError(f"decode_gemm out must be ({m}, {n}) with unit stride on N; got {tuple(out.shape)} "
                         f"with strides {out.stride()}")
    block_m = max(16, next_power_of_2(m))
    tiles = triton.cdiv(n, config.block_n)
    k_tiles = triton.cdiv(k, config.block_k)
    split = max(1, min(config.split_k, k_tiles))
    k_per_split = triton.cdiv(k_tiles, split) * config.block_k
    split = triton.cdiv(k, k_per_split)  # no empty split
    if split > 1 and workspace is None:
        raise ValueError("decode_gemm with split_k > 1 needs a SplitKWorkspace")
    if workspace is not None:  # also unsplit: the same pointer types, one compiled kernel
        workspace.reserve(max(1, tiles * split * config.block_n * block_m) if split > 1 else 1, max(1, tiles))
        partials, counters = workspace.partials, workspace.counters
    else:
        partials, counters = out, out  # never touched when unsplit
    _decode_gemm_kernel[(tiles, split)](
        x, weight, out, partials, counters, m, n, k, x.stride(0), weight.stride(0), out.stride(0), k_per_split,
        split, BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out
