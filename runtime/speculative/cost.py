"""Whether drafts pay in this batch, and how many: the step's expected tokens against its measured cost.

A decode step of B requests takes `decode(B)` seconds on this device, a verify step of T tokens (each
request's tree) `verify(T)`: two curves, because a verify step is not a decode step with more rows. It
has its own kernels, runs synchronously (no step is launched ahead of it) and carries host work a decode
step does not, so a verify step of B + 1 tokens costs a fixed premium over a decode step of B, not 1/B
more. A request whose j-th draft is accepted with probability p_j (its history, by kind of draft:
adaptive.py) expects 1 + p_1 + ... + p_k tokens from a chain of k drafts. `allocate` orders every draft asked for by its
chance of being accepted and takes the prefix of that order with the most expected tokens per second,
which is none when the plain decode step's rate is best.

Costs are wall time between the scheduler's consecutive decisions on the same running requests, or
fewer of them (`StepCosts.begin`: under a stream of arrivals requests finish every few steps): what a
step costs the batch, host work included. A step is measured only when nothing else ran between (a
prefill, or a decode step launched ahead without a decision: `interrupt`). Where decode steps can be
launched ahead of the read-back (a GPU), the alternative to a verify step is not the decided decode
step measured that way but one launched ahead, its host work hidden behind the device's: a third curve,
`ahead`, times those (`StepCosts.ran_ahead`, between consecutive launches for the same requests, or
fewer), and `allocate` weighs drafts against it when told the batch would run ahead (interpolated where
the batch's own size was not timed).
With too few measurements (fewer than MIN_SAMPLES steps, or steps too short to be a device's:
MIN_STEP_S, a fake runner's) `allocate` gives every request what it asks.
"""

from __future__ import annotations

from typing import Optional, Sequence

MIN_SAMPLES = 2
MIN_STEP_S = 1e-3
DECAY = 0.8  # weight of the old average in each new measurement
# A step measured this many times its average is not that step alone (a chunk of a prefill launched
# beside it, a pause of the host): dropped.
OUTLIER = 3.0


def _bucket(tokens: int) -> int:
    """Token counts up to 32 on their own; above, powers of two (costs grow slowly there)."""
    if tokens <= 32:
        return tokens
    return 1 << (tokens - 1).bit_length()


class CostCurve:
    """Seconds per step of one kind by its token count: a moving average per bucket."""

    def __init__(self) -> None:
        self._avg: dict[int, float] = {}
        self._n: dict[int, int] = {}

    def record(self, tokens: int, seconds: float) -> None:
        if seconds < MIN_STEP_S or tokens <= 0:
            return
        b = _bucket(tokens)
        old = self._avg.get(b)
        if old is not None and self._n[b] >= MIN_SAMPLES and seconds > OUTLIER * old:
            return
        self._avg[b] = seconds if old is None else DECAY * old + (1 - DECAY) * seconds
        self._n[b] = self._n.get(b, 0) + 1

    def estimate(self, tokens: int) -> Optional[float]:
        """c(tokens), from the nearest measured counts (linear between them, flat past the largest: a
        larger step never costs less); None before MIN_SAMPLES steps of any size."""
        known = sorted(b for b, n in self._n.items() if n >= MIN_SAMPLES)
        if not known:
            return None
        b = _bucket(tokens)
        if b in self._avg and self._n[b] >= MIN_SAMPLES:
            return self._avg[b]
        lower = [k for k in known if k < b]
        upper = [k for k in known if k > b]
        if lower and upper:
            lo, hi = lower[-1], upper[0]
            return self._avg[lo] + (self._avg[hi] - self._avg[lo]) * (b - lo) / (hi - lo)
        if lower:  # past the largest measured: grow linearly from the two largest, or stay flat
            lo = lower[-1]
            if len(lower) >= 2:
                prev = lower[-2]
                slope = max(0.0, (self._avg[lo] - self._avg[prev]) / (lo - prev))
                return self._avg[lo] + slope * (b - lo)
            return self._avg[lo]
        return self._avg[upper[0]]  # below the smallest: no cheaper than it (unknown)

    def measured(self, tokens: int) -> bool:
        b = _bucket(tokens)
        return self._n.get(b, 0) >= MIN_SAMPLES


