"""What the kernel wrappers share: where a Triton kernel may run, programmatic dependent launch, and
block-size arithmetic.

Programmatic dependent launch (PDL, Hopper and newer): a kernel launched with it may start while the
kernel before it in the stream is still running, once every program of that one has signalled
(`gdc_launch_dependents`) or exited. Its programs then sit resident on the SMs and wait
(`gdc_wait`: the previous grid has completed and its writes are visible) instead of being launched
after it, and a kernel may do independent work before its wait (the skinny matmul loads its first
weight tile: weights are never written by a decode step).

Off by default: measured (benchmarks/engine/bench_one_batch.py --variants, 8B shape, decode steps
pipelined as the engine runs them), it gained nothing at batch 1 (nor with the MLP's matmuls on the skinny
matmul too, so that every kernel of the chain took part) and cost time at batch 8, where PDL kernels sit
between cuBLAS matmuls.

Every kernel here that takes `USE_PDL` calls `pdl_wait_then_release` before its first load of data a
previous kernel may have written. Releasing right after the wait is safe: the next kernel's own wait
covers this one's whole run. A kernel after a non-PDL one (a cuBLAS matmul, a torch op) simply starts
when that one ends. Switch: the `pdl` kernel choice (runtime/kernel_choices.py, ServerArgs `enable_pdl`; on compute
capability >= 9), read per launch so one process can capture graphs both ways and compare them.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import triton
import triton.language as tl

from ..kernel_choices import current as current_choices


def interpreter_enabled() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1 at triton import)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def check_device(op: str, *tensors: Optional[torch.Tensor]) -> None:
    """Kernels need all tensors on one CUDA device, or on the CPU under the Triton interpreter."""
    present = [t for t in tensors if t is not None]
    devices = {t.device for t in present}
    if len(devices) != 1:
        raise ValueError(f"{op}: all tensors must be on one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type == "cpu" and not interpreter_enabled():
        raise ValueError(
            f"{op}: the Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1 for the CPU "
            "interpreter); use the torch path for CPU tensors"
        )
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"{op}: unsupported device {device}")


def linear_operands(
    op: str,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    out: Optional[torch.Tensor],
    out_dtype: Optional[torch.dtype],
    max_rows: int,
):
    """The checks every Triton matmul wrapper makes on y = x (M, K) @ weight (N, K)^T (+ bias (N,)):
    devices, shapes, 1 <= M <= max_rows, unit stride on K; and its output, `out` if given ((M, N), unit
    stride on N, of out_dtype if that is given), else a new (M, N) tensor of out_dtype (default x's).
    Returns (m, n, k, y)."""
    check_device(op, x, weight, bias, out)
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"{op} expects x (M, K) and weight (N, K); got {tuple(x.shape)} and {tuple(weight.shape)}")
    m, k = x.shape
    n = weight.shape[0]
    if not 1 <= m <= max_rows:
        raise ValueError(f"{op} handles 1..{max_rows} rows, got {m}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"{op} needs unit stride on K for x and weight")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"{op} bias must be ({n},), got {tuple(bias.shape)}")
    if out is None:
        return m, n, k, torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if tuple(out.shape) != (m, n) or out.stride(1) != 1 or (out_dtype is not None and out.dtype != out_dtype):
        raise ValueError(
            f"{op} out must be ({m}, {n}) with unit stride on N (and out_dtype {out_dtype} if "
            f"given); got {tuple(out.shape)} {out.dtype} with strides {out.stride()}"
        )
    return m, n, k, out


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@functools.lru_cache(maxsize=None)
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def pdl_enabled(device: torch.device) -> bool:
    """Whether launches on `device` use programmatic dependent launch: the `pdl` kernel choice (ServerArgs
    enable_pdl) and a CUDA device of
    compute capability >= 9 (not the interpreter)."""
    if device.type != "cuda" or interpreter_enabled() or not current_choices().pdl:
        return False
    return _capability_major(device.index if device.index is not None else torch.cuda.current_device()) >= 9


def pdl_launch_args(device: torch.device) -> dict:
    """Keyword arguments for a kernel launch that takes USE_PDL: the constexpr and, when on, the launch flag."""
    return {"USE_PDL": True, "launch_pdl": True} if pdl_enabled(device) else {"USE_PDL": False}


@triton.jit
def pdl_wait_then_release(USE_PDL: tl.constexpr):
    # See the module docstring: wait for the previous kernel, then let the next one launch.
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
