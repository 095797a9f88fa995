"""A request's speculation history: how likely its next drafts are accepted, how many drafts it may propose
next, and when it stops proposing for a while (its acceptance collapsed: every draft costs compute,
none pays).

Accept rates are kept per kind of draft, grammar-forced and guessed (prompt lookup, a drafter): a forced
token is rejected only where the model spells the forced text otherwise, a guess far more often, and one
chain may hold both (forced text, then a lookup's value). Each is a moving count of accepted drafts over
drafts that were decided (a chain of k with a accepted decides a + 1 of them, or k when all are
accepted), from a prior. `chances` turns them into each draft's chance of being accepted, which is what
cost.allocate weighs drafts by. The length goes back to the maximum when every draft is accepted, and
drops to one more than what was accepted when some are rejected, for drafts that cost a drafter's step
each (`shrink`: a draft model, an EAGLE head); drafts found by lookup or forced by a grammar cost nothing
to propose, and cost.allocate cuts what does not pay (a lookup's chain after one rejection is no worse a
bet than before it: its next match starts afresh). After `COLLAPSE_STEPS` verify steps in a row that
accepted nothing the request sits out `backoff` decode steps, doubling up to `MAX_BACKOFF` while it keeps
failing; one accepted draft resets it.

A request's history starts from what recent requests' drafts achieved (`AcceptRates`, by kind): under a
stream of requests whose drafts are rejected, each new one would otherwise pay its own verify steps to
learn what the ones before it learnt; before any history, from PRIOR.
"""

from __future__ import annotations

from typing import Optional

from .ngram import NgramIndex

COLLAPSE_STEPS = 3
FIRST_BACKOFF = 8
MAX_BACKOFF = 128
RATE_DECAY = 0.8  # weight of the past in the accept rate at each verify step
PRIOR = {False: (2.0, 3.0), True: (9.0, 10.0)}  # (accepted, decided): guessed drafts, grammar-forced ones
POPULATION_DECAY = 0.99  # weight of the past in the recent requests' rates at each request's verify step
MIN_POPULATION = 8.0  # decided drafts (decayed) before recent requests' rates replace PRIOR


class AcceptRates:
    """Accepted over decided drafts by kind, over every request's verify steps (decayed sums)."""

    def __init__(self) -> None:
        self._sums = {forced: [0.0, 0.0] for forced in (False, True)}  # kind -> [accepted, decided]

    def add(self, forced: bool, accepted: int, decided: int) -> None:
        s = self._sums[forced]
        s[0] = POPULATION_DECAY * s[0] + accepted
        s[1] = POPULATION_DECAY * s[1] + decided

    def prior(self, forced: bool) -> tuple[float, float]:
        """A new request's (accepted, decided) for a kind: PRIOR's weight at the recent requests' rate."""
        hits, decided = self._sums[forced]
        weight = PRIOR[forced][1]
        if decided < MIN_POPULATION:
            return PRIOR[forced]
        return (weight * hits / decided, weight)


class RequestSpecState:
    """One request's speculation: its lookup index, its draft length, and its counters (meta_info)."""

    def __init__(
        self,
        max_drafts: int,
        adaptive: bool,
        ngram: Optional[NgramIndex] = None,
        shrink: bool = True,
        population: Optional[AcceptRates] = None,
    ):
        self.max_drafts = max_drafts
        self.shrink = shrink
        self.population = population  # recent requests' rates: where this one's start, and what it adds to
        start = population.prior if population is not None else PRIOR.__getitem__
        self._rates = {forced: list(start(forced)) for forced in (False, True)}  # kind -> [accepted, decided]
        self.forced: list[bool] = []  # which drafts of this step's chain the grammar forced (the rest: guessed)
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

    def chances(self, drafts: int) -> list[float]:
        """The chance that each of this step's first `drafts` drafts is accepted (it and those before it):
        by the kinds in `forced`, a draft past them guessed."""
        rate = {kind: hits / decided for kind, (hits, decided) in self._rates.items()}
        out, p = [], 1.0
        for j in range(drafts):
            p *= rate[j < len(self.forced) and self.forced[j]]
            out.append(p)
        return out

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
        kinds = [j < len(self.forced) and self.forced[j] for j in range(min(proposed, accepted + 1))]
        for kind in set(kinds):  # the rates of the kinds this chain decided
            hits = sum(1 for k in kinds[:accepted] if k == kind)
            rate = self._rates[kind]
            rate[0] = RATE_DECAY * rate[0] + hits
            decided = sum(1 for k in kinds if k == kind)
            rate[1] = RATE_DECAY * rate[1] + decided
            if self.population is not None:
                self.population.add(kind, hits, decided)
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
