"""Two-level paged KV memory.

- `ReqToTokenPool`: `req_to_token[req_slot, position] -> kv_slot` (int32), one row per running request,
  on the device for the attention kernels and mirrored on the host for the scheduler.
- `KVPool`: K and V per layer, indexed by kv slot; shape (num_slots, num_kv_heads, head_dim); in FP8
  with a scale per layer (`kv_cache_dtype`, kv_quant.py).
- `TokenAllocator`: the free list of kv slots.

NOTE: kv slot 0 is never handed out. It is the dummy slot that padded batch entries (CUDA-graph
padding, padded gathers in the torch_native backend) write to and read from.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from .host_copies import HostCopyLog
from .host_pages import advise_huge_pages
from .kv_quant import is_fp8, quantize


class ReqToTokenPool:
    """The table on the device, and a host mirror that gets every write (`write`, `write_step`).

    NOTE: the scheduler reads slots (`read`) from the mirror only: reading the device table is a
    device-to-host copy that waits for every queued step, including the decode step that overlap
    scheduling launched ahead, so the host work after it would overlap nothing. np.zeros maps pages
    lazily: rows sized for the full context cost only what is used.

    With `record_writes` (rank 0 of a model split over ranks) the writes other than a step's own
    (`write`, `write_rows`: the scheduler's, at admission and after prefix-cache inserts) are also
    kept, as plain host data, until `take_writes`: the other ranks `replay_writes` them into their own
    tables before the next step, so every rank's table holds the same slots. A step's own writes
    travel with the step (StepInput.kv_writes).
    """

    def __init__(self, size: int, max_context_len: int, device: str, record_writes: bool = False):
        self.size = size
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int32, device=device)
        self.host = np.zeros((size, max_context_len), dtype=np.int32)
        self._free = list(range(size))
        self._recorded: Optional[list[tuple]] = [] if record_writes else None

    def alloc(self) -> Optional[int]:
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        self._free.append(slot)

    def available(self) -> int:
        return len(self._free)

    def write(self, slot: int, start: int, kv_slots: torch.Tensor) -> None:
        """kv_slots (n,) at positions start..start+n of one request, in both tables."""
        host = kv_slots.cpu().numpy().astype(np.int32)
        self.req_to_token[slot, start : start + len(host)] = self._upload(host)
        self.host[slot, start : start + len(host)] = host
        if self._recorded is not None:
            self._recorded.append(("row", slot, start, host.astype(np.int32)))

    def write_rows(self, items: list[tuple[int, torch.Tensor]]) -> None:
        """Several requests' kv_slots from position 0 (cached prefixes at admission): host writes, and
        one upload + one indexed write on the device for all of them. Rows that pass the same tensor
        object (requests that matched the same cached prefix) share its upload.

        NOTE: one `write` per request was one pageable host-to-device copy each, and such a copy waits
        for the device: admitting a batch of requests that share a long prefix waited on every step in flight.
        The upload is each distinct prefix's int32 slots plus each row's (req slot, length, start of its
        prefix in the upload); the (row, position, source) indices are expanded on the device: ~10 KB
        instead of 1.3 MB (163 rows of one 2,000-token prefix), and no host copy per row.
        """
        if not items:
            return
        blob_of: dict[int, int] = {}  # id(kv tensor) -> index in blobs
        blobs: list[np.ndarray] = []  # distinct prefixes, as host arrays
        slots_of: list[list[int]] = []  # req slots per distinct prefix
        blob_per_row: list[int] = []
        for slot, kv_slots in items:
            b = blob_of.get(id(kv_slots))
            if b is None:
                b = blob_of[id(kv_slots)] = len(blobs)
                blobs.append(kv_slots.cpu().numpy())
                slots_of.append([])
            slots_of[b].append(slot)
            blob_per_row.append(b)
        for host, slots in zip(blobs, slots_of):  # (rows, n) <- (n,): one write per distinct prefix
            self.host[slots if len(slots) > 1 else slots[0], : len(host)] = host
        if self._recorded is not None:
            self._recorded.append(("rows", [(host.astype(np.int32), slots) for host, slots in zip(blobs, slots_of)]))
        k = len(items)
        blob_lens = np.fromiter(map(len, blobs), dtype=np.int64, count=len(blobs))
        blob_starts = np.cumsum(blob_lens) - blob_lens
        row_blob = np.asarray(blob_per_row, dtype=np.int64)
        lens, src_starts = blob_lens[row_blob], blob_starts[row_blob]  # (k,) each
        n, m = int(lens.sum()), int(blob_lens.sum())
        row_slots = np.fromiter((s for s, _ in items), dtype=np.int64, count=k)
        host_packed = np.concatenate(blobs + [row_slots, lens, src_starts, np.cumsum(lens) - lens])
        packed = self._upload(host_packed.astype(np.int32))  # one copy
        kv = packed[:m]
        slots_t, lens_t, src_t, dst_t = (packed[m + i * k : m + (i + 1) * k].long() for i in range(4))
        # NOTE: output_size keeps repeat_interleave from reading the total back (a sync).
        rows = torch.repeat_interleave(slots_t, lens_t, output_size=n)  # (n,)
        positions = torch.arange(n, device=packed.device) - torch.repeat_interleave(dst_t, lens_t, output_size=n)
        src = torch.repeat_interleave(src_t, lens_t, output_size=n) + positions  # (n,) into kv
        self.req_to_token[rows, positions] = kv[src]

    def _upload(self, host: np.ndarray) -> torch.Tensor:
        """A 1-D int32 host array on the table's device, without waiting for the device.

        NOTE: `.to(device)` from pageable memory synchronizes the stream: admission (which calls this
        once per prefill batch, ~0.6 MB for 512 rows of 128 distinct 1,113-token prefixes) waited for
        the step in flight, so the host work after it overlapped nothing. From pinned memory the copy
        is queued; the caching host allocator keeps the pinned block until the copy has run.
        """
        t = torch.from_numpy(host)
        device = self.req_to_token.device
        if device.type == "cpu":
            return t
        staging = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        staging.copy_(t)
        return staging.to(device, non_blocking=True)

    def write_step(self, device_rows: tuple, host_rows: tuple) -> None:
        """A step's new tokens, (req slots, positions, kv slots) each (T,): one indexed write per
        table, from the same values (already uploaded, and still on the host)."""
        slots, positions, kv = device_rows
        self.req_to_token[slots, positions] = kv.to(torch.int32)
        slots, positions, kv = host_rows
        self.host[slots, positions] = kv

    def take_writes(self) -> list[tuple]:
        """The recorded writes since the last call (see the class note), oldest first."""
        if self._recorded is None:
            raise RuntimeError("take_writes: this table does not record its writes (record_writes=False)")
        taken, self._recorded = self._recorded, []
        return taken

    def replay_writes(self, writes: list[tuple]) -> None:
        """Apply another rank's `take_writes()`, in order, to this table (both copies)."""
        for write in writes:
            if write[0] == "row":
                _, slot, start, host = write
                self.write(slot, start, torch.from_numpy(host))
            else:
                self.write_rows(
                    [(slot, kv) for host, slots in write[1] for kv in (torch.from_numpy(host),) for slot in slots]
                )

    def read(self, slot: int, n: int) -> torch.Tensor:
        """(n,) int64 kv slots of positions 0..n of one request, from the host mirror (no sync)."""
        return torch.from_numpy(self.host[slot, :n].astype(np.int64))


class TokenAllocator:
    """Free-list allocator of kv slots 1..num_slots (slot 0 is the dummy).

    NOTE: freed slots are kept in a list of runs and merged into the main free tensor only when an
    allocation needs them. Concatenating on every free would copy the whole free list (millions of
    slots for a small model on a large GPU) each time a request finishes.

    On the CPU the most recently freed runs are handed out first: the pool's memory is the OS's fresh pages
    until first written (`zeroed`), and a first write into one costs a page fault (~70 us a K or V store of 16
    tokens against ~5 into a written page, on the developers' VM), so an allocator that walks the whole pool
    before reusing a slot paid that at every step until it had written all of it.
    """

    def __init__(self, num_slots: int, device: str):
        self.num_slots = num_slots
        self.device = device
        self.reuse_freed_first = torch.device(device).type == "cpu"
        self.clear()

    def clear(self) -> None:
        self._free = torch.arange(1, self.num_slots + 1, dtype=torch.int64, device="cpu")
        self._released: list[torch.Tensor] = []  # freed runs not yet merged into _free
        self._released_count = 0

    def available(self) -> int:
        return int(self._free.numel()) + self._released_count

    def alloc(self, n: int) -> Optional[torch.Tensor]:
        if n > self.available():
            return None
        if self.reuse_freed_first and self._released_count:
            return self._alloc_freed_first(n)
        if n > self._free.numel():
            self._merge_released()
        out, self._free = self._free[:n], self._free[n:]
        return out

    def _alloc_freed_first(self, n: int) -> torch.Tensor:
        parts, need = [], n
        while need and self._released:
            run = self._released.pop()  # the most recently freed run
            if run.numel() > need:
                self._released.append(run[need:])
                run = run[:need]
            parts.append(run)
            need -= run.numel()
        self._released_count -= n - need
        if need:
            parts.append(self._free[:need])
            self._free = self._free[need:]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self._released.append(slots.to("cpu", torch.int64))
            self._released_count += int(slots.numel())

    def free_slots(self) -> torch.Tensor:
        """Every free slot, as one int64 tensor (for integrity checks)."""
        self._merge_released()
        return self._free

    def free_slot_set(self) -> set[int]:
        return set(self.free_slots().tolist())

    def _merge_released(self) -> None:
        if self._released:
            self._free = torch.cat([self._free, *self._released])
            self._released, self._released_count = [], 0


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """torch.zeros, for a KV cache. On the CPU the zeros come from calloc (through numpy), whose large blocks are
    fresh pages the OS zeroes when first touched, so a pool costs nothing until its slots are used.
    NOTE: torch.zeros wrote every byte at once, so a large CPU pool cost its whole size in writes at each start-up."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    num_bytes = int(np.prod(shape)) * dtype.itemsize
    zeros = np.zeros(num_bytes, dtype=np.uint8)
    advise_huge_pages(zeros)
    return torch.from_numpy(zeros).view(dtype).view(shape)


class KVPool:
    """K and V per layer, (num_slots + 1, num_kv_heads, head_dim) each, in `dtype`.

    An FP8 pool (`quantized`) also holds one float32 scale per layer for K and one for V (kv_quant.py):
    a stored row times its layer's scale is the model's K (V). The scales live on the pool's device and
    are set in place (`set_scales`), so CUDA graphs and kernels that read them see later values.
    """

    def __init__(
        self, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: str
    ):
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        # +1 for the dummy slot 0.
        shape = (num_slots + 1, num_kv_heads, head_dim)
        self.k_buffer = [zeroed(shape, dtype, device) for _ in range(num_layers)]
        self.v_buffer = [zeroed(shape, dtype, device) for _ in range(num_layers)]
        self.quantized = is_fp8(dtype)
        self.k_scale = torch.ones(num_layers, dtype=torch.float32, device=device)  # (L,) used when quantized
        self.v_scale = torch.ones(num_layers, dtype=torch.float32, device=device)
        # Per layer, the (k_scale, v_scale) 0-d views kernels take; None for a pool in the model's dtype.
        self._layer_scales = [(self.k_scale[i], self.v_scale[i]) if self.quantized else None for i in range(num_layers)]
        # Rank 0 of a model split over ranks: where a host tier over this pool records its copies, for the
        # other ranks to replay on their own pools (host_copies.py; set by the group runner).
        self.host_copies: Optional[HostCopyLog] = None

    def nbytes(self) -> int:
        """Bytes the pool's buffers hold (this rank's layers and KV heads)."""
        return sum(b.numel() * b.element_size() for b in (*self.k_buffer, *self.v_buffer))

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8

    def set_scales(self, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        """This pool's layers' scales (L,) each, copied in place; before any K/V is written with them."""
        if not self.quantized:
            raise ValueError(f"a KV pool in {self.dtype} stores K/V unscaled")
        if k_scale.shape != (self.num_layers,) or v_scale.shape != (self.num_layers,):
            raise ValueError(f"scales must be ({self.num_layers},), got {tuple(k_scale.shape)}, {tuple(v_scale.shape)}")
        if not (bool((k_scale > 0).all()) and bool((v_scale > 0).all())):
            raise ValueError("KV scales must be positive")
        self.k_scale.copy_(k_scale)
        self.v_scale.copy_(v_scale)

    def layer_scales(self, layer_id: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """(k_scale, v_scale) of a layer as 0-d float32 tensors for the attention kernels; None unless quantized."""
        return self._layer_scales[layer_id]

    def stores_from(self, dtype: torch.dtype) -> bool:
        """Whether a kernel writing K/V of `dtype` stores straight into this pool (the same dtype, or FP8
        through the layer's scale)."""
        return self.quantized or dtype == self.dtype

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # loc: (T,) ; k, v: (T, num_kv_heads, head_dim)
        if self.quantized:
            self.k_buffer[layer_id][loc] = quantize(k, self.k_scale[layer_id], self.dtype)
            self.v_buffer[layer_id][loc] = quantize(v, self.v_scale[layer_id], self.dtype)
            return
        self.k_buffer[layer_id][loc] = k.to(self.dtype)
        self.v_buffer[layer_id][loc] = v.to(self.dtype)
