"""Whether drafts pay, one step at a time: speculation's policy as one object.

The scheduler asks it three things of the running requests' next decode step, and tells it one:

- `may_verify`: before a decode step is planned past the one in flight (overlap scheduling), whether the
  next step could verify drafts; if so the step in flight is read back first (drafts depend on its tokens).
  When not, the step launched ahead is a plain decode step, counted here (pauses, sit-outs, timing).
- `decide`: the decode step about to run: which drafts (if any) are worth verifying in it. The requests'
  proposals come from the `StepRequests` it is handed, asked only when the policy wants them.
- `observed`: what the step decided became (a VERIFY step of so many tokens, or a plain decode step: the
  pool may have had no room for drafts); `interrupted`: something else ran (a prefill).

Inside, three judges, each for what the others cannot see:
- the cost model (cost.py): each step's drafts against the measured cost of decode and verify steps,
  weighed by each request's accept history (adaptive.py; a new request's starts from recent requests');
- the guard (guard.py): per batch size, the tokens per second each policy arm delivered over stretches
  of the same requests (not asked while the batch streams: see STREAMING);
- pauses: a decision needs its predecessor read back, which is the overlap a plain decode step has, so
  where drafts do not pay the batch decides nothing for a while (its decode steps launched ahead).

In the step's token budget a verify row is its request's k + 1 scheduled tokens; they run only in a step
of decode rows alone (a step with prefill rows never verifies, so one likely next is planned ahead
without asking for drafts: `may_verify`'s `prefill_next`), and only where the cost model expects them to
deliver more tokens per second than the plain decode step would.

The cost model decides most steps' drafts; every EXPLORE_EVERY-th decision verifies what was proposed
anyway (the costs of steps it stopped running would never be measured again), and one decision later in
each such period is a plain decode step (decode costs drift with the sequences too), unless a decode step
of the batch's size was timed in the period already (a request with nothing to draft decodes, constrained
ones after each free value); until a plain decode step of the batch's size was measured, every
MEASURE_EVERY-th decision is one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

from .adaptive import RequestSpecState
from .cost import StepCosts, allocate
from .guard import Arm, SpeculationGuard
from .proposer import leading_forced
from .settings import SpecSettings
from .tree import DraftTree

EXPLORE_EVERY = 32
MEASURE_EVERY = 8
# When the cost model gives no drafts to a batch that proposed some, the batch decides nothing for a
# pause of decode steps (launched ahead, overlapped, as without speculation), doubling while it keeps
# saying no. Without steps launched ahead (a CPU, a drafter's runner, requests sampled on the host) there
# is no overlap to win: no pause.
FIRST_PAUSE = 1
MAX_PAUSE = 64
# When no request found a draft to propose (prompt lookup matched nothing), the batch pauses too, for
# 1, 2, 4 steps while that lasts: each decided step waits for its predecessor's read-back, which is the
# overlap lost for nothing. Short: a lookup that would match during the pause is lost with it (the pause
# starts short again whenever drafts were proposed).
MAX_IDLE_PAUSE = 4
# Under a stream of arrivals the running batch changes every few steps (requests join and leave, prefill
# chunks run between its decode steps). The guard judges stretches of the same requests, which then never
# complete: its verdict is not asked (each of its arms' first steps would be one more decided step), and
# where lookups find nothing the batch pauses up to STREAMING_IDLE_PAUSE steps (with 4, one step in 5 was
# decided for nothing: most of what speculation cost such a stream). A batch streams while the share of
# its steps that followed a change (a moving average, CHURN_DECAY per step) is above STREAMING.
STREAMING_IDLE_PAUSE = 16
CHURN_DECAY = 0.9
STREAMING = 0.03
# A measuring decision on a batch that runs ahead: this many decode steps launched ahead after it, timed
# (the `ahead` curve: what a pause's steps cost, the alternative to verifying there).
MEASURE_PAUSE = 4


@dataclass
class Proposal:
    """One request's drafts this step, as the policy weighs them."""

    tree: DraftTree  # a lone root: no drafts
    by_model: bool  # the runner's drafter fills the tree in (only its size is known here)
    state: RequestSpecState  # the request's accept history

    def cut(self, drafts: int) -> "Proposal":
        """The first `drafts` drafts of a chain (a drafter's top-k tree is kept whole or not at all)."""
        t = self.tree
        if drafts == t.size - 1:
            return self
        if drafts == 0 or not t.is_chain():
            return Proposal(DraftTree([t.tokens[0]], [-1]), False, self.state)
        return Proposal(DraftTree.chain(t.tokens[0], t.tokens[1 : drafts + 1]), self.by_model, self.state)


