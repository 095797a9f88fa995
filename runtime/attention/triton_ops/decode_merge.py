"""Stage 2 of the split-KV decode (`decode_attention.py`): each request's KV splits, and with shared-prefix
attention the prefix kernel's partials (`PrefixPartials`), merged by their log-sum-exps (base 2) into the
output. A request's splits sit in the scratch at the rows of their stage-1 items: with even splits at rows
b * split_cap + split, with a plan (`SplitPlan`, decode_config.py) its first split at row b and the others from
the row the plan names.

An empty split or request (seq_len == 0) weighs nothing; a request with nothing at all gets zeros.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from ...kernels.launch import pdl_wait_then_release
from .decode_config import DecodeConfig


@triton.jit
def suffix_start(ReqInfo, b, HAS_PREFIX: tl.constexpr):
    # First KV position the split-KV stages cover: the suffix after the group's shared prefix.
    if HAS_PREFIX:
        begin = tl.load(ReqInfo + b * 3).to(tl.int32)
    else:
        begin = b * 0  # an int32 zero, folded away
    return begin


@triton.jit
def request_split_count(Splits, b, suffix_len, split_cap, MIN_SPLIT_LEN: tl.constexpr, ITEMS: tl.constexpr):
    # A request's KV splits: its plan's count, or with even splits the same formula in both stages, so they
    # agree on where each starts and ends.
    if ITEMS:
        n = tl.load(Splits + 2 * b)
    else:
        n = tl.maximum(tl.minimum(tl.cdiv(suffix_len, MIN_SPLIT_LEN), split_cap), 1)
    return n


@triton.jit
def _request_splits(
    SeqLens, ReqInfo, Splits, b, split_cap, MIN_SPLIT_LEN: tl.constexpr, HAS_PREFIX: tl.constexpr, ITEMS: tl.constexpr
):
    # Stage 2's view of request b: the KV length stage 1 covered, its split count and length, and where its
    # partials are: the request's block of the scratch (even splits: its own; a plan's: the one shared
    # block), and in it the rows of its first and second splits (the others follow the second).
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    suffix_len = tl.maximum(seq_len - suffix_start(ReqInfo, b, HAS_PREFIX), 0)
    num_splits = request_split_count(Splits, b, suffix_len, split_cap, MIN_SPLIT_LEN, ITEMS)
    if ITEMS:
        block = b * 0
        first_row = b
        second_row = tl.load(Splits + 2 * b + 1)
    else:
        block = b
        first_row = b * 0
        second_row = first_row + 1
    return suffix_len, num_splits, tl.cdiv(suffix_len, num_splits), block, first_row, second_row


@triton.jit(do_not_specialize=["split_cap", "stride_plb", "stride_plh"])  # see _decode_stage1_kernel's note
def _decode_stage2_kernel(
    PartialO,
    PartialLse,
    SeqLens,
    Out,
    ReqInfo,
    Splits,
    PrefixO,
    PrefixLse,
    split_cap,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_plb,
    stride_plh,
    stride_ob,
    stride_oh,
    stride_xos,
    stride_xoh,
    stride_xls,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    MIN_SPLIT_LEN: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
    ITEMS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_wait_then_release(USE_PDL)
    # One program per request, all its query heads at once: a (heads x head_dim) tile per split.
    # NOTE: a program per (request, head) moved 2 KB each: at a large batch, tens of thousands of tiny
    # programs whose time went mostly to block scheduling.
    b = tl.program_id(0)

    suffix_len, num_splits, split_len, block, first_row, second_row = _request_splits(
        SeqLens, ReqInfo, Splits, b, split_cap, MIN_SPLIT_LEN, HAS_PREFIX, ITEMS
    )
    PartialO += block * stride_pob
    PartialLse += block * stride_plb
    offs_h = tl.arange(0, BLOCK_HQ)
    h_mask = offs_h < NUM_HEADS
    offs_s = tl.arange(0, BLOCK_S)
    if ITEMS:
        rows = tl.where(offs_s == 0, first_row, second_row + offs_s - 1)  # (BLOCK_S,) each split's row
    else:
        rows = offs_s
    # NOTE: with split_len = cdiv(L, n) the last split can be empty (L=9, n=4 -> 3,3,3,0); stage 1
    # wrote nothing there, so it must be masked here by its start, not just by num_splits.
    s_mask = (offs_s < num_splits) & (offs_s * split_len < suffix_len)
    offs_d = tl.arange(0, BLOCK_D)
    hd_mask = h_mask[:, None] & (offs_d < HEAD_DIM)[None, :]

    lse = tl.load(
        PartialLse + offs_h[:, None] * stride_plh + rows[None, :],
        mask=h_mask[:, None] & s_mask[None, :],
        other=float("-inf"),
    )  # (BLOCK_HQ, BLOCK_S)
    lse_max = tl.max(lse, 1)  # (BLOCK_HQ,)
    if HAS_PREFIX:
        p_slot = tl.load(ReqInfo + b * 3 + 1)
        n_prefix = tl.load(ReqInfo + b * 3 + 2)
        offs_p = tl.arange(0, BLOCK_P)
        lse_p = tl.load(
            PrefixLse + (p_slot + offs_p)[None, :] * stride_xls + offs_h[:, None],
            mask=h_mask[:, None] & (offs_p < n_prefix)[None, :],
            other=float("-inf"),
        )
        lse_max = tl.maximum(lse_max, tl.max(lse_p, 1))
    # Guard the all-empty case (seq_len == 0): exp2(-inf - -inf) would be NaN.
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w = tl.exp2(lse - lse_max[:, None])  # (BLOCK_HQ, BLOCK_S), 0 for masked splits
    w_sum = tl.sum(w, 1)
    acc = tl.zeros([BLOCK_HQ, BLOCK_D], dtype=tl.float32)
    # The splits stage 1 wrote (not the empty last one; the scratch there is stale, maybe NaN).
    n_written = tl.cdiv(suffix_len, tl.maximum(split_len, 1))
    for s in range(0, n_written):
        if ITEMS:  # (a plan's requests may have up to 64 splits: its weight read, not picked from the tile)
            row = tl.where(s == 0, first_row, second_row + s - 1)
            lse_s = tl.load(PartialLse + offs_h * stride_plh + row, mask=h_mask, other=float("-inf"))
            w_s = tl.exp2(lse_s - lse_max)  # (BLOCK_HQ,) this split's weight
        else:
            row = s
            w_s = tl.sum(tl.where(offs_s[None, :] == s, w, 0.0), 1)  # (BLOCK_HQ,) this split's weight
        o = tl.load(
            PartialO + offs_h[:, None] * stride_poh + row * stride_pos + offs_d[None, :],
            mask=hd_mask,
            other=0.0,
        )
        acc += o * w_s[:, None]
    if HAS_PREFIX:
        w_p = tl.exp2(lse_p - lse_max[:, None])  # (BLOCK_HQ, BLOCK_P)
        w_sum += tl.sum(w_p, 1)
        for j in range(0, n_prefix):
            w_j = tl.sum(tl.where(offs_p[None, :] == j, w_p, 0.0), 1)
            o = tl.load(
                PrefixO + (p_slot + j) * stride_xos + offs_h[:, None] * stride_xoh + offs_d[None, :],
                mask=hd_mask,
                other=0.0,
            )
            acc += o * w_j[:, None]
    out = acc / tl.where(w_sum > 0, w_sum, 1.0)[:, None]
    tl.store(
        Out + b * stride_ob + offs_h[:, None] * stride_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=hd_mask,
    )


@triton.jit(do_not_specialize=["split_cap", "stride_plb", "stride_plh"])  # see _decode_stage1_kernel's note
def _decode_stage2_per_head_kernel(
    PartialO,
    PartialLse,
    SeqLens,
    Out,
    ReqInfo,
    Splits,
    PrefixO,
    PrefixLse,
    split_cap,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_plb,
    stride_plh,
    stride_ob,
    stride_oh,
    stride_xos,
    stride_xoh,
    stride_xls,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    CHUNK_S: tl.constexpr,
    MIN_SPLIT_LEN: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
    ITEMS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_wait_then_release(USE_PDL)
    # One program per (request, query head), all splits in one load: the latency-bound small batches'
    # merge (a batch of one has 32 of these programs, where the per-request merge has one).
    b = tl.program_id(0)
    head = tl.program_id(1)

    suffix_len, num_splits, split_len, block, first_row, second_row = _request_splits(
        SeqLens, ReqInfo, Splits, b, split_cap, MIN_SPLIT_LEN, HAS_PREFIX, ITEMS
    )
    PartialO += block * stride_pob + head * stride_poh
    PartialLse += block * stride_plb + head * stride_plh
    offs_s = tl.arange(0, BLOCK_S)
    if ITEMS:
        rows = tl.where(offs_s == 0, first_row, second_row + offs_s - 1)  # (BLOCK_S,) each split's row
    else:
        rows = offs_s
    # NOTE: with split_len = cdiv(L, n) the last split can be empty (L=9, n=4 -> 3,3,3,0); stage 1
    # wrote nothing there, so it must be masked here by its start, not just by num_splits.
    s_mask = (offs_s < num_splits) & (offs_s * split_len < suffix_len)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM

    lse = tl.load(PartialLse + rows, mask=s_mask, other=float("-inf"))  # (BLOCK_S,)
    lse_max = tl.max(lse, 0)
    if HAS_PREFIX:
        p_slot = tl.load(ReqInfo + b * 3 + 1)
        offs_p = tl.arange(0, BLOCK_P)
        p_mask = offs_p < tl.load(ReqInfo + b * 3 + 2)
        lse_p = tl.load(
            PrefixLse + (p_slot + offs_p) * stride_xls + head, mask=p_mask, other=float("-inf")
        )  # (BLOCK_P,)
        lse_max = tl.maximum(lse_max, tl.max(lse_p, 0))
    # Guard the all-empty case (seq_len == 0): exp2(-inf - -inf) would be NaN.
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w = tl.exp2(lse - lse_max)  # (BLOCK_S,) 0 for masked splits
    w_sum = tl.sum(w, 0)
    if ITEMS:
        # A plan's partials CHUNK_S splits at a time: as many as even splits give a request of this batch
        # (one chunk), where one (BLOCK_S, BLOCK_D) tile would hold the most splits a request can have (64
        # rows) in every program, most of them masked.
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        n_written = tl.cdiv(suffix_len, tl.maximum(split_len, 1))
        for c in range(0, n_written, CHUNK_S):
            offs_c = c + tl.arange(0, CHUNK_S)
            c_mask = offs_c < n_written
            rows_c = tl.where(offs_c == 0, first_row, second_row + offs_c - 1)
            w_c = tl.exp2(tl.load(PartialLse + rows_c, mask=c_mask, other=float("-inf")) - lse_max)  # (CHUNK_S,)
            o = tl.load(
                PartialO + rows_c[:, None] * stride_pos + offs_d[None, :],
                mask=c_mask[:, None] & d_mask[None, :],
                other=0.0,
            )  # (CHUNK_S, BLOCK_D)
            acc += tl.sum(o * w_c[:, None], 0)  # (BLOCK_D,)
    else:
        o = tl.load(
            PartialO + offs_s[:, None] * stride_pos + offs_d[None, :],
            mask=s_mask[:, None] & d_mask[None, :],
            other=0.0,
        )  # (BLOCK_S, BLOCK_D)
        acc = tl.sum(o * w[:, None], 0)  # (BLOCK_D,)
    if HAS_PREFIX:
        w_p = tl.exp2(lse_p - lse_max)  # (BLOCK_P,)
        o_p = tl.load(
            PrefixO + (p_slot + offs_p)[:, None] * stride_xos + head * stride_xoh + offs_d[None, :],
            mask=p_mask[:, None] & d_mask[None, :],
            other=0.0,
        )  # (BLOCK_P, BLOCK_D)
        w_sum += tl.sum(w_p, 0)
        acc += tl.sum(o_p * w_p[:, None], 0)
    out = acc / tl.where(w_sum > 0, w_sum, 1.0)  # (BLOCK_D,)
    tl.store(Out + b * stride_ob + head * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=d_mask)


@dataclass
class PrefixPartials:
    """What the shared-prefix kernel left for the split-KV decode to merge (see prefix_attention.py)."""

    req_info: torch.Tensor  # (B, 3) int32: suffix start, first prefix partial slot, prefix partials
    partial_o: torch.Tensor  # (slots, H, D) fp32
    partial_lse: torch.Tensor  # (slots, H) fp32
    max_partials: int  # most prefix partials one request has (sizes stage 2's merge)


def merge_partials(
    partial_o: torch.Tensor,  # fp32, stage 1's per-split outputs (layout: decode_attention's scratch)
    partial_lse: torch.Tensor,  # fp32, their log-sum-exps (base 2)
    strides: tuple[int, int, int, int, int],  # the scratch layout's (block, head, split) and lse (block, head)
    seq_lens: torch.Tensor,  # (B,)
    out: torch.Tensor,  # (B, H, D) written in place
    req_info: torch.Tensor,  # (B, 3) int32 with a prefix (suffix start, first prefix slot, prefix partials)
    splits: Optional[torch.Tensor],  # int32, an uneven split plan (SplitPlan's table); None: even splits
    prefix_o: torch.Tensor,  # (slots, H, D) fp32 prefix partials (unused without a prefix)
    prefix_lse: torch.Tensor,  # (slots, H) fp32
    split_cap: int,  # even splits: the most a request has (cfg.even_splits)
    max_row_splits: int,  # the most splits any request can have
    cfg: DecodeConfig,
    prefix: Optional[PrefixPartials],
    pdl: dict,
) -> None:
    """Stage 2: each request's splits (and prefix partials) merged into `out`, per request or, for the
    latency-bound small batches (`cfg.merge_per_head`), per (request, query head)."""
    batch, num_heads, head_dim = out.shape
    block_d = triton.next_power_of_2(head_dim)
    block_p = triton.next_power_of_2(max(1, prefix.max_partials if prefix is not None else 1))
    # NOTE: the bounds depend on the config and batch size only, so a captured graph's constexpr BLOCK_S
    # stays right for any sequence lengths.
    block_s = triton.next_power_of_2(max_row_splits)
    # NOTE: without a prefix, `prefix_o` / `prefix_lse` are the split partials passed as unused pointers, and their
    # strides would carry a plan's item count (different every step): specialized by whether it is a multiple of
    # 16, a value the start-up's graphs never passed compiled a variant mid-serving (H100, every serving row).
    prefix_strides = (prefix_o.stride(0), prefix_o.stride(1), prefix_lse.stride(0)) if prefix is not None else (0, 0, 0)
    args = (
        partial_o,
        partial_lse,
        seq_lens,
        out,
        req_info,
        splits if splits is not None else seq_lens,  # (unused with even splits)
        prefix_o,
        prefix_lse,
        split_cap,
        *strides,
        out.stride(0),
        out.stride(1),
        *prefix_strides,
    )
    consts = dict(
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_S=block_s,
        MIN_SPLIT_LEN=cfg.min_split_len,
        HAS_PREFIX=prefix is not None,
        ITEMS=splits is not None,
        BLOCK_P=block_p,
        **pdl,
    )
    if cfg.merge_per_head:
        # (a request's partials CHUNK_S at a time: as many as even splits give it, in one chunk)
        chunk = min(block_s, triton.next_power_of_2(split_cap))
        _decode_stage2_per_head_kernel[(batch, num_heads)](
            *args, **consts, CHUNK_S=chunk, num_warps=4 if block_d >= 128 else 2
        )
    else:
        _decode_stage2_kernel[(batch,)](
            *args, NUM_HEADS=num_heads, BLOCK_HQ=triton.next_power_of_2(num_heads), **consts, num_warps=4
        )
