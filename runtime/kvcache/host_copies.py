"""HostCopyLog: the copies rank 0's host tier made between the device KV pool and host memory, kept as plain
data for the other ranks of a model split over ranks.

Under tensor or pipeline parallelism every rank holds its own host shard (its KV heads, its stage's layers)
of as many slots as rank 0's, and rank 0's scheduler alone decides what moves (the radix tree and the host
slots' bookkeeping are its). Each `HostTier.save` / `load` on rank 0 is also recorded here, in the order it
was issued; the group runner takes the log into the next step plan, and every other rank replays it on its
own pool and shard before that step's forward (`HostTier.replay`). Rank 0 queued the same copies between
the previous step and this one, so every rank runs them at the same place among its steps: a load-back
lands before the step that reads it, a demotion reads the device slots before a later step reuses them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class HostCopy:
    """One copy: `device_slots` (n,) int64 to `host_slots` (n,) (ascending) when `to_host`, else back."""

    to_host: bool
    device_slots: np.ndarray
    host_slots: np.ndarray


class HostCopyLog:
    def __init__(self) -> None:
        self._copies: list[HostCopy] = []

    def record(self, to_host: bool, device_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        # NOTE: copied out: a node's slot tensors are views that a later split or free may reuse.
        device, host = (t.detach().cpu().numpy().astype(np.int64, copy=True) for t in (device_slots, host_slots))
        self._copies.append(HostCopy(to_host, device, host))

    def take(self) -> list[HostCopy]:
        """The copies since the last call, oldest first."""
        taken, self._copies = self._copies, []
        return taken
