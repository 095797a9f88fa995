"""Rotary position embedding (rotate-half RoPE, with llama3 and linear scaling): the torch reference and the fused
Triton kernels, under layers.py's contract (the torch code returns new tensors, the fused path rotates q and k in
place and may store K/V in the same launch)."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn as nn

from .layers import _kernels, _wants_triton


def _llama3_scaled_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_ctx = scaling.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Non-interleaved (rotate-half) RoPE with a precomputed cos/sin cache indexed by position."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        scaling: Optional[dict[str, Any]],
        use_triton: Optional[bool] = None,
    ):
        super().__init__()
        self.use_triton = use_triton
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        attention_factor = 1.0
        if scaling:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind == "llama3":
                inv_freq = _llama3_scaled_inv_freq(inv_freq, scaling)
            elif kind == "linear":
                inv_freq = inv_freq / scaling["factor"]
            elif kind not in (None, "default"):
                raise ValueError(f"unsupported rope_scaling type {kind!r}")
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # (P, D/2)
        self.register_buffer("cos_cache", (freqs.cos() * attention_factor), persistent=False)
        self.register_buffer("sin_cache", (freqs.sin() * attention_factor), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # positions: (T,), q: (T, H, D), k: (T, Hkv, D) -> rotated (q, k); the fused path is in place.
        if _wants_triton(q, self.use_triton):
            return _kernels().rotary_inplace(q, k, positions, self.cos_cache, self.sin_cache)
        return rotary_torch(positions, q, k, self.cos_cache, self.sin_cache)

    def fuses_kv_store(self, q: torch.Tensor) -> bool:
        """Whether `rotate_and_store_kv` is available for this tensor (the fused Triton path)."""
        return _wants_triton(q, self.use_triton)

    def rotate_and_store_kv(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        loc: torch.Tensor,
        kv_scales: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    ) -> torch.Tensor:
        """Rotate q (returned) and write rotated k and v into the caches at `loc`, in one launch (an FP8
        cache: divided by `kv_scales`, its layer's (k_scale, v_scale))."""
        return _kernels().rotary_and_store_kv(
            q, k, v, positions, self.cos_cache, self.sin_cache, k_cache, v_cache, loc, kv_scales
        )


def rotary_torch(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference rotate-half RoPE, computed in float32 and rounded once: returns new tensors. q and k sliced
    side by side from one projection's rows (q's heads, then k's) are rotated as one tensor (a third of the
    small ops, which dominate a CPU decode step's rotary)."""
    cos = cos_cache[positions].unsqueeze(1)  # (T, 1, D/2)
    sin = sin_cache[positions].unsqueeze(1)
    heads = q.shape[1]
    both = _side_by_side(q, k)
    if both is not None:
        out = _apply_rope(both, cos, sin)
        return out[:, :heads], out[:, heads:]
    return _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, heads, D) -> x * cos + rotate_half(x) * sin in x's dtype, float32 arithmetic: each half written out
    (x1 * cos + x2 * -sin, x2 * cos + x1 * sin), the sums rounded to x's dtype as they are stored.

    NOTE: the same operations, value for value, as the whole-row form with rotate_half's concatenation, without
    that copy of x nor a separate rounding pass (on a 2-core CPU they were a third of a prefill's rotary)."""
    xf = x.float()
    half = x.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    if x.requires_grad and torch.is_grad_enabled():  # (out= takes no tensors autograd tracks)
        return torch.cat([x1 * cos + x2 * -sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    torch.add(x1 * cos, x2 * -sin, out=out[..., :half])
    torch.add(x2 * cos, x1 * sin, out=out[..., half:])
    return out


def _side_by_side(q: torch.Tensor, k: torch.Tensor) -> Optional[torch.Tensor]:
    """q (T, H, D) and k (T, Hkv, D) as one (T, H + Hkv, D) view where k's heads follow q's in memory, row by
    row (both sliced from a fused QKV projection's output); None otherwise."""
    if q.dim() != 3 or k.dim() != 3 or q.dtype != k.dtype or q.device != k.device or q.shape[0] != k.shape[0]:
        return None
    head_dim = q.shape[2]
    if q.stride() != k.stride() or q.stride()[1:] != (head_dim, 1) or k.shape[2] != head_dim:
        return None
    if k.data_ptr() != q.data_ptr() + q.shape[1] * head_dim * q.element_size():
        return None
    return torch.as_strided(q, (q.shape[0], q.shape[1] + k.shape[1], head_dim), q.stride())
