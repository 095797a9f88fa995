"""`SchedulerAdapters`: the scheduler's LoRA part (with enable_lora). It owns the registry of loaded
adapters (runtime/lora/registry.py) and answers for it: a request naming an adapter that is not loaded is
refused at intake; admission keeps a step to `max_loras_per_batch` distinct adapters; each step is told
its requests' device slots (and which adapters to copy in first); adapters are loaded and unloaded by
control calls while requests run (one still asked for by a live request is not unloaded).
"""

from __future__ import annotations

from typing import Iterable, Optional

from ..io_struct import LoadLoraAdapterReq, UnloadLoraAdapterReq
from ..lora.adapter import LoraShapes
from ..lora.registry import LoraRegistry
from ..request import Req
from ..server_args import ServerArgs
from ..setting_values import parse_lora_paths
from ..step import StepInput
from .queues import RequestQueues


class SchedulerAdapters:
    def __init__(self, registry: LoraRegistry, queues: RequestQueues):
        self.registry = registry
        self.queues = queues

    @classmethod
    def of(cls, server_args: ServerArgs, model_config, queues: RequestQueues) -> Optional["SchedulerAdapters"]:
        """With enable_lora: the part, `lora_paths` loaded (a bad one stops the start with its error)."""
        if not server_args.enable_lora:
            return None
        sa = server_args
        registry = LoraRegistry(LoraShapes.of(model_config), sa.max_lora_rank, sa.max_loras_per_batch)
        for name, path in parse_lora_paths(sa.lora_paths or []).items():
            registry.load(name, path)
        return cls(registry, queues)

    def check_request(self, r: Req) -> None:
        """A LoraError naming the adapter when `r` asks for one that is not loaded."""
        if r.lora_path is not None:
            self.registry.check(r.lora_path)

    def active(self, reqs: Iterable[Req]) -> set:
        """The adapters that `reqs` use."""
        return {r.lora_path for r in reqs if r.lora_path is not None}

    def admits(self, r: Req, active: set) -> bool:
        """Whether `r` may join a step whose requests use `active` (which grows by its adapter if so)."""
        if not self.registry.admits(r.lora_path, active):
            return False
        if r.lora_path is not None:
            active.add(r.lora_path)
        return True

    def attach(self, step: StepInput, reqs: list[Req]) -> None:
        """The step's per-request slots (`step.lora`), for `reqs` in step order."""
        step.lora = self.registry.rows(r.lora_path for r in reqs)

    # ---- control calls ----
    def load(self, msg: LoadLoraAdapterReq) -> dict:
        return self.registry.load(msg.lora_name, msg.lora_path)

    def unload(self, msg: UnloadLoraAdapterReq) -> bool:
        users = sum(1 for r in self.queues.by_rid.values() if r.lora_path == msg.lora_name)
        self.registry.unload(msg.lora_name, users)
        return True

    def stats(self) -> dict:
        return {"lora": {**self.registry.stats(), "adapters": self.registry.names()}}
