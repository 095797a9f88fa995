"""The scheduler's side of constrained decoding: one `GrammarManager` per scheduler process.

Calls the scheduler makes (runtime/scheduler/grammars.py):

    manager = GrammarManager(tokenizer, vocab_size, server_args)     # lazily, first grammar request
    req.grammar_future = manager.request(sampling_params)            # on arrival; poll .done()
    req.set_grammar(req.grammar_future.result())                     # a per-request GrammarMatcher
                                                                     # (ValueError: abort the request)
    manager.fill_and_apply(logits, reqs)                             # sampler hook, before sampling
    manager.accept(req, token_id)                                    # after appending a sampled token
    plan = manager.jump_forward(req)                                 # after the stop checks, if the
                                                                     # request is still running
    tok = manager.forced_stop(req)                                   # before jump_forward: a stop
                                                                     # token the grammar leaves alone

Each matcher is a `RequestGrammar` (request_grammar.py): no repeated JSON keys, and (unless the request
set `close_within_budget` off) the closing that keeps a cut output valid. The masking itself happens in
the step runner (`GrammarMasker`, masker.py), which sees only matchers; so `accept` and `jump_forward`,
where the request is known, tell its matcher the budget left (`req.remaining_new_tokens()`), and
`accept` ends a request whose budget closing has written its last token with finish_reason "length".

`jump_forward` rewrites `req.output_ids` in place (drops at most the just-sampled token, whose KV
is not computed yet, and appends the forced tokens), advances the matcher and feeds the
detokenizer; the scheduler then prefills the new tail (`len(req.fill_ids) - req.kv_len` tokens)
instead of decoding one token. Stop strings are not searched inside forced text (the grammar, not
the model, wrote it); forced tokens count towards max_new_tokens and are cut to fit it.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Optional, Sequence

import torch

from ..request import FinishReason
from .base import JSON_KINDS, GrammarBackend, GrammarMatcher
from .bitmask import allocate_token_bitmask, apply_token_bitmask_inplace, single_token
from .completion import CompletionSearch
from .factory import create_grammar_backend
from .jump_forward import JumpForwardPlan, apply_jump_forward, plan_jump_forward
from .masker import GrammarMasker
from .request_grammar import RequestGrammar
from .token_tables import TokenTables
from .unique_keys import RepeatedKeyMask

# Compiles run on this many threads. NOTE: a compile cannot be stopped, so one that runs past its timeout
# keeps its thread until it ends; with a single thread every other request's constraint (a forced tool
# call included) would queue behind it and time out too.
COMPILE_THREADS = 4


class GrammarManager:
    """Owns the grammar backend and the batch bitmask of one scheduler."""

    def __init__(self, tokenizer: Any, vocab_size: int, server_args: Any) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.backend: GrammarBackend = create_grammar_backend(
            server_args.grammar_backend,
            tokenizer,
            vocab_size,
            num_threads=COMPILE_THREADS,
            compile_timeout=server_args.grammar_compile_timeout,
        )
        self.jump_forward_enabled = server_args.jump_forward_enabled()
        self.tables = TokenTables(self.backend.vocab)
        self.search = CompletionSearch(self.tables)
        self.keys = RepeatedKeyMask(self.tables)
        self._special = frozenset(getattr(tokenizer, "all_special_ids", []) or [])
        self._masker = GrammarMasker(self.backend.vocab_size)
        self._row = allocate_token_bitmask(1, self.backend.vocab_size)  # forced_stop's one row of bits
        # jump_forward_tokens: tokens appended without a decode step; jump_forward_rollback_tokens:
        # sampled tokens replaced by the retokenized forced text (decoded, then dropped).
        # grammar_closed_early: outputs steered to their shortest completion (budget or loop);
        # grammar_close_overshoots: outputs whose shortest completion no longer fitted their budget.
        # grammar_forced_stops: outputs ended on the one stop token their grammar allowed, without the
        # step that would have sampled it.
        self.counters = {
            "grammar_forced_stops": 0,
            "jump_forward_events": 0,
            "jump_forward_tokens": 0,
            "jump_forward_rollback_tokens": 0,
            "grammar_closed_early": 0,
            "grammar_close_overshoots": 0,
        }

    @property
    def stats(self) -> dict[str, float]:
        """Counters plus the compile cache's size, hits and misses (a soak watches the size: each
        compiled grammar holds its token-mask tables until the LRU drops it)."""
        cache = self.backend.cache_info()
        return {
            **self.counters,
            **self.search.stats,
            "grammar_repeated_keys_unavoidable": self.keys.unavoidable,
            "grammar_cache_size": cache["size"],
            "grammar_cache_hits": cache["hits"],
            "grammar_cache_misses": cache["misses"],
            "grammar_compile_seconds": round(cache["compile_seconds"], 6),
        }

    # ---- arrival ----
    def request(self, sampling_params: Any) -> "Future[GrammarMatcher]":
        """A future of a fresh matcher for the request's constraint (compiled once per key)."""
        return make_request_grammar(self.backend, sampling_params, self._wrap)

    def _wrap(self, matcher: GrammarMatcher, sampling_params: Any) -> RequestGrammar:
        # NOTE: the scheduler may clamp max_new_tokens to the context (None: all of it); the budget
        # accept() reports after the first token corrects this first one.
        max_new = sampling_params.max_new_tokens
        return RequestGrammar(
            matcher,
            self.tables,
            self.search,
            self.keys,
            json_text=sampling_params.grammar_key[0] in JSON_KINDS,
            close_within_budget=sampling_params.close_within_budget,
            greedy=sampling_params.is_greedy,
            budget_left=max_new,
            grammar_key=sampling_params.grammar_key,
        )

    # ---- sampling ----
    def fill_and_apply(self, logits: torch.Tensor, reqs: Sequence[Any]) -> None:
        """Mask logits (B, V) in place: row i follows reqs[i].grammar; rows without one untouched."""
        self._masker.apply(logits, [getattr(r, "grammar", None) for r in reqs])

    # ---- after sampling ----
    def accept(self, req: Any, token_id: int) -> bool:
        """Advance the request's matcher; a rejected token aborts the request (never silently).

        After the last token of a budget closing, the request ends with finish_reason "length"."""
        if advance(req, token_id):
            grammar = req.grammar
            if isinstance(grammar, RequestGrammar):
                self._count(grammar.take_event())
                if grammar.ends_within_budget():
                    req.finished_reason = FinishReason("length", length=len(req.output_ids))
                else:
                    grammar.note_budget(_budget_left(req))
            return True

        req.finished_reason = FinishReason(
            "abort",
            message=f"token {token_id} violates the request's grammar (constraint "
            f"{req.sampling_params.grammar_key[0]})",
        )
        return False

    def jump_forward(self, req: Any) -> Optional[JumpForwardPlan]:
        """Append the grammar-forced tokens to `req.output_ids` (see the module docstring)."""
        if not self.jump_forward_enabled or req.grammar is None or req.grammar.is_terminated():
            return None
        if getattr(req, "return_logprob", False):
            return None  # forced tokens have no logprobs; keep such requests token by token
        plan = jump_forward(req, self.tokenizer, self._special)
        if plan is not None:
            self.counters["jump_forward_events"] += 1
            self.counters["jump_forward_tokens"] += len(plan.append_token_ids)
            self.counters["jump_forward_rollback_tokens"] += plan.rollback_tokens
            if isinstance(req.grammar, RequestGrammar):
                req.grammar.note_budget(_budget_left(req))
        return plan

    def forced_stop(self, req: Any) -> Optional[int]:
        """The stop token that ends `req` now, when it is the only token its grammar allows here (the
        end of a fixed-length regex, a closed JSON value, a chosen label): whatever the logits, the
        next step would sample it and stop. The scheduler appends it instead of running that step.
        None where the step is still needed: logprobs asked for (the token's logprob comes from that
        step), a stop token the request does not stop on (ignore_eos, min_new_tokens), two or more
        tokens allowed (say, two EOS ids: the model chooses)."""
        grammar = req.grammar
        if not self.jump_forward_enabled or grammar is None or getattr(req, "return_logprob", False):
            return None
        if grammar.is_terminated() or not grammar.is_completed():
            return None
        with grammar.drafting():  # the mask as it stands, no budget decision taken for it
            grammar.fill_bitmask(self._row, 0)
        token = single_token(self._row[0])
        if token is None or token not in req.stop_token_ids:
            return None
        if len(req.output_ids) + 1 < req.sampling_params.min_new_tokens:
            return None
        self.counters["grammar_forced_stops"] += 1
        return token

    def _count(self, event: Optional[str]) -> None:
        if event == "closed":
            self.counters["grammar_closed_early"] += 1
        elif event == "overshoot":
            self.counters["grammar_close_overshoots"] += 1


