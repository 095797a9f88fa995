"""A tensor-parallel rank other than 0 following rank 0's steps: the same forward and the same logits
computations, in the same order, and no sampling.

Each of them holds collectives that every rank must reach in turn (the all-reduces in the layers, the
LM head's gather); rank 0 samples (runner.py). A follower runs its shard through the executor's
`StepForward`, as rank 0's model runner does.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..executor.step_forward import StepForward
from ..kernel_choices import using as using_kernels
from ..step import StepInput


class Follower:
    def __init__(self, forward: StepForward):
        self.forward = forward

    @torch.inference_mode()
    def follow(self, step: StepInput, launched: bool, input_ids: Optional[torch.Tensor] = None) -> None:
        """This rank's part of a step that rank 0 runs (`run`, or `launch` when `launched`). `input_ids`:
        the previous step's sampled tokens, when the step takes them from the device (`ids_from_prev`)."""
        f = self.forward
        with using_kernels(f.kernel_choices):
            if step.mode.is_verify():  # every node is scored (VerifySteps.run's eager path: no verify graphs here)
                f.logits(f.batch(step))
                return
            fb = f.batch(step, input_ids=input_ids if step.ids_from_prev else None)
            if f.replay_graph(fb) is not None:  # the logits are computed inside the graph
                return
            hidden, rows = f.eager(fb, step.sample_rows)
            self._logits(step, hidden, launched, rows)

    @torch.inference_mode()
    def follow_logits(self, step: StepInput, hidden: torch.Tensor) -> None:
        """`follow`'s logits part alone, from hidden states (T, hidden) computed elsewhere (the first
        pipeline stage's tensor-parallel ranks, while rank 0 runs `ModelRunner.sample_hidden`)."""
        with using_kernels(self.forward.kernel_choices):
            self._logits(step, hidden, launched=False)

    def _logits(
        self, step: StepInput, hidden: torch.Tensor, launched: bool, sample_rows_t: Optional[torch.Tensor] = None
    ) -> None:
        compute_logits = self.forward.model.compute_logits
        if step.logprob_rows and not launched:  # as StepSampler.sample_step: the prompt logprobs' rows first
            compute_logits(hidden[[lr.row for lr in step.logprob_rows]])
        if step.sample_rows:
            compute_logits(hidden[step.sample_rows if sample_rows_t is None else sample_rows_t])
