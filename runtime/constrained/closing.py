"""Valid within the budget: steer a constrained output to its shortest valid completion in time.

An output cut by max_new_tokens mid-object is text `json.loads` rejects. `BudgetCloser` (one per
request) keeps an estimate of how many tokens the shortest valid completion needs (completion.py)
and, before each token is sampled with `left` tokens of budget (that one included), looks at the
slack = left - estimate:

- slack == 0: close now. The completion's tokens are forced one per step, so the output ends,
  complete, exactly as the budget runs out (finish_reason "length": the budget ended it; so does an
  output the budget steered once it may end);
- 0 < slack <= NEAR: the next token must be one after which a completion still fits (`fitting`,
  with the row's logits: the model's likeliest tokens are tried in order, each accepted, the
  completion after it found, and rolled back). A greedy request keeps its own token whenever that
  one fits, so its output is unchanged unless the budget forces otherwise; a sampled one draws from
  the fitting ones among its CHOICES likeliest. When the likeliest token does not fit, the output
  counts as closed early. A token the grammar forces text after is counted with that text as
  jump-forward will spell it. The completion's own next token fits unless that spelling is longer;
  then the completion is written as planned. String content inside a string and digits inside a
  number leave the completion as it is: they fit without a look;
- slack < 0: no valid completion fits any more (a budget smaller than the schema's smallest value,
  or a token that opened too much at once, far from the end, where nothing is checked): the model's
  own text is left as it is, and `overshoot` records it;
- a loop (repetition.py): close now, whatever the budget (the output then ends with the grammar's
  own stop: "stop").

What it costs. Far from the end of the budget nothing is computed. The first estimate is taken
FIRST_LOOK tokens before the end; from then on it is refreshed every REFRESH tokens, and every token
once the slack is under NEAR. A refresh first tries the previous completion (what is left of it
when the model wrote its first bytes, or all of it when the model only added string content or
digits): a few token steps of the matcher, no search; the completion found for the token the model
then chose is kept as the next estimate. The search runs only where the structure changed (a value
ended, a key began).
"""

from __future__ import annotations

from typing import Hashable, Optional

from .base import GrammarMatcher
from .completion import Completion, CompletionSearch
from .json_scan import IN_LITERAL, IN_STRING, JsonScanner

FIRST_LOOK = 256
NEAR = 32
REFRESH = 16
CHOICES = 4
RETRY_AFTER = 4

BUDGET, REPETITION = "budget", "repetition"  # why an output was closed early


