"""Program-aware pins, from the executor's side: which text a program keeps cached, and until when.

The pin service itself (budget, ordering, release) is `pins.ProgramPins`; these are the decisions
a `StreamExecutor` makes about its own state: pin a fork's shared prefix until join, keep the
growing state pinned between two requests when another request will follow, give everything
back when the program ends.
"""

from __future__ import annotations

from typing import Any

from .ir import SglConcateAndAppend, SglGen, SglSelect, flatten

# A program state shorter than this is cheaper to prefill again than to keep pinned between gens.
MIN_STATE_PIN_CHARS = 256


class ExecutorPinsMixin:
    """Needs from the executor: `pins` (ProgramPins or None), `text_`, `branch`, `is_root`,
    `use_thread`, `queue` and `_ended`."""

    def pin_fork_prefix(self) -> Any:
        """Keep the text the branches of a fork share cached until join (a pin ticket, or None)."""
        return self.pins.pin(self.text_) if self.pins is not None else None

    def release_pin(self, ticket: Any) -> None:
        if self.pins is not None:
            self.pins.unpin(ticket)

    def _release_pins(self, wait: bool = True) -> None:
        if self.pins is None:
            return
        if self.is_root:  # the program is over: every pin it and its forks hold
            self.pins.release_all(wait=wait)
        else:
            self.pins.drop_state_pin(self.branch)

    def _maybe_pin_state(self) -> None:
        """After a request: keep this state cached until its next request, when that pays."""
        if self.pins is None:
            return
        if len(self.text_) >= MIN_STATE_PIN_CHARS and self._will_extend():
            self.pins.move_state_pin(self.branch, self.text_)
        else:
            self.pins.drop_state_pin(self.branch)

    def _will_extend(self) -> bool:
        """Whether another request will follow on this state: one is queued already, or the program
        body is still running (it may be reading this result to decide what to send next)."""
        if not self.use_thread:
            return not self._ended
        with self.queue.mutex:
            pending = list(self.queue.queue)
        for expr in pending:
            if expr is None:
                return False
            if any(isinstance(n, (SglGen, SglSelect, SglConcateAndAppend)) for n in flatten(expr)):
                return True
        return not self._ended
