"""Whether speculating pays in this batch, judged by what it delivered: the batch's tokens per second over
stretches of steps run one way against stretches run another.

The cost model (cost.py) predicts each step from curves of what steps cost; what it cannot see it gets
wrong: a verify step's host work the next step waits on, the overlap a decided step loses, acceptance
that comes in runs rather than draft by draft: at batch 8 it kept verifying where speculation was slower
than none. The guard looks only at the outcome. A stretch runs from one decision to a
later one for the same running requests, its steps all run under one policy (an `Arm`):

- WEIGHED: the cost model decides each step's drafts (its pauses and measuring steps included);
- ALL: every proposed draft is verified, no cost model (it wins where the model is too careful: at
  batch 1 the cost model ran as slowly as OFF where verifying everything was faster);
  tried where drafts were accepted under WEIGHED and it was no more than ALL_MARGIN slower than OFF
  (where none are accepted, verifying more cannot pay; where verifying what the cost model chose was
  clearly slower, verifying everything is slower still; a tie may be the cost model pausing through
  drafts that pay);
- OFF: no guessed drafts (prompt lookup, a drafter): decode steps launched ahead as without speculation.
  Grammar-forced drafts stay: they are what jump-forward would append.

A stretch counts the tokens its requests gained and the seconds it took, from its first decision to its
last (at a decision every earlier step has been read back: the counts are exact). Its rate is the batch
size times the harmonic mean of its requests' own rates, not their sum: each request's user waits on his
own tokens, and a batch run to its end waits on its slowest. Drafts accepted by one request (its output
loops, it copies) while the others accept none raise the sum, yet every request still pays the verify
steps' cost; the sum then picked verifying at batch 8 where it made the batch slower.

A stretch ends after its length in steps, or earlier where the batch changes (a request finished or
joined) or a prefill runs: then it counts up to its last decision. That matters where requests run one
at a time: drafts come in bursts (a request copying its prompt writes 60 tokens in 5 steps and ends),
and stretches thrown away at each request's end would see only the steps between bursts. Each arm's rate is its
decayed tokens
over its decayed seconds, per batch size: a long stretch weighs more than a short one.

Each batch size runs its best arm and probes the others now and then so a change of workload is seen:
one stretch of another arm after every PROBE_EVERY of the best; while OFF is best, one after each OFF
stretch, those growing from FIRST_OFF_STEPS to MAX_OFF_STEPS steps (the probes then cost little). OFF
is run only where it beat the best speculating arm by OFF_MARGIN, both measured MIN_SAMPLES times: a
mistaken OFF loses all that drafts gain (most where a request copies), a mistaken speculating arm at most
what the margin lets through.
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
OFF_MARGIN = 0.03
MIN_SAMPLES = 2
ALL_MARGIN = 0.03  # ALL is not tried where WEIGHED was this much slower than OFF
DECAY = 0.7  # weight of an arm's past tokens and seconds at each new stretch of it
MIN_COUNTED_STEPS = 2  # a stretch cut short counts if this many steps ran before its last decision


@dataclass
class _ArmRecord:
    tokens: float = 0.0  # decayed sums over the arm's stretches
    seconds: float = 0.0
    accepted: int = 0  # drafts its stretches accepted (tokens beyond one per request and step)
    samples: int = 0  # stretches counted
    last_run: int = -1  # the batch size's stretch number it was last counted in

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


@dataclass
class _SizeState:
    """One batch size's record per arm and its probing schedule."""

    arms: dict = field(default_factory=dict)  # Arm -> _ArmRecord, once counted
    stretches: int = 0  # counted, all arms
    since_probe: int = 0  # stretches of the best arm begun since the last probe
    last_started: Optional[Arm] = None  # the arm of the last stretch begun (counted or not)
    off_steps: int = FIRST_OFF_STEPS

    def rate(self, arm: Arm) -> float:
        return self.arms[arm].rate

    def samples(self, arm: Arm) -> int:
        return self.arms[arm].samples if arm in self.arms else 0

    def best_on(self) -> Arm:
        return max((a for a in self.arms if a is not Arm.OFF), key=self.rate)

    def best(self) -> Arm:
        """The speculating arm that delivered most, unless OFF beat it by OFF_MARGIN (each measured
        MIN_SAMPLES times: one stretch may be a noisy one)."""
        on = self.best_on()
        if min(self.samples(Arm.OFF), self.samples(on)) < MIN_SAMPLES:
            return on
        return Arm.OFF if self.rate(Arm.OFF) > (1 + OFF_MARGIN) * self.rate(on) else on

    def untried(self) -> Optional[Arm]:
        """The arm to measure next: WEIGHED (today's policy), OFF, both again where OFF would win (it is
        run only on MIN_SAMPLES stretches each), then ALL where WEIGHED's verify steps accepted drafts and
        it was about as fast as OFF or faster."""
        for arm in (Arm.WEIGHED, Arm.OFF):
            if arm not in self.arms:
                return arm
        on = self.best_on()
        if self.rate(Arm.OFF) > (1 + OFF_MARGIN) * self.rate(on):
            for arm in (on, Arm.OFF):
                if self.samples(arm) < MIN_SAMPLES:
                    return arm
        weighed = self.arms[Arm.WEIGHED]
        if Arm.ALL not in self.arms and weighed.accepted > 0 and weighed.rate >= (1 - ALL_MARGIN) * self.rate(Arm.OFF):
            return Arm.ALL
        return None


