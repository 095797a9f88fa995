"""The triton backend's shared-prefix ("cascade") decode: per-step plans, their device tables, the launch.

`TritonCascade` is owned by `TritonAttnBackend` (which stays in charge of the plain split-KV path):
- eager decode steps: a plan from `CascadePlanner`, uploaded with the step, or None (plain decode);
- CUDA graphs: decode graphs of batch >= `CascadeConfig.min_batch_size` have a variant captured with
  the cascade kernels over static tables (one int32 buffer, `CascadeLayout` per batch size) and a
  static partial scratch, beside the plain one. A step replays it only when its plan has a group
  (`graph_plan`): the cascade kernels with nothing grouped cost more attention than the plain
  decode. Each replay of that variant
  writes the step's plan into the tables with one host-to-device copy, skipped when the plan is the
  one already there (same requests as last step). Captured with empty tables (work_len 0, every
  suffix starting at 0), the kernels then run as the plain decode would.
- In a captured graph the prefix kernel runs on a side branch, beside the split-KV stage 1 (they are
  independent; stage 2 joins them), so when the work list is empty its early-exit launch costs the
  step nothing measurable rather than a serial kernel boundary per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from ..forward_batch import ForwardBatch
from ..uploads import copy_into, to_device
from .cascade_plan import CascadeConfig, CascadeLayout, CascadePlan, CascadePlanner
from .triton_ops import (
    PrefixConfig,
    PrefixPartials,
    PrefixTables,
    prefix_attention,
    prefix_partial_numel,
    split_prefix_scratch,
)


@dataclass
class CascadeStep:
    """A decode step's cascade inputs on the device (static storage when graphs are captured)."""

    tables: PrefixTables
    partial_o: torch.Tensor  # (slots, H, D) fp32
    partial_lse: torch.Tensor  # (slots, H) fp32
    plan: Optional[CascadePlan]  # None: nothing grouped this step (a graph's tables then say so)


