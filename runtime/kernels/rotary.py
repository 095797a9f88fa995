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

`rotary_and_store_kv` is the same kernel with the KV-cache write folded in: it rotates q in place and
writes the rotated k, and v, straight into the cache slots of each token, so a layer's rotary and its
cache store cost one launch (at decode batch 1 a launch costs more than the work). Into an FP8 cache it
stores k and v divided by their layer's scales, clamped and rounded (runtime/kvcache/kv_quant.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .launch import check_device, next_power_of_2, pdl_launch_args, pdl_wait_then_release


@triton.jit
def _scaled(x, Scale, SCALED: tl.constexpr, LIMIT: tl.constexpr):
    # x (fp32) as an FP8 cache stores it: divided by its layer's scale, clamped to the format's range.
    if SCALED:
        x = tl.minimum(tl.maximum(x / tl.load(Scale), -LIMIT), LIMIT)
    return x


@triton.jit
def _rotate_heads(
    Src,
    Dst,
    stride_sh,
    stride_dh,
    num_heads,
    cos,
    sin,
    offs_half,
    half_mask,
    Scale,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    SCALED: tl.constexpr,
    LIMIT: tl.constexpr,
):
    # Src/Dst point at one token's row; Dst may be Src (in place: each element is loaded and stored
    # by the same thread, so no barrier is needed).
    heads = tl.arange(0, BLOCK_H)  # (BH,)
    mask = (heads < num_heads)[:, None] & half_mask[None, :]  # (BH, BHALF)
    src = Src + heads[:, None] * stride_sh + offs_half[None, :]
    dst = Dst + heads[:, None] * stride_dh + offs_half[None, :]
    a = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    out_dtype = Dst.dtype.element_ty  # Src's, or an FP8 cache's
    tl.store(dst, _scaled(a * cos - b * sin, Scale, SCALED, LIMIT).to(out_dtype), mask=mask)
    tl.store(dst + HALF, _scaled(b * cos + a * sin, Scale, SCALED, LIMIT).to(out_dtype), mask=mask)


@triton.jit
def _copy_heads(
    Src,
    Dst,
    stride_sh,
    stride_dh,
    num_heads,
    offs_half,
    half_mask,
    Scale,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    SCALED: tl.constexpr,
    LIMIT: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)  # (BH,)
    mask = (heads < num_heads)[:, None] & half_mask[None, :]  # (BH, BHALF)
    src = Src + heads[:, None] * stride_sh + offs_half[None, :]
    dst = Dst + heads[:, None] * stride_dh + offs_half[None, :]
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    if SCALED:
        x1 = _scaled(x1.to(tl.float32), Scale, SCALED, LIMIT).to(Dst.dtype.element_ty)
        x2 = _scaled(x2.to(tl.float32), Scale, SCALED, LIMIT).to(Dst.dtype.element_ty)
    tl.store(dst, x1, mask=mask)
    tl.store(dst + HALF, x2, mask=mask)


