"""TokenizerManager: the asyncio side of the runtime, in the caller's process.

It tokenizes and validates requests, sends them to the scheduler process over ZMQ, and routes the
scheduler's output deltas back to whoever waits (a result future or a stream). It runs on its own
event loop in a background thread, so the Engine's sync API, an async caller and the HTTP server all
use it the same way through thread-safe bridges (see engine.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any, AsyncIterator, Callable, Optional, Sequence

import zmq
import zmq.asyncio

from ..detokenizer import TextDecoder, decode_as_stepped
from ..io_struct import (
    AbortReq,
    BatchOut,
    ControlReply,
    ControlReq,
    LoadLoraAdapterReq,
    ReqOutput,
    SchedulerInfo,
    ShutdownReq,
    TokenizedGenerateReq,
    UnloadLoraAdapterReq,
)
from ..multimodal.prompt_images import PromptImages
from ..request_options import RequestOptionError, RequestOptions, is_sample_of
from ..sampling_params import SamplingParams
from ..server_args import ServerArgs
from ..setting_values import parse_lora_paths
from .request_state import RequestState

logger = logging.getLogger("plait.tokenizer_manager")


UNSTARTED_KEPT = 4096
SHUTDOWN_SEND_S = 2.0  # how long the shutdown message may take to leave


def _keep(rids: dict[str, None], rid: str) -> None:
    rids[rid] = None
    while len(rids) > UNSTARTED_KEPT:
        rids.pop(next(iter(rids)))


class TokenizerManager:
    def __init__(
        self,
        server_args: ServerArgs,
        tokenizer,
        info: SchedulerInfo,
        send_addr: str,
        recv_addr: str,
        is_scheduler_alive: Callable[[], bool],
    ):
        self.server_args = server_args
        self.tokenizer = tokenizer
        self.info = info
        self.context = zmq.asyncio.Context()
        self.send_sock = self.context.socket(zmq.PUSH)
        self.send_sock.connect(send_addr)
        self.recv_sock = self.context.socket(zmq.PULL)
        self.recv_sock.bind(recv_addr)
        self.is_scheduler_alive = is_scheduler_alive
        self.text_decoder = TextDecoder.of(tokenizer)
        # A vision model's image facts (placeholders, preprocessing); None for a text-only model.
        self.images = PromptImages.for_model(server_args.model_path)
        self.states: dict[str, RequestState] = {}
        # The LoRA adapters loaded, name -> folder (start-up's, then load/unload calls): a request naming
        # another is refused; /v1/models lists them.
        self.lora_adapters: dict[str, str] = parse_lora_paths(server_args.lora_paths or [])
        # Streamed requests the Engine handed out but has not submitted (a stream starts when it is first
        # read), and aborts that came for them meanwhile: such a request ends at once when it comes.
        # Both keep at most UNSTARTED_KEPT rids (a stream never read stays unstarted forever).
        self.unstarted: dict[str, None] = {}
        self.early_aborts: dict[str, None] = {}
        self.control_calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self.dead_reason: Optional[str] = None
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        """Call on the manager's own loop."""
        self._tasks = [asyncio.ensure_future(self._recv_loop()), asyncio.ensure_future(self._watchdog())]

    @property
    def own_tasks(self) -> list[asyncio.Task]:
        return list(self._tasks)

    def fail_all(self, reason: str) -> None:
        """Nothing more will come from the scheduler: every request and control call in flight ends with
        EngineUnavailableError(reason), and new ones are refused with it (call on the manager's own loop)."""
        self.dead_reason = reason
        for st in list(self.states.values()):
            st.event.set()
        for fut in self.control_calls.values():
            if not fut.done():
                fut.set_exception(EngineUnavailableError(reason))

    async def close(self) -> None:
        """Stop the background tasks, tell the scheduler process to exit, close the sockets."""
        for t in self._tasks:
            t.cancel()
        try:
            # (bounded: with the scheduler gone a full send queue would block forever)
            await asyncio.wait_for(self.send_sock.send_pyobj(ShutdownReq()), SHUTDOWN_SEND_S)
        except (asyncio.TimeoutError, zmq.ZMQError):
            logger.warning("could not send the shutdown message to the scheduler; it will be terminated")
        # NOTE: linger, not 0: with 0 the shutdown message queued above can be dropped unsent, and the
        # scheduler then runs on until the engine gives up waiting and terminates it.
        self.send_sock.close(linger=int(SHUTDOWN_SEND_S * 1000))
        self.recv_sock.close(linger=0)
        self.context.term()

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass input_ids instead of a text prompt")
        return (
            self.tokenizer.encode(prompt, add_special_tokens=False)
            if _has_bos_in_template(self.tokenizer, prompt)
            else self.tokenizer.encode(prompt)
        )

    def validate(self, input_ids: list[int], sp: SamplingParams, options: RequestOptions) -> list[str]:
        """Check a request against this model (vocabulary, context, KV cache; a SamplingParams verified
        before is not verified again) -> the constraint's warnings."""
        if not input_ids:
            raise ValueError("prompt is empty")
        vocab = self.info.vocab_size
        # NOTE: C-level loops (isinstance mapped over the list, then min and max), not a generator
        # expression: a 256 x 2,050-token batch is validated in ~20 ms instead of ~30 before anything runs.
        if not all(map(int.__instancecheck__, input_ids)) or min(input_ids) < 0 or max(input_ids) >= vocab:
            raise ValueError(f"input_ids must be ints in [0, {vocab})")
        sp.verify(vocab)
        ctx = self.info.context_len
        if len(input_ids) >= ctx:
            raise ValueError(f"prompt is too long: {len(input_ids)} tokens, the context length is {ctx}")
        if sp.max_new_tokens is not None and len(input_ids) + sp.max_new_tokens > ctx:
            # As SGLang and vLLM do: a limit the context cannot hold is the caller's mistake, not a request
            # to run until the context is full (max_new_tokens=None asks for that).
            raise ValueError(
                f"the request needs up to {len(input_ids) + sp.max_new_tokens} tokens ({len(input_ids)} in "
                f"the prompt + max_new_tokens {sp.max_new_tokens}), more than the context length "
                f"{ctx}: lower max_new_tokens or shorten the prompt"
            )
        if len(input_ids) + 1 > self.info.max_total_tokens:
            raise ValueError(
                f"prompt is too long: {len(input_ids)} tokens cannot fit in the KV cache "
                f"({self.info.max_total_tokens} tokens)"
            )
        options.check_prompt(len(input_ids))
        if options.lora_path is not None and options.lora_path not in self.lora_adapters:
            loaded = ", ".join(sorted(self.lora_adapters)) or "none"
            raise RequestOptionError("lora_path", f"unknown LoRA adapter {options.lora_path!r} (loaded: {loaded})")
        key = sp.grammar_key
        if key is not None:
            from ..constrained import validate_constraint

            # Schema features the backend cannot enforce come back as warnings for the caller (with
            # strict, the first of them is a ValueError naming it).
            return list(validate_constraint(key[0], key[1], self.server_args.grammar_backend, strict=sp.strict) or [])
        return []

    async def submit(self, req: TokenizedGenerateReq, grammar_warnings: Sequence[str] = ()) -> RequestState:
        """Send a request to the scheduler; `grammar_warnings` (validate's) go into its meta_info."""
        if self.dead_reason:
            raise EngineUnavailableError(self.dead_reason)
        rid = req.rid
        if rid in self.states:
            raise ValueError(f"duplicate request id {rid!r}")
        limit = self.server_args.max_queued_requests
        if limit is not None and len(self.states) >= limit + self.info.max_running_requests:
            raise OverloadedError(f"too many requests in flight ({len(self.states)}); try again later")
        options = req.options
        state = RequestState(
            rid,
            len(req.input_ids),
            options.return_logprob,
            time.monotonic(),
            grammar_warnings=list(grammar_warnings),
            group=options.group,
        )
        self.states[rid] = state
        self.unstarted.pop(rid, None)
        if self.early_aborts.pop(rid, False) is None:
            state.finished_reason = {"type": "abort", "message": "aborted by the client before it started"}
            state.event.set()
            return state
        await self.send_sock.send_pyobj(req)
        return state

    async def wait(self, state: RequestState) -> dict[str, Any]:
        try:
            while state.finished_reason is None:
                await state.event.wait()
                state.event.clear()
                if self.dead_reason and state.finished_reason is None:
                    raise EngineUnavailableError(self.dead_reason)
            return state.result()
        finally:
            self.states.pop(state.rid, None)

    async def stream(
        self, req: TokenizedGenerateReq, grammar_warnings: Sequence[str] = ()
    ) -> AsyncIterator[dict[str, Any]]:
        """Submit `req` when first read; then its output as it comes, in delta chunks (`RequestState.delta`);
        the last one has a finish_reason. A consumer that leaves before it aborts the request."""
        state = await self.submit(req, grammar_warnings)
        finished = False
        try:
            while True:
                await state.event.wait()
                state.event.clear()
                if self.dead_reason and state.finished_reason is None:
                    raise EngineUnavailableError(self.dead_reason)
                yield state.delta()
                if state.finished_reason is not None:
                    finished = True
                    return
        finally:
            self.states.pop(state.rid, None)
            if not finished:  # the consumer went away: stop the work in the scheduler
                await self.abort(state.rid)

    def expect_stream(self, rid: str) -> None:
        """A streamed request exists but is submitted only when first read (call on the loop's thread)."""
        _keep(self.unstarted, rid)

    async def abort(self, rid: str) -> None:
        """Abort request `rid`, or every sample of an n > 1 request (samples `rid`-0, `rid`-1, ... of
        group `rid`: request_options.expand_samples). A stream not read yet ends as soon as it is."""
        if self.dead_reason:  # the scheduler holds nothing for us any more (and the sockets may be closed)
            return
        if rid in self.unstarted:
            _keep(self.early_aborts, rid)
        samples = [s.rid for s in self.states.values() if s.group == rid and is_sample_of(s.rid, rid)]
        for r in [rid, *samples]:  # (the scheduler ignores a rid it does not hold)
            await self.send_sock.send_pyobj(AbortReq(r))

    async def control(self, kind: type[ControlReq], **fields) -> Any:
        """Send a control request of type `kind` (io_struct) and wait for its reply's result."""
        if self.dead_reason:
            raise EngineUnavailableError(self.dead_reason)
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self.control_calls[call_id] = fut
        await self.send_sock.send_pyobj(kind(call_id, **fields))
        reply: ControlReply = await fut
        if reply.error:
            raise ValueError(reply.error)
        return reply.result

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict:
        """SGLang's: the PEFT folder `lora_path` loaded as adapter `lora_name` (a ValueError says why not)."""
        result = await self.control(LoadLoraAdapterReq, lora_name=lora_name, lora_path=lora_path)
        self.lora_adapters[lora_name] = lora_path
        return result

    async def unload_lora_adapter(self, lora_name: str) -> bool:
        """SGLang's: adapter `lora_name` forgotten (refused while a request still asks for it)."""
        await self.control(UnloadLoraAdapterReq, lora_name=lora_name)
        self.lora_adapters.pop(lora_name, None)
        return True

    # ------------------------------------------------------------------ background
    async def _recv_loop(self) -> None:
        while True:
            msg = await self.recv_sock.recv_pyobj()
            if isinstance(msg, BatchOut):
                self._decode_deferred_text(msg.outputs)
                for o in msg.outputs:
                    st = self.states.get(o.rid)
                    if st is not None:
                        st.apply(o)
            elif isinstance(msg, ControlReply):
                fut = self.control_calls.pop(msg.call_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)

    def _decode_deferred_text(self, outputs: list[ReqOutput]) -> None:
        """Fill in the final text of requests whose text the scheduler left to us (DeferredText).

        NOTE: decoding here, in the caller's process, takes it off the scheduler's step, where it
        cost about as much as the rest of the per-request work at large batch."""
        todo = [
            (o, st)
            for o in outputs
            if o.deferred_text is not None and o.deferred_text.num_ids and (st := self.states.get(o.rid)) is not None
        ]
        if not todo:
            return
        seqs = [(st.output_ids + o.new_ids)[: o.deferred_text.num_ids] for o, st in todo]
        try:
            texts = decode_as_stepped(self.text_decoder, seqs, [o.deferred_text.skip_special_tokens for o, _ in todo])
        except Exception:  # never let a decode error stop the routing of outputs (callers would hang)
            logger.exception("decoding the text of %d finished requests failed", len(todo))
            texts = [""] * len(todo)
        for (o, _), text in zip(todo, texts):
            o.final_text = text

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            if not self.is_scheduler_alive():
                self.fail_all("the scheduler process died; see its log above")
                return


class EngineUnavailableError(RuntimeError):
    """The scheduler is gone (it died, or the engine was shut down): nothing can be served (HTTP 503)."""


class OverloadedError(RuntimeError):
    """More requests in flight than `max_queued_requests` allows (HTTP 503)."""


def _has_bos_in_template(tokenizer, prompt: str) -> bool:
    # A prompt rendered from a chat template may already start with the BOS string; don't add another.
    bos = getattr(tokenizer, "bos_token", None)
    return bool(bos) and prompt.startswith(bos)
