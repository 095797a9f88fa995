"""The scheduler: continuous batching over the paged KV pool, composed of parts that own their state.

Each loop (`step`): expire pins, poll grammar compiles, release aborted requests → plan the next step
(`StepPlanner`: a token budget, the running requests' decode tokens first — retracting others when KV runs
short: `KVShortage` — then prefill chunks admitted by `PrefillAdmission`, in one mixed forward; a decode
step alone may become a VERIFY step of draft trees: `Speculation`) → run it on the step runner it was
handed (`StepPipeline`, which may launch it ahead and process the previous one) → commit the results
(`StepResults`). Requests move between queues only through `RequestQueues`; memory only through the
`KVManager`; a request ends only through the `Finisher`."""

from __future__ import annotations

import logging
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import torch

from ..detokenizer import TextDecoder
from ..executor.compile_watch import CompileWatch
from ..io_struct import AbortReq, ControlReply, ControlReq, SchedulerInfo, TokenizedGenerateReq
from ..kvcache.hiradix_cache import HiRadixCache
from ..kvcache.host_tier import HostTier
from ..kvcache.prefix_cache import NoSharingCache, PrefixCache
from ..kvcache.radix_cache import RadixCache
from ..lora.adapter import LoraError
from ..request import FinishReason, Req
from ..request_options import RequestOptions
from ..sampling_params import SamplingParams
from ..server_args import ServerArgs
from .adapters import SchedulerAdapters
from .admission import PrefillAdmission
from .batch import ScheduleBatch
from .control import ControlHandlers
from .finish import Finisher
from .grammars import SchedulerGrammars
from .kv_events import KVEventPublisher
from .kv_manager import KVManager
from .outputs import OutputBuilder
from .overlap import StepPipeline
from .planner import StepPlanner
from .queues import ReqStatus, RequestQueues
from .results import StepResults
from .retraction import KVShortage
from .speculation import Speculation
from .step_runner import StepRunner
from .step_timer import StepTimer

logger = logging.getLogger("plait.scheduler")


def create_scheduler(server_args: ServerArgs, model_path: str, marks: Optional[dict] = None) -> "Scheduler":
    """The scheduler over its step runner for `model_path` (one device, with a drafter when speculating with
        a draft model or head; or rank 0 of a model split over tp_size x pp_size ranks, which starts the other
        ranks: runtime/distributed/), and the tokenizer. `marks`: start-up marks so far (SchedulerInfo.startup_marks),
    to which this adds when the model and the tokenizer were done."""
    from ..executor.model_files import load_tokenizer
    from ..executor.spec_runner import create_step_runner

    marks = dict(marks or {})

    # NOTE: the tokenizer loads on a thread while the model is built (each is seconds of a small model's
    # start on the CPU, much of it in native code that releases the GIL).
    def timed_tokenizer():
        tokenizer = load_tokenizer(server_args.tokenizer_path or model_path)
        marks["tokenizer"] = time.time()
        return tokenizer

    with ThreadPoolExecutor(1, thread_name_prefix="plait-tokenizer") as pool:
        tokenizer = pool.submit(timed_tokenizer)
        runner = create_step_runner(server_args, model_path, _split_target(server_args, model_path))
        marks["model"] = time.time()
        # (with enable_lora the runner is the target's, a ModelRunner or a split model's GroupRunner: settings
        # refuse the drafters that run a SpecRunner)
        model_config = runner.model_config if server_args.enable_lora else None
        scheduler = Scheduler(server_args, runner, tokenizer.result(), model_config)
    scheduler.startup_marks.update(marks)
    return scheduler


def _split_target(server_args: ServerArgs, model_path: str):
    """For a model split over tp_size x pp_size ranks: what builds rank 0's runner (starting the other
    ranks), its KV pool sized beside a drafter's; None on one device."""
    if server_args.world_size() == 1:
        return None
    from ..distributed.runner import start_group

    return lambda extra_kv_bytes_per_token: start_group(server_args, model_path, extra_kv_bytes_per_token)