@dataclass
class _Stretch:
    rids: tuple
    arm: Arm
    tokens: tuple  # each request's output tokens at its first decision
    start: float
    length: int  # steps it runs
    steps: int = 0  # steps launched so far
    # at its latest decision: the requests' output tokens, the time, the steps launched before it
    last_tokens: tuple = ()
    last_time: float = 0.0
    last_steps: int = 0

    def done(self) -> bool:
        return self.steps >= self.length

    def _gains(self) -> list:
        """Each request's output tokens from its first decision to its last."""
        return [b - a for a, b in zip(self.tokens, self.last_tokens)]

    def gained(self) -> float:
        """The tokens it delivered, as the batch size times the harmonic mean of what each request gained
        (a request that gained nothing makes it 0)."""
        gains = self._gains()
        if min(gains) <= 0:
            return 0.0
        return len(gains) ** 2 / sum(1.0 / g for g in gains)

    def accepted(self) -> int:
        """The drafts accepted to its last decision: every step read back by then gave each request one
        token and its accepted drafts."""
        return sum(self._gains()) - len(self.rids) * self.last_steps


class SpeculationGuard:
    def __init__(self) -> None:
        self._sizes: dict[int, _SizeState] = {}
        self._open: Optional[_Stretch] = None
        self.stretches = {arm: 0 for arm in ARMS}  # stretches counted, by arm (reported)

    def checkpoint(self, rids: tuple, tokens: tuple, now: float) -> Arm:
        """A decision for the requests `rids`, which hold `tokens` output tokens each, starts at `now`:
        the policy this step runs under (the open stretch is counted where it ends here)."""
        tokens = tuple(tokens)
        s = self._open
        if s is not None and s.rids == rids:
            s.last_tokens, s.last_time, s.last_steps = tokens, now, s.steps
            if not s.done():
                return s.arm
        self._close()
        arm, length = self._next(len(rids))
        self._open = _Stretch(rids, arm, tokens, now, length, last_tokens=tokens, last_time=now)
        return arm

    def step(self) -> None:
        """A decode or verify step of the open stretch's batch was launched."""
        if self._open is not None:
            self._open.steps += 1

    def interrupt(self) -> None:
        """Something other than the batch's own steps ran (a prefill): the open stretch ends at its last
        decision."""
        self._close()

    def off_now(self, rids: tuple) -> bool:
        """Whether guessed drafts are off for the batch `rids` at this step (an OFF stretch of it is open
        and has steps left: its decode steps may be launched ahead, no decision needed)."""
        s = self._open
        return s is not None and s.rids == rids and s.arm is Arm.OFF and not s.done()

    def _close(self) -> None:
        """Count the open stretch up to its last decision, if steps ran before it."""
        s, self._open = self._open, None
        if s is None or s.last_steps < MIN_COUNTED_STEPS or s.last_time <= s.start:
            return
        st = self._sizes.setdefault(len(s.rids), _SizeState())
        rec = st.arms.setdefault(s.arm, _ArmRecord())
        rec.tokens = DECAY * rec.tokens + s.gained()
        rec.accepted += max(0, s.accepted())
        rec.seconds = DECAY * rec.seconds + (s.last_time - s.start)
        rec.samples += 1
        st.stretches += 1
        rec.last_run = st.stretches
        self.stretches[s.arm] += 1

    def _next(self, size: int) -> tuple[Arm, int]:
        st = self._sizes.setdefault(size, _SizeState())
        arm, length = self._choose(st)
        st.last_started = arm
        return arm, length

    def _choose(self, st: _SizeState) -> tuple[Arm, int]:
        arm = st.untried()
        if arm is not None:
            return arm, (FIRST_OFF_STEPS if arm is Arm.OFF else ON_STEPS)
        best = st.best()
        if best is Arm.OFF:
            # after each OFF stretch a probe, counted or not: one request at a time, a request's end (or a
            # prefill) cuts every long OFF stretch short
            if st.last_started is Arm.OFF:
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
        """The arm other than `best` that was counted least recently."""
        return min((a for a in st.arms if a is not best), key=lambda a: st.arms[a].last_run)

    def report(self) -> dict:
        """Each batch size's rates by arm (tokens per second) and the arm it runs: for /get_server_info."""
        return {
            size: {
                **{a.value: round(r.rate, 1) for a, r in st.arms.items()},
                "best": st.best().value if st.untried() is None else None,
            }
            for size, st in sorted(self._sizes.items())
            if st.arms
        }
