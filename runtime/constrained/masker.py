"""Grammar masks applied to a step's logits: the part the step runner holds.

It sees only each row's grammar matcher (never the scheduler's requests): row i follows matchers[i], a
row whose matcher is None is untouched. The bitmask is allocated once (grown when a batch is larger)
and filled on the host by the matchers, then applied in place on the logits' device.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from .bitmask import allocate_token_bitmask, apply_token_bitmask_inplace


class GrammarMasker:
    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self._bitmask: Optional[torch.Tensor] = None  # (rows, W) int32 on the host

    def fill(self, matchers: Sequence[Any], batch: int) -> torch.Tensor:
        """The (batch, W) int32 bits of what each row's matcher allows next (a terminated one: nothing; a row
        without a matcher: left as it was, never applied). Filled once a step: a matcher's fill may decide
        things (request_grammar.py), so `apply` takes these bits rather than filling again."""
        if self._bitmask is None or self._bitmask.shape[0] < batch:
            self._bitmask = allocate_token_bitmask(max(batch, 8), self.vocab_size)
        bitmask = self._bitmask[:batch]  # (B, W)
        for i, m in enumerate(matchers):
            if m is None:
                continue
            if not m.is_terminated():
                m.fill_bitmask(bitmask, i)
            else:  # only reached if a finished request is still batched: allow nothing but stop
                bitmask[i].zero_()
        return bitmask

    def refine(self, matchers: Sequence[Any], bitmask: torch.Tensor, row_logits: Callable[[int], torch.Tensor]) -> None:
        """Narrow the bits `fill` wrote by each row's logits, where its matcher reads them (`wants_logits`):
        `row_logits(i)` makes row i's (V,) logits, only for those rows."""
        for i, m in enumerate(matchers):
            if m is not None and not m.is_terminated() and m.wants_logits:
                m.refine_bitmask(row_logits(i), bitmask[i])

    def apply(self, logits: torch.Tensor, matchers: Sequence[Any], bitmask: Optional[torch.Tensor] = None) -> None:
        """Mask logits (B, V) in place: row i allows only what matchers[i] accepts next. `bitmask`: the bits
        `fill` wrote for this step already (else filled here)."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        if bitmask is None:
            bitmask = self.fill(matchers, logits.shape[0])
        self.refine(matchers, bitmask, lambda i: logits[i])
        apply_token_bitmask_inplace(logits, bitmask, rows)
