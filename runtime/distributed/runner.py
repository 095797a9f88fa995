"""The scheduler's step runner for a model split over ranks: rank 0's side of the group.

`start_group` (in the scheduler process, rank 0) checks that the model splits, starts this node's other
ranks, joins them and builds rank 0's shard. `GroupRunner` then implements the StepRunner protocol
(scheduler/step_runner.py), and a drafter's TargetRunner (executor/target_runner.py): each step is
broadcast as a plan (plan.py) and run on rank 0's shard, the others following it (worker.py,
follower.py); rank 0 samples, and sends the sampled tokens to the other ranks only
where a later step reads them on the device (a decode step launched ahead, overlap scheduling).

Any failure inside a step ends the group (launch.exit_group): the ranks would no longer agree on which
collective comes next. The engine then reports the scheduler gone (503), as for one device.
"""

from __future__ import annotations

import atexit
import logging
from dataclasses import replace
from typing import Any, Optional

import torch.distributed as dist

from ..executor.loader import load_model_config
from ..executor.model_runner import ModelRunner
from ..kvcache.host_copies import HostCopyLog
from ..models.parallel import check_parallel_shape
from ..server_args import ServerArgs
from ..step import StepInput, StepOutput
from .group import RankContext, join_group
from .launch import STOP_WAIT_S, GroupMonitor, LocalRanks, exit_group
from .pipeline import StageRunner
from .plan import LAUNCH, RUN, STOP, StepPlan, broadcast_plan, plan_of
from .topology import Rendezvous, Topology

logger = logging.getLogger("plait.distributed")


def start_group(server_args: ServerArgs, model_path: str, extra_kv_bytes_per_token: int = 0) -> "GroupRunner":
    """Rank 0: the model's shape checked against tp_size / pp_size (a clear error naming the numbers, before
    any rank starts), this node's other ranks started and joined, rank 0's shard built (its KV pool sized
    beside a drafter's of `extra_kv_bytes_per_token`: the ranks agree on the smallest pool)."""
    topology = Topology.of(server_args)
    cfg = load_model_config(model_path, server_args.load_format)
    check_parallel_shape(cfg, topology.tp_size, topology.pp_size)
    rendezvous = Rendezvous.of(server_args)
    children = LocalRanks(server_args, model_path, topology, rendezvous, [r for r in topology.node_ranks() if r])
    # NOTE: watching from the start: a rank that fails while loading must end the wait for it.
    monitor = GroupMonitor(children, topology, rendezvous, lambda message: exit_group(message, children))
    monitor.start()
    try:
        ctx = join_group(
            topology,
            0,
            rendezvous,
            server_args.resolved_device(),
            server_args.base_gpu_id,
            server_args.dist_timeout,
            cfg.num_hidden_layers,
        )
        return GroupRunner(server_args, model_path, ctx, children, monitor, extra_kv_bytes_per_token)
    except BaseException:
        monitor.stop()
        children.stop(0.0, terminate=True)
        raise


class GroupRunner:
    def __init__(
        self,
        server_args: ServerArgs,
        model_path: str,
        ctx: RankContext,
        children: LocalRanks,
        monitor: GroupMonitor,
        extra_kv_bytes_per_token: int = 0,
    ):
        self.ctx = ctx
        self.children = children
        self.monitor = monitor
        self.local = local = ModelRunner(server_args, model_path, ctx.parallel, extra_kv_bytes_per_token)
        self.stages = StageRunner(local.forward, local.info, ctx) if ctx.topology.pp_size > 1 else None
        # The StepRunner's facts and KV memory: rank 0's (every rank holds the same slots and as much
        # memory). NOTE: a pipeline's step is read back within `run` (its micro-batches are in flight
        # inside it): no overlap there.
        self.info = replace(local.info, supports_overlap=local.info.supports_overlap and self.stages is None)
        self.model_config = local.model_config  # (what the scheduler checks LoRA adapters against)
        self.allocator = local.allocator
        self.req_to_token_pool = local.req_to_token_pool
        self.kv_pool = local.kv_pool
        # (rank 0's shard; a drafter beside a split model reads the whole embedding and LM head elsewhere:
        # executor/spec_runner.py's WholeVocabulary)
        self.model = local.model
        # With a hierarchical cache: the copies the scheduler's host tier makes on rank 0's pool, recorded
        # for the other ranks' shards (kvcache/host_copies.py; the same tier settings built theirs).
        if server_args.enable_hierarchical_cache:
            self.kv_pool.host_copies = HostCopyLog()
        self._closed = False
        atexit.register(self.close)  # the scheduler process's exit stops the group

    # ------------------------------------------------------------------ StepRunner
    def run(self, step: StepInput, prev: Optional[Any] = None) -> StepOutput:
        try:
            self._send(RUN, step)
            if self.stages is None:
                return self.local.run(step, prev)
            hidden = self.stages.forward(step)  # (T, hidden), back from the last stage
            return self.local.sample_hidden(step, hidden)
        except BaseException as e:
            self._fail(e)

    def run_with_hidden(self, step: StepInput, capture_layers: tuple = ()):
        """A prefill or decode step with the hidden states an EAGLE head reads (ModelRunner.run_with_hidden;
        every rank holds them whole: the residual stream is all-reduced), the other ranks following."""
        try:
            self._send(RUN, step)
            return self.local.run_with_hidden(step, capture_layers)
        except BaseException as e:
            self._fail(e)

    def run_verify(self, step: StepInput, capture_layers: tuple = ()):
        """A VERIFY step for a drafter on rank 0 (ModelRunner.run_verify: its output, the nodes' hidden
        states, the forward batch); the other ranks score the same nodes (follower.py)."""
        try:
            self._send(RUN, step)
            return self.local.run_verify(step, capture_layers)
        except BaseException as e:
            self._fail(e)

    def capture_verify_graphs(self, nodes: int, max_bs: int, capture_layers: tuple = ()) -> None:
        """None: the other ranks score verify steps eagerly (follower.py), and rank 0 must reach the
        same collectives in the same order."""

    def launch(self, step: StepInput, prev: Optional[Any] = None) -> Any:
        try:
            self._send(LAUNCH, step)
            pending = self.local.launch(step, prev)
            if step.sample_rows:
                # The next step may be launched from these tokens before they are read back: every rank
                # needs them on its device (a broadcast queued after the sampling, no host sync).
                dist.broadcast(pending.next_ids, src=0, group=self.ctx.parallel.tp.group)
            return pending
        except BaseException as e:
            self._fail(e)

    def resolve(self, handle: Any) -> StepOutput:
        try:
            return self.local.resolve(handle)
        except BaseException as e:
            self._fail(e)

    # ------------------------------------------------------------------ the group
    def _send(self, kind: str, step: StepInput) -> None:
        log = self.kv_pool.host_copies
        copies = log.take() if log is not None else []
        broadcast_plan(plan_of(kind, step, self.req_to_token_pool.take_writes(), copies), self.ctx.plan_group)

    def _fail(self, error: BaseException) -> None:
        logger.exception("a step failed on rank 0 of a split model")
        exit_group(f"a step failed on rank 0 ({type(error).__name__}: {error})", self.children)

    def close(self) -> None:
        """Stop every rank (the scheduler is exiting): a STOP plan, then their processes reaped."""
        if self._closed:
            return
        self._closed = True
        self.monitor.stop()
        try:
            broadcast_plan(StepPlan(STOP), self.ctx.plan_group)
        except Exception as e:  # noqa: BLE001 - a rank already gone: stopped below regardless
            logger.warning("could not tell every rank to stop: %s", e)
        self.children.stop(STOP_WAIT_S)
        self.ctx.close()
