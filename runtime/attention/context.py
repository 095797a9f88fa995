"""What an attention backend is built from: `AttentionContext`, made once by whoever owns the KV pool
(the model runner for the target, the speculative runner for a drafter's own pool).

A backend reads these facts at construction only; per step it gets everything else (the table, the KV
pool, the batch) from the ForwardBatch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class AttentionHeads:
    """The head shape a backend's kernels see on this rank."""

    num_heads: int  # query heads per tensor-parallel rank
    num_kv_heads: int  # KV heads per rank (at least one: with tp_size > KV heads they are replicated)
    head_dim: int

    @classmethod
    def split(cls, num_heads: int, num_kv_heads: int, head_dim: int, tp_size: int = 1) -> "AttentionHeads":
        """A model's heads (num_attention_heads, num_key_value_heads, head_dim) over `tp_size` ranks."""
        if num_heads % tp_size:
            raise ValueError(f"{num_heads} attention heads do not split over tp_size {tp_size}")
        # NOTE: with TP > num_kv_heads the KV heads are replicated, one per rank (models/parallel.py).
        return cls(num_heads // tp_size, max(1, num_kv_heads // tp_size), head_dim)


@dataclass(frozen=True)
class AttentionContext:
    device: str  # where the backend's metadata and scratch live ("cpu", "cuda")
    # The head shape: it pre-sizes the triton decode scratch (before CUDA-graph capture) and plans
    # flashinfer's kernels. None: a backend that can learns it at its first step (kernel tests).
    heads: Optional[AttentionHeads] = None
    dtype: Optional[torch.dtype] = None  # of the queries and the KV pool; None: the backend's default
    max_total_tokens: Optional[int] = None  # slots of the KV pool (flashinfer's static page-index buffer)
    disable_cascade_attention: bool = False  # triton: no shared-prefix decode kernels
    kv_dtype: Optional[torch.dtype] = None  # what the KV pool stores, when it differs from `dtype` (FP8)
