"""What the attention kernels take for an FP8 KV pool's scales (kvcache/kv_quant.py), checked in one place."""

from __future__ import annotations

from typing import Optional

import torch

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def kv_scale_args(
    k_buffer: torch.Tensor, kv_scales: Optional[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (KScale, VScale) pointers a kernel takes: the layer's 0-d float32 scales for an FP8 pool; for a
    pool in the model's dtype any tensor (its KV_SCALED switch is off and never reads them).
    ValueError when an FP8 pool comes without scales, or scales without one."""
    fp8 = k_buffer.dtype in _FP8
    if fp8 != (kv_scales is not None):
        raise ValueError(f"kv_scales go with an FP8 KV pool and only with one; the pool is {k_buffer.dtype}")
    if kv_scales is None:
        return k_buffer, k_buffer
    k_scale, v_scale = kv_scales
    if k_scale.dtype != torch.float32 or v_scale.dtype != torch.float32 or k_scale.numel() != 1 or v_scale.numel() != 1:
        raise ValueError("kv_scales must be one float32 value each (a layer's k_scale, v_scale)")
    return k_scale, v_scale
