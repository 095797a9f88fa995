"""The step runner the scheduler is handed: the seam between deciding what runs and running it.

The scheduler builds each step as plain data (`runtime/step.py`) and hands it to its runner: the model
runner on one device (executor/model_runner.py), a fake runner with scripted tokens in tests
(tests/fake_runner.py), later a draft-and-verify runner or a tensor-parallel worker group. The runner
owns the device and the KV memory it sized; the scheduler borrows the slot allocator and the
request-to-token table (host side) from it.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

from ..kvcache.memory_pool import ReqToTokenPool, TokenAllocator
from ..step import StepInput, StepOutput


class StepRunner(Protocol):
    # Sizes, fixed at start-up.
    max_total_tokens: int  # kv slots in the pool
    max_running_requests: int
    context_len: int
    vocab_size: int
    device: str
    dtype: Any  # of the weights and the KV cache (a torch.dtype)
    attention_backend: str  # the backend's name, resolved from the settings
    eos_token_ids: tuple[int, ...]
    # The KV memory the scheduler accounts for.
    allocator: TokenAllocator
    req_to_token_pool: ReqToTokenPool
    # Bytes of device memory it holds: {"kv_cache_bytes": ..., "weight_bytes": ...} (get_stats reports them).
    memory_bytes: dict
    # Whether `launch` returns before the device finishes (overlap scheduling pays only then).
    supports_overlap: bool

    def run(self, step: StepInput, prev: Optional[Any] = None) -> StepOutput:
        """Run the step and read its results back. `prev`: as for `launch`."""

    def launch(self, step: StepInput, prev: Optional[Any] = None) -> Any:
        """Start the step without waiting; a handle for `resolve`. `prev`: the handle of the step still in
        flight whose sampled tokens are some of this step's input ids (`step.prev_src` says which)."""

    def resolve(self, handle: Any) -> StepOutput:
        """Wait for a launched step and read its results."""
