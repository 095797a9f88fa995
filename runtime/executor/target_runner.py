"""`TargetRunner`: what the draft-and-verify runner (spec_runner.py) needs of the runner of its target.

The model runner of one device and rank 0's `GroupRunner` of a split model (distributed/runner.py) are
both one. A drafter runs in lockstep with the target: after each prefill or decode step it reads the
step's tokens (and, for an EAGLE head, the target's hidden states), after each verify step the kept paths.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ..forward_batch import ForwardBatch
from ..kvcache.memory_pool import KVPool, ReqToTokenPool, TokenAllocator
from ..models.llama import LlamaForCausalLM
from ..step import StepInput, StepOutput
from .runner_info import RunnerInfo


class TargetRunner(Protocol):
    info: RunnerInfo
    # The KV memory the scheduler accounts for; a drafter's pool holds the same slots over the same table.
    allocator: TokenAllocator
    req_to_token_pool: ReqToTokenPool
    kv_pool: KVPool

    @property
    def model(self) -> LlamaForCausalLM:
        """The target's model. An EAGLE head beside a target on one device reads its embedding and LM
        head (a split target's are shards, whose lookups are collectives: the head reads the whole ones
        from the checkpoint instead)."""

    def run(self, step: StepInput) -> StepOutput:
        """A step run and read back (a drafter that reads no hidden states observes its output)."""

    def run_with_hidden(
        self, step: StepInput, capture_layers: tuple = ()
    ) -> tuple[StepOutput, torch.Tensor, ForwardBatch]:
        """A prefill or decode step run eagerly: its output, the hidden states of all its rows (T, hidden)
        and its forward batch, with the inputs of the layers in `capture_layers` in `captured_hidden`."""

    def run_verify(self, step: StepInput, capture_layers: tuple = ()) -> tuple[StepOutput, torch.Tensor, Any]:
        """A VERIFY step: what each request accepted, the nodes' hidden states (T, hidden), and an object
        whose `captured_hidden` holds the inputs of `capture_layers`."""

    def capture_verify_graphs(self, nodes: int, max_bs: int, capture_layers: tuple = ()) -> None:
        """CUDA graphs for VERIFY steps of up to `nodes` tokens per request and `max_bs` requests, where
        the target runs its decode steps as graphs; nothing elsewhere."""
