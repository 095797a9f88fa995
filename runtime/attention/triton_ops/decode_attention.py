"""Split-KV decode attention over the paged KV pool, in two Triton stages.

One query token per request attends over its whole sequence, whose K/V live in the pool at the slots
`req_to_token[req_pool_indices[b], 0:seq_lens[b]]`.

- Stage 1 (grid: kv-head group x request x split, or kv-head group x item of a split plan): each program
  takes one KV split of one request, one
  or more adjacent KV heads (`DecodeConfig.kv_heads_per_program`) and ALL the query heads that share
  them (GQA grouping), so every K/V row is read from memory once per group instead of once per query
  head. It writes the split's normalised partial output and its log-sum-exp (base 2).
- Stage 2 (`decode_merge.py`): merges each request's splits by their log-sum-exps (grid: batch, all query
  heads of a request in one program; small batches: batch x query head, see `DecodePolicy` in
  decode_config.py).
  With one split per request and nothing to merge, stage 1 writes the output itself and stage 2 is not
  launched.

With shared-prefix ("cascade") attention (`prefix_attention.py`), a grouped request's prefix was already
attended by the prefix kernel: stage 1 then covers only its suffix, from `req_info[b, 0]`, and stage 2
merges the `req_info[b, 2]` prefix partials (from slot `req_info[b, 1]`) with the splits. Both are
constexpr switches: the plain decode compiles to exactly the kernels it had without them.

Splitting the KV axis is what keeps the GPU busy when the batch is small (a batch of one has only
`num_kv_heads` programs otherwise), and what keeps a long request from walking its KV alone in a batch of
short ones. Even splits (no `splits` argument): the split count per request is computed inside the kernels
from `seq_lens` and a cap that depends only on the batch size (`DecodeConfig.even_splits`), so a captured
graph stays valid for any lengths. A split plan (`DecodeSplits`: `SplitPlan`, decode_config.py, on the
device), for a step with a long request among short ones: per request its split count, per stage-1 item its
request and split; a captured graph launches a fixed number of items (batch + `DecodeConfig.extra_items`)
and the items a step does not use exit at once. The two are constexpr switches: even splits compile to
exactly the kernels there were before plans.

Empty requests (seq_len == 0, e.g. CUDA-graph padding) produce an all-zero output.

An FP8 pool (`kv_scales`) is read as it is stored: its rows are widened in the kernel, K's scale folds into
the softmax scale and V's into the output (a constexpr switch: a pool in q's dtype compiles to exactly the
kernel it had without it). With bf16 queries the rows widen to fp16, not bf16, and q and the probabilities
take fp16 for the two products: Hopper converts a pair of e4m3 codes to fp16 in one instruction and to bf16
only through fp16 (two more a value, in the loop over every K/V tile); fp16 also keeps more of q's mantissa,
and q is clamped to fp16's range first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import triton
import triton.language as tl

from ...kernels.launch import pdl_launch_args, pdl_wait_then_release
from .decode_config import DecodeConfig, SplitPlan, decode_scratch_numel
from .decode_merge import PrefixPartials, merge_partials, request_split_count, suffix_start
from .kv_scale_args import kv_scale_args

_LOG2E = 1.4426950408889634
_F16_MAX: tl.constexpr = tl.constexpr(65504.0)
# An FP8 pool's rows with bf16 queries widen to fp16 (see the module's docstring); False widens them to bf16
# (sweep_decode_attention.py --widen bf16 times the two: on an H100, 64 requests x 1,536 keys 93 against 107 us,
# 256 x 700 160 against 184).
WIDEN_FP8_TO_F16 = True


# NOTE: split_cap, items_at, stride_plh (even splits: split_cap; a plan: its item count) and stride_plb (even
# splits: heads x split_cap) change with a step's batch and lengths. Specialized (Triton compiles a variant for
# an int that is 1 or a multiple of 16), a value the start-up warm-up never passed compiles a variant
# mid-serving, a stall of ~1 s (H100, random64: both decode kernels compiled after start-up). They feed counts,
# scalar table reads and the LSE's few floats, not the partial outputs' vectorized rows.
@triton.jit(do_not_specialize=["split_cap", "items_at", "stride_plb", "stride_plh"])
def _decode_stage1_kernel(
    Q,
    K_buf,
    V_buf,
    ReqToToken,
    ReqPoolIndices,
    SeqLens,
    ReqInfo,
    Splits,
    PartialO,
    PartialLse,
    Out,
    KScale,
    VScale,
    sm_scale_log2,
    split_cap,
    items_at,
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_r2t,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_plb,
    stride_plh,
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,
    HPP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MIN_SPLIT_LEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
    ITEMS: tl.constexpr,
    DIRECT_OUT: tl.constexpr,
    KV_SCALED: tl.constexpr,
    KV_F16: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_wait_then_release(USE_PDL)
    if KV_SCALED:  # an FP8 pool: K's scale folds into the softmax scale, V's into the output (below)
        sm_scale_log2 = sm_scale_log2 * tl.load(KScale)
    # NOTE: the KV-head group is the grid's fastest axis, so the programs of one request's KV heads are
    # launched side by side and read the same tokens' K/V rows (heads are adjacent in a row) at the same time.
    kv_group = tl.program_id(0)
    if ITEMS:  # a split plan's item: its request (-1: one this step does not use) and split
        item = tl.program_id(1)
        owner = tl.load(Splits + items_at + 2 * item)
        split = tl.load(Splits + items_at + 2 * item + 1)
        b = tl.maximum(owner, 0)
        block, row = item * 0, item  # the partials at the item's row of the plan's one block
    else:  # even splits: (request, split) from the grid
        b = tl.program_id(1)
        split = tl.program_id(2)
        block, row = b, split  # the partials at the split's row of the request's own block

    seq_len = tl.load(SeqLens + b).to(tl.int32)
    kv_begin = suffix_start(ReqInfo, b, HAS_PREFIX)
    suffix_len = tl.maximum(seq_len - kv_begin, 0)
    num_splits = request_split_count(Splits, b, suffix_len, split_cap, MIN_SPLIT_LEN, ITEMS)
    split_len = tl.cdiv(suffix_len, num_splits)
    kv_start = kv_begin + split * split_len
    kv_end = tl.minimum(kv_start + split_len, seq_len)
    if ITEMS:
        kv_end = tl.where(owner >= 0, kv_end, kv_start)

    # The program reads HPP adjacent KV heads as one (BLOCK_N, HPP * BLOCK_D) tile, and its rows are their
    # query heads (head h's GROUP heads are rows h * GROUP ...). q is block-diagonal over those columns: a
    # row holds its own head's query and zeros elsewhere, so q @ k^T gives each row its own head's scores
    # and p @ v fills its own head's columns (the other columns are discarded).
    rows = tl.arange(0, BLOCK_R)
    heads = kv_group * (HPP * GROUP) + rows  # (BLOCK_R,) query heads
    r_mask = rows < HPP * GROUP
    cols = tl.arange(0, HPP * BLOCK_D)
    col_head = cols // BLOCK_D  # which of the HPP KV heads a column belongs to
    col_d = cols % BLOCK_D
    own = r_mask[:, None] & (col_head[None, :] == (rows // GROUP)[:, None]) & (col_d < HEAD_DIM)[None, :]

    if kv_start < kv_end:
        req = tl.load(ReqPoolIndices + b).to(tl.int64)
        kv_heads = kv_group * HPP + col_head  # (HPP * BLOCK_D,)
        k_cols = kv_heads * stride_kh + col_d
        v_cols = kv_heads * stride_vh + col_d
        c_mask = col_d < HEAD_DIM
        offs_n = tl.arange(0, BLOCK_N)

        q = tl.load(
            Q + b * stride_qb + heads[:, None] * stride_qh + col_d[None, :], mask=own, other=0.0
        )  # (BLOCK_R, HPP * BLOCK_D)
        if KV_F16:  # FP8 rows widen to fp16 in one instruction per pair (to bf16: two); q and p follow
            q = tl.clamp(q.to(tl.float32), -_F16_MAX, _F16_MAX).to(tl.float16)

        m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
        acc = tl.zeros([BLOCK_R, HPP * BLOCK_D], dtype=tl.float32)
        for n_start in range(kv_start, kv_end, BLOCK_N):
            kv_pos = n_start + offs_n  # (BLOCK_N,)
            n_mask = kv_pos < kv_end
            slots = tl.load(ReqToToken + req * stride_r2t + kv_pos, mask=n_mask, other=0).to(tl.int64)
            kv_mask = n_mask[:, None] & c_mask[None, :]
            k = tl.load(K_buf + slots[:, None] * stride_ks + k_cols[None, :], mask=kv_mask, other=0.0).to(
                q.dtype
            )  # (BLOCK_N, HPP * BLOCK_D)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale_log2  # (BLOCK_R, BLOCK_N)
            s = tl.where(n_mask[None, :], s, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V_buf + slots[:, None] * stride_vs + v_cols[None, :], mask=kv_mask, other=0.0).to(
                q.dtype
            )  # (BLOCK_N, HPP * BLOCK_D)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        if KV_SCALED:
            acc = acc * tl.load(VScale)
        if DIRECT_OUT:  # the only split: this is the output (what stage 2 would compute from it, bit for bit)
            tl.store(
                Out + b * stride_ob + heads[:, None] * stride_oh + col_d[None, :],
                (acc / l_i[:, None]).to(Out.dtype.element_ty),
                mask=own,
            )
        else:
            tl.store(
                PartialO + block * stride_pob + heads[:, None] * stride_poh + row * stride_pos + col_d[None, :],
                acc / l_i[:, None],
                mask=own,
            )
            tl.store(PartialLse + block * stride_plb + heads * stride_plh + row, m_i + tl.log2(l_i), mask=r_mask)
    elif DIRECT_OUT:  # an empty (padding) request: zero output, as stage 2 gives it
        tl.store(
            Out + b * stride_ob + heads[:, None] * stride_oh + col_d[None, :],
            tl.zeros([BLOCK_R, HPP * BLOCK_D], dtype=Out.dtype.element_ty),
            mask=own,
        )


@dataclass
class DecodeSplits:
    """A step's split plan on the device (`SplitPlan` uploaded): what `decode_attention` launches from."""

    table: torch.Tensor  # int32, the plan's table (a graph's static buffer may be longer)
    items_at: int
    items: int  # stage-1 items to launch
    merge: bool  # whether stage 2 runs (False: every request has one split, whose output stage 1 writes)

    @classmethod
    def upload(cls, plan: SplitPlan, device: torch.device) -> "DecodeSplits":
        """The plan on `device`, in a tensor of its own (tests, benchmarks; the backend uploads through a ring
        of pinned buffers and, for graphs, into a static table)."""
        table = torch.from_numpy(plan.table).to(device, non_blocking=True)
        return cls(table, plan.items_at, plan.items, plan.max_splits > 1)


