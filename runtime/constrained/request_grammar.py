"""One request's grammar: the backend's matcher plus what a grammar alone cannot promise.

`RequestGrammar` is the `GrammarMatcher` the scheduler holds for a constrained request (`req.grammar`).
It forwards to the backend's matcher and adds, for JSON text (schemas, any-JSON, tool calls):
- no repeated keys (unique_keys.py), always;
and for every kind, unless the request turned `close_within_budget` off:
- valid within the budget (closing.py): the GrammarManager tells it the tokens left after each token
  (`note_budget`); `fill_bitmask` decides from that whether to close, and closing forces the shortest
  completion's tokens through the mask; near the end `refine_bitmask` keeps, of the model's likeliest
  tokens (the row's logits), those after which a completion still fits;
- loops cut short (repetition.py): a loop starts the closing at once.

`closed_early` says why the output was closed early ("budget" | "repetition"), for meta_info.
`ends_within_budget()` is True once the budget has steered the output (a closing, or a token of the
model's that did not fit) and the grammar may end: the request ends there with finish_reason "length"
(the budget, not the model, ended it).
"""

from __future__ import annotations

import contextlib
from typing import Hashable, Iterator, Optional

import torch

from .base import GrammarMatcher
from .bitmask import allow, allowed_ids
from .closing import BUDGET, CHOICES, FIRST_LOOK, NEAR, BudgetCloser
from .completion import CompletionSearch
from .json_scan import JsonScanner
from .repetition import RepetitionWatch
from .token_tables import TokenTables
from .unique_keys import RepeatedKeyMask


