"""The split-KV decode's split plans for the triton backend: which decode steps need one (a long request among
short ones), the plan made from the lengths the host knows and uploaded, and the decode graphs' static table
for the ragged variant (triton_ops/decode_config.py says how a plan splits; decode_attention.py how the
kernels read it).

- eager steps (`eager`): a plan uploaded with the step, or None where even splits serve it;
- decode graphs (`graph_batch`, `graph_step`): from RAGGED_MIN_BATCH requests a ragged variant, replayed for
  the steps `uneven` picks, its plan (over the batch size's whole item capacity) copied into one static
  table that every ragged graph reads.

No plan for a batch below RAGGED_MIN_BATCH (even splits cut every request into 17 or more there) or, in
the backend, with shared-prefix (cascade) tables: an eager step then never meets a kernel variant the
start-up's graph captures did not compile (a compile in the middle of serving stalls every request for
about a second).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from ..uploads import copy_into, to_device
from .triton_ops import DecodePolicy, DecodeSplits, needs_plan, plan_splits, split_table_numel

RAGGED_MIN_BATCH = 8


class TritonSplits:
    def __init__(self, device: torch.device, policy: DecodePolicy):
        self.device = device
        self.policy = policy
        self._table: Optional[torch.Tensor] = None  # static int32 split table (graphs), sized for max_bs
        self._held: Optional[np.ndarray] = None  # the plan the static table holds

    def uneven(self, seq_lens: Sequence[int], num_kv_heads: int, batch: Optional[int] = None) -> bool:
        """Whether a step's plan would give some request more splits than even splits do (from the lengths'
        sum and maximum alone: a few microseconds, where making the plan is tens). `batch`: a graph's padded
        batch size, the lengths its first rows'."""
        b = len(seq_lens) if batch is None else batch
        return b >= RAGGED_MIN_BATCH and needs_plan(seq_lens, self.policy.for_batch(b), num_kv_heads, b)

    def eager(self, seq_lens: Sequence[int], num_kv_heads: int) -> Optional[DecodeSplits]:
        """An eager step's plan on the device, or None where even splits serve it."""
        if not self.uneven(seq_lens, num_kv_heads):
            return None
        plan = plan_splits(seq_lens, self.policy.for_batch(len(seq_lens)), num_kv_heads)
        return DecodeSplits(
            to_device(torch.from_numpy(plan.table), self.device), plan.items_at, plan.items, plan.max_splits > 1
        )

    # ---- the ragged decode graphs ----
    def init_graph_state(self, max_bs: int, num_kv_heads: int) -> None:
        """The static table, room for the plan of any graph up to max_bs (its batch size's item capacity)."""
        numel = max(split_table_numel(bs, bs + self._extra(bs, num_kv_heads)) for bs in range(1, max_bs + 1))
        self._table = torch.zeros(numel, dtype=torch.int32, device=self.device)
        self._held = None

    @staticmethod
    def graph_batch(bs: int) -> bool:
        """Whether decode graphs of batch `bs` come in a ragged variant."""
        return bs >= RAGGED_MIN_BATCH

    def graph_step(self, seq_lens: Sequence[int], num_kv_heads: int, bs: int) -> DecodeSplits:
        """A ragged graph step's plan in the static table: `seq_lens` its first rows', `bs` its padded size.

        NOTE: the ragged graph launches its batch size's whole item capacity and always merges (its steps'
        plans vary); the items a step does not use exit at once."""
        if self._table is None:
            raise RuntimeError("call init_graph_state(max_bs) before capturing or replaying a ragged graph")
        if len(seq_lens) < bs:  # (the graph runner hands the padded lengths already; direct callers may not)
            seq_lens = list(seq_lens) + [0] * (bs - len(seq_lens))
        plan = plan_splits(seq_lens, self.policy.for_batch(bs), num_kv_heads, bs + self._extra(bs, num_kv_heads))
        if self._held is None or not np.array_equal(self._held, plan.table):
            copy_into(self._table, torch.from_numpy(plan.table))  # (often the last step's plan again)
            self._held = plan.table
        return DecodeSplits(self._table[: plan.table.shape[0]], plan.items_at, plan.items, True)

    def _extra(self, bs: int, num_kv_heads: int) -> int:
        return self.policy.for_batch(bs).extra_items(num_kv_heads)
