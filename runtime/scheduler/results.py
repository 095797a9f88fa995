"""Committing a step's results in the scheduler: tokens appended, stop checks (one batched
detokenization per step), prefix-cache inserts, finished requests released, output messages.

A mixin of `Scheduler` (scheduler.py), separate because it is one concept: what happens after the
model ran. It uses the scheduler's queues (`running`, `jump_queue`, `chunked_req`, ...), its memory
(`cache`, `allocator`, `req_to_token`) and its `outputs` (OutputBuilder).
"""

from __future__ import annotations

import time

import torch

from ..io_struct import ReqOutput
from ..executor.model_runner import StepOutput
from ..request import FinishReason, Req
from .batch import ScheduleBatch
from .admission import token_prefix

# What `_process_result` does with a request once the step's stop checks ran.
_ABORTED, _NO_TOKEN, _TOKEN = range(3)


class StepResultsMixin:
    def _commit_prefill(self, batch: ScheduleBatch) -> None:
        """What a prefill batch changes on the host without its sampled tokens: each request's KV
        length, its computed prefix inserted into the prefix cache, a chunk mid-way made the chunked
        request, the others running. Done when the batch is launched (scheduler_pipeline.py; a batch
        launched ahead is committed before the next admission, which then matches these tokens instead
        of computing them again: the device writes their KV first), before `_process_result` reads the
        tokens, checks stops and releases."""
        for r, pre, ext in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
            r.kv_len = pre + ext
            self._insert_progress(r)
            if r.kv_len < r.seq_len:
                r.is_chunked = True
                self.chunked_req = r
            else:
                r.is_chunked = False
                self.running.append(r)  # finished or not: its first token is not read yet

    def _process_result(self, batch: ScheduleBatch, out: StepOutput) -> None:
        """Commit a step: tokens appended, stops checked (one batched detokenization for the whole
        step), then, in batch order, finished requests released, jumps queued. A prefill batch was
        committed (`_commit_prefill`) when it was launched; a later batch may have moved its requests
        on since, so their kv lengths are not touched here."""
        extend = batch.mode.is_extend()
        reqs = batch.reqs
        step_slots = batch.out_cache_loc.tolist() if not extend else [None] * len(reqs)
        staged: list[tuple[Req, int]] = []  # (request, what to do after the stop checks), batch order
        to_check: list[Req] = []
        n_tokens = 0
        now = None
        for i, (r, tok, lps, slot) in enumerate(zip(reqs, out.next_token_ids, out.output_logprobs, step_slots)):
            if r.finished_reason is not None and r.req_pool_idx is None:
                continue  # released already (overlap: the extra step of a finished request)
            if extend:
                for pos, lp, in_tok, top in out.input_logprobs[i]:
                    r.input_token_logprobs.append((lp, in_tok))
                    r.input_top_logprobs.append(top)
                    r.input_logprob_next = pos + 1
            else:
                if r.inflight_slot == slot:
                    r.inflight_slot = None  # this step's slot is committed here (kv_len += 1)
                r.kv_len += 1
            if r.finished_reason is not None:  # aborted mid-step
                staged.append((r, _ABORTED))
                continue
            if tok is None:  # a chunk mid-way (`_commit_prefill` made it the chunked request) or prefill-only
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
            if self.grammar_manager.accept(r, tok):
                to_check.append(r)
            staged.append((r, _TOKEN))
        self.stats["generation_tokens"] += n_tokens
        self.outputs.check_finish_many(to_check, self.model_runner.context_len)
        if not extend:  # plain decode requests were not staged: only those that finished need work
            staged = self._merge_finished(reqs, staged, to_check)
        changed = False
        for r, what in staged:
            if what == _ABORTED:
                self._finish_running(r)
                changed = True
            elif what == _NO_TOKEN:
                if r.prefill_only:
                    r.finished_reason = FinishReason("length", length=0)
                    self._finish_running(r)
                    changed = True
            else:
                if r.finished_reason is not None:
                    self._finish_running(r)
                    changed = True
                elif r.grammar is not None and self.grammar_manager.jump_forward(r) is not None:
                    # The grammar forced text: its tokens were appended; prefill them next step instead
                    # of decoding them one by one (unless they used up max_new_tokens).
                    if r.remaining_new_tokens() == 0:
                        r.finished_reason = FinishReason("length", length=len(r.output_ids))
                        self._finish_running(r)
                    else:
                        self.jump_queue.append(r)
                    changed = True
        if changed:
            jumped = set(map(id, self.jump_queue))
            self.running = [r for r in self.running if r.finished_reason is None and id(r) not in jumped]

    @staticmethod
    def _merge_finished(reqs: list[Req], staged: list[tuple[Req, int]],
                        checked: list[Req]) -> list[tuple[Req, int]]:
        """`staged` plus the checked requests that just finished (without a grammar), in batch order
        (the order finished requests are released in, and so inserted into the prefix cache)."""
        done = {id(r) for r in checked if r.finished_reason is not None and r.grammar is None}
        if not done:
            return staged
        if not staged:
            return [(r, _TOKEN) for r in reqs if id(r) in done]
        order = {id(r): i for i, r in enumerate(reqs)}
        merged = staged + [(r, _TOKEN) for r in reqs if id(r) in done]
        merged.sort(key=lambda item: order[id(item[0])])
        return merged

    def _insert_progress(self, r: Req) -> None:
        ids = token_prefix(r, r.kv_len)
        kv = self.req_to_token.read(r.req_pool_idx, r.kv_len)
        new_kv, node = self.cache.cache_unfinished_req(ids, kv, r.last_node)
        # NOTE: the row changes only where the tree already held a token this request computed too
        # (rare: prefills of one prefix are deduplicated), so the usual case writes nothing.
        if new_kv is not kv and not torch.equal(new_kv, kv):
            self.req_to_token.write(r.req_pool_idx, 0, new_kv)
        r.last_node = node
        # NOTE: the tree holds whole pages only (an unaligned tail stays the request's private memory),
        # and a cache without sharing holds nothing: all of it is private (the integrity check counts it).
        sa = self.server_args
        r.cache_len = 0 if sa.disable_radix_cache else r.kv_len - r.kv_len % sa.page_size

    def _release(self, r: Req) -> None:
        """Give the request's KV back: the computed part to the cache, the rest to the allocator."""
        if r.req_pool_idx is None:
            return
        # NOTE: read from the host mirror: a device read would wait for the step in flight.
        kv = self.req_to_token.read(r.req_pool_idx, r.kv_len)
        self.cache.cache_finished_req(token_prefix(r, r.kv_len), kv, r.last_node)
        self.req_to_token.free(r.req_pool_idx)
        r.req_pool_idx = None
        r.last_node = None

    def _finish_running(self, r: Req) -> None:
        if r.inflight_slot is not None:  # overlap: a step computed past the end; its slot is unused
            self.allocator.free(torch.tensor([r.inflight_slot]))
            r.inflight_slot = None
        self._release(r)
        if self.chunked_req is r:
            self.chunked_req = None
        self.outputs.emit_final(r)
        self.reqs_by_rid.pop(r.rid, None)
        self.stats["num_finished"] += 1

    def _finish_now(self, r: Req, reason: FinishReason, release: bool = False) -> None:
        r.finished_reason = reason
        if release:
            self._release(r)
        self.outputs.emit_final(r)
        self.reqs_by_rid.pop(r.rid, None)

    def collect_outputs(self) -> list[ReqOutput]:
        live = self.running + self.jump_queue
        if self.chunked_req is not None:
            live.append(self.chunked_req)
        return self.outputs.collect(live)

    def fail_all(self, message: str) -> None:
        """A step raised: abort every request with the error instead of dying (best-effort cleanup)."""
        # NOTE: every live request is in reqs_by_rid, including those of a prefill batch that raised
        # (admitted: no longer waiting, not yet running); without them their callers would wait forever.
        queued = (self.running + self.waiting + self.grammar_pending + self.jump_queue
                  + ([self.chunked_req] if self.chunked_req else []))
        reqs = list({id(r): r for r in queued + list(self.reqs_by_rid.values())}.values())
        self.running, self.waiting, self.grammar_pending, self.chunked_req = [], [], [], None
        self.jump_queue = []
        self.pending = self.pending_prefill = None
        for r in reqs:
            if r.finished_reason is None or r.finished_reason.type != "abort":
                r.finished_reason = FinishReason("abort", message=f"internal error: {message}")
            try:
                self._release(r)
            except Exception:
                pass
            self.outputs.emit_final(r)
            self.reqs_by_rid.pop(r.rid, None)