class BudgetCloser:
    """Per request: the current estimate, and once closing, the forced tokens."""

    def __init__(self, search: CompletionSearch, greedy: bool, grammar_key: Optional[Hashable] = None) -> None:
        self.search = search
        # With the bytes accepted, the state a search's result is kept under. A hash, not the key: the memo
        # would otherwise hold every distinct schema text it saw (a collision could only cost an estimate:
        # the memo's text is verified against this request's own matcher before it is used).
        self.grammar_id = None if grammar_key is None else hash(grammar_key)
        self.decoded = search.tables.vocab.decoded
        self.greedy = greedy  # the request samples the argmax: one fitting token is all it needs
        self.estimate: Optional[Completion] = None
        self._estimate_version = -1  # the matcher version the estimate was computed at
        self._estimate_left = 0  # the budget left then
        self._estimate_tokens = 0  # tokens the request had accepted then
        self._retry_left: Optional[int] = None  # after a failed search: no new one before this budget
        self._after: dict[int, Completion] = {}  # completions found by `fitting`, by candidate token
        self._after_left = 0
        self.plan: Optional[tuple[int, ...]] = None  # forced tokens, once closing
        self.plan_pos = 0
        self.reason: Optional[str] = None  # why it closed early (reported in meta_info)
        self.choosing = False  # the next token must keep a completion within the budget (`fitting`)
        self.slack = 0
        self.overshoot = False  # no completion fitted in what was left of the budget: nothing more is tried

    # ---- state the grammar wrapper reads ----
    @property
    def closing(self) -> bool:
        return self.plan is not None

    def forced_token(self) -> Optional[int]:
        """The next token of the closing plan (None when not closing or when it is all written)."""
        if self.plan is None or self.plan_pos >= len(self.plan):
            return None
        return self.plan[self.plan_pos]

    @property
    def plan_done(self) -> bool:
        return self.plan is not None and self.plan_pos >= len(self.plan)

    def first_token(self) -> Optional[int]:
        """The first token of the current estimate."""
        if self.estimate is None or not self.estimate.token_ids:
            return None
        return self.estimate.token_ids[0]

    def on_token(self, token_id: int, version: int, accepted: int) -> None:
        """After the request accepted `token_id` (now at `version`, with `accepted` tokens)."""
        found = self._after.get(token_id)
        self._after = {}
        if (
            found is None
            and self.estimate is not None
            and self.estimate.token_ids[:1] == (token_id,)
            and (self._estimate_version == version - 1)
        ):
            # The model wrote the completion's first token: the rest of it, token for token, completes.
            rest = self.estimate
            found = Completion(rest.text[len(self.decoded[token_id]) :], rest.token_ids[1:], rest.how)
            self._after_left = self._estimate_left
        if found is not None:  # `fitting` (or the completion itself) says how it ends from here
            self.estimate, self._estimate_version = found, version
            self._estimate_left, self._estimate_tokens = self._after_left - 1, accepted
        if self.plan is None:
            return
        if self.plan_pos < len(self.plan) and self.plan[self.plan_pos] == token_id:
            self.plan_pos += 1
        else:  # something other than the plan was accepted (cannot happen through the mask): replan
            self.plan, self.plan_pos = None, 0

    def on_rollback(self) -> None:
        self._after = {}
        if self.plan is not None:
            self.plan, self.plan_pos = None, 0

    # ---- the decision before each sampled token ----
    def step(
        self,
        matcher: GrammarMatcher,
        scanner: Optional[JsonScanner],
        version: int,
        accepted: list[bytes],
        left: int,
        looping: bool,
    ) -> None:
        """Decide, with `left` tokens of budget (the next one included), whether to close or choose.

        version: the matcher's state (changes with every accept and rollback); accepted: the bytes of
        every token accepted so far."""
        self.choosing = False
        if self.plan is not None or self.overshoot or matcher.is_terminated():
            return
        if looping:
            estimate = self._refresh(matcher, scanner, version, accepted, left)
            if estimate is not None and len(estimate.token_ids) <= left:
                self._close(REPETITION, estimate)
            return
        estimate = self._estimate(matcher, scanner, version, accepted, left)
        if estimate is None or not estimate.token_ids:
            return  # far from the end, or the grammar may end right here
        self.slack = left - len(estimate.token_ids)
        if self.slack < 0:
            self.overshoot = True
        elif self.slack == 0:
            self._close(BUDGET, estimate)
        elif self.slack <= NEAR:
            self.choosing = True

    def fitting(
        self, matcher: GrammarMatcher, scanner: Optional[JsonScanner], candidates: list[int], decoded: tuple, left: int
    ) -> list[int]:
        """Of `candidates` (allowed tokens, likeliest first), those after which a completion fits in the
        `left - 1` tokens then left; a greedy request stops at the first.

        NOTE: text the grammar forces after a token is appended by jump-forward as the tokenizer spells the
        token and that text together (jump_forward.py), which may take a token more than the completion's
        own spelling; the fit counts that spelling."""
        first = self.first_token()
        keep = []
        self._after, self._after_left = {}, left
        old = self.estimate.text if self.estimate is not None else b""
        tried_first = False
        for token in [*candidates, *([first] if first is not None and first not in candidates else [])]:
            if token == first:
                tried_first = True
            data = decoded[token]
            if left >= 3 and self._keeps_completion(scanner, data):
                fits = True  # (room left for what a jump-forward could add after it)
            elif not matcher.accept_token(token):
                continue
            else:
                fits = self._fits_after(matcher, scanner, data, old, left, token)
                matcher.rollback(1)
            if fits:
                keep.append(token)
                if self.greedy:
                    break
        if candidates and candidates[0] not in keep:
            self.reason = self.reason or BUDGET  # the model's own choice did not fit: the budget steers
        if not keep and tried_first:
            # Not even the completion's own next token fits with a jump-forward after it: from here the
            # completion is written token by token as planned (no jump-forward while closing).
            self._close(BUDGET, self.estimate)
            keep = [first]
        return keep

    def keeps(
        self, matcher: GrammarMatcher, scanner: Optional[JsonScanner], token: int, decoded: tuple, left: int
    ) -> bool:
        """Whether a greedy request whose likeliest allowed token is `token` writes it here: `fitting` with
        `token` first keeps it. When it does, the closer is left as `fitting` leaves it (the completion
        after `token` known for `on_token`); when not, as it was, for the full choice (its likeliest
        tokens in order) that the next mask makes from this state."""
        saved = (self._after, self._after_left, self.reason, self.plan, self.plan_pos)
        if self.fitting(matcher, scanner, [token], decoded, left)[:1] == [token]:
            return True
        self._after, self._after_left, self.reason, self.plan, self.plan_pos = saved
        return False

    def _fits_after(
        self, matcher: GrammarMatcher, scanner: Optional[JsonScanner], data: bytes, old: bytes, left: int, token: int
    ) -> bool:
        """With `token` just accepted on the matcher: whether a completion fits in `left - 1` tokens."""
        probe = None
        if scanner is not None:
            probe = JsonScanner.from_snapshot(scanner.snapshot())
            probe.feed(data)
        found = self.search.find(matcher, probe, _hints(old, data))
        if found is None:
            return False
        self._after[token] = found
        need = 1 + len(found.token_ids)  # this token and the completion after it
        forced = (matcher.jump_forward_string() or "").encode("utf-8")
        if forced and found.text.startswith(forced):
            # What jump-forward will write: this token re-spelled with the forced text (its back-off of
            # one token), or, where that does not spell it back, the forced text's own tokens after it.
            tables = self.search.tables
            rest = found.text[len(forced) :]
            rest_ids = tables.encode(rest) if rest else []
            together = tables.encode(data + forced) if _whole_utf8(data) else None
            alone = tables.encode(forced)
            jumped = len(together) if together is not None else None if alone is None else 1 + len(alone)
            if jumped is not None and rest_ids is not None:
                need = max(need, jumped + len(rest_ids))
        return need <= left

    @staticmethod
    def _keeps_completion(scanner: Optional[JsonScanner], data: bytes) -> bool:
        """Whether the token only adds a value string's content or a number's digits, after which the
        same completion still ends the text."""
        if scanner is None or not data:
            return False
        context = scanner.context
        if context == IN_STRING and not scanner.escape:
            return b'"' not in data and b"\\" not in data and min(data) >= 0x20
        return context == IN_LITERAL and scanner.literal[-1:].isdigit() and data.isdigit()

    def _estimate(self, matcher, scanner, version, accepted, left) -> Optional[Completion]:
        if self.estimate is not None and self._estimate_version == version:
            return self.estimate
        if left > FIRST_LOOK or (self._retry_left is not None and left > self._retry_left):
            return None
        if (
            self.estimate is not None
            and left - len(self.estimate.token_ids) > NEAR
            and (self._estimate_left - left < REFRESH)
        ):
            return self.estimate  # stale, but far enough from the end that nothing is decided on it
        return self._refresh(matcher, scanner, version, accepted, left)

    def _refresh(self, matcher, scanner, version, accepted, left) -> Optional[Completion]:
        old = self.estimate.text if self.estimate is not None else b""
        state = None if self.grammar_id is None else (self.grammar_id, b"".join(accepted))
        found = self.search.find(matcher, scanner, _hints(old, b"".join(accepted[self._estimate_tokens :])), state)
        # NOTE: a search that finds nothing (a grammar too intricate for its node budget) is not
        # retried on every token: the next try waits RETRY_AFTER tokens.
        self._retry_left = None if found is not None else left - RETRY_AFTER
        self.estimate, self._estimate_version = found, version
        self._estimate_left, self._estimate_tokens = left, len(accepted)
        return found

    def _close(self, reason: str, estimate: Completion) -> None:
        self.plan, self.plan_pos, self.reason = estimate.token_ids, 0, reason


def _whole_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


_STRUCTURAL = frozenset(b'"{}[],:')


def _hints(old: bytes, written: bytes) -> list[bytes]:
    """Completions to try first, from `old` (the completion before `written` was accepted), shortest
    first: what is left of it after as many bytes as the model wrote (the model wrote its start, or other
    bytes of a fixed-width field: a regex's date `000-01-01` after the model's "4" leaves `00-01-01`); it
    without its leading content (the model wrote a value's digits or letters of its own: `0, "b": 0}` after
    the model's "23" is `, "b": 0}`); it whole (the model only added content inside a string)."""
    if not old:
        return []
    hints = []
    if written and len(old) > len(written):
        hints.append(old[len(written) :])
    lead = next((i for i, b in enumerate(old) if b in _STRUCTURAL), len(old))
    if 0 < lead < len(old):
        hints.append(old[lead:])
    hints.append(old)
    return hints
