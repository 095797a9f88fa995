"""Shared-prefix ("cascade") decode attention: a prefix that several requests share is read once per tile.

In a decode batch where many requests hold the same KV slots for their first P positions (the radix
cache shares them), the split-KV kernel would read those P tokens once per request. Here the decode
queries of a group's members, times the query heads of one KV head, are the rows of one
tensor-core tile (BLOCK_M rows = members x GQA heads), and the tile walks the prefix's K/V once.

Each program takes one work item (group, tile of members, prefix split) and one KV head, runs an
online softmax (base 2, fp32 accumulation, like the split-KV stage 1) over its part of the prefix,
and writes, per (member, query head), the normalised partial output and its log-sum-exp into a
"prefix partial" slot. The split-KV decode then attends over each member's suffix only (positions
P..seq_len) and its stage 2 merges these partials with its own splits (`decode_attention.py`).

The work list lives in device memory with its length, so a CUDA graph can be captured with a fixed
grid (`max_work` x KV heads) and replayed for any grouping: programs past the list's end exit.

Tables (int32, filled on the host by `runtime/attention/cascade_plan.py`):
- groups (G, GROUP_FIELDS): member_start, member_count, prefix_len, r2t_row, split_len,
  num_splits, slot_base. The prefix's slots are read from req_to_token row `r2t_row` (any member's).
- members (M,): batch index of each grouped request, groups contiguous.
- work (W, 3): group, tile, split. work_len (1,): how many of the W rows are real.
Member i (0-based within its group) writes split s to partial slot `slot_base + i * num_splits + s`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .kv_scale_args import kv_scale_args

_LOG2E = 1.4426950408889634

# Columns of the groups table (see the module docstring).
GROUP_FIELDS = 7
G_MEMBER_START, G_MEMBER_COUNT, G_PREFIX_LEN, G_ROW, G_SPLIT_LEN, G_NUM_SPLITS, G_SLOT_BASE = range(GROUP_FIELDS)
WORK_FIELDS = 3


@dataclass(frozen=True)
class PrefixConfig:
    """Tiles and splitting of the shared-prefix kernel (GPU defaults; tests shrink them)."""

    # NOTE: 64 rows = 16 members x 4 query heads at Llama's GQA 4 (a tree of 16 requests per root is
    # one tile). Compiled for sm_90 at head_dim 128 (loads pipelined as cp.async, QK and PV on wgmma):
    # 64x64 tiles take 208 registers a thread at 4 warps (two programs per SM), 154 at 8 warps (one);
    # 64x32 at 4 warps 160 (three); 128x64 at 8 warps 202 (one).
    # benchmarks/kernels/bench_cascade_attention.py --sweep times the alternatives.
    block_m: int = 64  # query rows (member x head) per tile
    block_n: int = 64  # prefix tokens per inner-loop iteration
    num_warps: int = 4
    num_stages: int = 2
    # Persistent grid: this many programs loop over (work item x KV head), as many as fit on the GPU
    # at once (two per SM above). With an empty work list the launch is this many programs reading
    # one int, beside the split-KV stage 1 in a graph.
    num_programs: int = 2 * 132
    # Prefix splits: enough work items to fill the GPU when there are few tiles (one group, small
    # batch), but no split shorter than min_split_len: each split costs every member a partial
    # (head_dim + 1 floats per query head, written and read back), about 2 x GQA tokens' worth of KV.
    min_split_len: int = 256
    max_splits: int = 16
    target_programs: int = 4 * 132  # work items x KV heads wanted (about 2 per persistent program)

    def __post_init__(self):
        for name in ("block_m", "block_n"):
            val = getattr(self, name)
            if val < 16 or val & (val - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {val}")
        if min(self.min_split_len, self.max_splits, self.target_programs, self.num_programs) < 1:
            raise ValueError("min_split_len, max_splits, target_programs and num_programs must be >= 1")

    def rows_per_tile(self, group: int) -> int:
        """BLOCK_M actually launched: at least one member's worth of query heads."""
        return max(self.block_m, triton.next_power_of_2(group))

    def members_per_tile(self, group: int) -> int:
        return self.rows_per_tile(group) // group


