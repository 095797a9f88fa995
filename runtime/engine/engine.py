"""Engine: the in-process API over the tokenizer manager and the scheduler process.

    with Engine() as eng:                      # the embedded default model
        eng.generate("Hello", {"max_new_tokens": 8, "temperature": 0})

Every public method is safe to call from any thread and any asyncio loop: work is handed to the
tokenizer manager's own loop (a background thread) and the results are bridged back.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import tempfile
import time
import weakref
from typing import Any, AsyncIterator, Iterator, Optional, Union

from ..executor.model_files import load_tokenizer
from ..io_struct import (
    CheckIntegrityReq,
    FlushCacheReq,
    GetStatsReq,
    PinPrefixReq,
    SchedulerInfo,
    TokenizedGenerateReq,
    UnpinPrefixReq,
)
from ..request_options import RequestOptions
from ..sampling_params import SamplingParams
from ..server_args import ServerArgs
from .compat import SGLangEngineExtras
from .loop import (
    EngineLoop,
    get_interruptibly,
    in_background,
    launch_scheduler,
    release_engine,
    result_interruptibly,
    stop_scheduler_process,
    wait_scheduler_ready,
)
from .request_builder import build_requests
from .server_info import internal_state
from .tokenizer_manager import OverloadedError, TokenizerManager, new_rid

logger = logging.getLogger("plait.engine")


class Engine(SGLangEngineExtras):
    def __init__(self, model_path: Optional[str] = None, **kwargs: Any):
        started = time.perf_counter()
        if "model" in kwargs and model_path is None:
            model_path = kwargs.pop("model")
        self.server_args = ServerArgs.from_kwargs(model_path=model_path, **kwargs)
        from ..models.default_model import resolve_model_path

        if model_path is None:
            self.model_path = resolve_model_path(None)
        else:
            self.model_path = self.server_args.model_path  # "~" expanded
            from ..executor.model_files import check_is_folder
            from ..models.config import BUILTIN_SHAPES

            if not (self.server_args.load_format == "dummy" and self.model_path in BUILTIN_SHAPES):
                # NOTE: here, before a scheduler process starts only to fail on it (its traceback and the
                # "did not exit; terminating it" line used to come before the error that matters).
                check_is_folder(self.model_path)
        _check_device(self.server_args.device)
        if self.server_args.world_size() > 1:  # a model that cannot split: refused before any process starts
            from ..executor.model_files import check_model_splits

            check_model_splits(self.model_path, self.server_args)
        self.server_args.model_path = self.model_path
        self._tmpdir = tempfile.mkdtemp(prefix="plait-")
        to_sched = f"ipc://{self._tmpdir}/to_scheduler"
        from_sched = f"ipc://{self._tmpdir}/from_scheduler"

        ready_addr = f"ipc://{self._tmpdir}/ready"
        launched = time.time()
        self._proc = proc = launch_scheduler(
            self.server_args, self.model_path, to_sched, from_sched, ready_addr, self._tmpdir
        )
        # NOTE: loaded while the scheduler process starts (it loads the model and its own tokenizer): one after
        # the other, the two took a third of a CPU start-up.
        tokenizer = in_background(load_tokenizer, self.server_args.tokenizer_path or self.model_path)
        reported = False
        try:
            status, payload = wait_scheduler_ready(proc, ready_addr)
            if status != "ready":
                reported = True
                raise RuntimeError(f"the scheduler failed to start: {payload}")
            self.info: SchedulerInfo = payload
            self.tokenizer = result_interruptibly(tokenizer)
            self._bg = EngineLoop("plait-tokenizer-manager")
        except BaseException:  # (Ctrl-C while loading included) no scheduler process may outlive a failed start
            # NOTE: one that reported its error exits by itself: terminating it at once only added a
            # misleading "did not exit; terminating it" warning after its traceback.
            stop_scheduler_process(proc, self._tmpdir, patience_s=5 if reported else 0)
            raise

        async def make_tm():
            # (the liveness check must not hold the Engine: a dropped engine is then collected and released)
            tm = TokenizerManager(
                self.server_args, self.tokenizer, self.info, to_sched, from_sched, lambda: proc.poll() is None
            )
            tm.start()
            return tm

        self.tokenizer_manager: TokenizerManager = self._bg.call(make_tm())
        # shutdown() runs it; so does the garbage collector for an engine dropped without one, and interpreter exit.
        self._release = weakref.finalize(self, release_engine, self._bg, self.tokenizer_manager, proc, self._tmpdir)
        self.startup_s = time.perf_counter() - started  # SGLang's internal_states[0]["startup_time"]
        # Where the start-up went: seconds from the scheduler process's launch to each of its marks.
        self.startup_phases = {name: round(mark - launched, 3) for name, mark in self.info.startup_marks.items()}
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
    async def _generate_async(self, groups, batch: bool):
        tm = self.tokenizer_manager
        submitted = []
        try:
            # n > 1: prefill the shared prompt once (a prefill-only request), then start the samples.
            for members in groups:
                if len(members) > 1 and not self.server_args.disable_radix_cache:
                    head = members[0]
                    warm = TokenizedGenerateReq(
                        rid=new_rid(),
                        input_ids=head.input_ids,
                        sampling_params=SamplingParams(max_new_tokens=0),
                        group=head.group,
                    )
                    await tm.wait(await tm.submit(warm))
            states = []
            for members in groups:
                group_states = []
                for m in members:
                    group_states.append(await tm.submit(m))
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
        sampling_params: Union[dict, list[dict], None] = None,
        input_ids: Union[list[int], list[list[int]], None] = None,
        return_logprob: Union[bool, list[bool]] = False,
        logprob_start_len: Union[int, list[int], None] = None,
        top_logprobs_num: Union[int, list[int], None] = None,
        return_text_in_logprobs: bool = False,
        stream: bool = False,
        rid=None,
        group=None,
        options: Optional[RequestOptions] = None,
    ):
        """SGLang's generate. `options` (a RequestOptions) may stand for the keyword arguments after
        input_ids, as the HTTP server passes them, built and checked once."""
        self._bg.check_open()
        groups, batch = build_requests(
            self.tokenizer_manager,
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
            ),
            options,
        )
        stream = groups[0][0].stream
        if stream:
            return self._stream_sync(groups, batch)
        return self._bg.call(self._generate_async(groups, batch))  # (Ctrl-C while waiting aborts the requests)

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
    ):
        self._bg.check_open()
        groups, batch = build_requests(
            self.tokenizer_manager,
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
            ),
            options,
        )
        stream = groups[0][0].stream
        if stream:
            req = self._single_stream_req(groups, batch)  # reject a batch here, not at the first iteration
            self._expect_stream(req.rid)
            return self._stream_async(groups, batch)
        return await self._acall(self._generate_async(groups, batch))

    # Streaming: one request (n == 1, not a batch) yields cumulative chunks.
    def _single_stream_req(self, groups, batch):
        if batch or len(groups) != 1 or len(groups[0]) != 1:
            raise ValueError("stream=True takes a single prompt with n=1")
        return groups[0][0]

    async def _stream_async(self, groups, batch) -> AsyncIterator[dict]:
        req = self._single_stream_req(groups, batch)
        caller_loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def put(msg) -> bool:
            try:
                caller_loop.call_soon_threadsafe(q.put_nowait, msg)
                return True
            except RuntimeError:  # the consumer's loop is closed (it left without closing the stream)
                return False

        fut = self._pump_stream(req, put)
        try:
            while (chunk := _unpack(await q.get())) is not _END:
                yield chunk
        finally:
            self._stop_pump(fut, req)

    def _stream_sync(self, groups, batch) -> Iterator[dict]:
        req = self._single_stream_req(groups, batch)
        self._expect_stream(req.rid)
        q: queue.Queue = queue.Queue()

        def gen():
            fut = self._pump_stream(req, lambda msg: q.put(msg) or True)
            try:
                while (chunk := _unpack(get_interruptibly(q))) is not _END:
                    yield chunk
            finally:
                self._stop_pump(fut, req)

        return gen()

    def _expect_stream(self, rid: str) -> None:
        # (queued before any abort the caller sends next: the loop runs callbacks in order)
        self._bg.call_soon(self.tokenizer_manager.expect_stream, rid)

    def _pump_stream(self, req, put):
        """Run one request on the engine's loop, handing ("chunk", c) ... ("end", None) or ("error", e)
        to `put` (safe to call from that loop's thread; False when nobody can receive any more)."""
        tm = self.tokenizer_manager

        async def pump():
            try:
                chunks = tm.stream(await tm.submit(req))
                try:
                    async for chunk in chunks:
                        if not put(("chunk", chunk)):
                            return
                    put(("end", None))
                finally:
                    await chunks.aclose()  # now, not whenever it is collected: an unfinished stream aborts its request
            except asyncio.CancelledError:  # the consumer left, or a shutdown gave up waiting for this stream
                put(("error", RuntimeError("the stream was cancelled (the engine is shutting down)")))
                raise
            except Exception as e:  # noqa: BLE001 - forwarded to the consumer
                put(("error", e))

        return self._bg.submit(pump())

    def _stop_pump(self, fut, req) -> None:
        if not fut.done():  # the consumer left early (e.g. a client disconnect): abort in the scheduler
            fut.cancel()
            self.abort(req.rid)

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
        if not self._bg.closed:
            try:
                self._bg.submit(self.tokenizer_manager.abort(rid))
            except RuntimeError:  # shut down since the check: every request has ended already
                pass

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
        import dataclasses

        info = {**dataclasses.asdict(self.server_args), **dataclasses.asdict(self.info), **self.get_stats()}
        return {**info, "internal_states": [internal_state(info, self.startup_s)]}

    # ------------------------------------------------------------------ lifecycle
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


_END = object()  # the stream is over


def _unpack(msg: tuple):
    """A pump message -> the chunk, _END, or raises the error it carries."""
    kind, item = msg
    if kind == "error":
        raise item
    return item if kind == "chunk" else _END


__all__ = ["Engine", "OverloadedError"]


def _checked_pin_id(pin_id) -> int:
    if isinstance(pin_id, dict):
        raise TypeError("unpin_prefix takes the pin's id: pass pin_prefix(...)['pin_id'], not the whole result")
    if isinstance(pin_id, bool) or not isinstance(pin_id, int):
        raise TypeError(f"pin_id must be an int (pin_prefix(...)['pin_id']), got {type(pin_id).__name__}")
    return pin_id


def _check_device(device: str) -> None:
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():  # (the scheduler failed on it with an AttributeError deep in torch)
            raise ValueError("device='cuda' but torch sees no CUDA device here; use device='auto' or 'cpu'")
