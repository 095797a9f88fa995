"""A forward batch for calling a model's forward directly in kernel-level tests: the model's own KV pool shape, a
stand-in attention, the slots this step writes; no scheduler, no runner."""

from __future__ import annotations

import types

import torch
from plait.runtime.kvcache.memory_pool import KVPool


def model_step(model, attention, slots: list[int], pool_tokens: int, device="cpu") -> types.SimpleNamespace:
    """What `model(ids, positions, fb)` reads of fb: `attention` (an object with the backends' `forward`) over a
    pool of `pool_tokens` slots in the model's dtype, this step's K/V written at `slots`, no adapters."""
    cfg = model.config
    dtype = model.norm.weight.dtype
    pool = KVPool(pool_tokens, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, dtype, device)
    return types.SimpleNamespace(
        capture_layers=(),
        lora=None,
        attn_backend=attention,
        kv_pool=pool,
        out_cache_loc=torch.tensor(slots, device=device),
    )
