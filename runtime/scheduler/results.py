"""Committing a step's results: tokens appended, stop checks (one batched detokenization per round of
tokens), prefix-cache inserts, finished requests released, grammar-forced tails queued.

A prefill batch is committed in two parts: what it changes without its sampled tokens (each request's
KV length, its computed prefix in the cache, CHUNKED or RUNNING) when it is launched (`commit_prefill`:
a batch launched ahead is committed before the next admission, which then matches these tokens instead
of computing them again), and its tokens when they are read back (`process`).

One routine (`process`) commits every kind of step's tokens: a row's one token (a decode row, a prefill
that completes) or, for a VERIFY row (speculative decoding), its k accepted drafts and the target's
token after them, k + 1 in all. They are committed in rounds: round j appends every row's j-th token,
then the stop checks run for all of them at once, as for a decode step's tokens, so stop strings, EOS
and max_new_tokens cut exactly where they would one token a step; the speculation part then keeps the
KV of what a verify row committed and frees the rest.
"""

from __future__ import annotations

import time

from ..request import FinishReason, Req
from ..step import StepOutput
from .batch import ScheduleBatch
from .finish import Finisher
from .grammars import SchedulerGrammars
from .kv_manager import KVManager
from .outputs import OutputBuilder
from .queues import RequestQueues
from .speculation import Speculation

# What `process` does with a request once the step's stop checks ran.
_ABORTED, _NO_TOKEN, _TOKEN = range(3)


