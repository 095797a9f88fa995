"""The scheduler process: continuous batching over the paged KV pool.

Each loop: take new messages → build the next batch (a prefill batch when requests wait and fit, else a
decode batch of every running request; retract when KV runs short) → run it → process the results
(append tokens, detokenize, check stops, insert into the prefix cache: scheduler_results.py) → stream
outputs back. Which waiting requests a prefill batch admits is scheduler_prefill.py; overlap
scheduling (a step launched before the previous one is read back) is scheduler_pipeline.py.
When idle it verifies the KV slot accounting.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
import traceback
from typing import Any, Optional

import torch

from ..executor.compile_watch import CompileWatch
from ..detokenizer import TextDecoder
from ..io_struct import AbortReq, ControlReply, ControlReq, SchedulerInfo, TokenizedGenerateReq
from ..forward_batch import ForwardMode
from ..executor.loader import load_tokenizer
from ..executor.model_runner import ModelRunner
from ..kvcache.prefix_cache import NoSharingCache, PrefixCache
from ..sampling_params import SamplingParams
from ..request import FinishReason, Req
from .batch import ScheduleBatch
from .overlap import OverlapScheduleMixin
from .admission import PrefillAdmissionMixin
from .results import StepResultsMixin
from .retraction import INIT_NEW_TOKEN_RATIO, MIN_NEW_TOKEN_RATIO, NEW_TOKEN_RATIO_DECAY, KVShortageMixin
from ..server_args import ServerArgs
from .step_timer import StepTimer
from ..executor.warmup import warm_up_prefill
from .outputs import OutputBuilder

logger = logging.getLogger("plait.scheduler")



class Scheduler(PrefillAdmissionMixin, StepResultsMixin, OverlapScheduleMixin, KVShortageMixin):
    def __init__(self, server_args: ServerArgs, model_path: str):
        self.server_args = server_args
        self.tokenizer = load_tokenizer(server_args.tokenizer_path or model_path)
        self.text_decoder = TextDecoder.of(self.tokenizer)  # shared by every request's detokenizer
        self.model_runner = ModelRunner(server_args, model_path, grammar_hook=self._apply_grammar)
        mr = self.model_runner
        if mr.device == "cuda":
            warm_up_prefill(mr)
        self.allocator = mr.allocator
        self.req_to_token = mr.req_to_token_pool
        self.cache: PrefixCache = self._make_cache()
        # NOTE: the tokenizer's own EOS ends a request too (as in SGLang): a folder whose chat turns end with
        # a token that config.json and generation_config.json do not list would otherwise run to the limit.
        tokenizer_eos = getattr(self.tokenizer, "eos_token_id", None)
        self.eos_token_ids = tuple(sorted(set(mr.model_config.eos_token_ids)
                                          | ({tokenizer_eos} if isinstance(tokenizer_eos, int) else set())))
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
        self.timer = StepTimer(server_args.enable_step_timing)
        # Overlap scheduling (GPU; scheduler_pipeline.py): a decode step or a prefill step in flight,
        # launched but not yet read back (never both). PLAIT_PREFILL_PIPELINE=0 keeps prefills
        # synchronous (to measure what pipelining them gains).
        self.overlap = not server_args.disable_overlap_schedule and self.model_runner.device == "cuda"
        self.pipeline_prefills = os.environ.get("PLAIT_PREFILL_PIPELINE", "1") != "0"
        self.pending: Optional[tuple[ScheduleBatch, Any]] = None
        self.pending_prefill: Optional[tuple[ScheduleBatch, Any]] = None
        self.pins: dict[int, Any] = {}
        self.pin_expiry: dict[int, float] = {}  # pin id -> monotonic deadline (pins made with a ttl)
        self._pin_ids = itertools.count(1)
        # Last, so that start-up's own compiles (warm-up, graph capture) are not counted.
        self.compile_watch = CompileWatch()
        if mr.device == "cuda":
            self.compile_watch.start()

    def _make_cache(self) -> PrefixCache:
        if self.server_args.disable_radix_cache:
            return NoSharingCache(self.allocator, self.server_args.page_size)
        from ..kvcache.radix_cache import RadixCache

        return RadixCache(self.allocator, self.server_args.page_size)

    def info(self) -> SchedulerInfo:
        mr = self.model_runner
        return SchedulerInfo(
            max_total_tokens=mr.max_total_tokens, context_len=mr.context_len, vocab_size=mr.vocab_size,
            max_running_requests=mr.max_running_requests, device=mr.device, dtype=str(mr.dtype).replace("torch.", ""),
            attention_backend=self.server_args.resolved_attention_backend(), eos_token_ids=list(self.eos_token_ids))

    # ------------------------------------------------------------------ intake
    def handle_message(self, msg: Any) -> Optional[Any]:
        """Apply one incoming message; returns a reply to send back (control requests) or None.
        A request's `input_ids` list becomes the request's own (the caller must not change it)."""
        if isinstance(msg, TokenizedGenerateReq):
            try:
                self._add_request(msg)
            except Exception as e:  # one request the intake checks missed must not take every other one down
                logger.error("request %s refused:\n%s", msg.rid, traceback.format_exc())
                self._refuse_request(msg, f"{type(e).__name__}: {e}")
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
                  defer_text=True,  # the tokenizer manager decodes text nobody reads before the end
                  take_ids=True)  # the message is dropped after this
        if m.sampling_params.seed is not None:
            req.generator = torch.Generator(device=self.model_runner.device).manual_seed(m.sampling_params.seed)
        self.reqs_by_rid[req.rid] = req
        mr = self.model_runner
        # NOTE: max_new_tokens=None runs until the context is full: that is its budget. The admission
        # reserve and the "budget used up" check after a jump-forward read it; counted as 0 they
        # reserved nothing (retraction thrash) and ended a constrained output at its first forced tail.
        req.max_new_tokens = min(req.max_new_tokens, max(0, mr.context_len - len(req.origin_input_ids)))
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

    def _refuse_request(self, m: TokenizedGenerateReq, message: str) -> None:
        """End a request that failed while being added, before it holds anything, with an abort."""
        self.reqs_by_rid.pop(m.rid, None)
        self.waiting = [r for r in self.waiting if r.rid != m.rid]
        self.grammar_pending = [r for r in self.grammar_pending if r.rid != m.rid]
        req = Req(m.rid, list(m.input_ids), SamplingParams(max_new_tokens=0), tokenizer=self.text_decoder,
                  eos_token_ids=self.eos_token_ids, stream=m.stream, defer_text=True)
        self._finish_now(req, FinishReason("abort", message=f"the scheduler refused the request: {message}"))

    def _start_grammar(self, req: Req) -> bool:
        try:
            if self.grammar_manager is None:
                from ..constrained.integration import GrammarManager

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
            # The ttl is checked before the pin is taken: a bad one failed after it, leaving a pin whose
            # id the caller never got (held until a flush). NaN never expired.
            ttl = args.get("ttl")
            if ttl is not None and not float(ttl) > 0:
                raise ValueError(f"ttl must be > 0 seconds, got {ttl!r}")
            handle = self.cache.pin(args["token_ids"])
            pin_id = next(self._pin_ids)
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
            **self.compile_watch.stats(),
            "steps": self.timer.report(),
        }

    # ------------------------------------------------------------------ batching
    def is_idle(self) -> bool:
        return not (self.running or self.waiting or self.chunked_req or self.grammar_pending or self.pending
                    or self.pending_prefill or self.jump_queue)

    def step(self) -> Optional[ScheduleBatch]:
        """Build, run and process one batch. Returns the batch (None when nothing could run).
        With overlap scheduling a step may launch its batch and process the previous one instead
        (scheduler_pipeline.py)."""
        t0 = time.perf_counter()
        if self.pending is not None:
            return self._step_overlapped(t0)
        if self.pin_expiry:
            self._expire_pins()
        if self.grammar_pending:
            self._poll_grammars()
        self._sweep_aborted()
        batch = self._get_prefill_batch()
        if self.pending_prefill is not None:
            return self._step_after_prefill(batch, t0)
        if batch is None:
            batch = self._get_decode_batch()
        self.timer.phase("admit", time.perf_counter() - t0)
        if batch is None:
            return None
        return self._launch(batch, t0)

    def _count(self, batch: ScheduleBatch, t0: float) -> None:
        if batch.mode.is_extend():
            self.timer.count("prefill", len(batch.reqs), sum(batch.extend_lens), time.perf_counter() - t0)
        else:
            self.timer.count("decode", len(batch.reqs), len(batch.reqs), time.perf_counter() - t0)

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
            # NOTE: a half-prefilled request or a jump-forward tail holds KV too, and has generated no
            # token since (the fewest-outputs victim): it goes first. Left holding its memory, the last
            # running request was aborted for lack of memory that was not its own fault.
            if self.chunked_req is not None:
                self._retract_chunked()
            elif self.jump_queue:
                self._retract_jump_tails()
            elif len(self.running) == 1:
                victim = self.running[0]
                self.running = []
                self._finish_now(victim, FinishReason("abort", message=self._out_of_memory_message(victim)),
                                 release=True)
                return None
            else:
                self._retract_one()
            self.cache.evict(max(0, len(self.running) - self.allocator.available()))
        loc = self.allocator.alloc(len(self.running))  # written into req_to_token by the model runner
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        return ScheduleBatch(ForwardMode.DECODE, list(self.running), out_cache_loc=loc)

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
