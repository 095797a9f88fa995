"""Jump-forward decoding: append the text a grammar forces in one step instead of token by token.

When the grammar leaves exactly one way to continue (JSON keys, `":"`, closing brackets, the
fixed parts of a regex), decoding those tokens one at a time wastes model steps. Instead:

    plan = plan_jump_forward(matcher, tokenizer, output_ids)      # None: nothing forced
    if plan is not None and apply_jump_forward(matcher, plan):
        del output_ids[len(output_ids) - plan.rollback_tokens:]   # also free their KV slots
        output_ids.extend(plan.append_token_ids)                  # prefill these (extend step)

Retokenization at the boundary. Appending the forced text's own tokenization next to the model's
last token can produce a split the tokenizer would never make (the model wrote `"` and the
grammar forces `,"age":`; the tokenizer writes `","` + `age` + `":`). So the plan backs off the
last `max_backoff` output tokens, re-encodes their text together with the forced text, keeps the
common token prefix, and says how many old tokens to drop (`rollback_tokens`) and which tokens to
append. The result decodes to exactly the old text plus the forced text; when it would not (a
partial UTF-8 character at the boundary, a tokenizer that normalises text), the back-off is
dropped and only the forced text is encoded; when even that does not round-trip, no jump is made.
KV for the kept prefix stays; only the dropped tokens' KV is discarded and the appended tokens are
prefilled.

The matcher is rolled back by `rollback_tokens` and then accepts the appended tokens;
`apply_jump_forward` does both and restores the matcher if the grammar rejects anything (which
would be a bug in the plan, never a crash of the request).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from .base import GrammarMatcher


@dataclass(frozen=True)
class JumpForwardPlan:
    forced_text: str  # what the grammar forces next
    rollback_tokens: int  # trailing output tokens to drop (re-tokenized with the forced text)
    dropped_token_ids: tuple[int, ...]  # those tokens, for restoring the matcher on failure
    append_token_ids: tuple[int, ...]  # tokens to append after dropping

    @property
    def tokens_saved(self) -> int:
        """Decode steps avoided: appended tokens that needed no model step, minus re-done ones."""
        return len(self.append_token_ids) - self.rollback_tokens


def plan_jump_forward(
    matcher: GrammarMatcher, tokenizer: Any, output_ids: Sequence[int], max_backoff: int = 1
) -> Optional[JumpForwardPlan]:
    """The tokens to append for the text the grammar forces now, or None if nothing is forced.

    `output_ids` are the request's generated tokens so far (the matcher has accepted all of them);
    prompt tokens are never re-tokenized."""
    if matcher.is_terminated():
        return None
    forced = matcher.jump_forward_string()
    if not forced:
        return None
    backoff = min(max_backoff, len(output_ids), matcher.max_rollback)
    for k in (backoff, 0) if backoff > 0 else (0,):
        plan = _retokenize(tokenizer, list(output_ids[len(output_ids) - k :]) if k else [], forced)
        if plan is not None:
            return plan
    return None


def _retokenize(tokenizer: Any, tail_ids: list[int], forced: str) -> Optional[JumpForwardPlan]:
    tail_text = tokenizer.decode(tail_ids) if tail_ids else ""
    if "\ufffd" in tail_text:  # the tail ends inside a UTF-8 character
        return None
    new_ids = list(tokenizer.encode(tail_text + forced, add_special_tokens=False))
    if tokenizer.decode(new_ids) != tail_text + forced:
        return None
    keep = 0
    while keep < len(tail_ids) and keep < len(new_ids) and tail_ids[keep] == new_ids[keep]:
        keep += 1
    dropped = tail_ids[keep:]
    append = new_ids[keep:]
    if not append:
        return None
    return JumpForwardPlan(
        forced_text=forced,
        rollback_tokens=len(dropped),
        dropped_token_ids=tuple(dropped),
        append_token_ids=tuple(append),
    )


def apply_jump_forward(matcher: GrammarMatcher, plan: JumpForwardPlan) -> bool:
    """Roll the matcher back over the dropped tokens and accept the appended ones.

    Returns False (matcher unchanged) if the grammar rejects the plan."""
    if plan.rollback_tokens:
        matcher.rollback(plan.rollback_tokens)
    accepted = 0
    for token_id in plan.append_token_ids:
        if not matcher.accept_token(token_id):
            break
        accepted += 1
    if accepted == len(plan.append_token_ids):
        return True
    if accepted:
        matcher.rollback(accepted)
    for token_id in plan.dropped_token_ids:
        matcher.accept_token(token_id)
    return False