class RequestGrammar(GrammarMatcher):
    def __init__(
        self,
        matcher: GrammarMatcher,
        tables: TokenTables,
        search: CompletionSearch,
        keys: RepeatedKeyMask,
        json_text: bool,
        close_within_budget: bool,
        greedy: bool = False,
        budget_left: Optional[int] = None,
        grammar_key: Optional[Hashable] = None,
    ) -> None:
        self.inner = matcher
        self.warnings = matcher.warnings
        self._tables = tables
        self._keys = keys
        self.scanner: Optional[JsonScanner] = JsonScanner() if json_text else None
        self._snapshots: list[tuple] = []  # the scanner before each accepted token (for rollback)
        self._accepted: list[bytes] = []  # each accepted token's bytes
        self._version = 0  # changes with every accept and rollback: identifies the matcher's state
        self.watch = RepetitionWatch() if close_within_budget else None
        self.closer = BudgetCloser(search, greedy, grammar_key) if close_within_budget else None
        self._budget_left = budget_left  # tokens the request may still generate (None: not known yet)
        self._event: Optional[str] = None  # "closed" | "overshoot", until taken by the manager
        self._drafting = 0  # inside drafting(): masks are filled with no decision taken
        self._silent = 0  # the latest accepted tokens that were drafts (the loop watch and closer never saw them)

    # ---- what the scheduler reads ----
    @property
    def closed_early(self) -> Optional[str]:
        return self.closer.reason if self.closer is not None else None

    def note_budget(self, left: int) -> None:
        """The tokens the request may still generate (after each accepted token and jump-forward)."""
        self._budget_left = left

    def take_event(self) -> Optional[str]:
        """What the last decision did, once: "closed" (the closing began), "overshoot" (no completion
        fits the budget any more), or None."""
        event, self._event = self._event, None
        return event

    def ends_within_budget(self) -> bool:
        """Whether the budget steered this output and it may end here: it ends ("length")."""
        return self.closer is not None and self.closer.reason == BUDGET and self.inner.is_completed()

    def _decide(self) -> None:
        """Before the next token's mask: whether to close, or to keep only tokens that fit."""
        closer, left = self.closer, self._budget_left
        if closer is None or left is None or left < 1 or closer.closing or closer.overshoot:
            return
        had_reason = closer.reason is not None
        closer.step(self.inner, self.scanner, self._version, self._accepted, left, self.watch.looping)
        if closer.reason is not None and not had_reason:
            self._event = "closed"
        elif closer.overshoot:
            self._event = "overshoot"

    # ---- GrammarMatcher ----
    def accept_token(self, token_id: int) -> bool:
        if not self.inner.accept_token(token_id):
            return False
        data = self._tables.vocab.decoded[token_id] if 0 <= token_id < len(self._tables.vocab.decoded) else b""
        if self.scanner is not None:
            self._snapshots.append(self.scanner.snapshot())
            self.scanner.feed(data)
        self._accepted.append(data)
        self._version += 1
        if self._drafting:
            self._silent += 1  # a draft: the output may never hold it
        elif self.watch is not None:
            self.watch.feed(token_id, data)
            self.closer.on_token(token_id, self._version, len(self._accepted))
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        self.inner.rollback(num_tokens)
        if self.scanner is not None:
            self.scanner.restore(self._snapshots[-num_tokens])
            del self._snapshots[-num_tokens:]
        del self._accepted[-num_tokens:]
        self._version += 1
        drafts = min(num_tokens, self._silent)
        self._silent -= drafts
        if self.watch is not None and num_tokens > drafts:
            self.watch.rollback(num_tokens - drafts)
            self.closer.on_rollback()

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def is_completed(self) -> bool:
        return self.inner.is_completed()

    @property
    def max_rollback(self) -> int:
        return self.inner.max_rollback

    def jump_forward_string(self) -> Optional[str]:
        if self.closer is not None and self.closer.closing:
            return None  # the closing plan is written token by token through the mask
        forced = self.inner.jump_forward_string()
        if forced and self.scanner is not None and self._keys.closes_repeated_key(self.scanner, forced.encode()):
            return None  # left to the mask, which keeps the grammar's row only if nothing else is possible
        return forced

    # ---- speculative decoding ----
    def draft_room(self, num_tokens: int, free: bool) -> int:
        """How many of `num_tokens` drafts may be scored ahead with the plain masks of the states they lead
        to (no decision is taken there: `drafting`). The decision the next mask takes is taken first, at
        the output's state: none while the closer closes. A greedy request may draft all of them: as its
        verified tokens are committed, `keeps_verified` takes at each of them the decision plain decoding
        takes there, and the output keeps them only up to the first token that decision would not write.
        A sampled request's drafts come only where no decision steers: none while the closer chooses;
        forced text (`free` False) needs nothing more (every valid completion begins with it, so the slack
        is the same at each of its nodes); free drafts (prompt lookup, a draft model) change the slack as
        they go: only before the closer's first estimate near the end is due, or while the slack left
        after them stays over NEAR."""
        closer, left = self.closer, self._budget_left
        if closer is None:
            return num_tokens
        self._decide()
        if closer.closing or left is None:
            return 0
        if closer.greedy:
            return num_tokens
        if closer.choosing:
            return 0
        if not free:
            return num_tokens
        need = FIRST_LOOK if closer.estimate is None else len(closer.estimate.token_ids) + NEAR
        return max(0, min(num_tokens, left - 2 - need))

    def keeps_verified(self, token_id: int) -> bool:
        """Before a verified draft's target token is committed (the model's likeliest token under this
        state's plain mask): whether plain decoding writes it here. The decision the mask takes is taken
        first; while closing only the plan's next token is written, while choosing a greedy request keeps
        its likeliest token if a completion fits after it (BudgetCloser.keeps). A sampled request keeps
        nothing where a decision steers (its draws there are not plain decoding's)."""
        closer = self.closer
        if closer is None:
            return True
        self._decide()
        if closer.closing:
            return closer.greedy and closer.forced_token() == token_id
        if not closer.choosing:
            return True
        return closer.greedy and closer.keeps(
            self.inner, self.scanner, token_id, self._tables.vocab.decoded, self._budget_left
        )

    @contextlib.contextmanager
    def drafting(self) -> Iterator[None]:
        """Drafts accepted inside are invisible to the loop watch and the budget closer (their estimate is
        the output's, not a draft's): they see only the tokens the output commits, after verification."""
        self._drafting += 1
        try:
            yield
        finally:
            self._drafting -= 1

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if not self._drafting:
            self._decide()
        closer = self.closer
        if closer is not None and closer.closing:
            bitmask[row].zero_()
            forced = closer.forced_token()
            if forced is not None:
                allow(bitmask[row], forced)
            else:  # the plan is written: the grammar's own end
                bitmask[row] |= self._tables.stops
            return
        self.inner.fill_bitmask(bitmask, row)
        if self.scanner is not None and not self.scanner.broken:
            self._keys.apply(self.scanner, bitmask[row], self.inner)

    @property
    def wants_logits(self) -> bool:
        return self.closer is not None and self.closer.choosing and not self.closer.closing

    def refine_bitmask(self, logits: torch.Tensor, row: torch.Tensor) -> None:
        """Near the end of the budget (closing.py): of the CHOICES likeliest allowed tokens, keep those
        after which a completion still fits. logits: (V,) on any device; row: the (W,) bits just filled."""
        if not self.wants_logits:
            return
        ids = allowed_ids(row)
        ids = ids[ids < logits.shape[0]]
        values = logits[ids.to(logits.device)]
        top = values.topk(min(CHOICES, values.shape[0]))
        candidates = [t for t, v in zip(ids[top.indices.cpu()].tolist(), top.values.tolist()) if v != float("-inf")]
        had_reason = self.closer.reason is not None
        keep = self.closer.fitting(self.inner, self.scanner, candidates, self._tables.vocab.decoded, self._budget_left)
        if self.closer.reason is not None and not had_reason:
            self._event = "closed"
        row.zero_()
        for token in keep:
            allow(row, token)
