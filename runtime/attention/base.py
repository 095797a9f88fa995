"""The attention-backend interface.

A backend is built from an `AttentionContext` (context.py: device, head shape, dtype, pool size,
settings), never from a runner. It owns its per-step metadata (built once per step in
`init_forward_metadata`) and its CUDA-graph state. Layers call `backend.forward(q, k, v, layer,
forward_batch)`; the backend writes the new tokens' K/V into the pool at `forward_batch.out_cache_loc`
and attends over the paged cache.

Shapes: q (T, num_heads, head_dim); k, v (T, num_kv_heads, head_dim); output (T, num_heads * head_dim).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional

import torch

from ..forward_batch import ForwardBatch


@dataclass(frozen=True)
class AttentionLayerSpec:
    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float


class AttentionBackend(ABC):
    @abstractmethod
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        """Build `fb.attn_metadata` once per step (before the model runs)."""

    def forward(
        self,
        q: torch.Tensor,
        k: Optional[torch.Tensor],
        v: Optional[torch.Tensor],
        layer: AttentionLayerSpec,
        fb: ForwardBatch,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        # kv_stored: the caller already wrote this step's K/V into the pool (a fused rotary+store kernel).
        if not kv_stored:
            fb.kv_pool.set_kv(layer.layer_id, fb.out_cache_loc, k, v)
        if fb.forward_mode.is_decode():
            return self.forward_decode(q, layer, fb)
        if fb.forward_mode.is_verify():
            return self.forward_verify(q, layer, fb)
        return self.forward_extend(q, layer, fb)

    @abstractmethod
    def forward_extend(self, q: torch.Tensor, layer: AttentionLayerSpec, fb: ForwardBatch) -> torch.Tensor:
        """Causal attention of the new tokens over prefix + new tokens (K/V already in the pool)."""

    @abstractmethod
    def forward_decode(self, q: torch.Tensor, layer: AttentionLayerSpec, fb: ForwardBatch) -> torch.Tensor:
        """One query token per request over its whole sequence (K/V already in the pool)."""

    def forward_verify(self, q: torch.Tensor, layer: AttentionLayerSpec, fb: ForwardBatch) -> torch.Tensor:
        """Draft trees (ForwardMode.VERIFY): each new token over its request's prefix and the tree
        columns its mask allows (forward_batch.py's tree fields; K/V already in the pool)."""
        raise NotImplementedError(
            f"{type(self).__name__} has no verify mode for speculative decoding "
            "(use the torch_native or triton attention backend)"
        )

    # ---- CUDA-graph hooks (decode only). Backends without graph support keep the defaults. ----
    supports_cuda_graph: bool = False

    def init_cuda_graph_state(self, max_bs: int) -> None:
        raise NotImplementedError

    def init_forward_metadata_capture_cuda_graph(self, fb: ForwardBatch) -> None:
        raise NotImplementedError

    def init_forward_metadata_replay_cuda_graph(self, fb: ForwardBatch) -> None:
        raise NotImplementedError

    # A second graph per batch size, with other kernels (the triton backend's shared-prefix cascade).
    def has_cascade_graph(self, bs: int) -> bool:
        """Whether decode graphs of batch `bs` also come in a cascade variant."""
        return False

    def decode_uses_cascade(self, fb: ForwardBatch) -> bool:
        """Whether this graph step should replay the cascade variant."""
        return False

    # And one for steps whose requests' KV lengths are far apart (the triton backend's kernels of a split
    # plan, which a long request among short ones needs), beside the general graph.
    def has_ragged_graph(self, bs: int) -> bool:
        """Whether decode graphs of batch `bs` also come in a ragged variant."""
        return False

    def decode_uses_ragged(self, fb: ForwardBatch) -> bool:
        """Whether this graph step (not a cascade one) should replay the ragged variant."""
        return False
