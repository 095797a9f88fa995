"""The segmented LoRA matmul as two Triton kernels (SGMV, after Punica): a step's rows grouped into
segments of one adapter each, one program per (segment, tile of its rows[, tile of output columns]).

- shrink: shrunk (T, K) = x (T, in) @ A[slot, layer]^T (K = subs * R), per segment, looped over `in`;
- expand: y[:, cols] += shrunk[:, j * R : (j + 1) * R] @ B[slot, layer, cols]^T, one launch per
  sub-projection j of the fused target (q | k | v; gate | up), each over its own output columns.

A segment of slot 0 (the base model) returns at once: its rows are left as the base matmul wrote them.
Segments are device data ((S,) starts, lengths, slots), so a step can be captured in a CUDA graph: the
gathered form of `LoraBatch` (no host segments) is the same kernels with one segment per token. The grid
needs only the longest segment's length, which the host knows where it knows the segments.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 16  # rows per program (tl.dot needs at least 16)
BLOCK_IN = 64  # the shrink's step over the input features
BLOCK_N = 64  # output columns per expand program


def _block(n: int) -> int:
    """A tl.dot dimension of at least 16 (what the GPU's dot needs) holding `n`."""
    return max(16, triton.next_power_of_2(n))


# NOTE: the layer (and the expand's column offset and sub-projection) not specialized: each value 1 or a
# multiple of 16 would compile a variant of its own, after start-up's warm-up.
@triton.jit(do_not_specialize=["layer"])
def _shrink_kernel(
    X,
    A,
    Out,
    SegStart,
    SegLen,
    SegSlot,
    layer,
    stride_xt,
    stride_as,
    stride_al,
    stride_ak,
    IN: tl.constexpr,
    K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_IN: tl.constexpr,
):
    seg, tile = tl.program_id(0), tl.program_id(1)
    slot = tl.load(SegSlot + seg)
    n = tl.load(SegLen + seg)
    if (slot == 0) | (tile * BLOCK_T >= n):  # a base segment, or a tile past its end
        return
    local = tile * BLOCK_T + tl.arange(0, BLOCK_T)  # (BT,) rows within the segment
    rows = tl.load(SegStart + seg).to(tl.int64) + local
    row_mask = local < n
    ks = tl.arange(0, BLOCK_K)  # (BK,)
    k_mask = ks < K
    a_base = A + slot.to(tl.int64) * stride_as + layer * stride_al
    acc = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    for i0 in range(0, IN, BLOCK_IN):
        cols = i0 + tl.arange(0, BLOCK_IN)  # (BI,)
        c_mask = cols < IN
        x = tl.load(X + rows[:, None] * stride_xt + cols[None, :], mask=row_mask[:, None] & c_mask[None, :], other=0.0)
        a = tl.load(a_base + ks[:, None] * stride_ak + cols[None, :], mask=k_mask[:, None] & c_mask[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(a), input_precision="ieee")  # (BT, BK)
    out_ptrs = Out + rows[:, None] * K + ks[None, :]
    tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=row_mask[:, None] & k_mask[None, :])


@triton.jit(do_not_specialize=["layer", "col_offset", "sub"])
def _expand_kernel(
    Shrunk,
    B,
    Y,
    SegStart,
    SegLen,
    SegSlot,
    layer,
    col_offset,
    sub,
    stride_yt,
    stride_bs,
    stride_bl,
    stride_bo,
    SIZE: tl.constexpr,
    K: tl.constexpr,
    R: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    seg, tile, tile_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(SegSlot + seg)
    n = tl.load(SegLen + seg)
    if (slot == 0) | (tile * BLOCK_T >= n):  # a base segment, or a tile past its end
        return
    local = tile * BLOCK_T + tl.arange(0, BLOCK_T)  # (BT,)
    rows = tl.load(SegStart + seg).to(tl.int64) + local
    row_mask = local < n
    rs = tl.arange(0, BLOCK_R)  # (BR,)
    r_mask = rs < R
    within = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,) columns within this sub-projection
    n_mask = within < SIZE
    cols = col_offset + within  # (BN,) columns of the fused output
    s = tl.load(
        Shrunk + rows[:, None] * K + sub * R + rs[None, :], mask=row_mask[:, None] & r_mask[None, :], other=0.0
    )  # (BT, BR)
    b_base = B + slot.to(tl.int64) * stride_bs + layer * stride_bl
    b = tl.load(b_base + cols[:, None] * stride_bo + rs[None, :], mask=n_mask[:, None] & r_mask[None, :], other=0.0)
    delta = tl.dot(s, tl.trans(b), input_precision="ieee")  # (BT, BN)
    y_ptrs = Y + rows[:, None] * stride_yt + cols[None, :]
    mask = row_mask[:, None] & n_mask[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(Y.dtype.element_ty), mask=mask)


class Segments:
    """A step's segments as device data: (S,) starts, lengths and slots, and the longest one's length."""

    def __init__(self, starts: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor, longest: int):
        self.starts, self.lengths, self.slots, self.longest = starts, lengths, slots, longest

    @classmethod
    def of_runs(cls, runs: list[tuple[int, int, int]], device) -> "Segments":
        """(first token, end, slot) runs, known on the host (base runs may be left out)."""
        # (3, S): one copy up, each row contiguous as the kernels read it
        table = torch.tensor([[s, e - s, slot] for s, e, slot in runs] or [[0, 0, 0]], dtype=torch.int64).t()
        table = table.contiguous().to(device, non_blocking=True)
        longest = max((e - s for s, e, _ in runs), default=0)
        return cls(table[0], table[1], table[2], longest)

    @classmethod
    def per_token(cls, token_slots: torch.Tensor) -> "Segments":
        """One segment per token, its slot read on the device (no host value: what a CUDA graph holds)."""
        T = token_slots.shape[0]
        starts = torch.arange(T, dtype=torch.int64, device=token_slots.device)
        return cls(starts, torch.ones_like(starts), token_slots, 1)


def sgmv_apply(
    segments: Segments,
    a_all: torch.Tensor,
    b_all: torch.Tensor,
    layer: int,
    rank: int,
    splits: list[int],
    x: torch.Tensor,
    y: torch.Tensor,
) -> torch.Tensor:
    """y (T, out) += each segment's adapter over x (T, in): A `a_all` (S+1, L, subs * R, in), B `b_all`
    (S+1, L, out, R), `splits` the sub-projections' output sizes; y written in place and returned."""
    T, fan_in = x.shape
    num_segs = segments.starts.shape[0]
    if T == 0 or num_segs == 0 or segments.longest == 0:
        return y
    assert y.stride(1) == 1, "the kernels write y's rows as contiguous columns"
    x = x.contiguous()
    K = a_all.shape[2]
    shrunk = torch.empty(T, K, dtype=x.dtype, device=x.device)  # rows of base segments never read
    row_tiles = triton.cdiv(segments.longest, BLOCK_T)
    _shrink_kernel[(num_segs, row_tiles)](
        x,
        a_all,
        shrunk,
        segments.starts,
        segments.lengths,
        segments.slots,
        layer,
        x.stride(0),
        a_all.stride(0),
        a_all.stride(1),
        a_all.stride(2),
        IN=fan_in,
        K=K,
        BLOCK_T=BLOCK_T,
        BLOCK_K=_block(K),
        BLOCK_IN=BLOCK_IN,
    )
    col = 0
    for sub, size in enumerate(splits):
        _expand_kernel[(num_segs, row_tiles, triton.cdiv(size, BLOCK_N))](
            shrunk,
            b_all,
            y,
            segments.starts,
            segments.lengths,
            segments.slots,
            layer,
            col,
            sub,
            y.stride(0),
            b_all.stride(0),
            b_all.stride(1),
            b_all.stride(2),
            SIZE=size,
            K=K,
            R=rank,
            BLOCK_T=BLOCK_T,
            BLOCK_R=_block(rank),
            BLOCK_N=BLOCK_N,
        )
        col += size
    return y
