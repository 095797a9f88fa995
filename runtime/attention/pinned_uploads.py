"""Small int32 tables of a step's attention plan (the cascade's prefix groups, the split-KV decode's split
plan) from the host to the device, without waiting for the device.

Through a ring of pinned buffers, each rewritten only after its last copy ran: with overlap scheduling the
next step's tables are written while this step's copy may still be queued. A table goes into a tensor of its
own (an eager step's) or into a static one (a CUDA graph's, which its replays read). On the CPU (tests) the
table is handed over as it is.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch


class PinnedUploads:
    def __init__(self, device: torch.device, ring: int = 4):
        self.device = device
        self._ring: list = [(None, None)] * ring  # (pinned int32 buffer, its last copy's event)
        self._pos = 0

    def upload(self, table: np.ndarray, into: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`table` (int32) on the device: a new tensor, or the first entries of `into`, which it overwrites."""
        n = table.shape[0]
        if into is not None and n > into.numel():
            raise ValueError(f"a table of {n} entries does not fit the static one of {into.numel()}")
        host = torch.from_numpy(table)
        if self.device.type != "cuda":
            if into is None:
                return host.clone()
            into[:n].copy_(host)
            return into[:n]
        self._pos = (self._pos + 1) % len(self._ring)
        buf, done = self._ring[self._pos]
        if done is not None:
            done.synchronize()
        if buf is None or buf.numel() < n:
            buf = torch.empty(max(n, 4096), dtype=torch.int32, pin_memory=True)
        buf[:n].copy_(host)
        if into is None:
            dev = buf[:n].to(self.device, non_blocking=True)
        else:
            dev = into[:n]
            dev.copy_(buf[:n], non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self._ring[self._pos] = (buf, done)
        return dev
