"""Pinned host buffers between a step's host data and the device, in both directions.

`HostStaging` takes a step's int rows up (one copy per call, from a ring of pinned buffers, without waiting
for the device); `SampledIdCopies` brings a launched step's sampled ids down into pinned buffers that
`resolve` reads once the copy's event has completed (overlap scheduling). On the CPU both hand the host
data through: nothing runs asynchronously there.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

# Pinned staging buffers in the ring: a buffer is reused only after its last copy completed, and with
# overlap scheduling a step's inputs are written while the step before may still be copying its own.
STAGING_BUFFERS = 4
# Each staging buffer's smallest size, in int64 entries (grown for a larger step, never shrunk).
STAGING_MIN_ENTRIES = 1 << 16


class HostStaging:
    """Host rows to the device, one copy each, through a ring of pinned buffers."""

    def __init__(self, device: str):
        self.device = device
        self._ring: list[tuple[Optional[torch.Tensor], Optional[torch.cuda.Event]]] = [(None, None)] * STAGING_BUFFERS
        self._pos = 0

    def upload(self, rows: Any) -> torch.Tensor:
        """k equally long int lists (or a (k, n) array) -> a (k, n) int64 device tensor, one copy."""
        host = torch.from_numpy(np.asarray(rows, dtype=np.int64))
        if self.device == "cpu":
            return host
        k, n = host.shape
        # NOTE: rows padded to an even length, so every row of the result starts 16-byte aligned. Triton
        # compiles a kernel variant per pointer alignment: with odd n (a batch of one request: rows 8
        # bytes apart) a prefill would need variants that the start-up warm-up did not compile.
        width = n + (n & 1)
        slot = self._pos = (self._pos + 1) % len(self._ring)
        buf, done = self._ring[slot]
        if done is not None:
            done.synchronize()
        if buf is None or buf.numel() < k * width:
            buf = torch.empty(max(k * width, STAGING_MIN_ENTRIES), dtype=torch.int64, pin_memory=True)
        staging = buf[: k * width].view(k, width)
        staging[:, :n].copy_(host)
        dev = staging.to(self.device, non_blocking=True)[:, :n]
        done = torch.cuda.Event()
        done.record()
        self._ring[slot] = (buf, done)
        return dev


class SampledIdCopies:
    """Pinned host copies of launched steps' sampled ids: two buffers per kind of step ("decode",
    "prefill"), of `max_rows` entries each, used in turn."""

    KINDS = ("decode", "prefill")

    def __init__(self, device: str, max_rows: int):
        self.device = device
        self.max_rows = max_rows
        self._buffers: dict[str, list[torch.Tensor]] = {}
        self._pos: dict[str, int] = {kind: 0 for kind in self.KINDS}

    def copy(self, ids: torch.Tensor, kind: str) -> tuple[torch.Tensor, Optional[torch.cuda.Event]]:
        """A pinned host copy of the (n,) sampled ids, queued after the step, and the event marking it
        done; on the CPU the ids themselves and no event (nothing runs asynchronously)."""
        if self.device != "cuda":
            return ids, None
        host = self._next_buffer(kind, ids.shape[0])
        host.copy_(ids, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event

    def _next_buffer(self, kind: str, n: int) -> torch.Tensor:
        # NOTE: two pinned buffers per kind of step, used in turn: at most two steps of a kind are in
        # flight (the one being read back and the one just launched), and a prefill and a decode step
        # never share a buffer, whatever order the scheduler launches them in.
        bufs = self._buffers.get(kind)
        if bufs is None:
            bufs = self._buffers[kind] = [
                torch.empty(self.max_rows, dtype=torch.int64, pin_memory=True) for _ in range(2)
            ]
        pos = self._pos[kind] = self._pos[kind] ^ 1
        return bufs[pos][:n]
