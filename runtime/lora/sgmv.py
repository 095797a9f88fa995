"""The segmented LoRA matmul as two Triton kernels (SGMV, after Punica): a step's rows grouped into
segments of one adapter each.

- shrink: partials (P, T, K) fp32, part p of x (T, in) @ A[slot, layer]^T (K = subs * R) over the p-th
  slice of `in` (split-K): one program per (segment, tile of its rows, slice), so a few rows still fill the
  GPU; their sum is the shrunk (T, K);
- expand: y (T, out) += shrunk[:, j * R : (j + 1) * R] @ B[slot, layer, cols]^T for the columns of each
  sub-projection j of the fused target (q | k | v; gate | up), one program per (segment, tile of its rows,
  tile of output columns), summing the P partials as it loads them (no atomics, no reduction kernel).

Segments of one row each (the CUDA-graph form) take a GEMV path (a broadcast product summed, no 16-row
`tl.dot` tile of which 15 rows would be masked): a constexpr of the shrink, an expand kernel of their own
whose programs each take a few rows' tile of output columns.

A segment of slot 0 (the base model) returns at once: its rows are left as the base matmul wrote them.
Segments are device data ((S,) starts, lengths, slots), so a step can be captured in a CUDA graph: the
gathered form of `LoraBatch` (no host segments) is the same kernels with one segment per token. The grid
needs only the longest segment's length and the shapes, which the host knows where it knows the segments.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import triton
import triton.language as tl

from ..uploads import to_device

BLOCK_T = 16  # rows per tile (tl.dot needs at least 16)
BLOCK_IN = 64  # the tiled shrink's step over the input features
BLOCK_N = 64  # output columns per expand program
# Runs of at least this many rows (a prompt's prefill) take the expand in RUN_EXPAND_ROWS x 128 tiles. NOTE:
# in 16 x 64 tiles a prefill of 8 runs of 1,024 rows made 229,376 programs of 4 KB of y each for gate_up
# (443 us against the 2,640 of its base matmul, H100); the expand's row tile need not be the shrink's.
RUN_EXPAND_ROWS = 64
# One-row segments (decode): the expand's (segments, output columns) a program, by how many programs one
# row and BLOCK_N columns each would make. NOTE: H100, bench_sgmv.py: up to ~3,000 such programs, one row
# a program is fastest (qkv, o, down at 32 rows); from ~8,000 (gate_up at 32 rows: 14,336; everything at
# 128 rows) 4 rows x 256 columns is, by 10-40% (each program walks its rows in turn, which costs where
# programs are few).
ONE_ROW_EXPAND_MANY = 4096
ROW_TILE_ELEMS = 4096  # the one-row shrink's (BK, BI) accumulator: 32 fp32 registers a thread at 4 warps

# How many slices of the input features the shrink splits into: enough programs for about two waves on an
# H100's 132 SMs when the rows alone are few, each slice at least MIN_SLICE_IN features (shorter slices
# would make the expand's sum of partials cost more than they save), and at most MAX_SPLITS_ROW /
# MAX_SPLITS_TILE, what the expand sums for each row (NOTE: one-row down at 32 rows: 56 splits 13.6 us,
# 32 splits 8.3, H100) and holds unrolled for a tile.
TARGET_PROGRAMS = 264
# One-row segments' programs are a row's slice of the features, whose loop waits on each load: NOTE: at
# 264 programs T = 32 took slices of 512 (down: 1,792) features and T = 128 of 2,048 (qkv 42.8 us against
# the base matmul's 20.7, H100); ONE_ROW_PROGRAMS keeps each SM several programs deep instead.
ONE_ROW_PROGRAMS = 2048
MIN_SLICE_IN = 128
MAX_SPLITS_ROW = 32
MAX_SPLITS_TILE = 8


def _block(n: int) -> int:
    """A tl.dot dimension of at least 16 (what the GPU's dot needs) holding `n`."""
    return max(16, triton.next_power_of_2(n))


def one_row_expand_grid(num_segs: int, fan_out: int) -> tuple[int, int]:
    """(segments, output columns) per program of the one-row expand over `num_segs` rows."""
    return (4, 256) if num_segs * triton.cdiv(fan_out, BLOCK_N) > ONE_ROW_EXPAND_MANY else (1, BLOCK_N)


def run_expand_tile(longest: int) -> tuple[int, int]:
    """(rows, output columns) per program of the runs' expand, for runs of at most `longest` rows."""
    return (RUN_EXPAND_ROWS, 2 * BLOCK_N) if longest >= RUN_EXPAND_ROWS else (BLOCK_T, BLOCK_N)


def run_expand_warps(block_t: int, block_n: int) -> int:
    """Warps of a runs' expand program: 8 for a tile of 8,192 outputs or more (64 fp32 accumulators a
    thread at 4 warps)."""
    return 8 if block_t * block_n >= 8192 else 4


def shrink_plan(
    num_segs: int, longest: int, fan_in: int, K: int, in_splits: Optional[int] = None, fan_out: Optional[int] = None
):
    """(splits, slice, block_in) of the shrink for `num_segs` segments of at most `longest` rows over
    `fan_in` input features into K outputs (for a target of `fan_out` output columns): `splits` programs per
    row tile, each over `slice` features (a multiple of `block_in`, its step), every split non-empty.
    `in_splits`: ask for that many instead of the rule's (tests, the benchmark); host values only, so a
    captured graph replays the same grid."""
    one_row = longest == 1
    block_in = min(128, max(32, ROW_TILE_ELEMS // _block(K))) if one_row else BLOCK_IN
    if in_splits is None:
        programs = num_segs * triton.cdiv(longest, BLOCK_T)
        most = MAX_SPLITS_ROW if one_row else MAX_SPLITS_TILE
        target = ONE_ROW_PROGRAMS if one_row else TARGET_PROGRAMS
        in_splits = min(target // programs, fan_in // MIN_SLICE_IN, most)
        wide = fan_out is not None and (fan_out > 4 * fan_in or (longest >= 64 and fan_out >= fan_in))
        lone_long_run = longest >= RUN_EXPAND_ROWS and programs * 16 <= TARGET_PROGRAMS
        if not one_row and wide and not lone_long_run:
            # NOTE: the expand reads every split's partials once per BLOCK_N output columns: for row tiles
            # of a wide target (gate_up: 28,672 columns over 4,096 features) or long runs of an adapter
            # into as many columns as features (qkv, o), that costs more than the split saves (H100,
            # bench_sgmv.py: gate_up runs of 4-64 rows 1.5-3.1x the unsplit kernels, qkv / o runs of 64
            # rows 1.2-1.3x; down, 4,096 columns over 14,336 features, 2-4x faster split). Not where a
            # prompt or two alone make at most 16 row tiles: one program a tile walked all the features
            # (one 256-token prompt's LoRA took 30 ms of a 39 ms prefill on an H100).
            in_splits = 1
    in_splits = max(1, in_splits)
    slice_in = triton.cdiv(triton.cdiv(fan_in, in_splits), block_in) * block_in
    return triton.cdiv(fan_in, slice_in), slice_in, block_in


# NOTE: the layer and the partials' split stride (T * K) not specialized: each value 1 or a multiple of 16
# would compile a variant of its own, after start-up's warm-up.
@triton.jit(do_not_specialize=["layer", "split_stride"])
def _shrink_kernel(
    X,
    A,
    Partials,
    SegStart,
    SegLen,
    SegSlot,
    layer,
    split_stride,
    stride_xt,
    stride_as,
    stride_al,
    stride_ak,
    IN: tl.constexpr,
    K: tl.constexpr,
    SLICE_IN: tl.constexpr,
    ONE_ROW: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_IN: tl.constexpr,
):
    seg, tile, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(SegSlot + seg)
    n = tl.load(SegLen + seg)
    if (slot == 0) | (tile * BLOCK_T >= n):  # a base segment, or a tile past its end
        return
    ks = tl.arange(0, BLOCK_K)  # (BK,)
    k_mask = ks < K
    a_base = A + slot.to(tl.int64) * stride_as + layer * stride_al
    first = split * SLICE_IN
    out_base = Partials + split.to(tl.int64) * split_stride
    if ONE_ROW:
        row = tl.load(SegStart + seg).to(tl.int64)
        acc = tl.zeros((BLOCK_K, BLOCK_IN), dtype=tl.float32)
        for i0 in range(0, SLICE_IN, BLOCK_IN):
            cols = first + i0 + tl.arange(0, BLOCK_IN)  # (BI,)
            c_mask = cols < IN
            x = tl.load(X + row * stride_xt + cols, mask=c_mask, other=0.0)  # (BI,)
            a = tl.load(
                a_base + ks[:, None] * stride_ak + cols[None, :], mask=k_mask[:, None] & c_mask[None, :], other=0.0
            )
            acc += a.to(tl.float32) * x.to(tl.float32)[None, :]  # (BK, BI)
        tl.store(out_base + row * K + ks, tl.sum(acc, axis=1), mask=k_mask)
    else:
        local = tile * BLOCK_T + tl.arange(0, BLOCK_T)  # (BT,) rows within the segment
        rows = tl.load(SegStart + seg).to(tl.int64) + local
        row_mask = local < n
        acc = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
        for i0 in range(0, SLICE_IN, BLOCK_IN):
            cols = first + i0 + tl.arange(0, BLOCK_IN)  # (BI,)
            c_mask = cols < IN
            x = tl.load(
                X + rows[:, None] * stride_xt + cols[None, :], mask=row_mask[:, None] & c_mask[None, :], other=0.0
            )
            a = tl.load(
                a_base + ks[:, None] * stride_ak + cols[None, :], mask=k_mask[:, None] & c_mask[None, :], other=0.0
            )
            acc += tl.dot(x, tl.trans(a), input_precision="ieee")  # (BT, BK)
        tl.store(out_base + rows[:, None] * K + ks[None, :], acc, mask=row_mask[:, None] & k_mask[None, :])


@triton.jit(do_not_specialize=["layer", "split_stride"])
def _expand_kernel(
    Partials,
    B,
    Y,
    SegStart,
    SegLen,
    SegSlot,
    layer,
    split_stride,
    stride_yt,
    stride_bs,
    stride_bl,
    stride_bo,
    SPLITS: tl.constexpr,
    SUBS: tl.constexpr,
    END0: tl.constexpr,
    END1: tl.constexpr,
    END2: tl.constexpr,
    K: tl.constexpr,
    R: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Segments of runs: one program per (segment, tile of its rows, tile of output columns)."""
    seg, tile, tile_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(SegSlot + seg)
    n = tl.load(SegLen + seg)
    if (slot == 0) | (tile * BLOCK_T >= n):  # a base segment, or a tile past its end
        return
    rs = tl.arange(0, BLOCK_R)  # (BR,)
    r_mask = rs < R
    first_col = tile_n * BLOCK_N
    cols = first_col + tl.arange(0, BLOCK_N)  # (BN,) columns of the fused output
    b_base = B + slot.to(tl.int64) * stride_bs + layer * stride_bl
    local = tile * BLOCK_T + tl.arange(0, BLOCK_T)  # (BT,)
    rows = tl.load(SegStart + seg).to(tl.int64) + local
    row_mask = local < n
    delta = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for j in tl.static_range(SUBS):
        lo = END0 if j == 1 else (END1 if j == 2 else 0)  # sub-projection j's columns [lo, hi)
        hi = END0 if j == 0 else (END1 if j == 1 else END2)
        if (first_col < hi) & (first_col + BLOCK_N > lo):  # this tile holds columns of sub-projection j
            part_ptrs = Partials + rows[:, None] * K + j * R + rs[None, :]  # (BT, BR) of split 0
            part_mask = row_mask[:, None] & r_mask[None, :]
            s = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
            for p in tl.static_range(SPLITS):  # (at most MAX_SPLITS_TILE)
                s += tl.load(part_ptrs + p * split_stride, mask=part_mask, other=0.0)
            n_mask = (cols >= lo) & (cols < hi)
            b = tl.load(
                b_base + cols[:, None] * stride_bo + rs[None, :], mask=n_mask[:, None] & r_mask[None, :], other=0.0
            )
            # NOTE: the shrunk rows rounded to the adapter's dtype, as the torch path's matmuls round them
            delta += tl.dot(s.to(b.dtype), tl.trans(b), input_precision="ieee")  # (BT, BN)
    y_ptrs = Y + rows[:, None] * stride_yt + cols[None, :]
    mask = row_mask[:, None] & (cols < END2)[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(Y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_segs", "layer", "split_stride"])
def _expand_rows_kernel(
    Partials,
    B,
    Y,
    SegStart,
    SegSlot,
    num_segs,
    layer,
    split_stride,
    stride_yt,
    stride_bs,
    stride_bl,
    stride_bo,
    SPLITS: tl.constexpr,
    SUBS: tl.constexpr,
    END0: tl.constexpr,
    END1: tl.constexpr,
    END2: tl.constexpr,
    K: tl.constexpr,
    R: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Segments of one row (decode): one program per (ROWS segments, tile of output columns), a broadcast
    product summed per row (no 16-row `tl.dot` tile of which 15 rows would be masked)."""
    group, tile_n = tl.program_id(0), tl.program_id(1)
    ps = tl.arange(0, BLOCK_P)  # (BP,) the shrink's splits
    p_mask = ps < SPLITS
    rs = tl.arange(0, BLOCK_R)  # (BR,)
    r_mask = rs < R
    first_col = tile_n * BLOCK_N
    cols = first_col + tl.arange(0, BLOCK_N)  # (BN,) columns of the fused output
    for i in tl.static_range(ROWS):
        seg = group * ROWS + i
        if seg < num_segs:
            slot = tl.load(SegSlot + seg)
            if slot != 0:  # a base row is left as the base matmul wrote it
                row = tl.load(SegStart + seg).to(tl.int64)
                b_base = B + slot.to(tl.int64) * stride_bs + layer * stride_bl
                delta = tl.zeros((BLOCK_N,), dtype=tl.float32)
                for j in tl.static_range(SUBS):
                    lo = END0 if j == 1 else (END1 if j == 2 else 0)  # sub-projection j's columns [lo, hi)
                    hi = END0 if j == 0 else (END1 if j == 1 else END2)
                    if (first_col < hi) & (first_col + BLOCK_N > lo):  # the tile holds columns of j
                        part_ptrs = Partials + ps[:, None].to(tl.int64) * split_stride + row * K + j * R + rs[None, :]
                        part_mask = p_mask[:, None] & r_mask[None, :]
                        s = tl.sum(tl.load(part_ptrs, mask=part_mask, other=0.0), axis=0)  # (BR,)
                        n_mask = (cols >= lo) & (cols < hi)
                        b = tl.load(
                            b_base + cols[:, None] * stride_bo + rs[None, :],
                            mask=n_mask[:, None] & r_mask[None, :],
                            other=0.0,
                        )
                        delta += tl.sum(b.to(tl.float32) * s[None, :], axis=1)  # (BN,)
                mask = cols < END2
                y_ptrs = Y + row * stride_yt + cols
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
        table = to_device(table.contiguous(), device)
        longest = max((e - s for s, e, _ in runs), default=0)
        return cls(table[0], table[1], table[2], longest)

    @classmethod
    def per_token(cls, token_slots: torch.Tensor) -> "Segments":
        """One segment per token, its slot read on the device (no host value: what a CUDA graph holds)."""
        T = token_slots.shape[0]
        starts = torch.arange(T, dtype=torch.int64, device=token_slots.device)
        return cls(starts, torch.ones_like(starts), token_slots, 1)


class Shrunk:
    """The shrink's output for one target, waiting for its expand: the (P, T, K) fp32 partials and the plan
    they were made with."""

    def __init__(self, segments: Segments, partials: torch.Tensor, rank: int, splits: list[int]):
        self.segments = segments
        self.partials = partials
        self.rank = rank
        self.splits = splits


def sgmv_shrink(
    segments: Segments,
    a_all: torch.Tensor,
    layer: int,
    rank: int,
    splits: list[int],
    x: torch.Tensor,
    in_splits: Optional[int] = None,
    stream: Optional[torch.cuda.Stream] = None,
) -> Optional[Shrunk]:
    """Each segment's rows of x (T, in) times its adapter's A (`a_all` (S+1, L, subs * R, in)), as the
    partials `sgmv_expand` sums; None when no segment holds a row. `in_splits`: the split of `in`, where not
    `shrink_plan`'s. `stream`: where the kernel runs, if not the current stream (the partials are still
    allocated on the current one, which must wait for `stream` before it reads or frees them, or x)."""
    T, fan_in = x.shape
    num_segs = segments.starts.shape[0]
    if T == 0 or num_segs == 0 or segments.longest == 0:
        return None
    assert 1 <= len(splits) <= 3, "a fused target of one to three sub-projections"
    assert x.stride(1) == 1, "the shrink reads x's rows as contiguous features"
    K = a_all.shape[2]
    num_splits, slice_in, block_in = shrink_plan(num_segs, segments.longest, fan_in, K, in_splits, sum(splits))
    partials = torch.empty(num_splits, T, K, dtype=torch.float32, device=x.device)  # base rows never read
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        _shrink_kernel[(num_segs, triton.cdiv(segments.longest, BLOCK_T), num_splits)](
            x,
            a_all,
            partials,
            segments.starts,
            segments.lengths,
            segments.slots,
            layer,
            T * K,
            x.stride(0),
            a_all.stride(0),
            a_all.stride(1),
            a_all.stride(2),
            IN=fan_in,
            K=K,
            SLICE_IN=slice_in,
            ONE_ROW=segments.longest == 1,
            BLOCK_T=BLOCK_T,
            BLOCK_K=_block(K),
            BLOCK_IN=block_in,
        )
    return Shrunk(segments, partials, rank, splits)


def sgmv_expand(
    shrunk: Shrunk,
    b_all: torch.Tensor,
    layer: int,
    y: torch.Tensor,
    expand_grid: Optional[tuple[int, int]] = None,
    run_tile: Optional[tuple[int, int]] = None,
) -> torch.Tensor:
    """y (T, out) += the shrunk rows times each segment's adapter's B (`b_all` (S+1, L, out, R)), in place
    (returned). `expand_grid`: the one-row expand's (rows, columns) a program, `run_tile`: the runs'
    expand's, where not `one_row_expand_grid`'s / `run_expand_tile`'s."""
    assert y.stride(1) == 1, "the kernels write y's rows as contiguous columns"
    segments, splits, partials = shrunk.segments, shrunk.splits, shrunk.partials
    num_splits, T, K = partials.shape
    num_segs = segments.starts.shape[0]
    ends = [sum(splits[: j + 1]) for j in range(len(splits))]
    ends += [ends[-1]] * (3 - len(ends))
    common = dict(
        SPLITS=num_splits,
        SUBS=len(splits),
        END0=ends[0],
        END1=ends[1],
        END2=ends[2],
        K=K,
        R=shrunk.rank,
        BLOCK_R=_block(shrunk.rank),
    )
    strides = (y.stride(0), b_all.stride(0), b_all.stride(1), b_all.stride(2))
    if segments.longest == 1:
        rows, block_n = expand_grid or one_row_expand_grid(num_segs, ends[-1])
        grid = (triton.cdiv(num_segs, rows), triton.cdiv(ends[-1], block_n))
        _expand_rows_kernel[grid](
            partials, b_all, y, segments.starts, segments.slots, num_segs, layer, T * K, *strides,
            ROWS=rows, BLOCK_N=block_n, BLOCK_P=triton.next_power_of_2(num_splits), **common,
        )  # fmt: skip
    else:
        block_t, block_n = run_tile or run_expand_tile(segments.longest)
        grid = (num_segs, triton.cdiv(segments.longest, block_t), triton.cdiv(ends[-1], block_n))
        _expand_kernel[grid](
            partials, b_all, y, segments.starts, segments.lengths, segments.slots, layer, T * K, *strides,
            BLOCK_T=block_t, BLOCK_N=block_n, num_warps=run_expand_warps(block_t, block_n), **common,
        )  # fmt: skip
    return y


def sgmv_apply(
    segments: Segments,
    a_all: torch.Tensor,
    b_all: torch.Tensor,
    layer: int,
    rank: int,
    splits: list[int],
    x: torch.Tensor,
    y: torch.Tensor,
    in_splits: Optional[int] = None,
    expand_grid: Optional[tuple[int, int]] = None,
    run_tile: Optional[tuple[int, int]] = None,
) -> torch.Tensor:
    """y (T, out) += each segment's adapter over x (T, in): the shrink then the expand, in place (returned).
    `splits` the sub-projections' output sizes (at most three); the rest as `sgmv_shrink` / `sgmv_expand`."""
    shrunk = sgmv_shrink(segments, a_all, layer, rank, splits, x.contiguous(), in_splits)
    return y if shrunk is None else sgmv_expand(shrunk, b_all, layer, y, expand_grid, run_tile)
