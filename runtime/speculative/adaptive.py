"""How many drafts a request proposes next, from what its recent verify steps accepted, and when it
stops proposing for a while (its acceptance collapsed: every draft costs compute, none pays).

The length grows back to the maximum, doubling, while every draft is accepted, and drops to one more
than what was accepted when some are rejected. After `COLLAPSE_STEPS` verify steps in a row that
accepted nothing the request sits out `backoff` decode steps, doubling up to `MAX_BACKOFF` while it
keeps failing; one accepted draft resets it.
"""

from __future__ import annotations

from typing import Optional

from .ngram import NgramIndex

COLLAPSE_STEPS = 3
FIRST_BACKOFF = 8
MAX_BACKOFF = 128


class RequestSpecState:
    """One request's speculation: its lookup index, its draft length, and its counters (meta_info)."""

    def __init__(self, max_drafts: int, adaptive: bool, ngram: Optional[NgramIndex] = None):
        self.max_drafts = max_drafts
        self.adaptive = adaptive
        self.ngram = ngram
        self.draft_len = max_drafts
        self.misses = 0  # verify steps in a row that accepted nothing
        self.sit_out = 0  # decode steps left without drafts
        self.backoff = FIRST_BACKOFF
        # Reported per request: verify steps it had drafts in, drafts proposed, drafts accepted (committed).
        self.verify_steps = 0
        self.draft_tokens = 0
        self.accepted_tokens = 0

    def allowed_drafts(self) -> int:
        """Drafts this step may propose (0 while sitting out); one decode step counts down the sit-out."""
        if self.sit_out > 0:
            self.sit_out -= 1
            return 0
        return self.draft_len

    def record(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        self.verify_steps += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        if not self.adaptive:
            return
        if accepted >= proposed:
            self.draft_len = min(self.max_drafts, 2 * self.draft_len)
        else:
            self.draft_len = max(1, accepted + 1)
        if accepted:
            self.misses = 0
            self.backoff = FIRST_BACKOFF
            return
        self.misses += 1
        if self.misses >= COLLAPSE_STEPS:
            self.sit_out = self.backoff
            self.backoff = min(MAX_BACKOFF, 2 * self.backoff)
            self.misses = 0
