"""Joining the ranks of one model: torch.distributed's rendezvous (a TCPStore that rank 0 hosts) and the
process groups every rank builds in the same order.

- the default group: NCCL on GPUs, gloo on the CPU; the tensors of a step (all-reduces, the LM head's
  gather, a pipeline's hidden states);
- one tensor-parallel group per pipeline stage (its ranks' all-reduces);
- the plan group (gloo, over the host): rank 0's step plans to every rank. It waits as long as the
  server idles, so its timeout is unbounded in practice; a rank that dies is found by the monitor
  (launch.py), not by a timeout.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..models.parallel import ModelParallel, PipelineStage, TensorParallel
from .topology import Rendezvous, Topology

logger = logging.getLogger("plait.distributed")

PLAN_GROUP_TIMEOUT = timedelta(days=3650)


@dataclass
class RankContext:
    """One rank's membership: where it sits (`parallel`, given to its ModelRunner), its groups, the store."""

    topology: Topology
    rank: int
    parallel: ModelParallel
    plan_group: Any
    store: Any  # dist.TCPStore
    rendezvous: Rendezvous
    device: str  # "cpu" or "cuda"

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def join_group(
    topology: Topology,
    rank: int,
    rendezvous: Rendezvous,
    device: str,
    base_gpu_id: int,
    timeout_s: int,
    num_layers: int,
) -> RankContext:
    """Meet the other ranks (blocks until all of them came, or `timeout_s`) and build the groups."""
    world = topology.world_size
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(rendezvous.host, rendezvous.port, world, is_master=rank == 0, timeout=timeout)
    backend = "nccl" if device == "cuda" else "gloo"
    local = topology.local_rank(rank)
    if device == "cuda":
        torch.cuda.set_device(base_gpu_id + local)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    # NOTE: every rank creates every group, in the same order (new_group is collective).
    tp_groups = (
        [dist.new_group(topology.stage_ranks(s), backend=backend, timeout=timeout) for s in range(topology.pp_size)]
        if topology.tp_size > 1
        else [None] * topology.pp_size
    )
    plan_group = dist.new_group(list(range(world)), backend="gloo", timeout=PLAN_GROUP_TIMEOUT)
    stage = topology.stage_of(rank)
    parallel = ModelParallel(
        tp=TensorParallel(topology.tp_rank_of(rank), topology.tp_size, tp_groups[stage]),
        stage=PipelineStage.of(stage, topology.pp_size, num_layers) if topology.pp_size > 1 else PipelineStage(),
        rank=rank,
        world=plan_group,
        device_index=base_gpu_id + local,
    )
    if device == "cuda":
        # NCCL creates its communicators at the first collective: made here, before any CUDA-graph
        # capture records one.
        warm = torch.ones(1, device="cuda")
        dist.all_reduce(warm)
        if topology.tp_size > 1:
            dist.all_reduce(warm, group=tp_groups[stage])
        torch.cuda.synchronize()
    logger.info(
        "rank %d of %d joined (stage %d, tensor-parallel rank %d, %s)",
        rank,
        world,
        stage,
        topology.tp_rank_of(rank),
        backend,
    )
    return RankContext(topology, rank, parallel, plan_group, store, rendezvous, device)
