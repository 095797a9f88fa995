"""Which kernel paths a model's forward takes, as one engine's settings (ServerArgs) chose them.

The model runner makes a `KernelChoices` from its settings (`ServerArgs.kernel_choices`) and runs every forward (and
every CUDA-graph
capture) inside `using(choices)`; the layers and kernel wrappers read `current()`. A context variable,
not a module global read at import: two runners in one process keep their own choices.
"""

from __future__ import annotations

import contextlib
import contextvars
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
