"""Engine: the in-process API over the tokenizer manager and the scheduler process.

    with Engine() as eng:                      # the embedded default model
        eng.generate("Hello", {"max_new_tokens": 8, "temperature": 0})

Every public method is safe to call from any thread and any asyncio loop: work is handed to the
tokenizer manager's own loop (a background thread) and the results are bridged back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import weakref
from typing import Any, AsyncIterator, Iterator, Optional, Union

from ..io_struct import (
    CheckIntegrityReq,
    FlushCacheReq,
    GetStatsReq,
    PinPrefixReq,
    SchedulerInfo,
    TokenizedGenerateReq,
    UnpinPrefixReq,
)
from ..request_options import RequestOptions, new_rid
from ..sampling_params import SamplingParams
from ..server_args import ServerArgs
from .compat import SGLangEngineExtras
from .loop import EngineLoop, abort_request, release_engine, stop_scheduler_process
from .request_builder import OPTION_DEFAULTS, PREFILL_ONLY, PromptRequests, build_requests, single_stream, streamed
from .server_info import internal_state
from .startup import checked_model_path, start_scheduler
from .streams import RequestStreams, acumulative, cumulative
from .tokenizer_manager import OverloadedError, TokenizerManager

logger = logging.getLogger("plait.engine")


class Engine(SGLangEngineExtras):
    def __init__(self, model_path: Optional[str] = None, **kwargs: Any):
        started = time.perf_counter()
        if "model" in kwargs and model_path is None:
            model_path = kwargs.pop("model")
        self.server_args = ServerArgs.from_kwargs(model_path=model_path, **kwargs)
        self.model_path = self.server_args.model_path = checked_model_path(self.server_args, model_path)
        started_scheduler = start_scheduler(self.server_args, self.model_path)
        self._proc = proc = started_scheduler.proc
        self._tmpdir = started_scheduler.tmpdir
        self.info: SchedulerInfo = started_scheduler.info
        self.tokenizer = started_scheduler.tokenizer
        try:
            self._bg = EngineLoop("plait-tokenizer-manager")
        except BaseException:
            stop_scheduler_process(proc, self._tmpdir, patience_s=0)
            raise
        to_sched, from_sched = started_scheduler.to_scheduler, started_scheduler.from_scheduler

        async def make_tm():
            # (the liveness check must not hold the Engine: a dropped engine is then collected and released)
            tm = TokenizerManager(
                self.server_args, self.tokenizer, self.info, to_sched, from_sched, lambda: proc.poll() is None
            )
            tm.start()
            return tm

        self.tokenizer_manager: TokenizerManager = self._bg.call(make_tm())
        self._streams = RequestStreams(self._bg, self.tokenizer_manager)
        # shutdown() runs it; so does the garbage collector for an engine dropped without one, and interpreter exit.
        self._release = weakref.finalize(self, release_engine, self._bg, self.tokenizer_manager, proc, self._tmpdir)
        self.startup_s = time.perf_counter() - started  # SGLang's internal_states[0]["startup_time"]
        # Where the start-up went: seconds from the scheduler process's launch to each of its marks.
        self.startup_phases = {
            name: round(mark - started_scheduler.launched, 3) for name, mark in self.info.startup_marks.items()
        }
        logger.info(
            "engine ready in %.1fs: %s on %s (%s, %s attention, %d KV tokens); scheduler process, "
            "seconds from its launch: %s",
            self.startup_s,
            self.model_path,
            self.info.device,
            self.info.dtype,
            self.info.attention_backend,
            self.info.max_total_tokens,
            ", ".join(f"{name} {s:.1f}" for name, s in self.startup_phases.items()),
        )

    # ------------------------------------------------------------------ bridges
    def _call(self, coro):
        return self._bg.call(coro)

    async def _acall(self, coro):
        return await self._bg.acall(coro)

    # ------------------------------------------------------------------ properties
    @property
    def model_config(self) -> SchedulerInfo:
        return self.info

    @property
    def context_len(self) -> int:
        return self.info.context_len

    def get_tokenizer(self):
        """The tokenizer requests are encoded with (None for a model without one), as vLLM's LLM has it."""
        return self.tokenizer

    # ------------------------------------------------------------------ generate
    def _build(self, prompt, sampling_params, input_ids, option_args, options, image_data=None):
        self._bg.check_open()
        tm = self.tokenizer_manager
        return build_requests(tm, prompt, sampling_params, input_ids, option_args, options, image_data)

    async def _abuild(self, *args):  # with images in a worker thread: decoding them would hold the caller's loop
        return await asyncio.to_thread(self._build, *args) if args[-1] is not None else self._build(*args)

    async def _generate_async(self, prompts: list[PromptRequests], batch: bool):
        tm = self.tokenizer_manager
        submitted = []
        try:
            # n > 1: prefill the shared prompt once (a prefill-only request), then start the samples.
            for prompt in prompts:
                if len(prompt.samples) > 1 and not self.server_args.disable_radix_cache:
                    head = prompt.samples[0]
                    warm = TokenizedGenerateReq(
                        head.input_ids,
                        PREFILL_ONLY,
                        RequestOptions(rid=new_rid(), group=head.options.group),
                        head.images,
                    )
                    await tm.wait(await tm.submit(warm))
            states = []
            for prompt in prompts:
                group_states = []
                for m in prompt.samples:
                    group_states.append(await tm.submit(m, prompt.grammar_warnings))
                    submitted.append(group_states[-1])
                states.append(group_states)
            results = []
            for group_states in states:
                outs = [await tm.wait(s) for s in group_states]
                results.append(outs if len(outs) > 1 else outs[0])
        except BaseException:
            # NOTE: the caller gave up (cancelled, or a later submit failed): stop the requests already
            # in the scheduler and forget their states, or they would run on and leak.
            for st in submitted:
                if st.finished_reason is None:
                    await tm.abort(st.rid)
                tm.states.pop(st.rid, None)
            raise
        if batch:
            flat = []
            for r in results:
                flat.extend(r if isinstance(r, list) else [r])
            return flat
        return results[0]

    def generate(
        self,
        prompt: Union[str, list[str], None] = None,
        sampling_params: Union[dict, list[dict], SamplingParams, None] = None,
        input_ids: Union[list[int], list[list[int]], None] = None,
        return_logprob: Union[bool, list[bool]] = False,
        logprob_start_len: Union[int, list[int], None] = None,
        top_logprobs_num: Union[int, list[int], None] = None,
        return_text_in_logprobs: bool = False,
        stream: bool = False,
        rid=None,
        group=None,
        options: Optional[RequestOptions] = None,
        lora_path=None,
        image_data=None,
    ):
        """SGLang's generate. `options` (a RequestOptions) may stand for the keyword arguments after
        input_ids, as the HTTP server and the DSL pass them, built and checked once; a SamplingParams
        stands for its dict, and one verified before is not verified again. With stream=True: an
        iterator of SGLang's cumulative chunks (each holds all the output so far)."""
        prompts, batch = self._build(
            prompt,
            sampling_params,
            input_ids,
            dict(
                return_logprob=return_logprob,
                logprob_start_len=logprob_start_len,
                top_logprobs_num=top_logprobs_num,
                return_text_in_logprobs=return_text_in_logprobs,
                stream=stream,
                rid=rid,
                group=group,
                lora_path=lora_path,
            ),
            options,
            image_data,
        )
        if prompts[0].samples[0].options.stream:
            return cumulative(self._streams.sync(*single_stream(prompts, batch)))
        return self._bg.call(self._generate_async(prompts, batch))  # (Ctrl-C while waiting aborts the requests)

    async def async_generate(
        self,
        prompt=None,
        sampling_params=None,
        input_ids=None,
        return_logprob=False,
        logprob_start_len=None,
        top_logprobs_num=None,
        return_text_in_logprobs=False,
        stream: bool = False,
        rid=None,
        group=None,
        options: Optional[RequestOptions] = None,
        lora_path=None,
        image_data=None,
    ):
        """generate, awaited; with stream=True, an async iterator of SGLang's cumulative chunks."""
        prompts, batch = await self._abuild(
            prompt,
            sampling_params,
            input_ids,
            dict(
                return_logprob=return_logprob,
                logprob_start_len=logprob_start_len,
                top_logprobs_num=top_logprobs_num,
                return_text_in_logprobs=return_text_in_logprobs,
                stream=stream,
                rid=rid,
                group=group,
                lora_path=lora_path,
            ),
            options,
            image_data,
        )
        if prompts[0].samples[0].options.stream:
            req, warnings = single_stream(prompts, batch)  # (a batch is refused here, not at the first read)
            self._streams.expect(req.rid)
            return acumulative(self._streams.asynchronous(req, warnings))
        return await self._acall(self._generate_async(prompts, batch))

    def stream_deltas(
        self,
        prompt: Union[str, list[int], None] = None,
        sampling_params: Union[dict, SamplingParams, None] = None,
        input_ids: Optional[list[int]] = None,
        options: Optional[RequestOptions] = None,
        image_data=None,
    ) -> Iterator[dict]:
        """One request (n == 1) streamed as delta chunks (streams.py): the text, output ids and logprobs
        since the last chunk, the totals in meta_info. What the DSL reads; `options` need not say stream."""
        prompts, batch = self._build(prompt, sampling_params, input_ids, OPTION_DEFAULTS, streamed(options), image_data)
        return self._streams.sync(*single_stream(prompts, batch))

    async def async_stream_deltas(
        self,
        prompt: Union[str, list[int], None] = None,
        sampling_params: Union[dict, SamplingParams, None] = None,
        input_ids: Optional[list[int]] = None,
        options: Optional[RequestOptions] = None,
        image_data=None,
    ) -> AsyncIterator[dict]:
        """stream_deltas for an asyncio caller (the HTTP server): checked when awaited, streamed when read."""
        prompts, batch = await self._abuild(
            prompt, sampling_params, input_ids, OPTION_DEFAULTS, streamed(options), image_data
        )
        req, warnings = single_stream(prompts, batch)
        self._streams.expect(req.rid)
        return self._streams.asynchronous(req, warnings)

    # ------------------------------------------------------------------ prefix hints
    def _prefix_ids(self, prefix) -> list[int]:
        if isinstance(prefix, str):
            if not prefix:
                raise ValueError("prefix is empty")
            return self.tokenizer_manager.tokenize(prefix)
        if isinstance(prefix, list) and prefix and all(isinstance(t, int) for t in prefix):
            return list(prefix)
        raise ValueError("prefix must be a non-empty string or a list of token ids")

    def cache_prefix(self, prefix: Union[str, list[int]], pin: bool = False) -> dict:
        """Prefill `prefix` into the prefix cache without generating.

        Returns {"prompt_tokens", "cached_tokens" (already there before), "pin_id"}; with pin=True the
        prefix stays in the cache until `unpin_prefix(pin_id)` (a program's shared context between
        its own requests)."""
        ids = self._prefix_ids(prefix)
        out = self.generate(input_ids=ids, sampling_params={"max_new_tokens": 0})
        if out["meta_info"]["finish_reason"]["type"] == "abort":
            raise ValueError(out["meta_info"]["finish_reason"]["message"])
        pin_id = self.pin_prefix(ids)["pin_id"] if pin else None
        return {"prompt_tokens": len(ids), "cached_tokens": out["meta_info"]["cached_tokens"], "pin_id": pin_id}

    async def async_cache_prefix(self, prefix: Union[str, list[int]], pin: bool = False) -> dict:
        ids = self._prefix_ids(prefix)
        out = await self.async_generate(input_ids=ids, sampling_params={"max_new_tokens": 0})
        if out["meta_info"]["finish_reason"]["type"] == "abort":
            raise ValueError(out["meta_info"]["finish_reason"]["message"])
        pin_id = None
        if pin:
            pin_id = (await self._acall(self.tokenizer_manager.control(PinPrefixReq, token_ids=ids)))["pin_id"]
        return {"prompt_tokens": len(ids), "cached_tokens": out["meta_info"]["cached_tokens"], "pin_id": pin_id}

    def pin_prefix(self, prefix: Union[str, list[int]], ttl: Optional[float] = None) -> dict:
        """Lock the cached part of `prefix` against eviction → {"pin_id", "pinned_tokens"}.

        With `ttl` (seconds) the pin also ends by itself then: what remote clients get, so that one
        that dies without unpinning cannot hold KV memory forever."""
        if ttl is not None and not ttl > 0:
            raise ValueError(f"ttl must be > 0 seconds, got {ttl!r}")
        return self._call(self.tokenizer_manager.control(PinPrefixReq, token_ids=self._prefix_ids(prefix), ttl=ttl))

    def unpin_prefix(self, pin_id: Optional[int]) -> bool:
        """End a pin (`pin_prefix(...)["pin_id"]`). False if there is no such pin, or the engine is shut
        down: its pins went with it (a program still releasing its pins then must not fail)."""
        if pin_id is None or self._bg.closed:
            return False
        try:
            return self._call(self.tokenizer_manager.control(UnpinPrefixReq, pin_id=_checked_pin_id(pin_id)))
        except RuntimeError:
            if self._bg.closed:  # shut down during the call: the pin went with the engine
                return False
            raise

    async def async_unpin_prefix(self, pin_id: Optional[int]) -> bool:
        if pin_id is None or self._bg.closed:
            return False
        try:
            return await self._acall(self.tokenizer_manager.control(UnpinPrefixReq, pin_id=_checked_pin_id(pin_id)))
        except RuntimeError:
            if self._bg.closed:
                return False
            raise

    # ------------------------------------------------------------------ control
    def abort(self, rid: str) -> None:
        """Stop request `rid` (or every sample of an n > 1 request). Nothing to do once shut down."""
        abort_request(self._bg, self.tokenizer_manager, rid)

    def flush_cache(self) -> bool:
        return self._call(self.tokenizer_manager.control(FlushCacheReq))

    async def async_flush_cache(self) -> bool:
        return await self._acall(self.tokenizer_manager.control(FlushCacheReq))

    def get_stats(self) -> dict:
        return self._call(self.tokenizer_manager.control(GetStatsReq))

    async def async_get_stats(self) -> dict:
        return await self._acall(self.tokenizer_manager.control(GetStatsReq))

    def check_integrity(self) -> bool:
        """True when every KV slot is accounted for (free + cached + in use == total)."""
        return self._call(self.tokenizer_manager.control(CheckIntegrityReq))

    def get_server_info(self) -> dict:
        """Settings, the scheduler's facts and counters, and SGLang's `internal_states` (server_info.py)."""
        info = {**dataclasses.asdict(self.server_args), **dataclasses.asdict(self.info), **self.get_stats()}
        return {**info, "internal_states": [internal_state(info, self.startup_s)]}

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict:
        return self._call(self.tokenizer_manager.load_lora_adapter(lora_name, lora_path))

    def unload_lora_adapter(self, lora_name: str) -> bool:
        return self._call(self.tokenizer_manager.unload_lora_adapter(lora_name))

    # ------------------------------------------------------------------ lifecycle
    def run_on_loop(self, coro) -> Any:
        """Run `coro` on the engine's own event loop and wait for its result. What runs there reads its
        streams without a thread hop (`plait serve` serves HTTP there), and must never block."""
        return self._bg.call(coro)

    def shutdown(self) -> None:
        """Stop the engine: requests still in flight end with RuntimeError("the engine is shut down"), the
        scheduler process exits, and later calls raise that error. Safe to call twice, from any thread."""
        self._release()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __reduce__(self):
        # (pickling failed on a thread lock: "cannot pickle '_thread.lock' object" did not say what to do)
        raise TypeError(
            "an Engine cannot be pickled or sent to another process (its scheduler, thread and "
            "sockets belong to this one): create an Engine in each worker process, or share one "
            "through `plait serve`"
        )


__all__ = ["Engine", "OverloadedError"]


def _checked_pin_id(pin_id) -> int:
    if isinstance(pin_id, dict):
        raise TypeError("unpin_prefix takes the pin's id: pass pin_prefix(...)['pin_id'], not the whole result")
    if isinstance(pin_id, bool) or not isinstance(pin_id, int):
        raise TypeError(f"pin_id must be an int (pin_prefix(...)['pin_id']), got {type(pin_id).__name__}")
    return pin_id
