"""A rank other than 0: its shard of the model, following rank 0's step plans until told to stop.

`python -m plait.runtime.distributed SPEC` with torchrun's environment (topology.py); SPEC is the pickle
of (server_args, model_path) that the launcher wrote. The rank runs the same forward as rank 0 on its
shard (follower.py: the same collectives in the same order) and never samples.
"""

from __future__ import annotations

import logging
import pickle
import signal
import sys
from typing import Optional

import torch
import torch.distributed as dist

from ..executor.loader import load_model_config
from ..executor.model_runner import ModelRunner
from ..executor.runner_info import RunnerInfo
from ..executor.step_forward import StepForward
from ..kvcache.host_tier import HostTier
from ..server_args import ServerArgs
from .follower import Follower
from .group import RankContext, join_group
from .launch import RankWatchdog
from .pipeline import StageRunner
from .plan import LAUNCH, STOP, receive_plan
from .topology import Topology, rank_from_env

logger = logging.getLogger("plait.distributed")


def main() -> None:
    with open(sys.argv[1], "rb") as f:
        server_args, model_path = pickle.load(f)
    # NOTE: Ctrl-C reaches the whole process group; this rank's life belongs to rank 0 (a STOP plan, or
    # the watchdog when rank 0 is gone).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    serve_rank(server_args, model_path)


def serve_rank(server_args: ServerArgs, model_path: str) -> None:
    logging.basicConfig(
        level=getattr(logging, server_args.log_level.upper(), logging.INFO),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    if server_args.num_threads:
        torch.set_num_threads(server_args.num_threads)
    rendezvous, rank, world, _ = rank_from_env()
    topology = Topology.of(server_args)
    if world != topology.world_size:
        raise RuntimeError(f"WORLD_SIZE {world} is not tp_size x pp_size = {topology.world_size}")
    watchdog = RankWatchdog(rank, topology, rendezvous)
    watchdog.start()
    cfg = load_model_config(model_path, server_args.load_format)
    ctx = join_group(
        topology,
        rank,
        rendezvous,
        server_args.resolved_device(),
        server_args.base_gpu_id,
        server_args.dist_timeout,
        cfg.num_hidden_layers,
    )
    runner = ModelRunner(server_args, model_path, ctx.parallel)
    try:
        follow_plans(runner.forward, runner.info, ctx, host_shard(server_args, runner))
        watchdog.stop()
    finally:
        ctx.close()


def host_shard(server_args: ServerArgs, runner: ModelRunner) -> Optional[HostTier]:
    """This rank's part of the hierarchical cache's host tier, over its own KV pool: sized by the same
    settings as rank 0's, so it holds as many slots (host_copies.py; hicache_args.py refuses the settings
    where the ranks' counts could differ)."""
    if not server_args.enable_hierarchical_cache:
        return None
    return HostTier.sized(runner.kv_pool, server_args.hicache_ratio, server_args.hicache_size)


def follow_plans(forward: StepForward, info: RunnerInfo, ctx: RankContext, host: Optional[HostTier] = None) -> None:
    """Run rank 0's steps on this rank's shard (`forward`, its runner's) until a STOP plan; `host`: this
    rank's host tier, where rank 0's host copies are replayed."""
    follower = Follower(forward)
    stages = StageRunner(forward, info, ctx) if ctx.topology.pp_size > 1 else None
    device = torch.device("cuda", ctx.parallel.device_index) if info.device == "cuda" else torch.device("cpu")
    last_ids: Optional[torch.Tensor] = None  # the last step launched ahead: its sampled tokens (rank 0's)
    while True:
        plan = receive_plan(ctx.plan_group)
        if plan.kind == STOP:
            return
        forward.memory.req_to_token_pool.replay_writes(plan.table_writes)
        if plan.host_copies:
            assert host is not None, "rank 0 sent host-tier copies to a rank without a host tier"
            host.replay(plan.host_copies)
        step = plan.step
        if stages is not None:
            hidden = stages.forward(step)
            if hidden is not None:  # a first-stage rank: the LM head's share, as rank 0 samples
                follower.follow_logits(step, hidden)
            continue
        launched = plan.kind == LAUNCH
        follower.follow(step, launched, input_ids=last_ids)
        if launched and step.sample_rows:
            last_ids = torch.empty(len(step.sample_rows), dtype=torch.int64, device=device)
            dist.broadcast(last_ids, src=0, group=ctx.parallel.tp.group)
