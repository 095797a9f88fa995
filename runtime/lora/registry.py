"""`LoraRegistry`: the scheduler's adapters. Every loaded adapter is kept in host memory; the runner's
device pool has `max_loras_per_batch` slots (slots.py), and this decides which adapter sits in which:
a step's adapters get slots, the least recently used adapter that the step does not need leaves its slot
when there is no free one, and the step tells the runner what to copy (`LoraRows.loads`). So more adapters
may be loaded than fit on the device; at most `max_loras_per_batch` distinct ones run in one step, which
admission keeps to (`admits`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Optional

from ..step import LoraRows
from .adapter import LoraAdapter, LoraError, LoraShapes, read_adapter


class LoraRegistry:
    def __init__(self, shapes: LoraShapes, max_rank: int, max_loras_per_batch: int):
        self.shapes = shapes
        self.max_rank = max_rank
        self.max_per_batch = max_loras_per_batch
        self.adapters: dict[str, LoraAdapter] = {}
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # adapters in device slots, least recent first
        self._free_slots = list(range(max_loras_per_batch, 0, -1))  # popped from the end: 1 first
        self.swaps = 0  # adapters copied into a slot from host memory

    # ---- loading ----
    def load(self, name: str, path: str) -> dict:
        """Read the PEFT folder `path` as adapter `name` (a LoraError says why it cannot be served)."""
        if not isinstance(name, str) or not name or ":" in name:
            raise LoraError(f"LoRA adapter name {name!r} must be a non-empty string without ':'")
        if name in self.adapters:
            raise LoraError(f"LoRA adapter {name!r} is already loaded (from {self.adapters[name].path!r})")
        adapter = read_adapter(name, path, self.shapes, self.max_rank)
        self.adapters[name] = adapter
        return {"name": name, "path": path, "rank": adapter.rank}

    def unload(self, name: str, users: int) -> None:
        """Forget adapter `name`; refused while `users` requests (waiting or running) still ask for it."""
        self.check(name)
        if users:
            raise LoraError(f"LoRA adapter {name!r} is in use by {users} request(s); unload it when they end")
        del self.adapters[name]
        slot = self._slot_of.pop(name, None)
        if slot is not None:
            self._free_slots.append(slot)

    def check(self, name: str) -> None:
        if name not in self.adapters:
            loaded = ", ".join(sorted(self.adapters)) or "none"
            raise LoraError(f"unknown LoRA adapter {name!r} (loaded: {loaded})")

    def names(self) -> list[str]:
        return sorted(self.adapters)

    # ---- batches ----
    def admits(self, name: Optional[str], active: set) -> bool:
        """Whether a request of adapter `name` may join a step whose requests use the adapters `active`."""
        return name is None or name in active or len(active) < self.max_per_batch

    def rows(self, names: Iterable[Optional[str]]) -> Optional[LoraRows]:
        """A step's adapters: per request its adapter's slot (0: none), adapters not in a slot copied into
        one. None when no request of the step has an adapter."""
        names = list(names)
        needed = list(dict.fromkeys(n for n in names if n is not None))  # in order of first use
        if not needed:
            return None
        if len(needed) > self.max_per_batch:
            raise RuntimeError(f"a step of {len(needed)} LoRA adapters; admission keeps to {self.max_per_batch}")
        loads = []
        for name in needed:
            if name in self._slot_of:
                self._slot_of.move_to_end(name)
                continue
            if self._free_slots:
                slot = self._free_slots.pop()
            else:
                victim = next(n for n in self._slot_of if n not in needed)  # least recently used
                slot = self._slot_of.pop(victim)
            self._slot_of[name] = slot
            loads.append((slot, self.adapters[name]))
        self.swaps += len(loads)
        return LoraRows([0 if n is None else self._slot_of[n] for n in names], loads)

    def stats(self) -> dict:
        return {
            "loaded": len(self.adapters),
            "in_slots": len(self._slot_of),
            "slots": self.max_per_batch,
            "swaps": self.swaps,
        }
