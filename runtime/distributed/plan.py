"""Rank 0's step plans, broadcast to every rank of the model over the plan group (gloo, host memory).

Why rank 0 schedules and the others only execute (and not every rank its own scheduler fed the same
requests): the step is already plain data (runtime/step.py), so one scheduler's decisions reach every
rank exactly, and nothing can drift: grammar compiles that finish at different times, a retraction, a
prefix-cache eviction, a client's abort landing between two steps on one rank and not another. The
radix cache, the grammars, the overlap pipeline and the sampler state stay in one process.

A plan is what a rank needs to run the step itself: the StepInput without its sampling rows (rank 0
samples), and the req_to_token writes the scheduler made since the previous plan (prefix rows at
admission, cache inserts; ReqToTokenPool.take_writes), applied before the step; with a hierarchical cache,
the copies rank 0's host tier queued since then (kvcache/host_copies.py), which each rank replays on its own
pool and host shard before the step, after the table writes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

import torch.distributed as dist

from ..step import StepInput


@dataclass
class StepPlan:
    kind: str  # RUN, LAUNCH or STOP
    step: Optional[StepInput] = None
    table_writes: list = field(default_factory=list)
    host_copies: list = field(default_factory=list)  # HostCopy, oldest first


RUN, LAUNCH, STOP = "run", "launch", "stop"


def plan_of(kind: str, step: StepInput, table_writes: list, host_copies: list) -> StepPlan:
    """The plan of `step` for the other ranks: its sampling rows stay on rank 0 (their grammar matchers,
    generators and output lists are the scheduler's, and no other rank samples)."""
    return StepPlan(kind, dataclasses.replace(step, sampling=[]), table_writes, host_copies)


def broadcast_plan(plan: StepPlan, group: Any) -> None:
    """Rank 0: send `plan` to every rank of `group`."""
    dist.broadcast_object_list([plan], src=0, group=group)


def receive_plan(group: Any) -> StepPlan:
    """Another rank: wait for rank 0's next plan."""
    box: list = [None]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]
