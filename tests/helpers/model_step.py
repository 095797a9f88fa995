"""A forward batch for calling a model's forward directly in kernel-level tests: the model's own KV pool shape, a
stand-in attention, the slots this step writes; no scheduler, no runner. And a tiny dummy Llama to call."""

from __future__ import annotations

import types

import torch
from plait.runtime.executor.loader import load_model
from plait.runtime.kvcache.memory_pool import KVPool
from plait.runtime.models.config import ModelConfig


def tiny_llama(dtype: torch.dtype, tie: bool = False):
    """A 2-layer Llama (hidden 64, 4 heads over 2 KV heads, vocabulary 300) of dummy weights on the CPU; `tie`: its
    LM head is the token embedding."""
    cfg = ModelConfig(
        architecture="LlamaForCausalLM",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=300,
        tie_word_embeddings=tie,
    )
    return load_model("", cfg, "dummy", dtype, "cpu", max_position=64, seed=3)


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
