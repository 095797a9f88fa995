"""The step runner the scheduler is handed: the seam between deciding what runs and running it.

The scheduler builds each step as plain data (`runtime/step.py`) and hands it to its runner: the model
runner on one device (executor/model_runner.py), a fake runner with scripted tokens in tests
(tests/helpers/fake_runner.py), a draft-and-verify runner (executor/spec_runner.py) or rank 0 of a model split
over ranks (distributed/runner.py). The runner owns the device and the KV memory it sized, and states
its facts in `info`; the scheduler borrows the slot allocator and the request-to-token table (host side)
from it.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

from ..executor.runner_info import RunnerInfo
from ..kvcache.memory_pool import KVPool, ReqToTokenPool, TokenAllocator
from ..step import StepInput, StepOutput


class StepRunner(Protocol):
    # Its facts, fixed at start-up: sizes (kv slots, running requests, context, vocabulary), device and
    # dtype, EOS ids, the memory it holds, whether `launch` returns before the device finishes.
    info: RunnerInfo
    # The KV memory the scheduler accounts for; the K/V themselves, which a host tier copies (None: a runner
    # without K/V tensors).
    allocator: TokenAllocator
    req_to_token_pool: ReqToTokenPool
    kv_pool: Optional[KVPool]

    def run(self, step: StepInput, prev: Optional[Any] = None) -> StepOutput:
        """Run the step and read its results back. `prev`: as for `launch`."""

    def launch(self, step: StepInput, prev: Optional[Any] = None) -> Any:
        """Start the step without waiting; a handle for `resolve`. `prev`: the handle of the step still in
        flight whose sampled tokens are some of this step's input ids (`step.prev_src` says which)."""

    def resolve(self, handle: Any) -> StepOutput:
        """Wait for a launched step and read its results."""
