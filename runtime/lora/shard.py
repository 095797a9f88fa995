"""`LoraShard`: the part of every adapter that one rank of a split model holds, cut as the base model's
layers are (models/parallel.py decides the cuts; `projection_slices` names them here as plain data).

A LoRA delta of a projection is x @ A^T @ B^T, with A (r, in) and B (out, r):
- a column-parallel projection (q/k/v, gate/up: each rank its output rows) keeps A whole and cuts B's
  rows as the base's rows are cut: the rank computes its own output rows' delta;
- a row-parallel projection (o, down: each rank its input columns) cuts A's columns as the base's columns
  and keeps B whole: the rank's delta is a partial sum over its input columns, added to the base's
  partial output before the all-reduce that sums the base's (so the sum holds the whole delta once).
A pipeline stage holds its own layers' adapters only.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from .adapter import LoraShapes

ROWS, COLUMNS = 0, 1  # a projection's weight (out, in) cut along its output rows, or its input columns


@dataclass(frozen=True)
class LoraShard:
    first_layer: int = 0
    num_layers: int = -1  # -1: every layer
    # per projection (PEFT's module name) cut by the rank: (ROWS or COLUMNS, start, stop) of its base weight
    cuts: dict[str, tuple[int, int, int]] = field(default_factory=dict)

    @classmethod
    def of(
        cls, slices: dict[str, Optional[tuple[int, int, int]]], first_layer: int = 0, num_layers: int = -1
    ) -> "LoraShard":
        """From models.parallel.projection_slices (None: held whole) and the stage's layers."""
        return cls(first_layer, num_layers, {m: s for m, s in slices.items() if s is not None})

    def local_shapes(self, shapes: LoraShapes) -> LoraShapes:
        """The whole model's projection shapes -> this rank's (the sizes its slots hold)."""

        def size(module: str, whole: int) -> int:
            cut = self.cuts.get(module)
            return whole if cut is None else cut[2] - cut[1]

        layers = shapes.num_layers if self.num_layers < 0 else self.num_layers
        return replace(
            shapes,
            num_layers=layers,
            q_size=size("q_proj", shapes.q_size),
            kv_size=size("k_proj", shapes.kv_size),
            intermediate=size("gate_proj", shapes.intermediate),
        )

    def cut(self, module: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """An adapter's module on the host, A (L, r, in) and B (L, out, r) -> this rank's part: its layers,
        and B's rows (column-parallel) or A's columns (row-parallel) as the base weight is cut."""
        if self.num_layers >= 0:
            layers = slice(self.first_layer, self.first_layer + self.num_layers)
            a, b = a[layers], b[layers]
        cut = self.cuts.get(module)
        if cut is not None:
            dim, start, stop = cut
            if dim == ROWS:
                b = b[:, start:stop]  # (L, out shard, r)
            else:
                a = a[:, :, start:stop]  # (L, r, in shard)
        return a, b


WHOLE = LoraShard()  # one device: every layer, nothing cut