@triton.jit
def _prefix_attention_kernel(
    Q,
    K_buf,
    V_buf,
    ReqToToken,
    Groups,
    Members,
    Work,
    WorkLen,
    PartialO,
    PartialLse,
    KScale,
    VScale,
    sm_scale_log2,
    num_programs,
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_r2t,
    stride_pos,
    stride_poh,
    stride_pls,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    MEMBERS_PER_TILE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_FIELDS: tl.constexpr,
    WORK_FIELDS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_SCALED: tl.constexpr,
):
    if KV_SCALED:  # an FP8 pool: K's scale folds into the softmax scale, V's into the output (below)
        sm_scale_log2 = sm_scale_log2 * tl.load(KScale)
    # Persistent: program p takes items p, p + num_programs, ... of (work item x KV head); the KV
    # heads of one work item are consecutive items (same prefix slots, same query rows' neighbours).
    total = tl.load(WorkLen) * NUM_KV_HEADS
    for item in range(tl.program_id(0), total, num_programs):
        w = item // NUM_KV_HEADS
        kv_head = item % NUM_KV_HEADS
        g = tl.load(Work + w * WORK_FIELDS)
        tile = tl.load(Work + w * WORK_FIELDS + 1)
        split = tl.load(Work + w * WORK_FIELDS + 2)
        info = Groups + g * GROUP_FIELDS
        member_start = tl.load(info + 0)
        member_count = tl.load(info + 1)
        prefix_len = tl.load(info + 2)
        row = tl.load(info + 3).to(tl.int64)
        split_len = tl.load(info + 4)
        num_splits = tl.load(info + 5)
        slot_base = tl.load(info + 6)

        offs_m = tl.arange(0, BLOCK_M)
        local = tile * MEMBERS_PER_TILE + offs_m // GROUP  # (BLOCK_M,) member index within the group
        heads = kv_head * GROUP + offs_m % GROUP  # (BLOCK_M,) query head of each row
        m_mask = (offs_m < MEMBERS_PER_TILE * GROUP) & (local < member_count)
        b = tl.load(Members + member_start + local, mask=m_mask, other=0).to(tl.int64)  # (BLOCK_M,)
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        offs_n = tl.arange(0, BLOCK_N)
        q = tl.load(
            Q + b[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
            mask=m_mask[:, None] & d_mask[None, :],
            other=0.0,
        )  # (BLOCK_M, BLOCK_D)

        kv_start = split * split_len
        kv_end = tl.minimum(kv_start + split_len, prefix_len)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for n_start in range(kv_start, kv_end, BLOCK_N):
            kv_pos = n_start + offs_n  # (BLOCK_N,)
            n_mask = kv_pos < kv_end
            slots = tl.load(ReqToToken + row * stride_r2t + kv_pos, mask=n_mask, other=0).to(tl.int64)
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k = tl.load(
                K_buf + slots[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0
            ).to(q.dtype)  # (BLOCK_N, BLOCK_D)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale_log2  # (BLOCK_M, BLOCK_N)
            s = tl.where(n_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                V_buf + slots[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0
            ).to(q.dtype)  # (BLOCK_N, BLOCK_D)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        # NOTE: the planner never makes an empty split, but if one came through it must merge as
        # weight 0 (lse -inf, output 0), not as 0/0.
        has_keys = l_i > 0
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
        if KV_SCALED:
            o = o * tl.load(VScale)
        slot = (slot_base + local * num_splits + split).to(tl.int64)  # (BLOCK_M,)
        tl.store(
            PartialO + slot[:, None] * stride_pos + heads[:, None] * stride_poh + offs_d[None, :],
            o,
            mask=m_mask[:, None] & d_mask[None, :],
        )
        tl.store(PartialLse + slot * stride_pls + heads, lse, mask=m_mask)


@dataclass
class PrefixTables:
    """Device views of one step's grouping (int32), as the kernels read them."""

    groups: torch.Tensor  # (>= G, GROUP_FIELDS)
    members: torch.Tensor  # (>= M,)
    work: torch.Tensor  # (max_work, WORK_FIELDS); the grid's first dimension is max_work
    work_len: torch.Tensor  # (1,)
    req_info: torch.Tensor  # (B, 3): kv_start (suffix start), first prefix partial slot, prefix partials


def prefix_partial_numel(num_slots: int, num_heads: int, head_dim: int) -> int:
    """fp32 elements of scratch for `num_slots` prefix partials: outputs + log-sum-exps."""
    return num_slots * num_heads * (head_dim + 1)


def split_prefix_scratch(scratch: torch.Tensor, num_slots: int, num_heads: int, head_dim: int):
    """Flat fp32 scratch -> (partial outputs (slots, H, D), log-sum-exps (slots, H))."""
    n_o = num_slots * num_heads * head_dim
    need = prefix_partial_numel(num_slots, num_heads, head_dim)
    if scratch.dtype != torch.float32 or scratch.numel() < need:
        raise ValueError(
            f"prefix scratch must be fp32 with >= {need} elements, got {scratch.dtype} x {scratch.numel()}"
        )
    return (scratch[:n_o].view(num_slots, num_heads, head_dim), scratch[n_o:need].view(num_slots, num_heads))


def prefix_attention(
    q: torch.Tensor,  # (B, H, D)
    k_buffer: torch.Tensor,  # (num_slots + 1, Hkv, D)
    v_buffer: torch.Tensor,  # (num_slots + 1, Hkv, D)
    req_to_token: torch.Tensor,  # (rows, max_ctx) int32
    tables: PrefixTables,
    partial_o: torch.Tensor,  # (slots, H, D) fp32, written
    partial_lse: torch.Tensor,  # (slots, H) fp32, written
    sm_scale: float,
    cfg: PrefixConfig,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # an FP8 pool's layer (k_scale, v_scale), 0-d
) -> None:
    """Attention of every grouped request's query over its group's shared prefix, as partials."""
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if q.stride(2) != 1 or k_buffer.stride(2) != 1 or v_buffer.stride(2) != 1:
        raise ValueError("q and the KV buffers must be contiguous in head_dim")
    if partial_o.stride(2) != 1 or tuple(partial_o.shape[1:]) != (num_heads, head_dim):
        raise ValueError(f"prefix partials {tuple(partial_o.shape)} do not match (slots, {num_heads}, {head_dim})")
    k_scale, v_scale = kv_scale_args(k_buffer, kv_scales)
    # NOTE: the grid depends only on the tables' capacity (a captured graph replays it for any work
    # list); with no work each program reads work_len and exits.
    programs = min(cfg.num_programs, tables.work.shape[0] * num_kv_heads)
    if programs == 0:
        return
    group = num_heads // num_kv_heads
    _prefix_attention_kernel[(programs,)](
        q,
        k_buffer,
        v_buffer,
        req_to_token,
        tables.groups,
        tables.members,
        tables.work,
        tables.work_len,
        partial_o,
        partial_lse,
        k_scale,
        v_scale,
        sm_scale * _LOG2E,
        programs,
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        req_to_token.stride(0),
        partial_o.stride(0),
        partial_o.stride(1),
        partial_lse.stride(0),
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        MEMBERS_PER_TILE=cfg.members_per_tile(group),
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_M=cfg.rows_per_tile(group),
        BLOCK_N=cfg.block_n,
        GROUP_FIELDS=GROUP_FIELDS,
        WORK_FIELDS=WORK_FIELDS,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        KV_SCALED=kv_scales is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
