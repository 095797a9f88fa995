"""ForwardBatch: the per-step tensors the model and the attention backend consume.

Built once per step by the ModelRunner from a ScheduleBatch. The model's forward stays
`(input_ids, positions, forward_batch)`; attention layers reach the KV pool and the backend's own
metadata (`attn_metadata`, built by `attn_backend.init_forward_metadata`) through this object.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from .kvcache.memory_pool import KVPool, ReqToTokenPool


class ForwardMode(enum.Enum):
    EXTEND = 1  # prefill of new tokens on top of an (optionally) cached prefix
    DECODE = 2  # one new token per request

    def is_extend(self) -> bool:
        return self is ForwardMode.EXTEND

    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # (T,) int64, the new tokens of all requests, concatenated
    positions: torch.Tensor  # (T,) int64
    req_pool_indices: torch.Tensor  # (B,) int64 rows of req_to_token
    seq_lens: torch.Tensor  # (B,) int64 total length after this step (prefix + new)
    out_cache_loc: torch.Tensor  # (T,) int64 kv slots the new tokens' K/V are written to
    seq_lens_cpu: list[int]
    req_to_token_pool: ReqToTokenPool
    kv_pool: KVPool
    # NOTE: the step's attention backend (attention/base.py's AttentionBackend), untyped here: the
    # backends import ForwardBatch, and a type import back would tie the two modules in a circle.
    attn_backend: Any
    # DECODE: (B,) int64 host copy of req_pool_indices (the step's host rows; None when not built from
    # them). The triton backend's shared-prefix grouping reads req_to_token's host mirror at these rows.
    req_pool_indices_cpu: Optional[np.ndarray] = None

    # EXTEND only (for DECODE: prefix = seq_len - 1, extend = 1)
    extend_prefix_lens: Optional[torch.Tensor] = None  # (B,) int64
    extend_seq_lens: Optional[torch.Tensor] = None  # (B,) int64
    extend_start_loc: Optional[torch.Tensor] = None  # (B,) int64 offset of each request in T
    extend_prefix_lens_cpu: Optional[list[int]] = None
    extend_seq_lens_cpu: Optional[list[int]] = None

    # Rows of the hidden states (T,) that need logits: the last token of each request, plus every
    # prompt position at or after logprob_start_len for requests that asked for prompt logprobs.
    logits_indices: Optional[torch.Tensor] = None

    attn_metadata: Any = None
