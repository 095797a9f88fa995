"""Stop checks and the per-step output messages of the scheduler.

`check_finish` runs after every sampled token: it feeds the incremental detokenizer, then checks stop
token ids / EOS, stop strings, stop regexes, grammar termination, max_new_tokens and the context
length (`check_finish_many`: the same for a whole step's requests, detokenized in one call).
`collect` turns the requests' progress into `ReqOutput` deltas: streaming requests every
`stream_interval` tokens (the request's own, else the server's), the others once, when they finish.
"""

from __future__ import annotations

from typing import Optional

from ..detokenizer import find_stop_regex, find_stop_string, step_many
from ..io_struct import DeferredText, ReqOutput
from ..request import FinishReason, Req


class OutputBuilder:
    def __init__(self, tokenizer, stream_interval: int):
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        self.pending: list[ReqOutput] = []

    def check_finish(self, r: Req, context_len: int) -> None:
        self.check_finish_many([r], context_len)

    def check_finish_many(self, reqs: list[Req], context_len: int) -> None:
        """`check_finish` for requests that each just got one token, with one batched detokenization."""
        to_decode, tokens = [], []
        for r in reqs:
            tok = r.output_ids[-1]
            if tok in r.stop_token_ids and len(r.output_ids) >= r.sampling_params.min_new_tokens:
                # Like SGLang, the stop token stays in output_ids but its text is trimmed (unless
                # no_stop_trim): a stop id that is an ordinary token must not leak into the text.
                r.finished_reason = FinishReason("stop", matched=tok)
                if not r.sampling_params.no_stop_trim:
                    continue
            to_decode.append(r)
            tokens.append(tok)
        if not to_decode:
            return
        deltas = step_many([r.detok for r in to_decode], tokens)
        for r, delta in zip(to_decode, deltas):
            if r.finished_reason is not None:
                continue
            if r.checks_text and delta and self._check_text(r, delta):
                continue
            if r.grammar is not None and r.grammar.is_terminated():
                r.finished_reason = FinishReason("stop", matched=None)
                continue
            n = len(r.output_ids)
            if n >= r.max_new_tokens or len(r.origin_input_ids) + n >= context_len:
                r.finished_reason = FinishReason("length", length=n)

    @staticmethod
    def _check_text(r: Req, delta: str) -> bool:
        """Stop strings, then stop regexes, over the text decoded so far; True when one matched."""
        sp = r.sampling_params
        stops = sp.stop_strs
        if stops:
            hit = find_stop_string(r.detok.text, len(delta), stops)
            if hit is not None:
                idx, s = hit
                r.finished_reason = FinishReason("stop", matched=s)
                # NOTE: the last token may run past the stop string; no_stop_trim keeps the stop
                # string itself but not what follows it (SGLang).
                r.final_text = r.detok.text[: idx + len(s)] if sp.no_stop_trim else r.detok.text[:idx]
                return True
        if r.stop_regexes:
            regex_hit = find_stop_regex(r.detok.text, r.stop_regexes)
            if regex_hit is not None:
                start, end, s = regex_hit
                r.finished_reason = FinishReason("stop", matched=s)
                r.final_text = r.detok.text[:end] if sp.no_stop_trim else r.detok.text[:start]
                return True
        return False

    # ------------------------------------------------------------------ messages
    def emit_final(self, r: Req) -> None:
        assert r.finished_reason is not None, "a request's final output says why it ended"
        r.detok.flush()
        text = r.final_text if r.final_text is not None else r.detok.text
        out = self._delta(r, text, final=True)
        out.finished_reason = r.finished_reason.to_json()
        out.final_text = text
        out.closed_early = r.grammar.closed_early if r.grammar is not None else None
        if r.defer_text:
            out.deferred_text = DeferredText(len(r.detok.ids), r.detok.skip_special_tokens)
        self.pending.append(out)

    def collect(self, live: list[Req]) -> list[ReqOutput]:
        outs, self.pending = self.pending, []
        for r in live:
            if not r.stream or r.finished:
                continue
            interval = r.sampling_params.stream_interval or self.stream_interval
            if len(r.output_ids) - r.sent_ids < interval and not (r.sent_ids == 0 and r.output_ids):
                continue
            text = r.detok.text
            holdback = max((len(s) for s in r.sampling_params.stop_strs), default=1) - 1
            if holdback:
                text = text[: max(r.sent_text_len, len(text) - holdback)]
            outs.append(self._delta(r, text, final=False))
        return outs

    def _delta(self, r: Req, text: str, final: bool) -> ReqOutput:
        out = ReqOutput(
            rid=r.rid,
            new_ids=r.output_ids[r.sent_ids :],
            text_delta=text[r.sent_text_len :],
            finished_reason=None,
            prompt_tokens=len(r.origin_input_ids),
            completion_tokens=len(r.output_ids),
            cached_tokens=r.cached_tokens,
            first_token_time=r.first_token_time,
            cached_tokens_host=r.cached_tokens_host,
        )
        if r.spec is not None:
            out.spec_verify_ct = r.spec.verify_steps
            out.spec_draft_tokens = r.spec.draft_tokens
            out.spec_accepted_tokens = r.spec.accepted_tokens
        r.sent_ids = len(r.output_ids)
        r.sent_text_len = len(text)
        if r.return_logprob:
            self._add_logprobs(r, out)
        return out

    def _tok_text(self, r: Req, tok: Optional[int]) -> Optional[str]:
        if not r.return_text_in_logprobs or tok is None or self.tokenizer is None:
            return None
        return self.tokenizer.decode([tok])

    def _top(self, r: Req, top) -> Optional[list]:
        if top is None:
            return None
        return [(lp, t, self._tok_text(r, t)) for lp, t in top]

    def _add_logprobs(self, r: Req, out: ReqOutput) -> None:
        if r.sent_input_logprobs == 0 and r.return_logprob and (r.input_token_logprobs or r.logprob_start_len == 0):
            if r.logprob_start_len == 0 and r.origin_input_ids:
                first = r.origin_input_ids[0]
                out.input_token_logprobs.append((None, first, self._tok_text(r, first)))
                out.input_top_logprobs.append(None)
            for (lp, t), top in zip(r.input_token_logprobs, r.input_top_logprobs):
                out.input_token_logprobs.append((lp, t, self._tok_text(r, t)))
                out.input_top_logprobs.append(self._top(r, top))
            r.sent_input_logprobs = 1
        n = r.sent_output_logprobs
        for (lp, t), top in zip(r.output_token_logprobs[n:], r.output_top_logprobs[n:]):
            out.output_token_logprobs.append((lp, t, self._tok_text(r, t)))
            out.output_top_logprobs.append(self._top(r, top))
        r.sent_output_logprobs = len(r.output_token_logprobs)
        if r.prefill_only and r.finished_reason is not None and r.output_top_logprobs and not r.output_token_logprobs:
            # max_new_tokens=0: no token, but the next token's distribution was asked for (one final output)
            out.output_top_logprobs.append(self._top(r, r.output_top_logprobs[0]))
