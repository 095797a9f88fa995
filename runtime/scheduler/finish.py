"""The one way a request ends: its KV given back, its final output queued, and it leaves the queues."""

from __future__ import annotations

from typing import Optional

from ..request import FinishReason, Req
from .kv_manager import KVManager
from .outputs import OutputBuilder
from .queues import RequestQueues


class Finisher:
    def __init__(self, queues: RequestQueues, kv: KVManager, outputs: OutputBuilder, stats: dict):
        self.queues = queues
        self.kv = kv
        self.outputs = outputs
        self.stats = stats

    def end(self, r: Req, reason: Optional[FinishReason] = None, counted: bool = False) -> None:
        """End `r` (with `reason`, else the one it has). `counted`: it ran, and counts as finished in the
        stats (not one refused at intake or aborted for memory)."""
        if reason is not None:
            r.finished_reason = reason
        self.kv.release(r)
        self.queues.finished(r)
        self.outputs.emit_final(r)
        if counted:
            self.stats["num_finished"] += 1
