"""Steps launched without waiting for the device (overlap scheduling), and their reading back.

`InFlightSteps.launch_decode` / `launch_prefill` queue a step's forward and its sampling on the device;
the sampled ids stay there (a decode step launched next reads them as its input) with a pinned host copy
(staging.py's `SampledIdCopies`) that `resolve` reads once its event has completed. Only for steps whose
sampling needs nothing from the host (no grammar, no logprobs; never VERIFY). On the CPU the same code
runs synchronously.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from ..step import StepInput, StepOutput
from .sampler import StepSampler
from .staging import SampledIdCopies
from .step_forward import StepForward


@dataclass
class PendingDecode:
    """A decode step launched but not yet read back."""

    next_ids: torch.Tensor  # (B,) int64 on the device
    host: torch.Tensor  # (B,) pinned host copy, valid once `event` completes
    event: Optional[torch.cuda.Event]  # None on the CPU
    # Every request plain greedy: stays true along a chain of launched steps (their requests are a
    # subset of the first step's, and a request's sampling settings do not change), so it is computed once.
    plain_greedy: bool = False


@dataclass
class PendingPrefill:
    """A prefill (EXTEND) step launched but not yet read back."""

    next_ids: torch.Tensor  # (S,) int64 on the device: the tokens of the S requests that sample
    host: torch.Tensor  # (S,) pinned host copy, valid once `event` completes
    event: Optional[torch.cuda.Event]  # None on the CPU
    sampling_reqs: list[int]  # (S,) index in the batch of each sampled row
    batch_size: int


Pending = Union[PendingDecode, PendingPrefill]


class InFlightSteps:
    def __init__(self, forward: StepForward, sampler: StepSampler, copies: SampledIdCopies):
        self.forward = forward
        self.sampler = sampler
        self.copies = copies

    def launch_decode(self, step: StepInput, prev: Optional["Pending"]) -> PendingDecode:
        """A decode step. With `prev` (the step still in flight), some or all input tokens are prev's
        sampled tokens, read on the device (`step.prev_src` says which), and those requests are one token
        further along than their host state says."""
        f = self.forward
        fb = f.batch(step, input_ids=prev.next_ids if prev is not None else None)
        replayed = f.replay_graph(fb)
        if replayed is not None:
            logits, greedy = replayed  # (B, vocab), (B,)
        else:
            logits, greedy = f.logits(fb), None
        # (the chain's requests are a subset of its first step's: whether all are plain greedy is known)
        if isinstance(prev, PendingDecode) and step.all_ids_from_prev:
            plain_greedy = prev.plain_greedy
        else:
            plain_greedy = all(r.plain_greedy() for r in step.sampling)
        next_ids = self.sampler.sample_on_device(logits, step.sampling, plain_greedy, greedy)
        host, event = self.copies.copy(next_ids, "decode")
        return PendingDecode(next_ids, host, event, plain_greedy)

    def launch_prefill(self, step: StepInput, prev: Optional["Pending"] = None) -> PendingPrefill:
        """A prefill (EXTEND) step, mixed or not: the sampled tokens stay on the device, with a pinned host
        copy that `resolve` reads. `prev`: as for a decode step (a mixed step's decode rows read their
        inputs there). On the CPU it runs synchronously, through the same code."""
        if step.logprob_rows:
            raise ValueError("launch: a request wants prompt logprobs; run() the step instead")
        f = self.forward
        fb = f.batch(step, input_ids=prev.next_ids if prev is not None else None)
        hidden, rows = f.eager(fb, step.sample_rows)
        if step.sample_rows:
            logits = f.model.compute_logits(hidden[rows])  # (S, V)
            next_ids = self.sampler.sample_on_device(
                logits, step.sampling, all(r.plain_greedy() for r in step.sampling)
            )
        else:  # every request is a chunk mid-way (or prefill-only): nothing to read back
            next_ids = torch.empty(0, dtype=torch.int64, device=hidden.device)
        host, event = self.copies.copy(next_ids, "prefill")
        return PendingPrefill(next_ids, host, event, step.sampling_reqs, step.batch_size)


def resolve(pending: Pending) -> StepOutput:
    """Wait for a launched step and read its tokens."""
    if pending.event is not None:
        pending.event.synchronize()
    ids = pending.host.tolist()
    if isinstance(pending, PendingPrefill):
        n = pending.batch_size
        per_req: list[Optional[int]] = [None] * n  # None: a chunk mid-way or prefill-only
        for tok, i in zip(ids, pending.sampling_reqs):
            per_req[i] = tok
        return StepOutput(next_token_ids=per_req, output_logprobs=[None] * n, input_logprobs=[[] for _ in range(n)])
    # A decode step computes no prompt logprobs: input_logprobs stays empty (read for EXTEND only).
    return StepOutput(next_token_ids=ids, output_logprobs=[None] * len(ids))
