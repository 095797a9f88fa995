"""A request's speculation history: how likely its next draft is accepted, how many drafts it may propose
next, and when it stops proposing for a while (its acceptance collapsed: every draft costs compute,
none pays).

The accept rate is a moving count of accepted drafts over drafts that were decided (a chain of k with a
accepted decides a + 1 of them, or k when all are accepted), from a prior that constrained requests
(grammar-forced drafts) start higher. It is what cost.allocate weighs drafts by. The length goes back to
the maximum when every draft is accepted, and drops to one more than what was accepted when some are
rejected, for drafts that cost a drafter's step each (`shrink`: a draft model, an EAGLE head); drafts found
by lookup or forced by a grammar cost nothing to propose, and cost.allocate cuts what does not pay (a
lookup's chain after one rejection is no worse a bet than before it: its next match starts afresh). After `COLLAPSE_STEPS` verify steps in a row that accepted nothing the request sits out
`backoff` decode steps, doubling up to `MAX_BACKOFF` while it keeps failing; one accepted draft resets it.
"""

from __future__ import annotations

from typing import Optional

from .ngram import NgramIndex

COLLAPSE_STEPS = 3
FIRST_BACKOFF = 8
MAX_BACKOFF = 128
RATE_DECAY = 0.8  # weight of the past in the accept rate at each verify step
PRIOR = {False: (2.0, 3.0), True: (9.0, 10.0)}  # (accepted, decided): guessed drafts, grammar-forced ones

class RequestSpecState:
    """One request's speculation: its lookup index, its draft length, and its counters (meta_info)."""

    def __init__(self, max_drafts: int, adaptive: bool, ngram: Optional[NgramIndex] = None,
                 constrained: bool = False, shrink: bool = True):
        self.max_drafts = max_drafts
        self.shrink = shrink
        self._hits, self._decided = PRIOR[constrained]
        self.adaptive = adaptive
        self.ngram = ngram
        self.draft_len = max_drafts
        # (text the grammar forced, output length then) until the target's tokens spelling it are known
        self.pending_forced: Optional[tuple[str, int]] = None
        self.misses = 0  # verify steps in a row that accepted nothing
        self.sit_out = 0  # decode steps left without drafts
        self.backoff = FIRST_BACKOFF
        # Reported per request: verify steps it had drafts in, drafts proposed, drafts accepted (committed).
        self.verify_steps = 0
        self.draft_tokens = 0
        self.accepted_tokens = 0

    @property
    def accept_rate(self) -> float:
        """The chance that this request's next draft is accepted."""
        return self._hits / self._decided

    def allowed_drafts(self) -> int:
        """Drafts this step may propose (0 while sitting out); one decode step counts down the sit-out."""
        if self.sit_out > 0:
            self.sit_out -= 1
            return 0
        return self.draft_len

    def skip_step(self) -> None:
        """A decode step went by without asking for drafts (the batch paused, or ran ahead)."""
        if self.sit_out > 0:
            self.sit_out -= 1

    def record(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        self.verify_steps += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        self._hits = RATE_DECAY * self._hits + accepted
        self._decided = RATE_DECAY * self._decided + accepted + (accepted < proposed)
        if not self.adaptive:
            return
        if accepted >= proposed or not self.shrink:
            self.draft_len = self.max_drafts
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
