"""Speculative decoding's part of the scheduler: which running requests get drafts this step and how
many, the VERIFY batch that scores them with everyone else's next token, and what a verify step's
acceptance changes in KV memory.

`upgrade` turns the decode batch (one slot per running request, allocated by `KVShortage`) into a VERIFY
batch when at least one request has drafts and the pool has their slots; otherwise the batch stays a
plain decode. Drafts come from the request's grammar (the forced tokens: speculative/grammar_drafts.py)
and prompt lookup (NGRAM) here on the host, or from the runner's draft model / EAGLE head, for which
this part only sizes the tree. A request without drafts is a one-node tree in the same step.

Requests never speculate while their sampling depends on their own tokens beyond what a node's path
gives: penalties, a pending min_new_tokens, a seed (its samples would no longer reproduce those of a
run without speculation). Above `speculative_disable_by_batch_size` running requests only grammar-forced
drafts are proposed: a forced token is almost never rejected, so verifying it costs what jump-forward's
prefill of it would, where a guessed draft costs compute a large batch no longer has to spare.

After the step (`commit_kv`, called by `StepResults` once the stop checks said how many of the accepted
tokens a request keeps): the kept nodes' slots stay the request's (its table rewritten where a tree's
path is not its first nodes), every other node's slot goes back to the allocator: rejected drafts never
reach the prefix cache.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from ..forward_batch import ForwardMode
from ..request import Req
from ..server_args import ServerArgs
from ..speculative.adaptive import RequestSpecState
from ..speculative.cost import StepCosts, allocate
from ..speculative.grammar_drafts import GrammarDrafts
from ..speculative.guard import Arm, SpeculationGuard
from ..speculative.ngram import NgramIndex, TokenView
from ..speculative.settings import SpecSettings
from ..speculative.tree import DraftTree
from ..step import StepOutput
from .batch import ScheduleBatch, VerifyPlan
from .kv_manager import KVManager

# The cost model (speculative/cost.py) decides most steps' drafts; every EXPLORE_EVERY-th decision verifies
# what was proposed anyway (the costs of steps it stopped running would never be measured again), and one
# decision later in each such period is a plain decode step (decode costs drift with the sequences too),
# unless a decode step of the batch's size was timed in the period already (a request with nothing to
# draft decodes, constrained ones after each free value); until a plain decode step of the batch's size
# was measured, every MEASURE_EVERY-th decision is one.
EXPLORE_EVERY = 32
MEASURE_EVERY = 8
# When the cost model gives no drafts to a batch that proposed some, the batch decides nothing for a
# pause of decode steps (launched ahead, overlapped, as without speculation), doubling while it keeps
# saying no: a decision needs the previous step read back first, so deciding "no" every step would cost
# the overlap a plain decode has. Without steps launched ahead (a CPU, a drafter's runner, requests
# sampled on the host) there is no overlap to win: no pause.
FIRST_PAUSE = 1
MAX_PAUSE = 64
# When no request found a draft to propose (prompt lookup matched nothing), the batch pauses too, for
# 1, 2, 4 steps while that lasts: each decided step waits for its predecessor's read-back, which is the
# overlap lost for nothing. Short: a lookup that would match during the pause is lost with it.
MAX_IDLE_PAUSE = 4
# A measuring decision on a batch that runs ahead: this many decode steps launched ahead after it, timed
# (the `ahead` curve: what a pause's steps cost, the alternative to verifying there).
MEASURE_PAUSE = 4
MAX_LEARN_TOKENS = 32  # a forced text's tokens are learned from at most this many written after it


class Speculation:
    def __init__(self, server_args: ServerArgs, kv: KVManager, tokenizer: Any, context_len: int):
        self.settings = SpecSettings.of(server_args)
        self.kv = kv
        self.context_len = context_len
        sa = server_args
        self.ngram_window = (sa.speculative_ngram_min_match_window_size, sa.speculative_ngram_max_match_window_size)
        special = getattr(tokenizer, "all_special_ids", None) or ()
        self.grammar_drafts = GrammarDrafts(tokenizer, special) if self.settings.grammar and tokenizer else None
        self.costs = StepCosts()  # seconds per decode / verify step by its token count, on this device
        # Whether speculating pays, from the tokens per second it delivered (the cost model's safety net)
        self.guard = SpeculationGuard() if self.settings.adaptive else None
        self._arm = Arm.WEIGHED  # the guard's policy for the step being decided
        self.clock = time.perf_counter  # what steps are timed with (scheduler tests give a fake one)
        self._decisions = 0  # steps whose drafts the cost model weighed
        self._decode_timed: dict[int, int] = {}  # batch size -> self._decisions when a decode step of it was timed
        self._paused = 0  # decode steps left that decide nothing (the cost model said no)
        self._pause_len = FIRST_PAUSE  # the next pause's length
        self._idle_pause_len = FIRST_PAUSE  # the next pause's length when nobody proposed drafts
        # Whether the pipeline launches decode steps ahead: only such a pipeline asks `may_speculate`.
        self._launches_ahead = False
        # Request-steps verified with at least one draft, drafts proposed, drafts accepted (and kept),
        # VERIFY forward steps.
        self.totals = {
            "spec_verify_steps": 0,
            "spec_draft_tokens": 0,
            "spec_accepted_tokens": 0,
            "spec_verify_batches": 0,
        }

    @property
    def enabled(self) -> bool:
        return self.settings.enabled

    # ------------------------------------------------------------------ decisions
    def replaces_jump_forward(self, r: Req) -> bool:
        """The grammar's forced tokens are this request's drafts: jump-forward must not append them."""
        return self.grammar_drafts is not None and r.grammar is not None and self._eligible(r)

    def may_speculate(self, reqs: list[Req]) -> bool:
        """Whether the next step could be a VERIFY (so a decode step must not be launched ahead of it).
        When not, the decode step launched ahead is decided here: it counts down the batch's pause and
        the requests' sit-outs (no `upgrade` sees it), and it is not a step the cost model can time."""
        s = self.settings
        if not s.enabled:
            return False
        self._launches_ahead = True
        rids = tuple(r.rid for r in reqs)
        if self._paused > 0:
            self._paused -= 1
        else:
            small = len(reqs) <= s.max_batch and not (self.guard is not None and self.guard.off_now(rids))
            if any(self._may_draft(r, small) for r in reqs):
                self.costs.stop_running_ahead()
                return True
        self._skip_step(reqs)
        if self.guard is not None:
            self.guard.step()
        self.costs.ran_ahead(rids, self.clock())
        return False

    def upgrade(self, batch: ScheduleBatch) -> ScheduleBatch:
        """The decode `batch` as a VERIFY batch of every request's draft tree, when any request has
        drafts and the pool has their slots; else `batch` itself."""
        s = self.settings
        if not s.enabled:
            return batch
        small = len(batch.reqs) <= s.max_batch
        if not small and self.grammar_drafts is None:
            return batch
        rids = tuple(r.rid for r in batch.reqs)
        now = self.clock()
        if self.costs.begin(rids, now) is False:
            self._decode_timed[len(rids)] = self._decisions
        small = small and self._guard_allows_guesses(batch.reqs, rids, now)
        weigh = s.adaptive and self._arm is not Arm.ALL  # (ALL: every proposal verified, no pauses)
        if self._paused > 0 or not any(self._may_draft(r, small) for r in batch.reqs):
            # a pause's step that was not launched ahead (no overlap, or it had to wait), or nobody drafts
            self._paused = max(0, self._paused - 1)
            self._skip_step(batch.reqs)
            self.costs.decided(rids, False, len(rids), now)
            return batch
        trees: list[DraftTree] = []
        model_draft: list[bool] = []
        for r in batch.reqs:
            tree, by_model = self._plan(r, small)
            trees.append(tree)
            model_draft.append(by_model)
        proposed = any(t.size > 1 for t in trees)
        # Whether this batch's plain decode steps would be launched ahead (then a pause is the alternative
        # to verifying, and what it costs is the `ahead` curve's).
        ahead = self._launches_ahead and not any(r.sampling.needs_host_sampling() for r in batch.reqs)
        measuring = False
        if weigh and proposed:
            self._decisions += 1
            period = self._decisions % EXPLORE_EVERY
            plain = self.costs.ahead if ahead else self.costs.decode
            timed = self._decode_timed.get(len(trees))
            stale = timed is None or self._decisions - timed > EXPLORE_EVERY // 2
            measuring = (period == EXPLORE_EVERY // 2 and stale) or (
                not plain.measured(len(trees)) and self._decisions % MEASURE_EVERY == 0
            )
            if measuring:  # a plain decode step, timed (and where steps run ahead, the ones after it)
                trees = [DraftTree([t.tokens[0]], [-1]) for t in trees]
                if ahead:
                    self._paused = MEASURE_PAUSE
            elif period:  # else: verify what was proposed (costs drift; measure again)
                trees, model_draft = self._afford(batch.reqs, trees, model_draft, ahead)
        out = self._verify_batch(batch, trees, model_draft)
        verified = out is not batch
        if weigh and proposed and not measuring:
            self._idle_pause_len = FIRST_PAUSE
            if verified:
                self._pause_len = FIRST_PAUSE
            elif ahead:
                # drafts were proposed, none paid: decide nothing for a while, the decode steps launched
                # ahead (a pause where they could not be would only lose drafts)
                self._paused = self._pause_len
                self._pause_len = min(MAX_PAUSE, 2 * self._pause_len)
        elif weigh and not proposed and ahead and not self._forced_drafts_possible(batch.reqs):
            self._paused = self._idle_pause_len  # nothing to verify: run ahead a little (MAX_IDLE_PAUSE)
            self._idle_pause_len = min(MAX_IDLE_PAUSE, 2 * self._idle_pause_len)
        self.costs.decided(rids, verified, len(out.out_cache_loc), now)
        return out

    def _guard_allows_guesses(self, reqs: list[Req], rids: tuple, now: float) -> bool:
        """The guard's checkpoint at this decision (a small batch's): whether guessed drafts run this step.
        A new policy starts without the cost model's pause left over from the one before."""
        if self.guard is None:
            return True
        arm = self.guard.checkpoint(rids, [len(r.output_ids) for r in reqs], now)
        self.guard.step()
        if arm is not self._arm:
            self._arm = arm
            self._paused = 0
        return arm is not Arm.OFF

    def _verify_batch(self, batch: ScheduleBatch, trees: list[DraftTree], model_draft: list[bool]) -> ScheduleBatch:
        """The VERIFY batch of `trees` (their draft slots allocated), or `batch` when no tree has drafts
        or the pool has no room for them."""
        extra = sum(t.size - 1 for t in trees)
        if extra == 0:
            return batch
        loc = self.kv.alloc(extra)
        if loc is None:  # no room for drafts this step: decode as usual
            return batch
        roots = batch.out_cache_loc.numpy()
        slots = np.empty(len(roots) + extra, dtype=np.int64)
        extra_np = loc.numpy()
        at = used = 0
        for i, t in enumerate(trees):
            slots[at] = roots[i]
            slots[at + 1 : at + t.size] = extra_np[used : used + t.size - 1]
            at += t.size
            used += t.size - 1
        self.totals["spec_verify_batches"] += 1
        return ScheduleBatch(
            ForwardMode.VERIFY, batch.reqs, out_cache_loc=torch.from_numpy(slots), verify=VerifyPlan(trees, model_draft)
        )

    def _may_draft(self, r: Req, small: bool) -> bool:
        """Whether `r` could have drafts this step: grammar-forced ones (any batch), guessed ones
        (prompt lookup, a drafter) in a `small` batch. NOTE: grammar drafts are on by default, so a
        server without a speculative algorithm gets here too: its unconstrained requests never draft,
        and must not keep their decode steps from being launched ahead."""
        if not self._eligible(r) or (r.spec is not None and r.spec.sit_out > 0):
            return False
        if self.grammar_drafts is not None and r.grammar is not None:
            return True
        return small and (self.settings.ngram or self.settings.model_drafts)

    def _forced_drafts_possible(self, reqs: list[Req]) -> bool:
        """Whether a request's grammar may force text at any step (its drafts would be lost to a pause)."""
        return self.grammar_drafts is not None and any(r.grammar is not None for r in reqs)

    def _skip_step(self, reqs: list[Req]) -> None:
        """A decode step decided without drafts: one step of each request's sit-out is served."""
        for r in reqs:
            if r.spec is not None:
                r.spec.skip_step()

    def _afford(self, reqs: list[Req], trees: list[DraftTree], model_draft: list[bool], ahead: bool):
        """The drafts this step's measured costs make worth verifying (cost.allocate; `ahead`: the batch
        would otherwise run ahead): chains are cut, a drafter's top-k tree is kept whole or not at all. A
        chain's forced text before its first guess is always verified (it is what jump-forward would append,
        whatever the step costs); the guesses after it are weighed on top of it."""
        fixed = [_leading(r.spec.forced) for r in reqs]
        give = allocate(
            self.costs,
            [t.size - 1 for t in trees],
            [r.spec.chances(t.size - 1) for r, t in zip(reqs, trees)],
            fixed,
            ahead,
        )
        out_trees, out_model = [], []
        for t, by_model, k in zip(trees, model_draft, give):
            if k == t.size - 1:
                out_trees.append(t)
                out_model.append(by_model)
            elif k == 0 or not t.is_chain():
                out_trees.append(DraftTree([t.tokens[0]], [-1]))
                out_model.append(False)
            else:
                out_trees.append(DraftTree.chain(t.tokens[0], t.tokens[1 : k + 1]))
                out_model.append(by_model)
        return out_trees, out_model

    def observe_step(self, batch: ScheduleBatch, seconds: float) -> None:
        """A step ran synchronously: a prefill between two decisions makes the time between them no
        decode or verify step's cost (those are timed between decisions: StepCosts.begin)."""
        if self.settings.enabled and batch.mode.is_extend():
            self.costs.interrupt()
            if self.guard is not None:
                self.guard.interrupt()

    def _eligible(self, r: Req) -> bool:
        sp = r.sampling_params
        row = r.sampling
        if r.finished_reason is not None or row.penalized or row.min_tokens_pending():
            return False
        if sp.seed is not None and not sp.is_greedy:
            return False
        return r.grammar is None or r.grammar.max_rollback > 0

    def _state(self, r: Req) -> RequestSpecState:
        if r.spec is None:
            s = self.settings
            constrained = r.grammar is not None and self.grammar_drafts is not None
            # NOTE: a constrained request's free values (a name, a number) are mostly copied from its prompt:
            # grammar drafts continue with prompt lookup where nothing is forced, NGRAM or not.
            ngram = NgramIndex(*self.ngram_window) if s.ngram or constrained else None
            # (a drafter's chain shortens after a rejection: each draft costs a drafter step; lookup and
            # forced drafts cost nothing to propose, the cost model cuts them)
            r.spec = RequestSpecState(s.max_drafts, s.adaptive, ngram, shrink=s.model_drafts and not constrained)
        return r.spec

    def _plan(self, r: Req, small: bool) -> tuple[DraftTree, bool]:
        """The request's tree this step (a lone root: no drafts) and whether the runner drafts it;
        `small`: the batch is small enough for guessed drafts (prompt lookup, a draft model)."""
        root = r.output_ids[-1]
        lone = DraftTree([root], [-1])
        state = self._state(r)
        state.forced = []
        if not self._eligible(r) or not (small or r.grammar is not None):
            return lone, False
        # Drafts past the request's budget or the context would be thrown away (the target's own next
        # token comes with them): at most remaining - 1, and the tree must fit in the context.
        room = min(r.remaining_new_tokens() - 1, self.context_len - r.seq_len)
        n = min(state.allowed_drafts(), room)  # the adaptive length (0 while sitting out)
        s = self.settings
        by_grammar = self.grammar_drafts is not None and r.grammar is not None
        if by_grammar:
            # NOTE: the adaptive length and the sit-outs bound guessed drafts only: forced text is what
            # jump-forward would append, drafted whole (up to the cap) whatever became of earlier guesses.
            # Not where the grammar's budget closer would act within the drafts (draft_room).
            chain = r.grammar.draft_room(min(s.max_drafts, room), free=False)
            if chain > 0:
                if state.pending_forced is None:
                    forced = r.grammar.jump_forward_string()
                    if forced:
                        state.pending_forced = (forced, len(r.output_ids))
                lookup = state.ngram is not None and small and r.grammar.draft_room(chain, free=True) >= chain
                drafts, state.forced = self.grammar_drafts.propose(
                    r.grammar,
                    TokenView(r.origin_input_ids, r.output_ids),
                    chain,
                    state.ngram.propose if lookup else None,
                    max_guessed=n,
                )
                if drafts:
                    return DraftTree.chain(root, drafts), False
            free = r.grammar.draft_room(n, free=True)
            n = min(n, chain)
        else:
            free = n if r.grammar is None else r.grammar.draft_room(n, free=True)
            n = free
        if n <= 0:
            return lone, False
        if not by_grammar and state.ngram is not None:
            drafts = state.ngram.propose(TokenView(r.origin_input_ids, r.output_ids), n)
            if drafts:
                return DraftTree.chain(root, drafts), False
        if s.model_drafts and small and free > 0:
            size = min(n, free) + 1 if s.chain_only else s.tree_nodes
            if size - 1 <= free and size <= room + 1 and r.seq_len + s.draft_span <= self.context_len:
                return DraftTree.chain(root, [0] * (size - 1)), True
        return lone, False

    # ------------------------------------------------------------------ after the step
    def commit_kv(self, batch: ScheduleBatch, out: StepOutput, committed: list[int]) -> None:
        """Request i kept `committed[i]` of its accepted tokens: the slots of its root and of the first
        committed - 1 accepted drafts hold their KV now (kv_len grows by that many); the others are freed."""
        slots = batch.out_cache_loc.numpy()
        table = self.kv.req_to_token
        freed = []
        at = 0
        for r, tree, v, m in zip(batch.reqs, batch.verify.trees, out.verified, committed):
            n = tree.size
            seg = slots[at : at + n]
            at += n
            kept = max(1, m)  # an aborted request keeps its root's KV, as a decode step's
            path = [0] + v.nodes[: kept - 1]
            if path != list(range(kept)):  # a tree's path: its slots move to the positions after the prefix
                table.write(r.req_pool_idx, r.kv_len, torch.from_numpy(seg[path]))
            keep = set(path)
            freed.extend(int(seg[j]) for j in range(n) if j not in keep)
            r.kv_len += kept
            self._record(r, v.proposed, min(len(v.nodes), m))
        if freed:
            self.kv.allocator.free(torch.tensor(freed, dtype=torch.int64))

    def _learn(self, r: Req) -> None:
        """What the target wrote since the grammar forced a text: the grammar drafts' tokens for it."""
        forced, start = r.spec.pending_forced
        written = r.output_ids[start:]
        if self.grammar_drafts.learn(forced, written) is not None or len(written) > MAX_LEARN_TOKENS:
            r.spec.pending_forced = None

    def _record(self, r: Req, proposed: int, accepted: int) -> None:
        if r.spec is not None and r.spec.pending_forced is not None:
            self._learn(r)
        if proposed <= 0:
            return
        self._state(r).record(proposed, accepted)
        t = self.totals
        t["spec_verify_steps"] += 1
        t["spec_draft_tokens"] += proposed
        t["spec_accepted_tokens"] += accepted

    def stats(self) -> dict:
        t = self.totals
        steps = t["spec_verify_steps"]
        out = {**t, "avg_spec_accept_length": (t["spec_accepted_tokens"] + steps) / steps if steps else 0.0}
        if self.guard is not None and self.settings.enabled:
            out["spec_guard"] = self.guard.report()
        return out


def _leading(forced: list[bool]) -> int:
    """How many of a chain's drafts the grammar forced before its first guess."""
    n = 0
    while n < len(forced) and forced[n]:
        n += 1
    return n
