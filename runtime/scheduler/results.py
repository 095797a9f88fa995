"""Committing a step's results: tokens appended, stop checks (one batched detokenization per step),
prefix-cache inserts, finished requests released, grammar-forced tails queued.

A prefill batch is committed in two parts: what it changes without its sampled tokens (each request's
KV length, its computed prefix in the cache, CHUNKED or RUNNING) when it is launched (`commit_prefill`:
a batch launched ahead is committed before the next admission, which then matches these tokens instead
of computing them again), and its tokens when they are read back (`process`).

A VERIFY step (speculative decoding) gives a request several tokens: they are committed one at a time,
each through the stop checks as a decode step's token would be (one batched detokenization per
round), so stop strings, EOS and max_new_tokens cut exactly where they would without speculation; the
speculation part then keeps the KV of what was committed and frees the rest.
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
        """Commit a step: tokens appended, stops checked (one batched detokenization for the whole step),
        then, in batch order, finished requests released, jumps queued. A later batch may have moved a
        prefill's requests on since it was committed, so their kv lengths are not touched here."""
        if batch.mode.is_verify():
            return self._process_verify(batch, out)
        extend = batch.mode.is_extend()
        reqs = batch.reqs
        # Decode rows (a mixed step's first ones) each wrote one token's KV at its slot.
        num_decode = batch.num_decode if extend else len(reqs)
        decode_slots = batch.out_cache_loc[:num_decode].tolist() if num_decode else []
        staged: list[tuple[Req, int]] = []  # (request, what to do after the stop checks), batch order
        to_check: list[Req] = []
        n_tokens = 0
        now = None
        for i, (r, tok, lps) in enumerate(zip(reqs, out.next_token_ids, out.output_logprobs)):
            if r.finished_reason is not None and r.req_pool_idx is None:
                continue  # released already (overlap: the extra step of a finished request)
            if i < num_decode:
                if r.inflight_slot == decode_slots[i]:
                    r.inflight_slot = None  # this step's slot is committed here (kv_len += 1)
                r.kv_len += 1
            else:
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
            r.output_ids.append(tok)
            n_tokens += 1
            if lps is not None:
                lp, top = lps
                r.output_token_logprobs.append((lp, tok))
                r.output_top_logprobs.append(top)
            if r.grammar is None:
                to_check.append(r)
                if extend:
                    staged.append((r, _TOKEN))
                continue
            # A token the grammar rejects gets an abort reason from accept(); it keeps it.
            if self.grammars.accept(r, tok):
                to_check.append(r)
            staged.append((r, _TOKEN))
        self.stats["generation_tokens"] += n_tokens
        self.outputs.check_finish_many(to_check, self.context_len)
        if not extend:  # plain decode requests were not staged: only those that finished need work
            staged = _merge_finished(reqs, staged, to_check)
        self._settle(staged)

    def _process_verify(self, batch: ScheduleBatch, out: StepOutput) -> None:
        """Commit each request's accepted tokens in rounds (round j: every request still going appends its
        j-th token, then the stop checks run for all of them at once). A token after the first was chosen
        at a draft's node under the grammar's plain mask: the grammar says first whether plain decoding
        would write it there (`keeps_verified`: the budget closer's decision); where not, the request
        keeps what it has and its next step decodes from there."""
        reqs = batch.reqs
        tokens = [v.tokens for v in out.verified]
        committed = [0] * len(reqs)
        aborted = [r.finished_reason is not None for r in reqs]  # aborted mid-step
        active = [i for i, a in enumerate(aborted) if not a]
        cut: set[int] = set()
        j = 0
        while active:
            to_check = []
            for i in active:
                r, tok = reqs[i], tokens[i][j]
                if j and r.grammar is not None and not r.grammar.keeps_verified(tok):
                    cut.add(i)
                    continue
                r.output_ids.append(tok)
                committed[i] += 1
                lps = out.verified[i].logprobs
                if lps is not None:
                    r.output_token_logprobs.append((lps[j][0], tok))
                    r.output_top_logprobs.append(lps[j][1])
                # A token the grammar rejects gets an abort reason from accept(); it keeps it.
                if r.grammar is None or self.grammars.accept(r, tok):
                    to_check.append(r)
            self.outputs.check_finish_many(to_check, self.context_len)
            j += 1
            active = [i for i in active if reqs[i].finished_reason is None and j < len(tokens[i]) and i not in cut]
        self.stats["generation_tokens"] += sum(committed)
        self.spec.commit_kv(batch, out, committed)
        self._settle([(r, _ABORTED if a else _TOKEN) for r, a in zip(reqs, aborted)])

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
