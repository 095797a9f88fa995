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

from typing import Optional

import torch

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
        what was there."""
        if not 1 <= slot <= self.num_slots:
            raise ValueError(f"LoRA slot {slot} out of 1..{self.num_slots}")
        r, R = adapter.rank, self.max_rank
        for t in TARGETS:
            a, b = self.a[t.name][slot], self.b[t.name][slot]  # (L, subs * R, in), (L, out, R)
            a.zero_()
            b.zero_()
            out = 0
            for j, (module, size) in enumerate(zip(t.modules, self.out_splits[t.name])):
                weights = adapter.weights.get(module)
                if weights is not None:
                    part_a, part_b = self.shard.cut(module, *weights)
                    a[:, j * R : j * R + r].copy_(part_a)  # (L, r, in)
                    b[:, out : out + size, :r].copy_(part_b)  # (L, size, r)
                out += size
        self.holds[slot] = adapter.name