def decode_attention(
    q: torch.Tensor,  # (B, H, D)
    k_buffer: torch.Tensor,  # (num_slots + 1, Hkv, D)
    v_buffer: torch.Tensor,  # (num_slots + 1, Hkv, D)
    out: torch.Tensor,  # (B, H, D) written in place (a view of the (B, H * D) layer output is fine)
    req_to_token: torch.Tensor,  # (rows, max_ctx) int32
    req_pool_indices: torch.Tensor,  # (B,)
    seq_lens: torch.Tensor,  # (B,) 0 means an empty (padding) request
    sm_scale: float,
    cfg: DecodeConfig,
    scratch: torch.Tensor | None = None,  # flat fp32, >= decode_scratch_numel(...) elements
    prefix: Optional[PrefixPartials] = None,  # shared-prefix partials to merge; stage 1 starts after them
    before_merge: Optional[Callable[[], None]] = None,  # called between the stages (a stream join)
    kv_scales: Optional[tuple[torch.Tensor, torch.Tensor]] = None,  # an FP8 pool's layer (k_scale, v_scale), 0-d
    splits: Optional[DecodeSplits] = None,  # a step's uneven split plan; None: even splits, from the grid
) -> torch.Tensor:
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    _check_decode_args(q, k_buffer, v_buffer, out, num_kv_heads)
    k_scale, v_scale = kv_scale_args(k_buffer, kv_scales)
    if batch == 0:
        return out
    split_cap = cfg.even_splits(batch, num_kv_heads)
    need = decode_scratch_numel(batch, num_heads, num_kv_heads, head_dim, cfg)
    if scratch is None:
        scratch = torch.empty(need, dtype=torch.float32, device=q.device)
    if scratch.dtype != torch.float32 or scratch.numel() < need:
        raise ValueError(
            f"decode scratch must be fp32 with >= {need} elements, got {scratch.dtype} x {scratch.numel()}"
        )
    items = splits.items if splits is not None else batch * split_cap  # splits written
    if items > batch + cfg.extra_items(num_kv_heads):
        raise ValueError(f"a split plan of {items} items for a batch of {batch} is over this config's bound")
    n_o = items * num_heads * head_dim
    # The partials: with even splits a block per request, (B, H, split_cap, D), a request's splits of a head
    # side by side for the merge; with a plan one block, (H, items, D), each item's at its row.
    if splits is None:
        partial_o = scratch[:n_o].view(batch, num_heads, split_cap, head_dim)
        partial_lse = scratch[n_o : n_o + items * num_heads].view(batch, num_heads, split_cap)
        strides = (partial_o.stride(0), partial_o.stride(1), partial_o.stride(2), partial_lse.stride(0), split_cap)
    else:
        partial_o = scratch[:n_o].view(num_heads, items, head_dim)
        partial_lse = scratch[n_o : n_o + items * num_heads].view(num_heads, items)
        strides = (0, partial_o.stride(0), partial_o.stride(1), 0, items)
    group = num_heads // num_kv_heads
    hpp = cfg.heads_per_program(num_kv_heads)
    block_d = triton.next_power_of_2(head_dim)
    # NOTE: tl.dot needs M >= 16 on the GPU; the query heads of a program's KV heads are padded to 16
    # rows. The extra rows cost tensor-core time only, which decode (memory-bound) has to spare.
    block_r = max(16, triton.next_power_of_2(group * hpp))
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    if prefix is not None and prefix.req_info.shape[0] < batch:
        raise ValueError(f"req_info has {prefix.req_info.shape[0]} rows for a batch of {batch}")
    # Unused pointers when there is no prefix (the constexpr switch removes every access).
    req_info = prefix.req_info if prefix is not None else seq_lens
    prefix_o = prefix.partial_o if prefix is not None else partial_o
    prefix_lse = prefix.partial_lse if prefix is not None else partial_lse

    # NOTE: when every request has one split (batch * kv heads already fills the GPU and no request is
    # much longer than the rest) and no prefix partials to merge, stage 1 writes every output and stage 2,
    # which would only copy them, is not launched.
    merge = (splits.merge if splits is not None else split_cap > 1) or prefix is not None
    # NOTE: no programmatic launch with a shared prefix: stage 2 then also waits for the prefix kernel on
    # another stream (`before_merge`), a dependency PDL's same-stream handshake does not cover.
    pdl = pdl_launch_args(q.device) if prefix is None else {"USE_PDL": False}
    grid = (num_kv_heads // hpp, items) if splits is not None else (num_kv_heads // hpp, batch, split_cap)
    table = splits.table if splits is not None else seq_lens  # (unused without a plan)
    _decode_stage1_kernel[grid](
        q,
        k_buffer,
        v_buffer,
        req_to_token,
        req_pool_indices,
        seq_lens,
        req_info,
        table,
        partial_o,
        partial_lse,
        out,
        k_scale,
        v_scale,
        sm_scale * _LOG2E,
        split_cap,
        splits.items_at if splits is not None else 0,
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        req_to_token.stride(0),
        *strides,
        out.stride(0),
        out.stride(1),
        GROUP=group,
        HPP=hpp,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_R=block_r,
        BLOCK_N=cfg.block_n,
        MIN_SPLIT_LEN=cfg.min_split_len,
        DOT_PRECISION=precision,
        HAS_PREFIX=prefix is not None,
        ITEMS=splits is not None,
        DIRECT_OUT=not merge,
        KV_SCALED=kv_scales is not None,
        KV_F16=kv_scales is not None and q.dtype == torch.bfloat16 and WIDEN_FP8_TO_F16,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl,
    )
    if before_merge is not None:
        before_merge()
    if not merge:
        return out
    merge_partials(
        partial_o,
        partial_lse,
        strides,
        seq_lens,
        out,
        req_info,
        splits.table if splits is not None else None,
        prefix_o,
        prefix_lse,
        split_cap,
        cfg.max_row_splits(num_kv_heads) if splits is not None else split_cap,
        cfg,
        prefix,
        pdl,
    )
    return out


def _check_decode_args(q, k_buffer, v_buffer, out, num_kv_heads) -> None:
    batch, num_heads, head_dim = q.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if k_buffer.shape[2] != head_dim or v_buffer.shape != k_buffer.shape:
        raise ValueError(f"KV buffers {tuple(k_buffer.shape)}/{tuple(v_buffer.shape)} do not match head_dim {head_dim}")
    if q.stride(2) != 1 or out.stride(2) != 1 or k_buffer.stride(2) != 1 or v_buffer.stride(2) != 1:
        raise ValueError("q, out and the KV buffers must be contiguous in head_dim")
    if tuple(out.shape) != (batch, num_heads, head_dim):
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {(batch, num_heads, head_dim)}")
