"""HostTier: host memory under the device KV pool, where the hierarchical cache keeps evicted prefixes.

Layout: (host slots + 1, layers, 2 (K, V), KV heads, head dim): one token's K/V of every layer side by
side, so a run of host slots is one contiguous block of memory for all layers (a node's tokens move as a
few large copies, not one small copy per layer). Pinned when the pool is on a GPU. Host slot 0 is never
handed out (as on the device), so a slot is 1..num_slots.

Copies (`save`: device -> host, `load`: host -> device) go in chunks of at most STAGING_BYTES; on a GPU they
run on a copy stream of their own, through two fixed staging buffers on the device, and never make the host
wait: a save gathers the device slots on the compute stream (so a later step that reuses them cannot
overwrite them first), and the copy stream waits for that gather; a load's copies are followed, on the
compute stream, by a wait for them and the scatter into the device slots, so the first step that reads them
runs after the load. Every access to host memory is a copy on the copy stream, in order, so a host slot
freed and handed out again is never written before an earlier copy of it has read it. On the CPU the same
calls copy synchronously.

A model split over ranks: each rank holds a tier of its own over its pool (its KV heads, its stage's layers),
of the same number of slots; rank 0's copies are recorded (the pool's `host_copies`) and `replay`ed by the
others before the next step (host_copies.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from .host_copies import HostCopy
from .memory_pool import KVPool, TokenAllocator, zeroed

GB = 1 << 30
STAGING_BYTES = 64 << 20  # one of the two device staging buffers of a GPU's copies


@dataclass
class HostTierStats:
    """What crossed between the tiers since start-up (or the last `reset`)."""

    num_loads: int = 0  # matches that loaded host-resident tokens back
    loaded_tokens: int = 0  # tokens loaded back onto the device
    saved_tokens: int = 0  # tokens copied to the host (demoted, or written through)
    evicted_tokens: int = 0  # host-resident tokens dropped to make room (host LRU)
    bytes_to_host: int = 0
    bytes_to_device: int = 0

    def reset(self) -> None:
        self.num_loads = self.loaded_tokens = self.saved_tokens = self.evicted_tokens = 0
        self.bytes_to_host = self.bytes_to_device = 0


class HostTier:
    def __init__(self, kv_pool: KVPool, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"the host tier needs at least one token of room, got {num_slots}")
        self.kv_pool = kv_pool
        self.num_slots = num_slots
        self.bytes_per_token = KVPool.bytes_per_token(
            kv_pool.num_layers, kv_pool.num_kv_heads, kv_pool.head_dim, kv_pool.dtype
        )
        need, free = (num_slots + 1) * self.bytes_per_token, host_memory_available()
        if free is not None and need > free:
            raise ValueError(
                f"the host tier of {num_slots} tokens needs {need / GB:.1f} GB of host memory and {free / GB:.1f} GB "
                "are available: lower hicache_ratio or hicache_size"
            )
        self.allocator = TokenAllocator(num_slots, "cpu")
        self.on_gpu = torch.device(kv_pool.device).type == "cuda"
        shape = (num_slots + 1, kv_pool.num_layers, 2, kv_pool.num_kv_heads, kv_pool.head_dim)
        # Tokens copied at once: a chunk of at most STAGING_BYTES.
        self.chunk_tokens = max(1, STAGING_BYTES // self.bytes_per_token)
        if self.on_gpu:
            self.buffer = torch.empty(shape, dtype=kv_pool.dtype, pin_memory=True)
            self.copy_stream: Optional[torch.cuda.Stream] = torch.cuda.Stream(device=kv_pool.device)
            staging_shape = (self.chunk_tokens, *shape[1:])
            self._staging = [torch.empty(staging_shape, dtype=kv_pool.dtype, device=kv_pool.device) for _ in range(2)]
            self._staging_free = [torch.cuda.Event(), torch.cuda.Event()]
            self._turn = 0
        else:
            self.buffer = zeroed(shape, kv_pool.dtype, "cpu")
            self.copy_stream = None
        self.stats = HostTierStats()

    @classmethod
    def sized(cls, kv_pool: KVPool, ratio: float, size_gb: float) -> "HostTier":
        """A host tier of `size_gb` GB when that is > 0, else `ratio` times the device pool's tokens
        (SGLang's --hicache-size and --hicache-ratio)."""
        per_token = KVPool.bytes_per_token(kv_pool.num_layers, kv_pool.num_kv_heads, kv_pool.head_dim, kv_pool.dtype)
        if size_gb > 0:
            return cls(kv_pool, int(size_gb * GB) // per_token)
        return cls(kv_pool, int(kv_pool.num_slots * ratio))

    # ---- host slots ----
    def alloc(self, n: int) -> Optional[torch.Tensor]:
        """`n` host slots, ascending (so they fall in few contiguous runs), or None when fewer are free."""
        slots = self.allocator.alloc(n)
        return None if slots is None else torch.sort(slots).values

    def free(self, slots: torch.Tensor) -> None:
        self.allocator.free(slots)

    def available(self) -> int:
        return self.allocator.available()

    def used(self) -> int:
        return self.num_slots - self.allocator.available()

    def clear(self) -> None:
        self.allocator.clear()

    # ---- copies ----
    def save(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        """The K/V of `device_slots` (n,) into `host_slots` (n,) (ascending, from `alloc`)."""
        for at in range(0, int(device_slots.numel()), self.chunk_tokens):
            d, h = device_slots[at : at + self.chunk_tokens], host_slots[at : at + self.chunk_tokens]
            if self.copy_stream is None:
                self.buffer[h] = self._gather(d)
            else:
                self._save_on_gpu(d, h)
        if self.kv_pool.host_copies is not None:
            self.kv_pool.host_copies.record(True, device_slots, host_slots)
        self.stats.saved_tokens += int(device_slots.numel())
        self.stats.bytes_to_host += int(device_slots.numel()) * self.bytes_per_token

    def load(self, host_slots: torch.Tensor, device_slots: torch.Tensor, hold: bool = False) -> Optional[object]:
        """The K/V in `host_slots` (n,) (ascending) into `device_slots` (n,). Without `hold`, before any later
        step reads them (the compute stream waits for the copies). With `hold` (one device), the copies and
        the scatter run on the copy stream alone and the returned event (its `query()` true once they are
        done) tells when the slots may be read: the caller keeps every step off them until then. None where
        the copy was synchronous (the CPU) or waited for."""
        for at in range(0, int(host_slots.numel()), self.chunk_tokens):
            h, d = host_slots[at : at + self.chunk_tokens], device_slots[at : at + self.chunk_tokens]
            if self.copy_stream is None:
                self._scatter(d, self.buffer[h])
            else:
                self._load_on_gpu(h, d, hold)
        if self.kv_pool.host_copies is not None:
            self.kv_pool.host_copies.record(False, device_slots, host_slots)
        self.stats.loaded_tokens += int(host_slots.numel())
        self.stats.bytes_to_device += int(host_slots.numel()) * self.bytes_per_token
        if not hold or self.copy_stream is None:
            return None
        done = torch.cuda.Event()
        done.record(self.copy_stream)
        return done

    def replay(self, copies: list[HostCopy]) -> None:
        """Rank 0's copies (its pool's `host_copies`, taken into a step plan), in order, on this rank's pool
        and shard: another rank of a split model, before the plan's step."""
        for c in copies:
            device, host = torch.from_numpy(c.device_slots), torch.from_numpy(c.host_slots)
            if c.to_host:
                self.save(device, host)
            else:
                self.load(host, device)

    # NOTE: on a GPU each chunk goes through one of two fixed staging buffers on the device (a node of
    # thousands of tokens staged whole would need gigabytes there). `_staging_free[i]` is recorded after the
    # last use of buffer i, on whichever stream used it; the next use waits for it on the device, never on
    # the host.
    def _save_on_gpu(self, d: torch.Tensor, h: torch.Tensor) -> None:
        assert self.copy_stream is not None
        compute, i = torch.cuda.current_stream(), self._next_staging()
        staging = self._staging[i][: d.numel()]  # (m, L, 2, H, D)
        compute.wait_event(self._staging_free[i])
        pool, idx = self.kv_pool, self._on_device(d)
        for layer, (k, v) in enumerate(zip(pool.k_buffer, pool.v_buffer)):  # gathered on the compute stream:
            staging[:, layer, 0] = k[idx]  # a later step that reuses the slots runs after it
            staging[:, layer, 1] = v[idx]
        self.copy_stream.wait_stream(compute)
        with torch.cuda.stream(self.copy_stream):
            for lo, hi, at in _runs(h):
                self.buffer[lo:hi].copy_(staging[at : at + hi - lo], non_blocking=True)
            self._staging_free[i].record()

    def _load_on_gpu(self, h: torch.Tensor, d: torch.Tensor, hold: bool) -> None:
        assert self.copy_stream is not None
        compute, i = torch.cuda.current_stream(), self._next_staging()
        staging = self._staging[i][: h.numel()]  # (m, L, 2, H, D)
        # NOTE: the copies wait for the buffer only, not for the step in flight on the compute stream.
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(self._staging_free[i])
            for lo, hi, at in _runs(h):
                staging[at : at + hi - lo].copy_(self.buffer[lo:hi], non_blocking=True)
        if hold:
            # NOTE: the scatter waits for what the compute stream has queued (a step in flight may still read
            # what these freshly allocated slots held before), never the other way round: no step is held up.
            self.copy_stream.wait_stream(compute)
            with torch.cuda.stream(self.copy_stream):
                self._scatter(d, staging)
                self._staging_free[i].record(self.copy_stream)
            return
        compute.wait_stream(self.copy_stream)
        self._scatter(d, staging)
        self._staging_free[i].record(compute)

    def _next_staging(self) -> int:
        self._turn = 1 - self._turn
        return self._turn

    def _gather(self, device_slots: torch.Tensor) -> torch.Tensor:
        pool = self.kv_pool
        idx = self._on_device(device_slots)
        per_layer = [torch.stack((k[idx], v[idx]), dim=1) for k, v in zip(pool.k_buffer, pool.v_buffer)]
        return torch.stack(per_layer, dim=1)  # (n, L, 2, H, D)

    def _scatter(self, device_slots: torch.Tensor, staging: torch.Tensor) -> None:
        pool = self.kv_pool
        idx = self._on_device(device_slots)
        for layer, (k, v) in enumerate(zip(pool.k_buffer, pool.v_buffer)):
            k[idx] = staging[:, layer, 0]
            v[idx] = staging[:, layer, 1]

    def _on_device(self, slots: torch.Tensor) -> torch.Tensor:
        # NOTE: an upload from pageable memory would wait for the steps in flight; from pinned memory it is queued.
        if not self.on_gpu:
            return slots
        return slots.pin_memory().to(self.kv_pool.device, non_blocking=True)

    def usage(self) -> dict:
        s = self.stats
        return {
            "hicache_host_tokens": self.num_slots,
            "hicache_host_used_tokens": self.used(),
            "hicache_host_usage": self.used() / self.num_slots,
            "hicache_host_bytes": self.buffer.numel() * self.buffer.element_size(),
            "hicache_num_loads": s.num_loads,
            "hicache_loaded_tokens": s.loaded_tokens,
            "hicache_saved_tokens": s.saved_tokens,
            "hicache_host_evicted_tokens": s.evicted_tokens,
            "hicache_bytes_to_host": s.bytes_to_host,
            "hicache_bytes_to_device": s.bytes_to_device,
        }


def host_memory_available() -> Optional[int]:
    """Bytes of memory the OS could still give (Linux's MemAvailable), or None where it does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _runs(slots: torch.Tensor) -> list[tuple[int, int, int]]:
    """Ascending slots as contiguous runs: (first slot, past the last, index of the first in `slots`)."""
    s = slots.numpy()
    if s.size == 0:
        return []
    starts = np.flatnonzero(np.diff(s) != 1) + 1
    bounds = np.concatenate(([0], starts, [s.size]))
    return [(int(s[a]), int(s[b - 1]) + 1, int(a)) for a, b in zip(bounds[:-1], bounds[1:])]
