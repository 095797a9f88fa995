"""Extend (prefill) attention over the paged KV pool with a cached prefix, in one Triton launch.

Request b contributes `extend_lens[b]` new query tokens at rows `extend_start[b]...` of q; its keys are
the `prefix_lens[b] + extend_lens[b]` tokens at `req_to_token[req_pool_indices[b], :]` (the new
tokens' K/V are already written to the pool). New token i sits at position `prefix_lens[b] + i` and
sees keys at positions <= its own (causal mask; the prefix is fully visible).

Grid: request x KV head x block of new tokens. A program's tile rows are (token, query head) pairs:
the GROUP query heads that share one KV head, for BLOCK_M // GROUP consecutive new tokens (GQA
packing). Each K/V tile is then loaded once for the whole group, and a short extend still fills the
tile: 50 new tokens x 4 heads are 200 rows, where one head's 50 rows left most of a 128-row tile empty
(a large share of a few-shot prefill step: 163 requests x 50 tokens after a 2,000-token prefix).
FlashAttention-style online softmax (base 2). The key range of a block splits in two phases:
- keys before the block's first query position: visible to every row, no causal mask;
- the diagonal keys up to the block's last query position: causal mask.
Keys past the block's last query position are never loaded.

Draft trees (speculative decoding's VERIFY steps) are a branch of the same kernel (`TREE`, `tree_attention`):
request b then has `prefix_lens[b]` keys every new token sees (its cached sequence), then `tree_lens[b]`
tree columns (req_to_token positions prefix .. prefix + tree_len), of which its `extend_lens[b]` new
tokens are the last. New token e sees tree column c where `tree_mask[mask_offsets[b] + e * tree_len + c]`
is set: its ancestors and itself. A target verify step scores whole trees (extend = tree); a draft
model's tree step adds one level to a tree drafted so far. The key range then splits into the prefix,
unmasked, and the tree columns, masked by the tree. Chains need no mask: the plain kernel runs them.

An FP8 pool (`kv_scales`) is dequantized in the kernel as in decode_attention.py (constexpr `KV_SCALED`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .kv_scale_args import kv_scale_args

_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class ExtendConfig:
    """Tile sizes of the extend kernel (GPU defaults; tests shrink them to exercise the loops)."""

    block_m: int = 128  # tile rows per program: (new token, query head of the KV group) pairs
    block_n: int = 64  # keys per inner-loop iteration
    num_warps: int = 8
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_m", "block_n"):
            val = getattr(self, name)
            if val < 16 or val & (val - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {val}")


def default_extend_config(head_dim: int) -> ExtendConfig:
    # NOTE: from benchmarks/kernels/sweep_extend_attention.py (8B heads, bf16; fewshot, tree, offline and
    # multiturn prefill shapes): 256 rows x 64 keys, 8 warps, 3 stages was within 2% of each shape's best
    # on average, well ahead of 128x64 with 2 stages. Head dims above 128
    # halve the rows to keep the fp32 accumulator in registers.
    if head_dim <= 128:
        return ExtendConfig(block_m=256, block_n=64, num_warps=8, num_stages=3)
    return ExtendConfig(block_m=64, block_n=64, num_warps=8, num_stages=2)


@triton.jit
def _online_softmax_step(
    q,
    K_buf,
    V_buf,
    slots,
    kv_mask,
    n_valid,
    kv_head,
    offs_d,
    m_i,
    l_i,
    acc,
    sm_scale_log2,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    DOT_PRECISION: tl.constexpr,
):
    # slots: (BLOCK_N,) int64 kv slots; kv_mask: (BLOCK_N, BLOCK_D); n_valid: (BLOCK_M, BLOCK_N)
    k = tl.load(K_buf + slots[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0).to(
        q.dtype
    )  # (BLOCK_N, BLOCK_D)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale_log2  # (BLOCK_M, BLOCK_N)
    s = tl.where(n_valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(V_buf + slots[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0).to(
        q.dtype
    )  # (BLOCK_N, BLOCK_D)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _extend_attention_kernel(
    Q,
    Out,
    K_buf,
    V_buf,
    ReqToToken,
    ReqPoolIndices,
    PrefixLens,
    ExtendLens,
    ExtendStart,
    TreeLens,  # TREE only: (B,) tree columns
    TreeMask,  # TREE only: (sum E_b * N_b,) uint8, row-major per request
    MaskOffsets,  # TREE only: (B,) int64
    KScale,  # KV_SCALED only: the FP8 pool's layer scales, () float32
    VScale,
    sm_scale_log2,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_r2t,
    GROUP: tl.constexpr,
    TOKENS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TREE: tl.constexpr,
    KV_SCALED: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    m_start = tl.program_id(2) * TOKENS  # first new token of this block
    ext_len = tl.load(ExtendLens + b).to(tl.int32)

    if m_start < ext_len:
        if KV_SCALED:  # an FP8 pool: K's scale folds into the softmax scale, V's into the output (below)
            sm_scale_log2 = sm_scale_log2 * tl.load(KScale)
        prefix_len = tl.load(PrefixLens + b).to(tl.int32)
        q_start = tl.load(ExtendStart + b).to(tl.int64)
        req = tl.load(ReqPoolIndices + b).to(tl.int64)

        offs_r = tl.arange(0, BLOCK_M)  # tile row = token-major (token, head in group)
        tok = m_start + offs_r // GROUP  # (BLOCK_M,) index among the new tokens
        heads = kv_head * GROUP + offs_r % GROUP  # (BLOCK_M,) query head
        r_mask = (offs_r < TOKENS * GROUP) & (tok < ext_len)
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        offs_n = tl.arange(0, BLOCK_N)
        q_off = (q_start + tok)[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(Q + q_off, mask=r_mask[:, None] & d_mask[None, :], other=0.0)  # (BLOCK_M, BLOCK_D)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        # Phase 1: keys at positions < the block's first query position (no causal mask needed); in a
        # tree, the prefix, seen whole.
        # NOTE: no NaN in a stored row: every valid row sees at least one key in the first iteration
        # of each phase (the tail mask only cuts the end), so m_i is finite from then on. Padding
        # rows may hold NaN; they are never stored.
        if TREE:
            visible_end = prefix_len
        else:
            visible_end = prefix_len + m_start
        for n_start in range(0, visible_end, BLOCK_N):
            kv_pos = n_start + offs_n
            n_mask = kv_pos < visible_end
            slots = tl.load(ReqToToken + req * stride_r2t + kv_pos, mask=n_mask, other=0).to(tl.int64)
            m_i, l_i, acc = _online_softmax_step(
                q,
                K_buf,
                V_buf,
                slots,
                n_mask[:, None] & d_mask[None, :],
                n_mask[None, :],
                kv_head,
                offs_d,
                m_i,
                l_i,
                acc,
                sm_scale_log2,
                stride_ks,
                stride_kh,
                stride_vs,
                stride_vh,
                DOT_PRECISION,
            )

        if TREE:
            # Phase 2: the tree columns, through the mask. NOTE: no NaN in a stored row: with a prefix m_i
            # is finite already, and without one the first tile holds the root, which every node sees.
            tree_len = tl.load(TreeLens + b).to(tl.int32)
            mask_off = tl.load(MaskOffsets + b).to(tl.int64)
            tree_row = tree_len - ext_len + tok  # (BLOCK_M,) each new token's own tree column
            for n_start in range(0, tree_len, BLOCK_N):
                col = n_start + offs_n  # (BLOCK_N,)
                n_mask = col < tree_len
                slots = tl.load(ReqToToken + req * stride_r2t + prefix_len + col, mask=n_mask, other=0).to(tl.int64)
                bits = tl.load(
                    TreeMask + mask_off + tok[:, None].to(tl.int64) * tree_len + col[None, :],
                    mask=r_mask[:, None] & n_mask[None, :],
                    other=0,
                )  # (BLOCK_M, BLOCK_N)
                seen = (bits != 0) & n_mask[None, :] & (col[None, :] <= tree_row[:, None])
                m_i, l_i, acc = _online_softmax_step(
                    q,
                    K_buf,
                    V_buf,
                    slots,
                    n_mask[:, None] & d_mask[None, :],
                    seen,
                    kv_head,
                    offs_d,
                    m_i,
                    l_i,
                    acc,
                    sm_scale_log2,
                    stride_ks,
                    stride_kh,
                    stride_vs,
                    stride_vh,
                    DOT_PRECISION,
                )
        else:
            # Phase 2: the diagonal, keys from the first to the last query position of this block.
            q_pos = prefix_len + tok  # (BLOCK_M,) absolute positions
            diag_end = prefix_len + tl.minimum(m_start + TOKENS, ext_len)
            for n_start in range(visible_end, diag_end, BLOCK_N):
                kv_pos = n_start + offs_n
                n_mask = kv_pos < diag_end
                slots = tl.load(ReqToToken + req * stride_r2t + kv_pos, mask=n_mask, other=0).to(tl.int64)
                causal = (kv_pos[None, :] <= q_pos[:, None]) & n_mask[None, :]  # (BLOCK_M, BLOCK_N)
                m_i, l_i, acc = _online_softmax_step(
                    q,
                    K_buf,
                    V_buf,
                    slots,
                    n_mask[:, None] & d_mask[None, :],
                    causal,
                    kv_head,
                    offs_d,
                    m_i,
                    l_i,
                    acc,
                    sm_scale_log2,
                    stride_ks,
                    stride_kh,
                    stride_vs,
                    stride_vh,
                    DOT_PRECISION,
                )

        out = acc / l_i[:, None]
        if KV_SCALED:
            out = out * tl.load(VScale)
        o_off = (q_start + tok)[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(Out + o_off, out.to(Out.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])


@dataclass(frozen=True)
class TreeMasks:
    """A VERIFY step's draft trees, for the kernel's tree branch."""

    tree_lens: torch.Tensor  # (B,) tree columns (>= extend_lens)
    tree_mask: torch.Tensor  # (sum E_b * N_b,) uint8 / bool, row-major per request
    mask_offsets: torch.Tensor  # (B,) int64


def extend_attention(
    q: torch.Tensor,  # (T, H, D) new tokens of all requests, concatenated
    k_buffer: torch.Tensor,  # (num_slots + 1, Hkv, D)
    v_buffer: torch.Tensor,  # (num_slots + 1, Hkv, D)
    out: torch.Tensor,  # (T, H, D) written in place
    req_to_token: torch.Tensor,  # (rows, max_ctx) int32
    req_pool_indices: torch.Tensor,  # (B,)
    prefix_lens: torch.Tensor,  # (B,)
    extend_lens: torch.Tensor,  # (B,)
    extend_start: torch.Tensor,  # (B,) row of each request's first new token in q
    max_extend_len: int,
    sm_scale: float,
    cfg: ExtendConfig | None = None,
    tree: TreeMasks | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # an FP8 pool's layer (k_scale, v_scale), 0-d
) -> torch.Tensor:
    """Causal extend attention, or with `tree` each request's new tokens over its prefix and draft tree."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if k_buffer.shape[2] != head_dim or v_buffer.shape != k_buffer.shape:
        raise ValueError(f"KV buffers {tuple(k_buffer.shape)}/{tuple(v_buffer.shape)} do not match head_dim {head_dim}")
    if tuple(out.shape) != tuple(q.shape):
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(q.shape)}")
    if q.stride(2) != 1 or out.stride(2) != 1 or k_buffer.stride(2) != 1 or v_buffer.stride(2) != 1:
        raise ValueError("q, out and the KV buffers must be contiguous in head_dim")
    k_scale, v_scale = kv_scale_args(k_buffer, kv_scales)
    batch = req_pool_indices.shape[0]
    if batch == 0 or num_tokens == 0 or max_extend_len <= 0:
        return out
    cfg = cfg or default_extend_config(head_dim)
    group = num_heads // num_kv_heads
    block_m = max(cfg.block_m, triton.next_power_of_2(group))  # at least one token per tile
    tokens = block_m // group
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    grid = (batch, num_kv_heads, triton.cdiv(max_extend_len, tokens))
    # (the plain kernel never reads the tree's pointers: any tensor stands in for them)
    t = tree if tree is not None else TreeMasks(extend_lens, extend_lens, extend_lens)
    _extend_attention_kernel[grid](
        q,
        out,
        k_buffer,
        v_buffer,
        req_to_token,
        req_pool_indices,
        prefix_lens,
        extend_lens,
        extend_start,
        t.tree_lens,
        t.tree_mask,
        t.mask_offsets,
        k_scale,
        v_scale,
        sm_scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        req_to_token.stride(0),
        GROUP=group,
        TOKENS=tokens,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_M=block_m,
        BLOCK_N=cfg.block_n,
        DOT_PRECISION=precision,
        TREE=tree is not None,
        KV_SCALED=kv_scales is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def tree_attention(
    q: torch.Tensor,  # (T, H, D) new tokens of all requests, concatenated
    k_buffer: torch.Tensor,  # (num_slots + 1, Hkv, D)
    v_buffer: torch.Tensor,  # (num_slots + 1, Hkv, D)
    out: torch.Tensor,  # (T, H, D) written in place
    req_to_token: torch.Tensor,  # (rows, max_ctx) int32
    req_pool_indices: torch.Tensor,  # (B,)
    prefix_lens: torch.Tensor,  # (B,)
    extend_lens: torch.Tensor,  # (B,) new tokens
    extend_start: torch.Tensor,  # (B,) row of each request's first new token in q
    tree_lens: torch.Tensor,  # (B,) tree columns (>= extend_lens)
    tree_mask: torch.Tensor,  # (sum E_b * N_b,) uint8 / bool, row-major per request
    mask_offsets: torch.Tensor,  # (B,) int64
    max_extend_len: int,
    sm_scale: float,
    cfg: ExtendConfig | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Draft-tree attention: the extend kernel's tree branch (see the module doc)."""
    tree = TreeMasks(tree_lens, tree_mask, mask_offsets)
    return extend_attention(
        q,
        k_buffer,
        v_buffer,
        out,
        req_to_token,
        req_pool_indices,
        prefix_lens,
        extend_lens,
        extend_start,
        max_extend_len,
        sm_scale,
        cfg,
        tree,
        kv_scales,
    )