class TritonCascade:
    def __init__(
        self,
        device: torch.device,
        config: CascadeConfig,
        prefix_config: PrefixConfig,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
    ):
        self.device = device
        self.config = config
        self.prefix_config = prefix_config
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.planner = CascadePlanner(config, prefix_config, num_heads, num_kv_heads)
        self._tables: Optional[torch.Tensor] = None  # static int32 tables (graphs), sized for max_bs
        self._partials: Optional[torch.Tensor] = None  # static fp32 prefix partials (graphs)
        self._partial_slots = 0
        self._max_bs = 0  # largest graph batch (0: graphs off)
        self._uploaded: Optional[tuple] = None  # (plan or empty array, batch size) in the static tables
        self._empty: dict[int, np.ndarray] = {}  # batch size -> tables of a step without groups
        self._side_stream: Optional[torch.cuda.Stream] = None

    def invalidate(self) -> None:
        self.planner.invalidate()

    # ---- eager steps ----
    def eager_step(self, fb: ForwardBatch, num_rows: Optional[int] = None) -> Optional[CascadeStep]:
        """A decode step's cascade inputs, or None (plain decode). `num_rows`: only the first rows decode
        (a mixed step's decode rows, whose q and out are the first rows of the step's)."""
        rows = fb.req_pool_indices_cpu
        if rows is None:
            return None
        n = len(rows) if num_rows is None else num_rows
        if n < self.config.min_batch_size:
            return None
        layout = self.planner.layout(n)
        plan = self.planner.plan(fb.req_to_token_pool.host, rows[:n], fb.seq_lens_cpu[:n], layout)
        if plan is None:
            return None
        # NOTE: queued (uploads.py): from pageable memory the copy would make the host wait for the step in
        # flight, and a mixed step (whose decode rows take this path) would no longer overlap it.
        tables = to_device(torch.from_numpy(plan.packed), self.device)
        scratch = torch.empty(
            prefix_partial_numel(plan.num_partials, self.num_heads, self.head_dim),
            dtype=torch.float32,
            device=self.device,
        )
        o, lse = split_prefix_scratch(scratch, plan.num_partials, self.num_heads, self.head_dim)
        views = layout.views(tables)
        views.work = views.work[: plan.num_work]  # eager: no more programs than work
        return CascadeStep(views, o, lse, plan)

    # ---- CUDA graphs ----
    def graph_batch(self, bs: int) -> bool:
        """Whether the decode graph of batch `bs` carries the cascade kernels."""
        return self._tables is not None and bs >= self.config.min_batch_size and bs <= self._max_bs

    def init_graph_state(self, max_bs: int) -> None:
        self._max_bs = max_bs
        if max_bs < self.config.min_batch_size:
            return
        numel = self.planner.layout(max_bs).numel  # grows with the batch size: fits every smaller one
        self._tables = torch.zeros(numel, dtype=torch.int32, device=self.device)
        # Enough partial slots for one split per request at max_bs, and for a small batch's prefix
        # split `target_work` ways (the planner splits less when they would not fit).
        self._partial_slots = max(2 * max_bs, self.planner.members_per_tile * self.planner.target_work)
        self._partials = torch.empty(
            prefix_partial_numel(self._partial_slots, self.num_heads, self.head_dim),
            dtype=torch.float32,
            device=self.device,
        )
        self._uploaded = None
        if self.device.type == "cuda":
            self._side_stream = torch.cuda.Stream(self.device)

    def graph_plan(self, fb: ForwardBatch) -> Optional[CascadePlan]:
        """The plan of a graph step (fb.batch_size: the padded size; fb.req_pool_indices_cpu: the real
        rows), or None when nothing is grouped (or the rows are not on the host). The planner caches it
        while the batch's requests stay, so asking again in the same step costs a row comparison."""
        rows = fb.req_pool_indices_cpu
        if rows is None:
            return None
        layout = self.planner.layout(fb.batch_size)
        return self.planner.plan(
            fb.req_to_token_pool.host, rows, fb.seq_lens_cpu[: len(rows)], layout, self._partial_slots
        )

    def graph_step(self, fb: ForwardBatch, capture: bool) -> CascadeStep:
        """Fill the static tables for this step (capture: an empty plan) and return their views."""
        bs = fb.batch_size
        layout = self.planner.layout(bs)
        plan = None if capture else self.graph_plan(fb)
        if plan is None:
            packed = self._empty.get(bs)
            if packed is None:
                packed = self._empty[bs] = _empty_tables(layout)
            self._upload(packed, packed, bs)
        else:
            self._upload(plan, plan.packed, bs)
        o, lse = split_prefix_scratch(self._partials, self._partial_slots, self.num_heads, self.head_dim)
        return CascadeStep(layout.views(self._tables), o, lse, plan)

    def _upload(self, key, packed: np.ndarray, bs: int) -> None:
        if self._uploaded is not None and self._uploaded[0] is key and self._uploaded[1] == bs:
            return  # the static tables hold exactly this already
        copy_into(self._tables, torch.from_numpy(packed))
        self._uploaded = (key, bs)

    # ---- the attention call ----
    def prefix_partials(self, step: CascadeStep) -> PrefixPartials:
        return PrefixPartials(step.tables.req_info, step.partial_o, step.partial_lse, self.prefix_config.max_splits)

    def launch_prefix(
        self,
        step: CascadeStep,
        q: torch.Tensor,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        req_to_token: torch.Tensor,
        sm_scale: float,
        kv_scales: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    ) -> Optional[Callable[[], None]]:
        """Start the prefix kernel; returns what must run before the merge (a stream join), if anything."""

        def run() -> None:
            prefix_attention(
                q,
                k_buffer,
                v_buffer,
                req_to_token,
                step.tables,
                step.partial_o,
                step.partial_lse,
                sm_scale,
                self.prefix_config,
                kv_scales,
            )

        if self._side_stream is None or not torch.cuda.is_current_stream_capturing():
            run()
            return None
        main = torch.cuda.current_stream()
        self._side_stream.wait_stream(main)
        with torch.cuda.stream(self._side_stream):
            run()
        return lambda: main.wait_stream(self._side_stream)


def _empty_tables(layout: CascadeLayout) -> np.ndarray:
    return np.zeros(layout.numel, dtype=np.int32)  # work_len 0; every request's suffix starts at 0
