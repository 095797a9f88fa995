"""Checks shared by the kernel wrappers: where a Triton kernel may run, and block-size arithmetic."""

from __future__ import annotations

import os
from typing import Optional

import torch


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
        raise ValueError(f"{op}: the Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1 for the CPU "
                         "interpreter); use the torch path for CPU tensors")
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"{op}: unsupported device {device}")


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
