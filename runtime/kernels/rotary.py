"""Rotary position embedding (non-interleaved, rotate-half) on q and k, in place, in one launch.

For token t at position p = positions[t], every head of q and k is rotated with
c = cos_cache[p], s = sin_cache[p] (float32, (D/2,)) and halves x1 = x[:D/2], x2 = x[D/2:]:
    x1' = x1 * c - x2 * s        x2' = x2 * c + x1 * s
computed in float32 and rounded back to the input dtype — the same formula as `layers.apply_rope_torch`
(the GPU may contract a multiply-add into an FMA, so fp32 results can differ in the last bit).

q (T, H, D) and k (T, Hkv, D) may be strided views (e.g. slices of a fused QKV output) as long as D
has unit stride; they are overwritten. One program per token handles all of its q and k heads, so the
cos/sin row is read once. Positions must lie in [0, cos_cache.shape[0]): they are not checked, because
checking would need a host sync and the launch must be capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import check_device, next_power_of_2


@triton.jit
def _rotate_heads(X, token, stride_t, stride_h, num_heads, cos, sin, offs_half, half_mask,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)  # (BH,)
    mask = (heads < num_heads)[:, None] & half_mask[None, :]  # (BH, BHALF)
    ptr1 = X + token * stride_t + heads[:, None] * stride_h + offs_half[None, :]
    x1 = tl.load(ptr1, mask=mask, other=0.0)
    x2 = tl.load(ptr1 + HALF, mask=mask, other=0.0)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    tl.store(ptr1, (a * cos - b * sin).to(x1.dtype), mask=mask)
    tl.store(ptr1 + HALF, (b * cos + a * sin).to(x2.dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    Q, K, Positions, Cos, Sin,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos,
    num_q_heads, num_k_heads,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(Positions + token).to(tl.int64)
    offs_half = tl.arange(0, BLOCK_HALF)  # (BHALF,)
    half_mask = offs_half < HALF
    cos = tl.load(Cos + pos * stride_cos + offs_half, mask=half_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(Sin + pos * stride_cos + offs_half, mask=half_mask, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(Q, token, stride_qt, stride_qh, num_q_heads, cos, sin, offs_half, half_mask, HALF, BLOCK_HQ)
    _rotate_heads(K, token, stride_kt, stride_kh, num_k_heads, cos, sin, offs_half, half_mask, HALF, BLOCK_HK)


def rotary_inplace(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor,
                   sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (T, H, D) and k (T, Hkv, D) in place by positions (T,); returns (q, k)."""
    check_device("rotary", q, k, positions, cos_cache, sin_cache)
    if q.dim() != 3 or k.dim() != 3 or positions.dim() != 1:
        raise ValueError(f"rotary expects q (T, H, D), k (T, Hkv, D), positions (T,); got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(positions.shape)}")
    tokens, _, head_dim = q.shape
    if k.shape[0] != tokens or k.shape[2] != head_dim or positions.shape[0] != tokens:
        raise ValueError(f"rotary: q {tuple(q.shape)}, k {tuple(k.shape)} and positions "
                         f"{tuple(positions.shape)} disagree on T or D")
    if head_dim % 2:
        raise ValueError(f"rotary needs an even head_dim, got {head_dim}")
    half = head_dim // 2
    if cos_cache.dim() != 2 or cos_cache.shape[1] != half or sin_cache.shape != cos_cache.shape:
        raise ValueError(f"cos/sin caches must be (max_pos, {half}), got {tuple(cos_cache.shape)} and "
                         f"{tuple(sin_cache.shape)}")
    if q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError("rotary rotates in place: q and k need unit stride on head_dim")
    if positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be int32 or int64, got {positions.dtype}")
    cos_cache, sin_cache = cos_cache.contiguous(), sin_cache.contiguous()
    if tokens == 0:
        return q, k
    _rotary_kernel[(tokens,)](
        q, k, positions, cos_cache, sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_cache.stride(0),
        q.shape[1], k.shape[1],
        HALF=half, BLOCK_HALF=next_power_of_2(half), BLOCK_HQ=next_power_of_2(q.shape[1]),
        BLOCK_HK=next_power_of_2(k.shape[1]), num_warps=4)
    return q, k
