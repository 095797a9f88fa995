"""Forward batches a drafter (draft model, EAGLE head) runs over its own KV pool, in lockstep with the target.

A drafter's KV lives at the target's slots (its own pool, indexed by the same slot ids, with the same
req_to_token table), so the prefix cache, retraction and slot accounting cover it with no bookkeeping
of its own: every slot that holds the target's KV of a token holds the drafter's too. Tree drafting
needs slots beyond those: a scratch area after the target's slots, `scratch_per_row` per request row,
written into the table's device copy past the request's sequence (never into its host mirror; the
verify step that follows overwrites those positions with its own slots).

Built from the target's plain step data (`StepInput`, through the one builder `ForwardBatch.of_step`),
never from the target's ForwardBatch, so the target may run its step however it likes (a CUDA graph).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ..forward_batch import ForwardBatch, ForwardMemory, ForwardMode, HostUploader
from ..kvcache.memory_pool import KVPool, ReqToTokenPool
from ..step import StepInput


@dataclass
class DraftMemory:
    kv_pool: KVPool  # the drafter's K/V: the target's slots 1..num_slots, then the scratch area
    req_to_token: ReqToTokenPool  # the target's table
    attn_backend: object  # the drafter's own, over its pool
    num_target_slots: int
    scratch_per_row: int
    device: str
    staging: HostUploader  # a target step's rows to the device (executor/staging.py's HostStaging)

    def __post_init__(self) -> None:
        self.forward_memory = ForwardMemory(self.req_to_token, self.kv_pool, self.attn_backend)

    def scratch_slots(self, rows: torch.Tensor, first: int, count: int) -> torch.Tensor:
        """(B, count) scratch slots first .. first + count of each request row."""
        base = self.num_target_slots + 1 + rows[:, None] * self.scratch_per_row  # (B, 1)
        return base + first + torch.arange(count, device=rows.device)[None, :]

    def upload(self, host: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(host, dtype=np.int64)).to(self.device)

    def batch(
        self, mode: ForwardMode, input_ids, positions, rows, seq_lens, out_loc, seq_lens_cpu: list[int], **fields
    ) -> ForwardBatch:
        fb = ForwardBatch(
            forward_mode=mode,
            batch_size=int(rows.shape[0]),
            input_ids=input_ids,
            positions=positions,
            req_pool_indices=rows,
            seq_lens=seq_lens,
            out_cache_loc=out_loc,
            seq_lens_cpu=seq_lens_cpu,
            req_to_token_pool=self.req_to_token,
            kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
        )
        for name, value in fields.items():
            setattr(fb, name, value)
        return fb

    def of_step(self, step: StepInput) -> ForwardBatch:
        """The target's EXTEND or DECODE step, over the drafter's pool (the table is already written)."""
        return ForwardBatch.of_step(step, self.forward_memory, self.staging, write_table=False)

    def tree_level(
        self,
        rows: torch.Tensor,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        prefix: torch.Tensor,
        prefix_cpu: list[int],
        tree_len: int,
        new: int,
        slots: torch.Tensor,
        mask: Optional[torch.Tensor],
    ) -> ForwardBatch:
        """A VERIFY forward of `new` tokens per request (B, new each: ids, positions, slots), the last
        `new` of its `tree_len` tree columns after its `prefix`; mask (B, new, tree_len) bool or None
        (a chain). Writes the new tokens' slots into the table's device copy."""
        B = rows.shape[0]
        cols = prefix[:, None] + (tree_len - new) + torch.arange(new, device=rows.device)[None, :]  # (B, new)
        self.req_to_token.req_to_token[rows[:, None].expand(B, new), cols] = slots.to(torch.int32)
        ext = torch.full((B,), new, dtype=torch.int64, device=rows.device)
        tl = torch.full((B,), tree_len, dtype=torch.int64, device=rows.device)
        fields = dict(
            extend_prefix_lens=prefix,
            extend_seq_lens=ext,
            extend_start_loc=torch.arange(B, device=rows.device) * new,
            extend_prefix_lens_cpu=list(prefix_cpu),
            extend_seq_lens_cpu=[new] * B,
            tree_lens=tl,
            tree_lens_cpu=[tree_len] * B,
        )
        if mask is not None:
            fields["tree_mask"] = mask.reshape(-1)
            fields["tree_mask_offsets"] = torch.arange(B, device=rows.device) * (new * tree_len)
        positions = positions.expand(B, new)  # (B, 1) broadcasts: a level of one depth
        return self.batch(
            ForwardMode.VERIFY,
            input_ids.reshape(-1),
            positions.reshape(-1),
            rows,
            prefix + tree_len,
            slots.reshape(-1),
            [p + tree_len for p in prefix_cpu],
            **fields,
        )

    def extend_paths(
        self,
        rows: list[int],
        prefix: list[int],
        paths: list[list[int]],
        tokens: list[list[int]],
        positions: list[list[int]],
    ) -> ForwardBatch:
        """An EXTEND of each request's kept path (its tokens at these positions, their KV at the slots
        in `paths`), right after its prefix; the table's device copy gets the path's slots there."""
        lens = [len(p) for p in paths]
        flat_slots = np.concatenate([np.asarray(p, dtype=np.int64) for p in paths])
        cols = np.concatenate([np.arange(pre, pre + n) for pre, n in zip(prefix, lens)])
        row_rep = np.repeat(np.asarray(rows, dtype=np.int64), lens)
        dev_slots, dev_cols, dev_rows = self.upload(np.stack([flat_slots, cols, row_rep]))
        self.req_to_token.req_to_token[dev_rows, dev_cols] = dev_slots.to(torch.int32)
        ids = self.upload(np.concatenate([np.asarray(t, dtype=np.int64) for t in tokens]))
        pos = self.upload(np.concatenate([np.asarray(p, dtype=np.int64) for p in positions]))
        ext = np.asarray(lens, dtype=np.int64)
        pre = np.asarray(prefix, dtype=np.int64)
        r, seq, pre_t, ext_t, start = self.upload(
            np.stack([np.asarray(rows), pre + ext, pre, ext, np.cumsum(ext) - ext])
        )
        return self.batch(
            ForwardMode.EXTEND,
            ids,
            pos,
            r,
            seq,
            dev_slots,
            (pre + ext).tolist(),
            extend_prefix_lens=pre_t,
            extend_seq_lens=ext_t,
            extend_start_loc=start,
            extend_prefix_lens_cpu=list(prefix),
            extend_seq_lens_cpu=lens,
        )


def ancestor_rows(parents: torch.Tensor, anc: torch.Tensor, first: int) -> torch.Tensor:
    """Grow the ancestor table of a drafted tree by one level. anc (B, M, M) bool over tree columns
    (column 0: the root, when the tree has one; `first` is the column of this level's first node);
    parents (B, k): each new node's parent column. Returns the new nodes' rows (B, k, M)."""
    B, k = parents.shape
    rows = anc.gather(1, parents[:, :, None].expand(B, k, anc.shape[2]))  # (B, k, M) the parents' rows
    rows = rows.clone()
    idx = torch.arange(k, device=parents.device)
    rows[:, idx, first + idx] = True
    anc[:, first : first + k] = rows
    return rows
