"""Which kernel paths a model's forward takes, as one engine's settings (ServerArgs) chose them.

The model runner makes a `KernelChoices` from its settings (`ServerArgs.kernel_choices`) and runs every forward (and
every CUDA-graph
capture) inside `using(choices)`; the layers and kernel wrappers read `current()`. A context variable,
not a module global read at import: two runners in one process keep their own choices.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from dataclasses import dataclass
from typing import Iterator


@dataclass(frozen=True)
class KernelChoices:
    # Decode batches of 2-64 rows through the tensor-core decode matmul (kernels/decode_gemm.py);
    # False sends them to the matmul library.
    decode_gemm: bool = True
    # A batch-1 decode step's RMSNorm and SiLU-and-mul folded into the matmuls after them
    # (kernels/gemv_fused.py). Off by default: measured slower (models/layers.py says why).
    fused_decode_row: bool = False
    # Programmatic dependent launch between kernels on Hopper (kernels/launch.py). Off by default.
    pdl: bool = False
    # ... and on for the decode graphs of at most this many rows whatever `pdl` says: with FP8 weights a batch-1
    # decode step, whose kernels are short, gains from it (single-stream 256 -> 271 out tok/s on an H100, 8B), where
    # batch 64 loses 2% (benchmarks/RESULTS.md, issue 38).
    pdl_max_rows: int = 0

    def for_rows(self, rows: int) -> "KernelChoices":
        """These choices for a step of `rows` rows (`pdl_max_rows`)."""
        return self if self.pdl or rows > self.pdl_max_rows else dataclasses.replace(self, pdl=True)


DEFAULT = KernelChoices()
_CURRENT: contextvars.ContextVar[KernelChoices] = contextvars.ContextVar("plait_kernel_choices", default=DEFAULT)


def current() -> KernelChoices:
    return _CURRENT.get()


@contextlib.contextmanager
def using(choices: KernelChoices) -> Iterator[None]:
    token = _CURRENT.set(choices)
    try:
        yield
    finally:
        _CURRENT.reset(token)