class StepResults:
    def __init__(
        self,
        queues: RequestQueues,
        kv: KVManager,
        outputs: OutputBuilder,
        finisher: Finisher,
        grammars: SchedulerGrammars,
        context_len: int,
        stats: dict,
        spec: Speculation,
    ):
        self.queues = queues
        self.kv = kv
        self.outputs = outputs
        self.finisher = finisher
        self.grammars = grammars
        self.context_len = context_len
        self.stats = stats
        self.spec = spec

    def commit_prefill(self, batch: ScheduleBatch) -> None:
        """What a prefill batch changes on the host without its sampled tokens (see the module doc). A
        mixed step's decode rows change nothing until their tokens are read."""
        for r, pre, ext in zip(*batch.prefill_part()):
            r.kv_len = pre + ext
            self.kv.insert_progress(r)
            r.is_chunked = r.kv_len < r.seq_len
            self.queues.commit_prefill(r, complete=not r.is_chunked)

    def process(self, batch: ScheduleBatch, out: StepOutput) -> None:
        """Commit a step: tokens appended in rounds, stops checked (one batched detokenization a round),
        then, in batch order, finished requests released, jumps queued. A later batch may have moved a
        prefill's requests on since it was committed, so their kv lengths are not touched here."""
        verify, extend = batch.mode.is_verify(), batch.mode.is_extend()
        reqs = batch.reqs
        # Decode rows (a mixed step's first ones) each wrote one token's KV at its slot (a verify row's
        # KV is kept after its tokens: `Speculation.commit_kv`).
        num_decode = batch.num_decode if extend else (0 if verify else len(reqs))
        decode_slots = batch.slots[:num_decode].tolist() if num_decode else []
        staged: list[tuple[Req, int]] = []  # (request, what to do after the stop checks), batch order
        to_check: list[Req] = []
        committed = [0] * len(reqs) if verify else None  # a verify row's tokens kept
        more: list[int] = []  # verify rows with tokens after their first
        n_tokens = 0
        now = None
        for i, (r, tok, lps) in enumerate(zip(reqs, out.next_token_ids, out.output_logprobs)):
            if r.finished_reason is not None and r.req_pool_idx is None:
                continue  # released already (overlap: the extra step of a finished request)
            if i < num_decode:
                if r.inflight_slot == decode_slots[i]:
                    r.inflight_slot = None  # this step's slot is committed here (kv_len += 1)
                r.kv_len += 1
            elif not verify:
                for pos, lp, in_tok, top in out.input_logprobs[i]:
                    r.input_token_logprobs.append((lp, in_tok))
                    r.input_top_logprobs.append(top)
                    r.input_logprob_next = pos + 1
            if r.finished_reason is not None:  # aborted mid-step
                staged.append((r, _ABORTED))
                continue
            if tok is None:  # a chunk mid-way (`commit_prefill` made it the chunked request) or prefill-only
                if batch.prefix_lens[i] + batch.extend_lens[i] == r.seq_len:
                    if lps is not None:  # prefill-only, top logprobs asked: the next token's distribution
                        r.output_top_logprobs.append(lps[1])
                    staged.append((r, _NO_TOKEN))
                continue
            if r.first_token_time is None:
                r.first_token_time = now = now or time.monotonic()
            if committed is not None:  # round 0 of a verify row: its first token
                v = out.verified[i]
                tok, lps = v.tokens[0], v.logprobs[0] if v.logprobs is not None else None
                committed[i] = 1
                if len(v.tokens) > 1:
                    more.append(i)
            r.output_ids.append(tok)
            n_tokens += 1
            if lps is not None:
                lp, top = lps
                r.output_token_logprobs.append((lp, tok))
                r.output_top_logprobs.append(top)
            if r.grammar is None:
                to_check.append(r)
                if extend or verify:
                    staged.append((r, _TOKEN))
                continue
            # A token the grammar rejects gets an abort reason from accept(); it keeps it.
            if self.grammars.accept(r, tok):
                to_check.append(r)
            staged.append((r, _TOKEN))
        self.outputs.check_finish_many(to_check, self.context_len)
        if committed is not None:
            n_tokens += self._later_rounds(reqs, out, more, committed)
            self.spec.commit_kv(batch, out, committed)
        self.stats["generation_tokens"] += n_tokens
        if not (extend or verify):  # plain decode requests were not staged: only those that finished need work
            staged = _merge_finished(reqs, staged, to_check)
        self._settle(staged)

    def _later_rounds(self, reqs: list[Req], out: StepOutput, rows: list[int], committed: list[int]) -> int:
        """Rounds 1, 2, .. of a VERIFY step's rows `rows` (those with more than one token): each row still
        going appends its next token, then the stop checks run for the round. A token after the first was
        chosen at a draft's node under the grammar's plain mask: the grammar says first whether plain
        decoding would write it there (`keeps_verified`: the budget closer's decision); where not, the
        request keeps what it has and its next step decodes from there. Returns the tokens appended."""
        appended = 0
        j = 1
        while rows:
            rows = [i for i in rows if reqs[i].finished_reason is None and j < len(out.verified[i].tokens)]
            to_check = []
            going = []
            for i in rows:
                r, v = reqs[i], out.verified[i]
                tok = v.tokens[j]
                if r.grammar is not None and not r.grammar.keeps_verified(tok):
                    continue
                going.append(i)
                r.output_ids.append(tok)
                committed[i] += 1
                appended += 1
                if v.logprobs is not None:
                    lp, top = v.logprobs[j]
                    r.output_token_logprobs.append((lp, tok))
                    r.output_top_logprobs.append(top)
                # A token the grammar rejects gets an abort reason from accept(); it keeps it.
                if r.grammar is None or self.grammars.accept(r, tok):
                    to_check.append(r)
            self.outputs.check_finish_many(to_check, self.context_len)
            rows = going
            j += 1
        return appended

    def _settle(self, staged: list[tuple[Req, int]]) -> None:
        """In batch order: finished requests released, grammar-forced tails queued for a prefill."""
        changed = False
        jumped = []
        for r, what in staged:
            if what == _ABORTED:
                self.finisher.end(r, counted=True)
                changed = True
            elif what == _NO_TOKEN:
                if r.prefill_only:
                    self.finisher.end(r, FinishReason("length", length=0), counted=True)
                    changed = True
            elif r.finished_reason is not None:
                self.finisher.end(r, counted=True)
                changed = True
            elif r.grammar is not None and self._forced_stop(r):
                self.finisher.end(r, counted=True)
                changed = True
            elif (
                r.grammar is not None
                and not self.spec.replaces_jump_forward(r)
                and self.grammars.jump_forward(r) is not None
            ):
                # The grammar forced text: its tokens were appended; prefill them next step instead of
                # decoding them one by one (unless they used up max_new_tokens).
                if r.remaining_new_tokens() == 0:
                    self.finisher.end(r, FinishReason("length", length=len(r.output_ids)), counted=True)
                else:
                    jumped.append(r)
                changed = True
        if jumped:
            self.queues.to_jump_tails(jumped)
        if changed:
            self.queues.drop_from_running()

    def _forced_stop(self, r: Req) -> bool:
        """Where the grammar allows only the stop token `r` ends on, append it now, as the step that would
        sample it would have (stop checks included), and save that step. True: `r` finished."""
        token = self.grammars.forced_stop(r)
        if token is None:
            return False
        r.output_ids.append(token)
        self.grammars.accept(r, token)
        self.stats["generation_tokens"] += 1
        self.outputs.check_finish_many([r], self.context_len)
        return r.finished_reason is not None

    def collect_outputs(self):
        return self.outputs.collect(self.queues.holding_kv())


def _merge_finished(reqs: list[Req], staged: list[tuple[Req, int]], checked: list[Req]) -> list[tuple[Req, int]]:
    """`staged` plus the checked requests that just finished (without a grammar), in batch order (the
    order finished requests are released in, and so inserted into the prefix cache)."""
    done = {id(r) for r in checked if r.finished_reason is not None and r.grammar is None}
    if not done:
        return staged
    if not staged:
        return [(r, _TOKEN) for r in reqs if id(r) in done]
    order = {id(r): i for i, r in enumerate(reqs)}
    merged = staged + [(r, _TOKEN) for r in reqs if id(r) in done]
    merged.sort(key=lambda item: order[id(item[0])])
    return merged
