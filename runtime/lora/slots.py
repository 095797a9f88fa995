"""`LoraSlots`: the runner's device memory for the adapters a batch may use, one slot each.

Slot 0 is the base model alone: zeros, never written. Slots 1..S hold adapters at the server's
--max-lora-rank, lower ranks zero-padded (a zero row of A and column of B add exactly nothing). Which
adapter is in which slot is the scheduler's decision (registry.py); the runner copies an adapter from host
memory into its slot when a step asks (`StepInput.lora.loads`), before the step's forward. On a rank of a
split model the slots hold the rank's part of each adapter (shard.py): its layers, and A or B cut as the
base projection is; every rank writes the same slots from the same step plan.

Per fused projection (adapter.TARGETS), over all layers:
- A (S+1, L, subs * R, in): sub-projection j's A in rows j * R ..;
- B (S+1, L, out, R): each output row's B row, in the fused matrix's output order (q | k | v; gate | up),
  scaled by the adapter's lora_alpha / r.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from ..uploads import copy_into
from .adapter import TARGETS, LoraAdapter, LoraShapes
from .shard import WHOLE, LoraShard


class LoraSlots:
    def __init__(
        self,
        shapes: LoraShapes,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: str,
        shard: LoraShard = WHOLE,
    ):
        """`shapes`: the whole model's; `shard`: this rank's part of it (the slots hold that part)."""
        self.shard = shard
        self.shapes = shapes = shard.local_shapes(shapes)
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.device = device
        L, R = shapes.num_layers, max_rank
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        self.out_splits: dict[str, list[int]] = {}
        for t in TARGETS:
            self.a[t.name] = torch.zeros(
                num_slots + 1, L, len(t.modules) * R, shapes.in_features(t), dtype=dtype, device=device
            )
            self.b[t.name] = torch.zeros(num_slots + 1, L, shapes.out_total(t), R, dtype=dtype, device=device)
            self.out_splits[t.name] = [shapes.out_features(m) for m in t.modules]
        self.holds: list[str | None] = [None] * (num_slots + 1)  # the adapter's name in each slot
        self.dtype = dtype
        # id(adapter) -> (a weak reference to it, its host image): see host_image
        self._images: dict[int, tuple[weakref.ref, dict[str, tuple[torch.Tensor, torch.Tensor]]]] = {}

    @classmethod
    def for_server(
        cls, server_args, shapes: LoraShapes, dtype: torch.dtype, device: str, shard: LoraShard = WHOLE
    ) -> Optional["LoraSlots"]:
        """The slots ServerArgs ask for (max_loras_per_batch at max_lora_rank) of the rank's `shard`; None
        without enable_lora."""
        if not server_args.enable_lora:
            return None
        return cls(shapes, server_args.max_loras_per_batch, server_args.max_lora_rank, dtype, device, shard)

    def nbytes(self) -> int:
        return sum(x.nbytes for d in (self.a, self.b) for x in d.values())

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy `adapter` (host, the whole model's) into `slot` (1..S), this rank's part of it, replacing
        what was there: two copies per fused projection from the adapter's host image (`host_image`), queued
        on the device, so a swap neither waits for the step in flight nor converts on the way."""
        if not 1 <= slot <= self.num_slots:
            raise ValueError(f"LoRA slot {slot} out of 1..{self.num_slots}")
        image = self.host_image(adapter)
        for t in TARGETS:
            a, b = image[t.name]
            copy_into(self.a[t.name][slot], a)
            copy_into(self.b[t.name][slot], b)
        self.holds[slot] = adapter.name

    def host_image(self, adapter: LoraAdapter) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The adapter as one slot holds it (this rank's part, the slots' dtype, zero-padded to the max rank),
        per fused projection (A (L, subs * R, in), B (L, out, R)), on the host. Made at its first write and kept
        while the adapter object lives (the registry's: until it is unloaded).

        NOTE: written module by module from the float32 host weights, a slot took ~40 small copies, each
        converted on the way and, from pageable memory, each waiting for the step in flight: an 8B-shaped
        rank-16 adapter's first use cost the whole batch ~0.15 s (bench_lora: ~1 s for seven, GPU, 2026-12-06).
        """
        key = id(adapter)
        kept = self._images.get(key)
        if kept is not None and kept[0]() is adapter:
            return kept[1]
        L, R = self.shapes.num_layers, self.max_rank
        r = adapter.rank
        image = {}
        for t in TARGETS:
            a = torch.zeros(L, len(t.modules) * R, self.shapes.in_features(t), dtype=self.dtype)
            b = torch.zeros(L, self.shapes.out_total(t), R, dtype=self.dtype)
            out = 0
            for j, (module, size) in enumerate(zip(t.modules, self.out_splits[t.name])):
                weights = adapter.weights.get(module)
                if weights is not None:
                    part_a, part_b = self.shard.cut(module, *weights)
                    a[:, j * R : j * R + r] = part_a  # (L, r, in)
                    b[:, out : out + size, :r] = part_b  # (L, size, r)
                out += size
            image[t.name] = (a, b)
        self._images[key] = (weakref.ref(adapter, lambda _, key=key: self._images.pop(key, None)), image)
        return image
