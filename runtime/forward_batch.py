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
    # Speculative decoding: each request's draft tree (its last token and the drafts after it) scored in
    # one step, over its cached prefix; a token sees the prefix and its own ancestors in the tree.
    VERIFY = 3

    def is_extend(self) -> bool:
        return self is ForwardMode.EXTEND

    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE

    def is_verify(self) -> bool:
        return self is ForwardMode.VERIFY


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

    # EXTEND and VERIFY (for DECODE: prefix = seq_len - 1, extend = 1)
    extend_prefix_lens: Optional[torch.Tensor] = None  # (B,) int64
    extend_seq_lens: Optional[torch.Tensor] = None  # (B,) int64
    extend_start_loc: Optional[torch.Tensor] = None  # (B,) int64 offset of each request in T
    extend_prefix_lens_cpu: Optional[list[int]] = None
    extend_seq_lens_cpu: Optional[list[int]] = None
    # EXTEND: the first `decode_rows` requests bring one token each (a mixed step's decode rows, first in T).
    decode_rows: int = 0

    # Rows of the hidden states (T,) that need logits: the last token of each request, plus every
    # prompt position at or after logprob_start_len for requests that asked for prompt logprobs.
    logits_indices: Optional[torch.Tensor] = None

    # VERIFY: request b's tree spans req_to_token positions prefix .. prefix + tree_lens[b] (seq_lens[b] is
    # their end); its new tokens are the last extend_seq_lens[b] of them, and new token e sees tree column
    # c where tree_mask[tree_mask_offsets[b] + e * tree_lens[b] + c] (row-major, E_b x N_b). The prefix is
    # seen whole. tree_mask None: every tree is a chain (causal, as an EXTEND).
    tree_lens: Optional[torch.Tensor] = None  # (B,) int64
    tree_lens_cpu: Optional[list[int]] = None
    tree_mask: Optional[torch.Tensor] = None  # (sum E_b * N_b,) bool
    tree_mask_offsets: Optional[torch.Tensor] = None  # (B,) int64

    # Hidden states a drafter reads (EAGLE-3): the model appends `hidden + residual` at the input of each
    # layer named in capture_layers, (T, hidden) each, to `captured_hidden`.
    capture_layers: tuple = ()
    captured_hidden: Optional[list] = None

    attn_metadata: Any = None