@triton.jit
def _rotary_kernel(
    Q,
    K,
    Positions,
    Cos,
    Sin,
    V,
    KCache,
    VCache,
    Loc,
    KScale,
    VScale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    stride_vt,
    stride_vh,
    stride_ct,
    stride_ch,
    num_q_heads,
    num_k_heads,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    STORE_KV: tl.constexpr,
    SCALED: tl.constexpr,
    LIMIT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_wait_then_release(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(Positions + token).to(tl.int64)
    offs_half = tl.arange(0, BLOCK_HALF)  # (BHALF,)
    half_mask = offs_half < HALF
    cos = tl.load(Cos + pos * stride_cos + offs_half, mask=half_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(Sin + pos * stride_cos + offs_half, mask=half_mask, other=0.0).to(tl.float32)[None, :]
    q_row = Q + token * stride_qt
    _rotate_heads(
        q_row,
        q_row,
        stride_qh,
        stride_qh,
        num_q_heads,
        cos,
        sin,
        offs_half,
        half_mask,
        KScale,
        HALF,
        BLOCK_HQ,
        False,
        1.0,
    )
    k_row = K + token * stride_kt
    if STORE_KV:
        # The rotated K goes straight into the cache (K itself is left as it was), V is copied beside it.
        slot = tl.load(Loc + token).to(tl.int64)
        _rotate_heads(
            k_row,
            KCache + slot * stride_ct,
            stride_kh,
            stride_ch,
            num_k_heads,
            cos,
            sin,
            offs_half,
            half_mask,
            KScale,
            HALF,
            BLOCK_HK,
            SCALED,
            LIMIT,
        )
        _copy_heads(
            V + token * stride_vt,
            VCache + slot * stride_ct,
            stride_vh,
            stride_ch,
            num_k_heads,
            offs_half,
            half_mask,
            VScale,
            HALF,
            BLOCK_HK,
            SCALED,
            LIMIT,
        )
    else:
        _rotate_heads(
            k_row,
            k_row,
            stride_kh,
            stride_kh,
            num_k_heads,
            cos,
            sin,
            offs_half,
            half_mask,
            KScale,
            HALF,
            BLOCK_HK,
            False,
            1.0,
        )


def rotary_inplace(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (T, H, D) and k (T, Hkv, D) in place by positions (T,); returns (q, k)."""
    _check(q, k, positions, cos_cache, sin_cache)
    _launch(q, k, positions, cos_cache, sin_cache, None, None, None, None, None)
    return q, k


def rotary_and_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    loc: torch.Tensor,
    kv_scales: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> torch.Tensor:
    """Rotate q in place and write rotated k and plain v (T, Hkv, D) into k_cache/v_cache (S, Hkv, D) at
    slots loc (T,), in one launch: a layer's rotary and KV-cache store are one kernel, not three.
    Returns q; k is left unrotated. Slots are not bounds-checked (that would need a host sync).
    An FP8 cache takes `kv_scales`, its layer's (k_scale, v_scale) (0-d float32 tensors): k and v are
    stored divided by them, clamped to the format's range (runtime/kvcache/kv_quant.py)."""
    _check(q, k, positions, cos_cache, sin_cache)
    check_device("rotary_and_store_kv", q, v, k_cache, v_cache, loc)
    if v.shape != k.shape or v.stride(2) != 1:
        raise ValueError(f"v must be shaped like k {tuple(k.shape)} with unit stride on head_dim, got {tuple(v.shape)}")
    if (
        k_cache.dim() != 3
        or k_cache.shape[1:] != k.shape[1:]
        or v_cache.shape != k_cache.shape
        or k_cache.stride() != v_cache.stride()
        or k_cache.stride(2) != 1
    ):
        raise ValueError(
            f"k/v caches must both be (slots, {k.shape[1]}, {k.shape[2]}) with the same strides, "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    fp8 = k_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    if (k_cache.dtype != k.dtype or v_cache.dtype != v.dtype) and not fp8:
        raise ValueError(f"cache dtype {k_cache.dtype} differs from k/v dtype {k.dtype}")
    if fp8 != (kv_scales is not None):
        raise ValueError(f"kv_scales go with an FP8 cache and only with one; the cache is {k_cache.dtype}")
    if loc.shape != (q.shape[0],):
        raise ValueError(f"loc must be ({q.shape[0]},), got {tuple(loc.shape)}")
    _launch(q, k, positions, cos_cache, sin_cache, v, k_cache, v_cache, loc, kv_scales)
    return q


def _check(q, k, positions, cos_cache, sin_cache) -> None:
    check_device("rotary", q, k, positions, cos_cache, sin_cache)
    if q.dim() != 3 or k.dim() != 3 or positions.dim() != 1:
        raise ValueError(
            f"rotary expects q (T, H, D), k (T, Hkv, D), positions (T,); got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(positions.shape)}"
        )
    tokens, _, head_dim = q.shape
    if k.shape[0] != tokens or k.shape[2] != head_dim or positions.shape[0] != tokens:
        raise ValueError(
            f"rotary: q {tuple(q.shape)}, k {tuple(k.shape)} and positions {tuple(positions.shape)} disagree on T or D"
        )
    if head_dim % 2:
        raise ValueError(f"rotary needs an even head_dim, got {head_dim}")
    half = head_dim // 2
    if cos_cache.dim() != 2 or cos_cache.shape[1] != half or sin_cache.shape != cos_cache.shape:
        raise ValueError(
            f"cos/sin caches must be (max_pos, {half}), got {tuple(cos_cache.shape)} and {tuple(sin_cache.shape)}"
        )
    if q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError("rotary rotates in place: q and k need unit stride on head_dim")
    if positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be int32 or int64, got {positions.dtype}")
    if not (cos_cache.is_contiguous() and sin_cache.is_contiguous()):
        raise ValueError("cos/sin caches must be contiguous")


def _launch(q, k, positions, cos_cache, sin_cache, v, k_cache, v_cache, loc, kv_scales) -> None:
    tokens, _, head_dim = q.shape
    if tokens == 0:
        return
    store = v is not None
    half = head_dim // 2
    v_ = v if store else k  # unused when not storing: any tensor with k's strides
    kc, vc, lc = (k_cache, v_cache, loc) if store else (k, k, positions)
    k_scale, v_scale = kv_scales if kv_scales is not None else (cos_cache, cos_cache)  # (unread without scales)
    _rotary_kernel[(tokens,)](
        q,
        k,
        positions,
        cos_cache,
        sin_cache,
        v_,
        kc,
        vc,
        lc,
        k_scale,
        v_scale,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_cache.stride(0),
        v_.stride(0),
        v_.stride(1),
        kc.stride(0),
        kc.stride(1),
        q.shape[1],
        k.shape[1],
        HALF=half,
        BLOCK_HALF=next_power_of_2(half),
        BLOCK_HQ=next_power_of_2(q.shape[1]),
        BLOCK_HK=next_power_of_2(k.shape[1]),
        STORE_KV=store,
        SCALED=kv_scales is not None,
        LIMIT=torch.finfo(kc.dtype).max if kv_scales is not None else 1.0,
        num_warps=4,
        **pdl_launch_args(q.device),
    )