class StepCosts:
    """The decode and verify curves, and the step being timed (its requests, kind, tokens, start)."""

    def __init__(self) -> None:
        self.decode = CostCurve()
        self.verify = CostCurve()
        self.ahead = CostCurve()  # decode steps launched ahead of the previous one's read-back
        self._open: Optional[tuple[tuple, bool, int, float]] = None
        self._ahead_open: Optional[tuple[tuple, float]] = None

    def begin(self, rids: tuple, now: float) -> Optional[bool]:
        """A decision for the requests `rids` starts at `now`: the step decided last, when it was for
        the same requests (or more: some finished in it) and nothing ran since, took `now - its start`.
        Returns whether that step was a verify step (None: no step was timed)."""
        timed = None
        if self._open is not None and _same_step(self._open[0], rids):
            _, verify, tokens, start = self._open
            (self.verify if verify else self.decode).record(tokens, now - start)
            timed = verify
        self._open = None
        return timed

    def decided(self, rids: tuple, verify: bool, tokens: int, now: float) -> None:
        """The step just decided (started at `now`, when its decision began) is the one timed next."""
        self._open = (rids, verify, tokens, now)

    def interrupt(self) -> None:
        """Something other than the decided step ran: the time to the next decision (or launch) is not its
        cost."""
        self._open = None
        self._ahead_open = None

    def ran_ahead(self, rids: tuple, now: float) -> None:
        """A decode step for `rids` is launched ahead at `now`, undecided: the one launched before it for
        the same requests took `now - its launch` (the device's pace, host work behind it)."""
        if self._ahead_open is not None and _same_step(self._ahead_open[0], rids):
            self.ahead.record(len(self._ahead_open[0]), now - self._ahead_open[1])
        self._ahead_open = (rids, now)
        self._open = None  # (and the decided step before it is not timed to the next decision)

    def stop_running_ahead(self) -> None:
        """The next step waits for a decision: the launches' pace is no longer timed."""
        self._ahead_open = None


def _same_step(before: tuple, now: tuple) -> bool:
    """Whether a decision for the requests `now` follows the step of `before` with nothing between: the same
    requests, or fewer (some finished in it); a request that joined came with a prefill."""
    return before == now or (len(now) < len(before) and set(now).issubset(before))


def allocate(
    costs: StepCosts,
    available: Sequence[int],
    chances: Sequence[Sequence[float]],
    fixed: Optional[Sequence[int]] = None,
    ahead: bool = False,
) -> list[int]:
    """Drafts per request (at most available[i]) maximizing the step's expected tokens per second;
    chances[i][j - 1]: the chance that request i's j-th draft is accepted (it and those before it: not
    increasing in j); fixed[i]: request i's first drafts that are verified whatever they cost (grammar-
    forced text); `ahead`: without drafts the batch's decode steps would be launched ahead (their cost is
    the `ahead` curve's, once measured). Everything asked when costs are unknown.

    Request i's j-th draft adds chances[i][j - 1] expected tokens. Of the drafts in that order (likeliest
    first; each request's own in order) the best prefix is taken: costs may flatten as a step grows, so a
    run of drafts can pay where its first one alone does not."""
    base = len(available)
    fixed = [min(f, a) for f, a in zip(fixed, available)] if fixed is not None else [0] * base
    c_plain = costs.ahead.estimate(base) if ahead else None
    if c_plain is None:
        c_plain = costs.decode.estimate(base)
    if c_plain is None or costs.verify.estimate(base + 1) is None:
        return list(available)
    items = sorted(
        ((chances[i][j - 1], j, i) for i in range(base) for j in range(fixed[i] + 1, available[i] + 1)),
        key=lambda t: (-t[0], t[1]),
    )
    taken = sum(fixed)
    expected = base + sum(sum(chances[i][: fixed[i]]) for i in range(base))
    best_m, best_rate = 0, base / c_plain if taken == 0 else expected / costs.verify.estimate(base + taken)
    for m, (gain, _, _) in enumerate(items, 1):
        expected += gain
        c = costs.verify.estimate(base + taken + m)
        if expected / c > best_rate:
            best_m, best_rate = m, expected / c
    give = list(fixed)
    for _, _, i in items[:best_m]:
        give[i] += 1
    return give
