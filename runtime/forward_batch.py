"""ForwardBatch: the per-step tensors the model and the attention backend consume.

Built once per step from the step's plain data (`ForwardBatch.of_step`: the one builder, for the model
runner, a split model's other ranks and pipeline stages, and a drafter over its own KV pool). The model's
forward stays `(input_ids, positions, forward_batch)`; attention layers reach the KV pool and the
backend's own metadata (`attn_metadata`, built by `attn_backend.init_forward_metadata`) through this object.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import numpy as np
import torch

from .kvcache.memory_pool import KVPool, ReqToTokenPool
from .step import ForwardMode, StepInput
from .uploads import to_device

__all__ = ["ForwardBatch", "ForwardMemory", "ForwardMode", "HostUploader"]


class HostUploader(Protocol):
    """Host rows to the device (executor/staging.py's `HostStaging`)."""

    device: str

    def upload(self, rows: Any) -> torch.Tensor:
        """k equally long int rows (a list of lists or a (k, n) array) -> a (k, n) int64 device tensor."""


@dataclass(frozen=True)
class ForwardMemory:
    """What a forward runs over: the request-to-token table, the KV pool its K/V go into, and the
    attention backend that reads them (a target's, or a drafter's own pool and backend over the same table)."""

    req_to_token_pool: ReqToTokenPool
    kv_pool: KVPool
    # NOTE: attention/base.py's AttentionBackend, untyped here: the backends import ForwardBatch, and a
    # type import back would tie the two modules in a circle.
    attn_backend: Any


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
    attn_backend: Any  # the step's attention backend (untyped: see ForwardMemory)
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
    # The step's LoRA adapters (runtime/lora/matmul.py's LoraBatch), which the projections add beside
    # their base matmul: `lora.finish(lora.begin(layer, target, x), y)`; None: the base model alone.
    lora: Any = None
    # EXTEND: the step's image tokens (step.ImageRows), whose input embeddings a vision model replaces
    # with the images' features; empty for every other step (a decode step never has any).
    images: list = field(default_factory=list)

    @classmethod
    def of_step(
        cls,
        step: StepInput,
        memory: ForwardMemory,
        staging: HostUploader,
        input_ids: Optional[torch.Tensor] = None,
        write_table: bool = True,
    ) -> "ForwardBatch":
        """The step's ForwardBatch over `memory`: its token rows go up in one copy (and an EXTEND or
        VERIFY step's request rows in one more). `input_ids`: the previous step's sampled tokens, on the
        device, when the step reads some of its inputs from there (`step.prev_src` says which). `write_table`:
        the new tokens' kv slots go into req_to_token here (one indexed write on the device, the same values
        from the host rows into its host mirror); False where they are there already (a drafter over the
        target's table)."""
        mode = step.mode
        prev_src = step.prev_src if input_ids is not None else None  # where inputs come from the previous step
        rows = np.vstack([step.token_rows, prev_src]) if prev_src is not None else step.token_rows
        if mode.is_decode():
            dev = staging.upload(rows)  # (5, B); + prev_src
            host_ids, pos_t, pool_t, seq_t, loc_t = dev[:5]
            token_rows, table_pos = pool_t, pos_t
        else:
            # (4, T); VERIFY (5, T): + req_to_token positions; + prev_src
            dev = staging.upload(rows)
            host_ids, pos_t, loc_t, token_rows = dev[:4]
            pool_t, seq_t, pre_t, ext_t, start_t = staging.upload(step.req_rows)  # (5, B)
            table_pos = dev[4] if mode.is_verify() else pos_t
        if prev_src is not None and input_ids is not None:
            input_ids = ids_from_prev(host_ids, input_ids, dev[-1], step.all_ids_from_prev)
        else:
            input_ids = host_ids
        if write_table:
            memory.req_to_token_pool.write_step((token_rows, table_pos, loc_t), step.kv_writes)
        fb = cls(
            forward_mode=mode,
            batch_size=step.batch_size,
            input_ids=input_ids,
            positions=pos_t,
            req_pool_indices=pool_t,
            seq_lens=seq_t,
            out_cache_loc=loc_t,
            seq_lens_cpu=step.seq_lens,
            req_to_token_pool=memory.req_to_token_pool,
            kv_pool=memory.kv_pool,
            attn_backend=memory.attn_backend,
        )
        if mode.is_decode():
            fb.req_pool_indices_cpu = step.token_rows[2]  # (B,) host rows, for the shared-prefix grouping
            return fb
        fb.extend_prefix_lens_cpu = list(step.prefix_lens)
        fb.extend_seq_lens_cpu = list(step.extend_lens)
        fb.extend_prefix_lens, fb.extend_seq_lens, fb.extend_start_loc = pre_t, ext_t, start_t
        fb.decode_rows = step.decode_rows
        if step.decode_rows and step.req_rows is not None:
            fb.req_pool_indices_cpu = step.req_rows[0]  # (B,) host rows: a mixed step's decode rows group too
        fb.images = step.images
        if mode.is_verify():
            fb._set_trees(step, staging.device)
        return fb

    def _set_trees(self, step: StepInput, device: str) -> None:
        """A VERIFY step's trees: a target verify's new tokens are its whole trees."""
        self.tree_lens, self.tree_lens_cpu = self.extend_seq_lens, list(step.extend_lens)
        mask = step.draft.tree_mask if step.draft is not None else None
        if mask is not None:
            sizes = np.asarray(step.extend_lens, dtype=np.int64)  # (B,)
            self.tree_mask = to_device(torch.from_numpy(mask), device)
            offsets = np.cumsum(sizes * sizes) - sizes * sizes  # (B,) each tree's first mask entry
            self.tree_mask_offsets = to_device(torch.from_numpy(offsets), device)


def ids_from_prev(host_ids: torch.Tensor, prev_ids: torch.Tensor, src: torch.Tensor, every: bool) -> torch.Tensor:
    """(T,) input ids: `host_ids`, but where `src` (T,) >= 0 the previous step's sampled id at that index
    (`every`: all of them; no host id is read)."""
    if every:
        return prev_ids.index_select(0, src)
    return torch.where(src >= 0, prev_ids.index_select(0, src.clamp(min=0)), host_ids)