class Scheduler:
    def __init__(self, server_args: ServerArgs, runner: StepRunner, tokenizer: Any, model_config: Any = None):
        """`model_config`: the model's (models/config.py), which LoRA adapters are checked against (with
        enable_lora)."""
        self.server_args = server_args
        self.runner = runner
        self.tokenizer = tokenizer
        self.text_decoder = TextDecoder.of(tokenizer)  # shared by every request's detokenizer
        # NOTE: the tokenizer's own EOS ends a request too (as in SGLang): a folder whose chat turns end with
        # a token that config.json and generation_config.json do not list would otherwise run to the limit.
        tokenizer_eos = tokenizer.eos_token_id if tokenizer is not None else None
        self.eos_token_ids = tuple(
            sorted(set(runner.info.eos_token_ids) | ({tokenizer_eos} if isinstance(tokenizer_eos, int) else set()))
        )
        self.stats = {
            "prompt_tokens": 0,
            "generation_tokens": 0,
            "cached_tokens": 0,
            "num_retractions": 0,
            "num_finished": 0,
            "integrity_errors": 0,
        }
        self.last_integrity_error: Optional[str] = None
        self.timer = StepTimer(server_args.enable_step_timing)
        # The parts, each owning its state.
        self.queues = RequestQueues()
        self.adapters = SchedulerAdapters.of(server_args, model_config, self.queues)  # None without enable_lora
        self.kv_events = KVEventPublisher.of(server_args, runner.info.device)  # None unless an endpoint is set
        self.kv = KVManager(runner.allocator, runner.req_to_token_pool, self._make_cache())
        self.outputs = OutputBuilder(tokenizer, server_args.stream_interval)
        self.finisher = Finisher(self.queues, self.kv, self.outputs, self.stats)
        self.grammars = SchedulerGrammars(tokenizer, runner.info.vocab_size, server_args, self.queues, self.finisher)
        self.shortage = KVShortage(
            self.queues, self.kv, self.finisher, self.stats, server_args.schedule_conservativeness
        )
        self.admission = PrefillAdmission(
            server_args,
            self.queues,
            self.kv,
            self.shortage,
            runner.info.max_running_requests,
            self.stats,
            self.adapters,
        )
        self.speculation = Speculation(server_args, self.kv, tokenizer, runner.info.context_len)
        self.results = StepResults(
            self.queues,
            self.kv,
            self.outputs,
            self.finisher,
            self.grammars,
            runner.info.context_len,
            self.stats,
            self.speculation,
        )
        # Overlap scheduling (a step in flight, launched but not read back) pays where the runner launches
        # asynchronously.
        self.pipeline = StepPipeline(
            runner,
            self.queues,
            self.kv,
            self.results,
            self.timer,
            overlap=not server_args.disable_overlap_schedule and runner.info.supports_overlap,
            pipeline_prefills=not server_args.disable_prefill_pipeline,
            spec=self.speculation,
            adapters=self.adapters,
        )
        self.planner = StepPlanner(
            self.queues,
            self.kv,
            self.admission,
            self.shortage,
            self.speculation,
            runner.info.context_len,
            mixing=not server_args.disable_mixed_chunk,
        )
        self.control = ControlHandlers(self.kv, self.is_idle, self.get_stats, self._full_check, self.adapters)
        # Last, so that start-up's own compiles (warm-up, graph capture) are not counted.
        self.compile_watch = CompileWatch()
        self.startup_marks: dict[str, float] = {}  # (create_scheduler's; SchedulerInfo.startup_marks)
        if runner.info.device == "cuda":
            self.compile_watch.start()

    def _make_cache(self) -> PrefixCache:
        allocator, page_size = self.runner.allocator, self.server_args.page_size
        sa, listener = self.server_args, self.kv_events.recorder if self.kv_events else None
        if sa.disable_radix_cache:
            return NoSharingCache(allocator, page_size)
        if sa.enable_hierarchical_cache:
            if self.runner.kv_pool is None:
                raise ValueError("enable_hierarchical_cache: this step runner holds no K/V to copy to the host")
            host = HostTier.sized(self.runner.kv_pool, sa.hicache_ratio, sa.hicache_size)
            hold = sa.hicache_load_policy == "hold"
            return HiRadixCache(allocator, host, page_size, sa.hicache_write_policy, listener, hold_loads=hold)
        return RadixCache(allocator, page_size, listener)

    def info(self) -> SchedulerInfo:
        r = self.runner.info
        return SchedulerInfo(
            max_total_tokens=r.max_total_tokens,
            context_len=r.context_len,
            vocab_size=r.vocab_size,
            max_running_requests=r.max_running_requests,
            device=r.device,
            dtype=str(r.dtype).replace("torch.", ""),
            attention_backend=r.attention_backend,
            eos_token_ids=list(self.eos_token_ids),
            quantization=r.quantization,
            kv_cache_dtype=r.kv_cache_dtype or str(r.dtype).replace("torch.", ""),
            cpu_features=list(r.cpu_features),
            startup_marks=dict(self.startup_marks),
        )

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
                return ControlReply(msg.call_id, result=self.control.handle(msg))
            except Exception as e:  # a bad control call must not kill the scheduler
                return ControlReply(msg.call_id, error=f"{type(e).__name__}: {e}")
        return None

    def _add_request(self, m: TokenizedGenerateReq) -> None:
        req = Req.of(m, self.text_decoder, self.eos_token_ids)
        if req.lora_path is not None:
            if self.adapters is None:
                raise LoraError("LoRA adapters are off: start the server with --enable-lora or --lora-paths")
            self.adapters.check_request(req)
        if m.sampling_params.seed is not None:
            req.set_generator(torch.Generator(device=self.runner.info.device).manual_seed(m.sampling_params.seed))
        # NOTE: max_new_tokens=None runs until the context is full: that is its budget. The admission
        # reserve and the "budget used up" check after a jump-forward read it.
        context_len = self.runner.info.context_len
        req.max_new_tokens = min(req.max_new_tokens, max(0, context_len - len(req.origin_input_ids)))
        if req.seq_len + 1 > self.kv.total:
            self.queues.register(req)
            self.finisher.end(
                req,
                FinishReason(
                    "abort",
                    message=(f"prompt of {req.seq_len} tokens cannot fit in the KV cache ({self.kv.total} tokens)"),
                ),
            )
            return
        constrained = m.sampling_params.grammar_key is not None
        if constrained:
            self.queues.register(req)
            if not self.grammars.start(req):
                return
        self.queues.add(req, grammar_pending=constrained)

    def _refuse_request(self, m: TokenizedGenerateReq, message: str) -> None:
        """End a request that failed while being added, before it holds anything, with an abort."""
        known = self.queues.get(m.rid)
        if known is not None and known.status in (ReqStatus.WAITING, ReqStatus.GRAMMAR_PENDING):
            self.queues.remove(known)
        self.queues.by_rid.pop(m.rid, None)
        req = Req(
            m.rid,
            list(m.input_ids),
            SamplingParams(max_new_tokens=0),
            RequestOptions(rid=m.rid, stream=m.options.stream),  # (only what ends it: no logprobs)
            tokenizer=self.text_decoder,
            eos_token_ids=self.eos_token_ids,
            defer_text=True,
        )
        self.finisher.end(req, FinishReason("abort", message=f"the scheduler refused the request: {message}"))

    def _abort(self, rid: str) -> None:
        req = self.queues.get(rid)
        if req is None or req.finished:
            return
        req.finished_reason = FinishReason("abort", message="aborted by the client")
        if req.status in (ReqStatus.WAITING, ReqStatus.GRAMMAR_PENDING):
            self.finisher.end(req)
        # Requests holding KV (running, chunked, jump tails, in a batch) are released at the end of the
        # current step, or at the next one's sweep.

    # ------------------------------------------------------------------ the loop
    def is_idle(self) -> bool:
        # (a held load from the host tier still landing keeps the loop polling: its lock ends when it lands)
        return self.queues.is_idle() and not self.pipeline.in_flight() and not self.kv.cache.loads_pending()

    def step(self) -> Optional[ScheduleBatch]:
        """Plan, run and process one step. Returns its batch (None when nothing could run). With overlap
        scheduling a step is launched ahead of its read-back, and the one in flight before it is processed
        meanwhile (the returned batch is the one launched, or, when nothing more runs, the one read back)."""
        t0 = time.perf_counter()
        self.kv.expire_pins()
        self.kv.cache.poll_loads()  # held loads from the host tier that have landed unlock their prefixes
        self.grammars.poll()
        self._sweep_aborted()
        prev = self.pipeline.pending
        if prev is not None and not self.planner.can_run_ahead(prev[0]):
            self.pipeline.read_back()
            prev = None
        self.pipeline.pending = None
        batch = self.planner.plan(prev[0] if prev is not None else None)
        self.timer.phase("admit", time.perf_counter() - t0)
        if batch is None:
            if prev is None:
                return None
            self.pipeline.pending = prev
            return self.pipeline.read_back()  # the last step of a pipeline: read back, nothing launched
        return self.pipeline.run(batch, t0, prev)

    def _sweep_aborted(self) -> None:
        """Release requests holding KV that were aborted since the last step (they may not be in the next
        batch)."""
        q = self.queues
        for r in [r for r in q.holding_kv() if r.finished]:
            self.finisher.end(r, counted=True)
        q.drop_from_running()

    def collect_outputs(self):
        return self.results.collect_outputs()

    def fail_all(self, message: str) -> None:
        """A step raised: abort every request with the error instead of dying (best-effort cleanup)."""
        # NOTE: every live request is in the queues or `by_rid`, including those of a prefill batch that
        # raised (admitted: no longer waiting, not yet running); without them their callers would wait forever.
        reqs = self.queues.clear()
        self.pipeline.clear()
        for r in reqs:
            if r.finished_reason is None or r.finished_reason.type != "abort":
                r.finished_reason = FinishReason("abort", message=f"internal error: {message}")
            try:
                self.kv.release(r)
            except Exception:
                pass
            self.outputs.emit_final(r)

    # ------------------------------------------------------------------ checks and stats
    def check_integrity(self, full: bool = True) -> bool:
        """Every live request in exactly one queue, and every KV slot accounted for; the error is kept in
        `last_integrity_error` (and counted) instead of raised."""
        try:
            if full:
                self.queues.check()
            self.kv.check(self.queues.holding_kv(), full=full)
            self.last_integrity_error = None
        except AssertionError as e:
            self.last_integrity_error = str(e)
            self.stats["integrity_errors"] += 1
            logger.error("integrity check failed: %s", e)
        return self.last_integrity_error is None

    def _full_check(self) -> bool:
        return self.check_integrity(full=True)

    def get_stats(self) -> dict:
        q = self.queues
        return {
            "num_running_reqs": q.num_running(),
            "num_waiting_reqs": q.num_waiting(),
            **self.kv.usage(),
            **self.runner.info.memory_bytes,
            **self.stats,
            "cache_hit_rate": self.stats["cached_tokens"] / max(1, self.stats["prompt_tokens"]),
            "last_integrity_error": self.last_integrity_error,
            **self.grammars.stats(),
            **self.speculation.stats(),
            **self.compile_watch.stats(),
            **(self.adapters.stats() if self.adapters is not None else {}),
            "steps": self.timer.report(),
        }