def make_request_grammar(
    backend: GrammarBackend, sampling_params: Any, wrap: Any = None
) -> "Optional[Future[GrammarMatcher]]":
    """None for an unconstrained request; else a future resolving to the request's own matcher
    (with `.warnings`, the constraint features the backend does not enforce) or to ValueError.

    wrap(matcher, sampling_params): what the request holds instead of the backend's bare matcher."""
    key = sampling_params.grammar_key
    if key is None:
        return None
    compiled_future = backend.get_or_compile(key)
    matcher_future: Future = Future()

    def on_compiled(fut: Future) -> None:
        exc = fut.exception()
        if exc is not None:
            matcher_future.set_exception(exc)
            return
        compiled = fut.result()
        matcher = compiled.new_matcher()
        matcher.warnings = compiled.warnings
        try:
            matcher_future.set_result(matcher if wrap is None else wrap(matcher, sampling_params))
        except Exception as e:  # delivered to the request (an abort naming it), never lost on a thread
            matcher_future.set_exception(e)

    compiled_future.add_done_callback(on_compiled)
    return matcher_future


def fill_and_apply_masks(logits: torch.Tensor, reqs: Sequence[Any], bitmask: torch.Tensor) -> None:
    """Stateless form of `GrammarManager.fill_and_apply` with a caller-owned (B, W) bitmask."""
    rows = [i for i, r in enumerate(reqs) if getattr(r, "grammar", None) is not None]
    for i in rows:
        reqs[i].grammar.fill_bitmask(bitmask, i)
    if rows:
        apply_token_bitmask_inplace(logits, bitmask, rows)


