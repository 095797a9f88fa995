"""Whether speculating pays in this batch, judged by what it delivered: the batch's tokens per second over
stretches of steps run one way against stretches run another.

The cost model (cost.py) predicts each step from curves of what steps cost; what it cannot see it gets
wrong: a verify step's host work the next step waits on, the overlap a decided step loses, acceptance
that comes in runs rather than draft by draft. On an H200 at batch 8 it kept verifying where speculation
was 7% slower than none. The guard looks only at the outcome. A stretch runs from one decision to a
later one for the same running requests, its steps all run under one policy (an `Arm`):

- WEIGHED: the cost model decides each step's drafts (its pauses and measuring steps included);
- ALL: every proposed draft is verified, no cost model (it wins where the model is too careful); tried
  only once WEIGHED has beaten OFF by ALL_MARGIN (where speculating does not pay, verifying more will not either);
- OFF: no guessed drafts (prompt lookup, a drafter): decode steps launched ahead as without speculation.
  Grammar-forced drafts stay: they are what jump-forward would append.

Its rate is the tokens the requests gained over the seconds it took, the decisions at both ends included
(at a decision every earlier step has been read back: the counts are exact). Each batch size keeps a
moving average per arm and runs the best one, probing the others now and then so a change of workload
is seen: one stretch of another arm after every PROBE_EVERY of the best, or, while OFF is best, after
each OFF stretch, those growing from FIRST_OFF_STEPS to MAX_OFF_STEPS steps while OFF stays best (the
probe then costs little of the time). A stretch whose batch changed (a request joined or finished) or
that a prefill interrupted is not counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Optional


class Arm(Enum):
    WEIGHED = "weighed"
    OFF = "off"
    ALL = "all"


ARMS = (Arm.WEIGHED, Arm.OFF, Arm.ALL)
ON_STEPS = 16  # steps in a stretch of an arm that speculates
FIRST_OFF_STEPS = 16
MAX_OFF_STEPS = 256
PROBE_EVERY = 8
ALL_MARGIN = 0.02  # how much WEIGHED must beat OFF by before ALL is tried (a tie is no sign drafts pay)
DECAY = 0.7  # weight of the old average in each new stretch's rate


@dataclass
class _SizeState:
    """One batch size's record: each arm's average rate (tokens per second) and the probing schedule."""
    rate: dict = field(default_factory=dict)  # Arm -> tokens per second
    since_probe: int = 0  # stretches of the best arm since the last probe
    last_probed: dict = field(default_factory=dict)  # Arm -> stretch number it last ran in
    stretches: int = 0
    off_steps: int = FIRST_OFF_STEPS

    def best(self) -> Arm:
        return max(self.rate, key=lambda a: (self.rate[a], a is not Arm.OFF))  # a tie speculates

    def untried(self) -> Optional[Arm]:
        """The arm to measure first: WEIGHED (today's policy), OFF, then ALL where WEIGHED beat OFF."""
        for arm in (Arm.WEIGHED, Arm.OFF):
            if arm not in self.rate:
                return arm
        if Arm.ALL not in self.rate and self.rate[Arm.WEIGHED] > (1 + ALL_MARGIN) * self.rate[Arm.OFF]:
            return Arm.ALL
        return None


@dataclass
class _Stretch:
    rids: tuple
    arm: Arm
    tokens: int  # the requests' output tokens at its start
    start: float
    length: int  # steps it runs
    steps: int = 0  # steps so far


class SpeculationGuard:
    def __init__(self) -> None:
        self._sizes: dict[int, _SizeState] = {}
        self._open: Optional[_Stretch] = None
        self.stretches = {arm: 0 for arm in ARMS}  # stretches counted, by arm (reported)

    def checkpoint(self, rids: tuple, tokens: int, now: float) -> Arm:
        """A decision for the requests `rids`, which hold `tokens` output tokens, starts at `now`: the
        policy this step runs under (a stretch that ran its length ends here and is counted)."""
        s = self._open
        if s is not None and s.rids == rids and s.steps < s.length:
            return s.arm
        if s is not None and s.rids == rids and now > s.start:
            self._count(s, (tokens - s.tokens) / (now - s.start))
        arm, length = self._next(len(rids))
        self._open = _Stretch(rids, arm, tokens, now, length)
        return arm

    def step(self) -> None:
        """A decode or verify step of the open stretch's batch was launched."""
        if self._open is not None:
            self._open.steps += 1

    def interrupt(self) -> None:
        """Something other than the batch's own steps ran (a prefill): the open stretch is not counted."""
        self._open = None

    def off_now(self, rids: tuple) -> bool:
        """Whether guessed drafts are off for the batch `rids` at this step (an OFF stretch of it is open
        and has steps left: its decode steps may be launched ahead, no decision needed)."""
        s = self._open
        return s is not None and s.rids == rids and s.arm is Arm.OFF and s.steps < s.length

    def _count(self, s: _Stretch, rate: float) -> None:
        st = self._sizes.setdefault(len(s.rids), _SizeState())
        old = st.rate.get(s.arm)
        st.rate[s.arm] = rate if old is None else DECAY * old + (1 - DECAY) * rate
        st.stretches += 1
        st.last_probed[s.arm] = st.stretches
        self.stretches[s.arm] += 1

    def _next(self, size: int) -> tuple[Arm, int]:
        st = self._sizes.setdefault(size, _SizeState())
        arm = st.untried()
        if arm is not None:
            return arm, (FIRST_OFF_STEPS if arm is Arm.OFF else ON_STEPS)
        best = st.best()
        if best is Arm.OFF:
            if self._open is not None and self._open.arm is Arm.OFF:  # an OFF stretch just ended: probe
                return self._probe(st, best), ON_STEPS
            st.off_steps = min(MAX_OFF_STEPS, 2 * st.off_steps)
            return Arm.OFF, st.off_steps
        st.off_steps = FIRST_OFF_STEPS
        st.since_probe += 1
        if st.since_probe > PROBE_EVERY:
            st.since_probe = 0
            arm = self._probe(st, best)
            return arm, (FIRST_OFF_STEPS if arm is Arm.OFF else ON_STEPS)
        return best, ON_STEPS

    @staticmethod
    def _probe(st: _SizeState, best: Arm) -> Arm:
        """The arm other than `best` that ran least recently."""
        return min((a for a in st.rate if a is not best), key=lambda a: st.last_probed.get(a, -1))

    def report(self) -> dict:
        """Each batch size's rates by arm (tokens per second) and the arm it runs: for /get_server_info."""
        return {size: {**{a.value: round(r, 1) for a, r in st.rate.items()},
                       "best": st.best().value if st.untried() is None else None}
                for size, st in sorted(self._sizes.items()) if st.rate}
