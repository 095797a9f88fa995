"""Building blocks shared by the model files: RMSNorm, rotary embedding, SiLU-and-mul."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        # NOTE: computed in float32 and cast back, exactly as transformers does, so greedy outputs match.
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


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

    def __init__(self, head_dim: int, max_position: int, base: float, scaling: Optional[dict[str, Any]]):
        super().__init__()
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
        # q: (T, H, D), k: (T, Hkv, D)
        cos = self.cos_cache[positions].unsqueeze(1)  # (T, 1, D/2)
        sin = self.sin_cache[positions].unsqueeze(1)
        return _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x1, x2 = x.chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(dtype)