def _budget_left(req: Any) -> int:
    """Tokens the request may still generate, the one about to be sampled included."""
    remaining = getattr(req, "remaining_new_tokens", None)
    if remaining is not None:
        return remaining()
    max_new = req.sampling_params.max_new_tokens
    return (1 << 30) if max_new is None else max_new - len(req.output_ids)


def advance(req: Any, token_id: int) -> bool:
    """Feed a sampled token to the request's matcher; False if the grammar rejects it."""
    return req.grammar is None or req.grammar.accept_token(int(token_id))


def jump_forward(req: Any, tokenizer: Any, special_ids: frozenset = frozenset()) -> Optional[JumpForwardPlan]:
    """Plan and apply a jump-forward on `req` (output_ids, matcher, detokenizer); None if nothing
    is forced or the budget is spent. Drops at most the last (not yet KV-computed) token."""
    # NOTE: the scheduler's Req carries its budget, where max_new_tokens=None is what is left of the
    # context (set at intake); read from the sampling params, None let a forced tail run past the
    # context's end. A request-like object without it falls back to the sampling params.
    max_new = getattr(req, "max_new_tokens", req.sampling_params.max_new_tokens)
    budget = None if max_new is None else max_new - len(req.output_ids)
    if budget is not None and budget <= 0:
        return None
    plan = plan_jump_forward(req.grammar, tokenizer, req.output_ids, max_backoff=1)
    if plan is None or any(t in special_ids for t in plan.append_token_ids):
        return None  # forced text that encodes to special tokens is left to the model
    if budget is not None and plan.tokens_saved > budget:
        plan = _without_backoff(req.grammar, tokenizer, plan.forced_text, budget)
        if plan is None:
            return None
    detok_ids = (
        list(plan.append_token_ids)
        if plan.rollback_tokens == 0
        else list(tokenizer.encode(plan.forced_text, add_special_tokens=False))
    )
    if plan.rollback_tokens and tokenizer.decode(detok_ids) != plan.forced_text:
        return None
    if not apply_jump_forward(req.grammar, plan):
        return None
    if plan.rollback_tokens:
        del req.output_ids[len(req.output_ids) - plan.rollback_tokens :]
    req.output_ids.extend(plan.append_token_ids)
    detok = getattr(req, "detok", None)
    if detok is not None:
        # NOTE: the detokenizer already emitted the dropped token's text; the new tokens decode
        # to that text plus the forced text, so it is fed only tokens spelling the forced text.
        detok.step(detok_ids)
    return plan


def _without_backoff(matcher: GrammarMatcher, tokenizer: Any, forced: str, budget: int) -> Optional[JumpForwardPlan]:
    ids = list(tokenizer.encode(forced, add_special_tokens=False))[:budget]
    if not ids:
        return None
    text = tokenizer.decode(ids)
    if not forced.startswith(text) or "\ufffd" in text:
        return None
    return JumpForwardPlan(forced_text=text, rollback_tokens=0, dropped_token_ids=(), append_token_ids=tuple(ids))