class StepRequests(Protocol):
    """What the policy asks of the requests of one decode step (the scheduler answers for them)."""

    rids: tuple

    def output_lens(self) -> list[int]: ...
    def may_draft(self, guesses: bool) -> bool: ...
    def propose(self, guesses: bool) -> list[Proposal]: ...
    def skip_step(self) -> None: ...
    def forced_possible(self) -> bool: ...
    def host_sampled(self) -> bool: ...


class _Churn:
    """How often the running batch changed before its steps (a moving average over steps)."""

    def __init__(self) -> None:
        self.rate = 0.0
        self._rids: tuple = ()

    def step(self, rids: tuple, prefill: bool = False) -> None:
        """A decode step of the requests `rids` (`prefill`: a step with prefill rows)."""
        changed = prefill or rids != self._rids
        self._rids = rids
        self.rate = CHURN_DECAY * self.rate + (1 - CHURN_DECAY) * changed

    def prefill(self) -> None:
        """A step with prefill rows ran (the batch's requests decode in it, or wait for it)."""
        self.step(self._rids, prefill=True)

    @property
    def streaming(self) -> bool:
        return self.rate > STREAMING


@dataclass
class _Decision:
    """The step `decide` planned, until `observed` says what it became."""

    rids: tuple
    now: float
    weigh: bool = False
    proposed: bool = False
    measuring: bool = False
    ahead: bool = False
    forced: bool = False


