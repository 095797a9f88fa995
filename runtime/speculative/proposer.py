"""Who may have drafts this step and which: each request's draft tree, from its grammar (the forced tokens:
grammar_drafts.py) and prompt lookup (NGRAM) here on the host, or sized for the runner's draft model /
EAGLE head, which fills it in. A request without drafts is a one-node tree (its last token).

Requests never speculate while their sampling depends on their own tokens beyond what a node's path
gives: penalties, a pending min_new_tokens, a seed (its samples would no longer reproduce those of a run
without speculation). Guessed drafts (prompt lookup, a drafter) are proposed only where the policy allows
guesses (a small batch, a policy arm that speculates); grammar-forced ones in any batch: a forced token is
almost never rejected, so verifying it costs what jump-forward's prefill of it would.

A request's history (accept rates, draft length, sit-outs: adaptive.py) is updated here once the
scheduler knows how many of its accepted tokens it kept (`record`).
"""

from __future__ import annotations

from typing import Any, Optional

from ..request import Req
from .adaptive import AcceptRates, RequestSpecState
from .grammar_drafts import GrammarDrafts
from .ngram import NgramIndex, TokenView
from .settings import SpecSettings
from .tree import DraftTree

MAX_LEARN_TOKENS = 32  # a forced text's tokens are learned from at most this many written after it


class DraftProposer:
    def __init__(self, settings: SpecSettings, tokenizer: Any, ngram_window: tuple[int, int], context_len: int):
        self.settings = settings
        self.context_len = context_len
        self.ngram_window = ngram_window
        special = getattr(tokenizer, "all_special_ids", None) or ()
        self.grammar_drafts = GrammarDrafts(tokenizer, special) if settings.grammar and tokenizer else None
        self.accept_rates = AcceptRates()  # what recent requests' drafts achieved: a new request's start

    # ------------------------------------------------------------------ who may draft
    def eligible(self, r: Req) -> bool:
        sp = r.sampling_params
        row = r.sampling
        if r.finished_reason is not None or row.penalized or row.min_tokens_pending():
            return False
        if sp.seed is not None and not sp.is_greedy:
            return False
        return r.grammar is None or r.grammar.max_rollback > 0

    def forced(self, r: Req) -> bool:
        """Whether the request's grammar may force drafts (then jump-forward must not append them)."""
        return self.grammar_drafts is not None and r.grammar is not None

    def may_draft(self, r: Req, guesses: bool) -> bool:
        """Whether `r` could have drafts this step: grammar-forced ones (any batch), guessed ones
        (prompt lookup, a drafter) where `guesses` are allowed. NOTE: grammar drafts are on by default, so
        a server without a speculative algorithm gets here too: its unconstrained requests never draft,
        and must not keep their decode steps from being launched ahead."""
        if not self.eligible(r) or (r.spec is not None and r.spec.sit_out > 0):
            return False
        if self.forced(r):
            return True
        return guesses and (self.settings.ngram or self.settings.model_drafts)

    def state(self, r: Req) -> RequestSpecState:
        if r.spec is None:
            s = self.settings
            constrained = self.forced(r)
            # NOTE: a constrained request's free values (a name, a number) are mostly copied from its prompt:
            # grammar drafts continue with prompt lookup where nothing is forced, NGRAM or not.
            ngram = NgramIndex(*self.ngram_window) if s.ngram or constrained else None
            # (a drafter's chain shortens after a rejection: each draft costs a drafter step; lookup and
            # forced drafts cost nothing to propose, the cost model cuts them)
            r.spec = RequestSpecState(
                s.max_drafts, s.adaptive, ngram, shrink=s.model_drafts and not constrained, population=self.accept_rates
            )
        return r.spec

    @staticmethod
    def skip_step(reqs: list[Req]) -> None:
        """A decode step decided without drafts: one step of each request's sit-out is served."""
        for r in reqs:
            if r.spec is not None:
                r.spec.skip_step()

    # ------------------------------------------------------------------ the drafts
    def plan(self, r: Req, guesses: bool) -> tuple[DraftTree, bool]:
        """The request's tree this step (a lone root: no drafts) and whether the runner drafts it;
        `guesses`: prompt lookup and a draft model may propose (else grammar-forced drafts only)."""
        root = r.output_ids[-1]
        lone = DraftTree([root], [-1])
        state = self.state(r)
        state.forced = []
        if not self.eligible(r) or not (guesses or r.grammar is not None):
            return lone, False
        # Drafts past the request's budget or the context would be thrown away (the target's own next
        # token comes with them): at most remaining - 1, and the tree must fit in the context.
        room = min(r.remaining_new_tokens() - 1, self.context_len - r.seq_len)
        n = min(state.allowed_drafts(), room)  # the adaptive length (0 while sitting out)
        s = self.settings
        by_grammar = self.forced(r)
        if by_grammar and self.grammar_drafts is not None and r.grammar is not None:
            # NOTE: the adaptive length and the sit-outs bound guessed drafts only: forced text is what
            # jump-forward would append, drafted whole (up to the cap) whatever became of earlier guesses.
            # Not where the grammar's budget closer would act within the drafts (draft_room).
            chain = r.grammar.draft_room(min(s.max_drafts, room), free=False)
            if chain > 0:
                if state.pending_forced is None:
                    forced = r.grammar.jump_forward_string()
                    if forced:
                        state.pending_forced = (forced, len(r.output_ids))
                lookup = state.ngram is not None and guesses and r.grammar.draft_room(chain, free=True) >= chain
                drafts, state.forced = self.grammar_drafts.propose(
                    r.grammar,
                    TokenView(r.origin_input_ids, r.output_ids),  # type: ignore[arg-type]
                    chain,
                    state.ngram.propose if lookup and state.ngram is not None else None,
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
            drafts = state.ngram.propose(TokenView(r.origin_input_ids, r.output_ids), n)  # type: ignore[arg-type]
            if drafts:
                return DraftTree.chain(root, drafts), False
        if s.model_drafts and guesses and free > 0:
            size = min(n, free) + 1 if s.chain_only else s.tree_nodes
            if size - 1 <= free and size <= room + 1 and r.seq_len + s.draft_span <= self.context_len:
                return DraftTree.chain(root, [0] * (size - 1)), True
        return lone, False

    # ------------------------------------------------------------------ after the step
    def record(self, r: Req, proposed: int, accepted: int) -> bool:
        """The request kept `accepted` of its `proposed` drafts; whether it had any (a verify step of its)."""
        if r.spec is not None and r.spec.pending_forced is not None:
            self._learn(r)
        if proposed <= 0:
            return False
        self.state(r).record(proposed, accepted)
        return True

    def _learn(self, r: Req) -> None:
        """What the target wrote since the grammar forced a text: the grammar drafts' tokens for it."""
        forced, start = r.spec.pending_forced
        written = r.output_ids[start:]
        learnt = self.grammar_drafts is not None and self.grammar_drafts.learn(forced, written) is not None
        if learnt or len(written) > MAX_LEARN_TOKENS:
            r.spec.pending_forced = None


def leading_forced(state: Optional[RequestSpecState]) -> int:
    """How many of a chain's drafts the grammar forced before its first guess."""
    forced = state.forced if state is not None else []
    n = 0
    while n < len(forced) and forced[n]:
        n += 1
    return n
