"""Draft-tree attention (speculative decoding's VERIFY steps) over the paged KV pool, in one Triton launch.

Request b has `prefix_lens[b]` keys every new token sees (its cached sequence), then `tree_lens[b]` tree
columns (req_to_token positions prefix .. prefix + tree_len), of which its `extend_lens[b]` new tokens
are the last (rows `extend_start[b]...` of q). New token e sees tree column c where
`tree_mask[mask_offsets[b] + e * tree_len + c]` is set: its ancestors and itself. A target verify step
scores whole trees (extend = tree); a draft model's tree step adds one level to a tree drafted so far.

Same tiling as the extend kernel (extend_attention.py: GQA-packed rows, online softmax in base 2), with
the key range in two phases: the prefix, unmasked; then the tree columns, masked by the tree. Chains
(every tree a chain) need no mask: the backend runs the extend kernel for them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .extend_attention import _LOG2E, ExtendConfig, _online_softmax_step, default_extend_config


@triton.jit
def _tree_attention_kernel(
    Q,
    Out,
    K_buf,
    V_buf,
    ReqToToken,
    ReqPoolIndices,
    PrefixLens,
    ExtendLens,
    ExtendStart,
    TreeLens,
    TreeMask,
    MaskOffsets,
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
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    m_start = tl.program_id(2) * TOKENS  # first new token of this block
    ext_len = tl.load(ExtendLens + b).to(tl.int32)

    if m_start < ext_len:
        prefix_len = tl.load(PrefixLens + b).to(tl.int32)
        tree_len = tl.load(TreeLens + b).to(tl.int32)
        q_start = tl.load(ExtendStart + b).to(tl.int64)
        req = tl.load(ReqPoolIndices + b).to(tl.int64)
        mask_off = tl.load(MaskOffsets + b).to(tl.int64)

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

        # Phase 1: the prefix, seen whole.
        for n_start in range(0, prefix_len, BLOCK_N):
            kv_pos = n_start + offs_n
            n_mask = kv_pos < prefix_len
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

        # Phase 2: the tree columns, through the mask. NOTE: no NaN in a stored row: with a prefix m_i
        # is finite already, and without one the first tile holds the root, which every node sees.
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

        out = acc / l_i[:, None]
        o_off = (q_start + tok)[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(Out + o_off, out.to(Out.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])


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
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if tuple(out.shape) != tuple(q.shape):
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(q.shape)}")
    if q.stride(2) != 1 or out.stride(2) != 1 or k_buffer.stride(2) != 1 or v_buffer.stride(2) != 1:
        raise ValueError("q, out and the KV buffers must be contiguous in head_dim")
    batch = req_pool_indices.shape[0]
    if batch == 0 or num_tokens == 0 or max_extend_len <= 0:
        return out
    cfg = cfg or default_extend_config(head_dim)
    group = num_heads // num_kv_heads
    block_m = max(cfg.block_m, triton.next_power_of_2(group))
    tokens = block_m // group
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    grid = (batch, num_kv_heads, triton.cdiv(max_extend_len, tokens))
    _tree_attention_kernel[grid](
        q,
        out,
        k_buffer,
        v_buffer,
        req_to_token,
        req_pool_indices,
        prefix_lens,
        extend_lens,
        extend_start,
        tree_lens,
        tree_mask,
        mask_offsets,
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
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
