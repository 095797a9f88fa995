"""A host copy of `req_to_token`, so that the scheduler never reads the device table.

Reading the device table (to insert a request's KV slots into the prefix cache) is a device-to-host
copy: it waits for every step already queued on the GPU, including the decode step that overlap
scheduling launched ahead, and the host work after it no longer overlaps anything. The host copy gets
every write the device table gets, from the same host arrays (`ScheduleBatch.kv_writes` for the
slots of a step's new tokens; the prefix cache's slots when a request is admitted or re-inserted).

NOTE: np.zeros maps untouched pages lazily: rows sized for the full context cost only what is used.
"""

from __future__ import annotations

import numpy as np
import torch


class HostReqToToken:
    def __init__(self, size: int, max_context_len: int):
        self.table = np.zeros((size, max_context_len), dtype=np.int32)  # [req slot, position] -> kv slot

    def write(self, slot: int, start: int, kv_slots: torch.Tensor) -> None:
        """Like ReqToTokenPool.write: kv_slots (n,) at positions start..start+n of one request."""
        self.table[slot, start:start + kv_slots.numel()] = kv_slots.cpu().numpy()

    def write_tokens(self, kv_writes: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
        """A step's new tokens: (req slots (T,), positions (T,), kv slots (T,))."""
        rows, positions, kv_slots = kv_writes
        self.table[rows, positions] = kv_slots

    def read(self, slot: int, n: int) -> torch.Tensor:
        """(n,) int64 kv slots of positions 0..n of one request."""
        return torch.from_numpy(self.table[slot, :n].astype(np.int64))
