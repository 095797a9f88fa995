"""Where the scheduler's time goes, per kind of step: how many, how many rows and tokens, host wall time,
and (on the GPU, with `enable_step_timing`) device time from CUDA events around each launched step.

Device busy time next to wall time is what says whether the host keeps the GPU fed: with overlap
scheduling a decode step is launched before the previous one is read back, so a gap between the two
sums is time the GPU waited for Python. `get_stats` reports the totals under `steps`.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

import torch

KINDS = ("prefill", "mixed", "decode", "verify")


class StepTimer:
    def __init__(self, device_timing: bool):
        self.device_timing = device_timing and torch.cuda.is_available()
        self.totals: dict[str, dict[str, float]] = {
            k: {"steps": 0, "rows": 0, "tokens": 0, "wall_s": 0.0, "device_s": 0.0} for k in KINDS
        }
        # Decode steps launched while the previous one had already been read back (the pipeline restarted).
        self.decode_restarts = 0
        # Host seconds by phase, whatever the step kind: admitting a prefill batch ("admit"), reading back
        # and processing a step's results ("results"), taking in requests ("intake") and sending outputs
        # ("outputs"). Next to the device time they say which host work the GPU waited for.
        self.phases = {"admit": 0.0, "results": 0.0, "intake": 0.0, "outputs": 0.0}
        # (kind, start event, end event), oldest first, not yet read
        self._open: deque[tuple[str, torch.cuda.Event, torch.cuda.Event]] = deque()

    def begin(self) -> Optional[torch.cuda.Event]:
        """Mark the start of a step's device work (in stream order). None when not timing."""
        if not self.device_timing:
            return None
        self._drain(block=False)
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def launched(self, kind: str, start: Optional[torch.cuda.Event]) -> None:
        """Mark the end of the step's device work: call right after the launch (or the read-back of a
        step run synchronously), before any host work, so no idle time falls between the events."""
        if start is not None:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._open.append((kind, start, ev))

    def count(self, kind: str, rows: int, tokens: int, wall_s: float) -> None:
        t = self.totals[kind]
        t["steps"] += 1
        t["rows"] += rows
        t["tokens"] += tokens
        t["wall_s"] += wall_s

    def phase(self, name: str, seconds: float) -> None:
        self.phases[name] += seconds

    def _drain(self, block: bool) -> None:
        # NOTE: events complete in stream order, so the oldest open one is the first to check.
        while self._open:
            kind, start, stop = self._open[0]
            if block:
                stop.synchronize()
            elif not stop.query():
                return
            self.totals[kind]["device_s"] += start.elapsed_time(stop) / 1e3
            self._open.popleft()

    def report(self) -> dict[str, object]:
        self._drain(block=True)
        out: dict[str, object] = {k: dict(v) for k, v in self.totals.items()}
        out["decode_restarts"] = self.decode_restarts
        out["host_phases"] = dict(self.phases)
        out["device_timing"] = self.device_timing
        return out
