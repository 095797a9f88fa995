"""Host tensors to the device without making the host wait for it.

A host-to-device copy from pageable memory synchronizes with the stream: the host waits until everything
queued before the copy has run. With overlap scheduling that is the step in flight, so a step whose
inputs went up that way was planned and launched only after the one before it had finished, and the
device idled through the host's work. From pinned memory the copy is queued and the host goes on; torch's
caching host allocator keeps the pinned block until the copy has run (so pinned memory stays bounded).
"""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device) -> torch.Tensor:
    """`host` (a CPU tensor) on `device`, queued behind the device's work without waiting for it. On the
    CPU, `host` itself."""
    device = torch.device(device)
    if device.type == "cpu":
        return host
    return _queueable(host, device).to(device, non_blocking=True)


def copy_into(dst: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    """`host` (a CPU tensor) into the first `len(host)` entries of `dst` (a static buffer: a CUDA graph's
    table, a LoRA slot), queued as `to_device` is; returns those entries."""
    n = host.shape[0]
    if n > dst.shape[0]:
        raise ValueError(f"{n} entries do not fit the static buffer of {dst.shape[0]}")
    out = dst[:n]
    out.copy_(_queueable(host, dst.device), non_blocking=True)
    return out


def _queueable(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    return host.pin_memory() if device.type == "cuda" else host
