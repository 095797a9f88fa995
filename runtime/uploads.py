"""Host tensors to the device without making the host wait for it.

A host-to-device copy from pageable memory synchronizes with the stream: the host waits until everything
queued before the copy has run. With overlap scheduling that is the step in flight, so a step whose
inputs went up that way was planned and launched only after the one before it had finished, and the
device idled through the host's work. From pinned memory the copy is queued and the host goes on; torch's
caching host allocator keeps the pinned block until the copy has run.
"""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device) -> torch.Tensor:
    """`host` (a CPU tensor) on `device`, queued behind the device's work without waiting for it. On the
    CPU, `host` itself."""
    device = torch.device(device)
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