class SpeculationPolicy:
    def __init__(self, settings: SpecSettings, forced_drafts: bool):
        self.settings = settings
        self.forced_drafts = forced_drafts  # grammar-forced drafts are proposed (in batches of any size)
        self.costs = StepCosts()  # seconds per decode / verify step by its token count, on this device
        # Whether speculating pays, from the tokens per second it delivered (the cost model's safety net)
        self.guard = SpeculationGuard() if settings.adaptive else None
        self._arm = Arm.WEIGHED  # the guard's policy for the step being decided
        self._decisions = 0  # steps whose drafts the cost model weighed
        self._decode_timed: dict[int, int] = {}  # batch size -> self._decisions when a decode step of it was timed
        self._paused = 0  # decode steps left that decide nothing (the cost model said no)
        self._pause_len = FIRST_PAUSE  # the next pause's length
        self._idle_pause_len = FIRST_PAUSE  # the next pause's length when nobody proposed drafts
        # Whether the pipeline launches decode steps ahead: only such a pipeline asks `may_verify`.
        self._launches_ahead = False
        self._decision: Optional[_Decision] = None
        self._churn = _Churn()

    def _guesses_fit(self, size: int) -> bool:
        return size <= self.settings.max_batch

    # ------------------------------------------------------------------ before the read-back
    def may_verify(self, reqs: StepRequests, now: float, prefill_next: bool = False) -> bool:
        """Whether the next step could be a VERIFY (so a decode step must not be launched ahead of it).
        When not, the decode step launched ahead is decided here: it counts down the batch's pause and
        the requests' sit-outs (no `decide` sees it), and it is not a step the cost model can time.
        `prefill_next`: the next step likely has prefill rows, which a VERIFY step never has: it is
        launched ahead, and it is no decode step of the batch (no cost is timed across it)."""
        self._launches_ahead = True
        rids = reqs.rids
        if prefill_next:
            self._paused = max(0, self._paused - 1)
            reqs.skip_step()
            self.interrupted()
            return False
        if self._paused > 0:
            self._paused -= 1
        else:
            guesses = self._guesses_fit(len(rids)) and not self._guard_says_off(rids)
            if reqs.may_draft(guesses):
                self.costs.stop_running_ahead()
                return True
        self._churn.step(rids)
        reqs.skip_step()
        if self.guard is not None:
            self.guard.step()
        self.costs.ran_ahead(rids, now)
        return False

    # ------------------------------------------------------------------ the decision
    def decide(self, reqs: StepRequests, now: float) -> Optional[list[Proposal]]:
        """The drafts worth verifying in this decode step (one proposal per request, lone roots
        included), or None: a plain decode step. `observed` must follow with what the step became."""
        self._decision = None
        guesses = self._guesses_fit(len(reqs.rids))
        if not guesses and not self.forced_drafts:
            return None  # (nothing to weigh, nothing timed: above the batch limit, no grammar drafts)
        rids = reqs.rids
        self._churn.step(rids)
        d = self._decision = _Decision(rids, now)
        if self.costs.begin(rids, now) is False:
            self._decode_timed[len(rids)] = self._decisions
        guesses = guesses and self._guard_allows_guesses(reqs, now)
        d.weigh = self.settings.adaptive and self._arm is not Arm.ALL  # (ALL: every proposal verified, no pauses)
        if self._paused > 0 or not reqs.may_draft(guesses):
            # a pause's step that was not launched ahead (no overlap, or it had to wait), or nobody drafts
            self._paused = max(0, self._paused - 1)
            reqs.skip_step()
            d.weigh = False
            return None
        proposals = reqs.propose(guesses)
        d.proposed = any(p.tree.size > 1 for p in proposals)
        # Whether this batch's plain decode steps would be launched ahead (then a pause is the alternative
        # to verifying, and what it costs is the `ahead` curve's).
        d.ahead = self._launches_ahead and not reqs.host_sampled()
        d.forced = reqs.forced_possible()
        if d.weigh and d.proposed:
            self._decisions += 1
            period = self._decisions % EXPLORE_EVERY
            plain = self.costs.ahead if d.ahead else self.costs.decode
            timed = self._decode_timed.get(len(rids))
            stale = timed is None or self._decisions - timed > EXPLORE_EVERY // 2
            d.measuring = (period == EXPLORE_EVERY // 2 and stale) or (
                not plain.measured(len(rids)) and self._decisions % MEASURE_EVERY == 0
            )
            if d.measuring:  # a plain decode step, timed (and where steps run ahead, the ones after it)
                proposals = [p.cut(0) for p in proposals]
                if d.ahead:
                    self._paused = MEASURE_PAUSE
            elif period:  # else: verify what was proposed (costs drift; measure again)
                proposals = self._afford(proposals, d.ahead)
        return proposals

    def observed(self, verify_tokens: Optional[int]) -> None:
        """The step `decide` planned runs as a VERIFY step of `verify_tokens` tokens (every node of every
        request), or as a plain decode step (None)."""
        d, self._decision = self._decision, None
        if d is None:
            return
        verified = verify_tokens is not None
        if d.weigh and d.proposed and not d.measuring:
            self._idle_pause_len = FIRST_PAUSE
            if verified:
                self._pause_len = FIRST_PAUSE
            elif d.ahead:
                # drafts were proposed, none paid: decide nothing for a while, the decode steps launched
                # ahead (a pause where they could not be would only lose drafts)
                self._paused = self._pause_len
                self._pause_len = min(MAX_PAUSE, 2 * self._pause_len)
        elif d.weigh and not d.proposed and d.ahead and not d.forced:
            self._paused = self._idle_pause_len  # nothing to verify: run ahead a little (MAX_IDLE_PAUSE)
            cap = STREAMING_IDLE_PAUSE if self._churn.streaming else MAX_IDLE_PAUSE
            self._idle_pause_len = min(cap, 2 * self._idle_pause_len)
        self.costs.decided(d.rids, verified, len(d.rids) if verify_tokens is None else verify_tokens, d.now)

    def interrupted(self) -> None:
        """A step with prefill rows runs (synchronously, or launched ahead): the time between two decisions
        is no step's cost, the guard's stretch ends, and the batch changed (churn)."""
        self._churn.prefill()
        self.costs.interrupt()
        if self.guard is not None:
            self.guard.interrupt()

    # ------------------------------------------------------------------ parts of a decision
    def _guard_says_off(self, rids: tuple) -> bool:
        return self.guard is not None and not self._churn.streaming and self.guard.off_now(rids)

    def _guard_allows_guesses(self, reqs: StepRequests, now: float) -> bool:
        """The guard's checkpoint at this decision (a small batch's): whether guessed drafts run this step.
        A new policy starts without the cost model's pause left over from the one before."""
        if self.guard is None:
            return True
        if self._churn.streaming:
            arm = Arm.WEIGHED
        else:
            arm = self.guard.checkpoint(reqs.rids, tuple(reqs.output_lens()), now)
            self.guard.step()
        if arm is not self._arm:
            self._arm = arm
            self._paused = 0
        return arm is not Arm.OFF

    def _afford(self, proposals: list[Proposal], ahead: bool) -> list[Proposal]:
        """The drafts this step's measured costs make worth verifying (cost.allocate; `ahead`: the batch
        would otherwise run ahead): chains are cut, a drafter's top-k tree is kept whole or not at all. A
        chain's forced text before its first guess is always verified (it is what jump-forward would
        append, whatever the step costs); the guesses after it are weighed on top of it."""
        give = allocate(
            self.costs,
            [p.tree.size - 1 for p in proposals],
            [p.state.chances(p.tree.size - 1) for p in proposals],
            [leading_forced(p.state) for p in proposals],
            ahead,
        )
        return [p.cut(k) for p, k in zip(proposals, give)]

    def report(self) -> Optional[dict]:
        """The guard's rates per batch size (for /get_server_info), when it runs."""
        return self.guard.report() if self.guard is not None else None
