"""The scheduler process: continuous batching over the paged KV pool.

Each loop: take new messages → build the next batch (a prefill batch when requests wait and fit, else a
decode batch of every running request; retract when KV runs short) → run it → process the results
(append tokens, detokenize, check stops, insert into the prefix cache: scheduler_results.py) → stream
outputs back.
When idle it verifies the KV slot accounting.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Optional

import torch

from .detokenizer import TextDecoder
from .io_struct import AbortReq, ControlReply, ControlReq, SchedulerInfo, TokenizedGenerateReq
from .forward_batch import ForwardMode
from .model_loader import load_tokenizer
from .model_runner import ModelRunner
from .prefix_cache import NoSharingCache, PrefixCache
from .schedule_batch import FinishReason, Req, ScheduleBatch
from .schedule_policy import PrefillBudget, order_waiting_queue
from .scheduler_results import StepResultsMixin
from .server_args import ServerArgs
from .output_builder import OutputBuilder

logger = logging.getLogger("plait.scheduler")

# Expected fraction of max_new_tokens a running request will still decode (admission reserve).
# Decays while nothing is retracted; jumps back up after a retraction (as SGLang does).
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001
# A waiting request that shares at least this many not-yet-cached tokens with one being prefilled
# waits one step, then hits the cache instead of computing the same prefix again.
IN_BATCH_DEDUP_MIN_TOKENS = 32


class Scheduler(StepResultsMixin):
    def __init__(self, server_args: ServerArgs, model_path: str):
        self.server_args = server_args
        self.tokenizer = load_tokenizer(server_args.tokenizer_path or model_path)
        self.text_decoder = TextDecoder.of(self.tokenizer)  # shared by every request's detokenizer
        self.model_runner = ModelRunner(server_args, model_path, grammar_hook=self._apply_grammar)
        mr = self.model_runner
        self.allocator = mr.allocator
        self.req_to_token = mr.req_to_token_pool
        self.cache: PrefixCache = self._make_cache()
        self.eos_token_ids = tuple(mr.model_config.eos_token_ids)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Optional[Req] = None
        self.grammar_pending: list[Req] = []
        self.jump_queue: list[Req] = []  # running requests whose grammar-forced tail needs a prefill
        self.grammar_manager = None
        self.reqs_by_rid: dict[str, Req] = {}
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.outputs = OutputBuilder(self.tokenizer, server_args.stream_interval)
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "cached_tokens": 0, "num_retractions": 0,
                      "num_finished": 0, "integrity_errors": 0}
        self.last_integrity_error: Optional[str] = None
        # Overlap scheduling (GPU): a decode step in flight, launched but not yet read back.
        self.overlap = not server_args.disable_overlap_schedule and self.model_runner.device == "cuda"
        self.pending: Optional[tuple[ScheduleBatch, Any]] = None
        self.pins: dict[int, Any] = {}
        self.pin_expiry: dict[int, float] = {}  # pin id -> monotonic deadline (pins made with a ttl)
        self._pin_ids = itertools.count(1)

    def _make_cache(self) -> PrefixCache:
        if self.server_args.disable_radix_cache:
            return NoSharingCache(self.allocator, self.server_args.page_size)
        from .radix_cache import RadixCache

        return RadixCache(self.allocator, self.server_args.page_size)

    def info(self) -> SchedulerInfo:
        mr = self.model_runner
        return SchedulerInfo(
            max_total_tokens=mr.max_total_tokens, context_len=mr.context_len, vocab_size=mr.vocab_size,
            max_running_requests=mr.max_running_requests, device=mr.device, dtype=str(mr.dtype).replace("torch.", ""),
            attention_backend=self.server_args.resolved_attention_backend(), eos_token_ids=list(self.eos_token_ids))

    # ------------------------------------------------------------------ intake
    def handle_message(self, msg: Any) -> Optional[Any]:
        """Apply one incoming message; returns a reply to send back (control requests) or None."""
        if isinstance(msg, TokenizedGenerateReq):
            self._add_request(msg)
        elif isinstance(msg, AbortReq):
            self._abort(msg.rid)
        elif isinstance(msg, ControlReq):
            try:
                return ControlReply(msg.call_id, result=self._control(msg.op, msg.args))
            except Exception as e:  # a bad control call must not kill the scheduler
                return ControlReply(msg.call_id, error=f"{type(e).__name__}: {e}")
        return None

    def _add_request(self, m: TokenizedGenerateReq) -> None:
        req = Req(m.rid, m.input_ids, m.sampling_params, return_logprob=m.return_logprob,
                  logprob_start_len=m.logprob_start_len, top_logprobs_num=m.top_logprobs_num,
                  return_text_in_logprobs=m.return_text_in_logprobs, stream=m.stream,
                  tokenizer=self.text_decoder, eos_token_ids=self.eos_token_ids, group=m.group,
                  defer_text=True)  # the tokenizer manager decodes text nobody reads before the end
        if m.sampling_params.seed is not None:
            req.generator = torch.Generator(device=self.model_runner.device).manual_seed(m.sampling_params.seed)
        self.reqs_by_rid[req.rid] = req
        mr = self.model_runner
        if req.seq_len + 1 > mr.max_total_tokens:
            self._finish_now(req, FinishReason("abort", message=(
                f"prompt of {req.seq_len} tokens cannot fit in the KV cache ({mr.max_total_tokens} tokens)")))
            return
        if m.sampling_params.grammar_key is not None:
            if not self._start_grammar(req):
                return
            self.grammar_pending.append(req)
            return
        self.waiting.append(req)

    def _start_grammar(self, req: Req) -> bool:
        try:
            if self.grammar_manager is None:
                from .constrained.integration import GrammarManager

                self.grammar_manager = GrammarManager(self.tokenizer, self.model_runner.vocab_size, self.server_args)
            req.grammar_future = self.grammar_manager.request(req.sampling_params)
            return True
        except Exception as e:
            self._finish_now(req, FinishReason("abort", message=f"constrained decoding unavailable: {e}"))
            return False

    def _poll_grammars(self) -> None:
        still = []
        for req in self.grammar_pending:
            if req.finished:
                continue
            fut = req.grammar_future
            if not fut.done():
                still.append(req)
                continue
            try:
                req.grammar = fut.result()
            except Exception as e:
                self._finish_now(req, FinishReason("abort", message=f"invalid grammar: {e}"))
                continue
            self.waiting.append(req)
        self.grammar_pending = still

    def _apply_grammar(self, logits: torch.Tensor, reqs: list[Req]) -> None:
        self.grammar_manager.fill_and_apply(logits, reqs)

    def _abort(self, rid: str) -> None:
        req = self.reqs_by_rid.get(rid)
        if req is None or req.finished:
            return
        req.finished_reason = FinishReason("abort", message="aborted by the client")
        if req in self.waiting:
            self.waiting.remove(req)
            self._finish_now(req, req.finished_reason, release=True)
        elif req in self.grammar_pending:
            self.grammar_pending.remove(req)
            self._finish_now(req, req.finished_reason)
        # Running or chunked requests are released at the end of the current step.

    def _control(self, op: str, args: dict) -> Any:
        if op == "flush_cache":
            if not self.is_idle():
                return False
            for handle in self.pins.values():
                self.cache.unpin(handle)
            self.pins.clear()
            self.pin_expiry.clear()
            self.cache.reset()
            return True
        if op == "get_stats":
            if self.pin_expiry:
                self._expire_pins()
            return self.get_stats()
        if op == "check_integrity":
            self._check_integrity()
            return self.last_integrity_error is None
        if op == "pin_prefix":
            if not hasattr(self.cache, "pin"):
                return {"pin_id": None, "pinned_tokens": 0}
            # NOTE: handles stay here; only an integer id crosses the process boundary. A pin with a
            # ttl expires on its own, so a client that dies without unpinning cannot hold KV forever.
            handle = self.cache.pin(args["token_ids"])
            pin_id = next(self._pin_ids)
            ttl = args.get("ttl")
            self.pins[pin_id] = handle
            if ttl is not None:
                self.pin_expiry[pin_id] = time.monotonic() + float(ttl)
            return {"pin_id": pin_id, "pinned_tokens": handle.num_tokens}
        if op == "unpin_prefix":
            return self._unpin(args["pin_id"])
        raise ValueError(f"unknown control op {op!r}")

    def _unpin(self, pin_id: int) -> bool:
        handle = self.pins.pop(pin_id, None)
        self.pin_expiry.pop(pin_id, None)
        if handle is None:
            return False
        self.cache.unpin(handle)
        return True

    def _expire_pins(self) -> None:
        now = time.monotonic()
        for pin_id in [p for p, t in self.pin_expiry.items() if t <= now]:
            logger.info("pin %d expired (its client never unpinned it)", pin_id)
            self._unpin(pin_id)

    def get_stats(self) -> dict:
        total = self.allocator.num_slots
        free = self.allocator.available()
        evictable = self.cache.evictable_size()
        return {
            "num_running_reqs": len(self.running) + len(self.jump_queue) + (1 if self.chunked_req else 0),
            "num_waiting_reqs": len(self.waiting) + len(self.grammar_pending),
            "max_total_tokens": total,
            "free_tokens": free,
            "evictable_tokens": evictable,
            "protected_tokens": self.cache.protected_size(),
            "kv_used_tokens": total - free - evictable,
            "token_usage": (total - free - evictable) / total,
            **self.stats,
            "cache_hit_rate": self.stats["cached_tokens"] / max(1, self.stats["prompt_tokens"]),
            "last_integrity_error": self.last_integrity_error,
            **(dict(self.grammar_manager.stats) if self.grammar_manager is not None else {}),
        }

    # ------------------------------------------------------------------ batching
    def is_idle(self) -> bool:
        return not (self.running or self.waiting or self.chunked_req or self.grammar_pending or self.pending
                    or self.jump_queue)

    def step(self) -> Optional[ScheduleBatch]:
        """Build, run and process one batch. Returns the batch (None when nothing could run)."""
        if self.pending is not None:
            return self._step_overlapped()
        if self.pin_expiry:
            self._expire_pins()
        if self.grammar_pending:
            self._poll_grammars()
        self._sweep_aborted()
        batch = self._get_prefill_batch()
        if batch is None:
            batch = self._get_decode_batch()
        if batch is None:
            return None
        if self.overlap and batch.mode.is_decode() and all(map(self.model_runner.can_overlap, batch.reqs)):
            self.pending = (batch, self.model_runner.launch_decode(batch))
            return batch
        out = self.model_runner.run(batch)
        self._process_result(batch, out)
        return batch

    # ------------------------------------------------------------------ overlap
    def _step_overlapped(self) -> ScheduleBatch:
        """Launch the next decode step on the device, then process the one in flight.

        While the GPU computes step i+1 (its input tokens are step i's samples, read on the device), the
        CPU reads step i's tokens, checks stops and streams outputs. A request that finishes at step i
        got one extra token computed in step i+1: it is dropped and its slot freed; step i+2 goes on
        without it.
        """
        batch, handle = self.pending
        self.pending = None
        keep = self._pipeline_rows(batch)
        if keep is not None:
            loc = self._alloc(len(keep))
            if loc is not None:
                nxt = batch.next_decode(loc, keep)
                for r, slot in zip(nxt.reqs, loc.tolist()):
                    r.inflight_slot = slot
                self.pending = (nxt, self.model_runner.launch_decode(nxt, prev=handle))
        self._process_result(batch, self.model_runner.resolve(handle))
        return batch

    def _pipeline_rows(self, batch: ScheduleBatch) -> Optional[list[int]]:
        """The rows of `batch` whose requests go on into a decode step launched now, before `batch`'s
        results are read; None when that step must wait (the requests that finished while `batch`
        was in flight are left out: they were released already)."""
        if self.grammar_pending or self.chunked_req is not None:
            return None
        # Waiting requests that could be admitted get their prefill first (one step later otherwise).
        if self.waiting and len(self.running) < self.model_runner.max_running_requests:
            return None
        # NOTE: every request of `batch` passed `can_overlap` when it was first launched, and that stays
        # true (its inputs are fixed per request, or, as min_new_tokens, only grow more permissive).
        keep = [j for j, r in enumerate(batch.reqs) if r.finished_reason is None]
        if not keep:
            return None
        # batch.seq_lens_host = each request's length now (the token then in flight is counted).
        if int(batch.seq_lens_host[keep].max()) >= self.model_runner.context_len - 1:
            return None
        return keep

    def _sweep_aborted(self) -> None:
        """Release running requests aborted since the last step (they may not be in the next batch)."""
        if any(r.finished for r in self.running):
            for r in [r for r in self.running if r.finished]:
                self._finish_running(r)
            self.running = [r for r in self.running if not r.finished]
        if self.chunked_req is not None and self.chunked_req.finished:
            self._finish_running(self.chunked_req)
        if any(r.finished for r in self.jump_queue):
            for r in [r for r in self.jump_queue if r.finished]:
                self._finish_running(r)
            self.jump_queue = [r for r in self.jump_queue if not r.finished]

    def _running_reserve(self) -> float:
        return sum(r.remaining_new_tokens() for r in self.running) * self.new_token_ratio

    def _get_prefill_batch(self) -> Optional[ScheduleBatch]:
        if not self.waiting and self.chunked_req is None and not self.jump_queue:
            return None
        sa = self.server_args
        budget = PrefillBudget(sa.max_prefill_tokens, sa.chunked_prefill_size,
                               self.allocator.available() + self.cache.evictable_size() - self._running_reserve())
        reqs, prefix_lens, extend_lens = [], [], []
        free_req_slots = self.req_to_token.available()

        continuing = self.chunked_req
        if continuing is not None:  # continue the chunked prefill first
            r = continuing
            # Bounded by the memory that really exists (free + evictable), not the reserve-adjusted budget:
            # the chunk's earlier part already holds memory, so it must be able to finish.
            room = self.allocator.available() + self.cache.evictable_size()
            ext = min(len(r.fill_ids) - r.kv_len, budget.rem_chunk_tokens, room)
            if ext <= 0:
                if self.running:
                    return None  # decode first; finishing (or retracted) requests free memory
                self._retract_chunked()
                return None
            reqs.append(r), prefix_lens.append(r.kv_len), extend_lens.append(ext)
            budget.take(ext, 0)
            self.chunked_req = None

        jumped = []
        for r in self.jump_queue:  # jump-forward tails: the requests already hold their prefix's KV
            if r.finished:
                continue
            ext = len(r.fill_ids) - r.kv_len
            if ext > min(budget.rem_chunk_tokens, budget.rem_input_tokens,
                         self.allocator.available() + self.cache.evictable_size()):
                break
            reqs.append(r), prefix_lens.append(r.kv_len), extend_lens.append(ext)
            budget.take(ext, 0)
            jumped.append(r)
        if jumped:
            ids = set(map(id, jumped))
            self.jump_queue = [r for r in self.jump_queue if id(r) not in ids]
        elif self.jump_queue and not self.running and continuing is None and not reqs:
            for r in self.jump_queue:  # nothing else can free memory: start them over
                self._release(r)
                r.reset_for_retract()
                self.waiting.insert(0, r)
            self.jump_queue = []
        self.waiting = order_waiting_queue(sa.schedule_policy, self.waiting, self.cache)
        admitted = []
        in_flight: list[list[int]] = []  # token ids being prefilled in this step
        for r in self.waiting:
            if len(self.running) + len(reqs) >= self.model_runner.max_running_requests or free_req_slots == 0:
                break
            matchable = self._matchable_ids(r)
            if in_flight and self._shares_in_flight_prefix(matchable, in_flight):
                continue  # next step its prefix is in the tree: prefill it once, not twice
            match = self.cache.match_prefix(matchable)
            pre = match.num_tokens
            ext = len(r.fill_ids) - pre
            reserve = r.remaining_new_tokens() * self.new_token_ratio
            if budget.fits_whole(ext, reserve):
                take = ext
            elif (not reqs and budget.rem_chunk_tokens > 0
                  and min(budget.rem_chunk_tokens, budget.rem_input_tokens) + reserve <= budget.rem_memory):
                take = min(budget.rem_chunk_tokens, budget.rem_input_tokens)  # first request: chunk it
            else:
                break
            if take <= 0:
                break
            evictable_before = self.cache.evictable_size()
            self._assign_slot_and_prefix(r, match)
            # Locking the matched prefix turned some evictable slots into protected ones.
            budget.rem_memory -= evictable_before - self.cache.evictable_size()
            free_req_slots -= 1
            budget.take(take, reserve)
            reqs.append(r), prefix_lens.append(pre), extend_lens.append(take)
            admitted.append(r)
            in_flight.append(r.fill_ids[:pre + take])
            if take < ext:
                break
        if admitted:
            ids = set(map(id, admitted))
            self.waiting = [r for r in self.waiting if id(r) not in ids]
        if not reqs:
            return None
        loc = self._alloc(sum(extend_lens))
        if loc is None:  # the budget overestimated what eviction can free: undo, fall back to decode
            for r in admitted:
                self._release(r)
                r.reset_for_retract()
            self.waiting = admitted + self.waiting
            self.jump_queue = jumped + self.jump_queue
            self.chunked_req = continuing
            if continuing is not None and not self.running:
                self._retract_chunked()
            return None
        for r, pre, ext in zip(reqs, prefix_lens, extend_lens):
            r.prefix_len_this_step, r.extend_len_this_step = pre, ext
        # NOTE: the model runner writes `loc` into req_to_token on the device (one indexed write).
        return ScheduleBatch(ForwardMode.EXTEND, reqs, prefix_lens, extend_lens, loc)

    def _shares_in_flight_prefix(self, ids: list[int], in_flight: list[list[int]]) -> bool:
        """Does `ids` share a long uncached prefix with a request already in this prefill batch?"""
        if self.server_args.disable_radix_cache:
            return False
        need = self._peek(ids) + IN_BATCH_DEDUP_MIN_TOKENS  # shared tokens that would make it wait
        if len(ids) < need:
            return False
        # NOTE: the window just past the cached part rejects most pairs in O(32): comparing whole
        # prefixes cost O(cached) per pair, and a few-shot batch has ~10^4 pairs sharing 2,000 tokens.
        window = ids[need - IN_BATCH_DEDUP_MIN_TOKENS:need]
        return any(other[need - IN_BATCH_DEDUP_MIN_TOKENS:need] == window and other[:need] == ids[:need]
                   for other in in_flight)

    def _peek(self, ids: list[int]) -> int:
        peek = getattr(self.cache, "peek_prefix_len", None)
        return peek(ids) if peek is not None else self.cache.match_prefix(ids).num_tokens

    def _matchable_ids(self, r: Req) -> list[int]:
        # Leave at least one token to compute (its logits give the next token), and recompute the
        # prompt positions whose logprobs were asked for.
        limit = len(r.fill_ids) - 1
        if r.needs_input_logprobs():
            limit = min(limit, max(r.input_logprob_next - 1, 0))
        return r.fill_ids[:limit]

    def _assign_slot_and_prefix(self, r: Req, match) -> None:
        r.req_pool_idx = self.req_to_token.alloc()
        if match.num_tokens:
            self.req_to_token.write(r.req_pool_idx, 0, match.kv_indices)
        self.cache.inc_lock(match.node)
        r.last_node = match.node
        r.kv_len = r.cache_len = match.num_tokens
        if r.num_retractions == 0:
            r.cached_tokens = match.num_tokens
            self.stats["cached_tokens"] += match.num_tokens
            self.stats["prompt_tokens"] += len(r.origin_input_ids)

    def _alloc(self, n: int) -> Optional[torch.Tensor]:
        loc = self.allocator.alloc(n)
        if loc is None:
            self.cache.evict(n - self.allocator.available())
            loc = self.allocator.alloc(n)
        return loc

    def _get_decode_batch(self) -> Optional[ScheduleBatch]:
        if not self.running:
            return None
        need = len(self.running)
        if self.allocator.available() < need:
            self.cache.evict(need - self.allocator.available())
        while self.allocator.available() < len(self.running):
            if len(self.running) == 1:
                victim = self.running[0]
                self.running = []
                self._finish_now(victim, FinishReason("abort", message="out of KV memory"), release=True)
                return None
            self._retract_one()
            self.cache.evict(max(0, len(self.running) - self.allocator.available()))
        loc = self.allocator.alloc(len(self.running))  # written into req_to_token by the model runner
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        return ScheduleBatch(ForwardMode.DECODE, list(self.running), out_cache_loc=loc)

    def _retract_chunked(self) -> None:
        """A half-prefilled request that cannot get memory with nothing else running: start it over."""
        r = self.chunked_req
        self.chunked_req = None
        self._release(r)
        r.reset_for_retract()
        self.waiting.insert(0, r)
        self.stats["num_retractions"] += 1
        logger.info("retracted chunked request %s for lack of KV memory", r.rid)

    def _retract_one(self) -> None:
        # The request with the fewest generated tokens loses the least work (ties: the longest prompt
        # frees the most memory).
        victim = min(self.running, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
        self.running.remove(victim)
        self._release(victim)
        victim.reset_for_retract()
        self.waiting.insert(0, victim)
        self.stats["num_retractions"] += 1
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        logger.info("retracted %s (%d output tokens) for lack of KV memory", victim.rid, len(victim.output_ids))

    def _check_integrity(self, full: bool = True) -> None:
        private = 0
        for r in self.running + self.jump_queue + ([self.chunked_req] if self.chunked_req else []):
            private += r.kv_len - r.cache_len + (r.inflight_slot is not None)
        try:
            self.cache.check_integrity(num_private=private, full=full)
            self.last_integrity_error = None
        except AssertionError as e:
            self.last_integrity_error = str(e)
            self.stats["integrity_errors"] += 1
            logger.error("KV integrity check failed: %s", e)
