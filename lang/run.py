"""Running programs: one (`run_program`), many concurrently (`run_program_batch`), and pre-caching
the text every run of a program starts with (`cache_program`)."""

from __future__ import annotations

import os
import random
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterator, Optional, Sequence, Union

from .batch_plan import BatchPrefill, plan_batch
from .gen_params import RunDefaults
from .global_config import global_config
from .interpreter import StreamExecutor
from .state import ProgramState
from .subprogram import running_body
from .tracer import extract_prefix_by_tracing

# Below this many characters a shared prefix is not worth a separate prefill request.
MIN_PRECACHE_CHARS = 64


def resolve_backend(backend: Any) -> Any:
    if backend is None:
        raise ValueError(
            "no backend to run on: call plait.set_default_backend(plait.Runtime()) or pass backend=... to run()"
        )
    # A Runtime (colocated or launched) wraps the backend that does the work.
    return backend.endpoint if hasattr(backend, "endpoint") else backend


def run_program(
    program: Any,
    backend: Any,
    args: Sequence[Any],
    kwargs: dict,
    defaults: RunDefaults,
    stream: bool,
    sync: bool = False,
    use_thread: bool = True,
    capture_errors: bool = False,
) -> ProgramState:
    """Start the program. Without streaming, its body runs here and an exception in it propagates
    (unless capture_errors, used by run_batch, records it in the state instead)."""
    backend = resolve_backend(backend)
    if program.num_api_spec_tokens is not None:
        backend.check_api_speculation(program.num_api_spec_tokens)
    kwargs = {**kwargs, **program.bind_arguments}
    executor = StreamExecutor(backend, kwargs, defaults, stream=stream, use_thread=use_thread)
    executor.recorder.name = program.__name__
    state = ProgramState(executor)
    if stream:
        # The body must keep submitting while the caller reads the stream, so it gets a thread.
        threading.Thread(
            target=_run_body,
            args=(state, program, args, kwargs, sync, True),
            daemon=True,
            name=f"plait-{program.__name__}",
        ).start()
        return state
    _run_body(state, program, args, kwargs, sync, capture_errors)
    return state


def _run_body(
    state: ProgramState, program: Any, args: Sequence[Any], kwargs: dict, sync: bool, capture_errors: bool
) -> None:
    executor = state.stream_executor
    try:
        with running_body(state):  # other programs called in the body run on this state
            state.ret_value = program.func(state, *args, **kwargs)
    except Exception as e:
        if capture_errors and executor.error_ is None:
            # The failed state is kept for inspection (run_batch, streams): let what the body appended
            # before the exception run, so its text and variables show how far the program got.
            executor.sync()
        if executor.error_ is None:
            executor._fail(e)
        if not capture_errors:
            raise
    finally:
        executor.end()
    if sync:
        executor.sync()
    if global_config.verbosity >= 2:
        print(state.text())


def run_program_batch(
    program: Any,
    backend: Any,
    batch_arguments: list[dict],
    defaults: RunDefaults,
    num_threads: Union[str, int],
    progress_bar: bool,
    generator_style: bool = False,
):
    backend = resolve_backend(backend)
    if not batch_arguments:
        return iter(()) if generator_style else []
    if num_threads == "auto":
        num_threads = max(96, (os.cpu_count() or 1) * 16)
    if not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"num_threads must be 'auto' or a positive int, got {num_threads!r}")
    num_threads = min(num_threads, len(batch_arguments))
    prefill = None
    # NOTE: without a prefix cache in the runtime, prefilling ahead of the programs is wasted work; so it
    # is under a LoRA adapter, for now: prefixes are pinned in the base model's namespace, not the adapter's.
    on_base_model = defaults.lora_path is None and getattr(backend, "lora", None) is None
    if (
        global_config.enable_precache_with_tracing
        and len(batch_arguments) > 1
        and backend.prefix_cache_enabled()
        and on_base_model
    ):
        if backend.hints_enabled():
            # plait: every shared segment of the batch (header, groups), prefilled and pinned once.
            prefill = _batch_prefill(program, backend, batch_arguments)
        if prefill is None:
            cache_program(program, backend)  # SGLang: the constant text every run starts with
    runs = _BatchRuns(program, backend, batch_arguments, defaults, num_threads, progress_bar, prefill)
    if generator_style:
        return runs.iter_in_order()
    return list(runs.iter_in_order())


# Characters per token where a plan compares text (over HTTP): to weigh it against the KV pool.
CHARS_PER_TOKEN = 4
# batch_prefill "auto": the share of the KV pool the batch's distinct tokens must fill for the up-front prefill.
BATCH_PREFILL_POOL_SHARE = 0.5
# Programs traced first to estimate the whole batch's distinct tokens (a trace runs a program's body to its
# first gen and tokenizes its prompt: for a batch of long prompts, most of the plan's cost).
SAMPLE_PROGRAMS = 8


def _batch_prefill(program: Any, backend: Any, batch_arguments: list[dict]) -> Optional[BatchPrefill]:
    """run_batch's up-front prefill of the batch's shared segments (global_config.batch_prefill), or None."""
    setting = global_config.batch_prefill
    if setting not in ("auto", "always", "never"):
        raise ValueError(f"global_config.batch_prefill must be 'auto', 'always' or 'never', got {setting!r}")
    if setting == "never":
        return None
    room = BATCH_PREFILL_POOL_SHARE * (backend.kv_pool_tokens() or 0) if setting == "auto" else 0
    n = len(batch_arguments)
    if room and n > SAMPLE_PROGRAMS:
        # Before tracing every program: the distinct tokens of a random sample's plan, its shared part plus
        # each sampled program's own part times the programs. Where the batch has many groups the sample
        # mostly falls in different ones, shares less and overestimates (then the whole batch is traced), so
        # the estimate skips the plan where the batch fits, not where it might not.
        picks = sorted(random.Random(n).sample(range(n), SAMPLE_PROGRAMS))
        sample = plan_batch(program, backend, [batch_arguments[i] for i in picks])
        shared = sum(seg.end - seg.start for seg in sample.segments)
        estimate = shared + (sample.distinct_length() - shared) * n / SAMPLE_PROGRAMS
        if _in_tokens(sample, estimate) <= room:
            return None
    plan = plan_batch(program, backend, batch_arguments)
    if not plan.segments:
        return None
    if room and _in_tokens(plan, plan.distinct_length()) <= room:
        return None
    return BatchPrefill(plan, backend)


def _in_tokens(plan: Any, length: float) -> float:
    return length if plan.unit == "tokens" else length / CHARS_PER_TOKEN


class _BatchRuns:
    """Runs the batch on a thread pool (grouped by shared segment when there is a plan); yields the
    states in input order."""

    def __init__(
        self,
        program,
        backend,
        batch_arguments,
        defaults,
        num_threads,
        progress_bar,
        prefill: Optional[BatchPrefill] = None,
    ):
        self.program = program
        self.backend = backend
        self.batch_arguments = batch_arguments
        self.defaults = defaults
        self.num_threads = num_threads
        self.progress_bar = progress_bar
        self.prefill = prefill

    def _run_one(self, index: int) -> ProgramState:
        try:
            state = run_program(
                self.program,
                self.backend,
                (),
                self.batch_arguments[index],
                self.defaults,
                stream=False,
                sync=True,
                capture_errors=True,
            )
        finally:
            if self.prefill is not None:
                self.prefill.program_done(index)
        if self.prefill is not None:
            state.batch_plan = self.prefill.plan
            self.prefill.plan.leaf_stats[index] = state.stream_executor.recorder.build().totals()
        return state

    def iter_in_order(self) -> Iterator[ProgramState]:
        bar = _progress_bar(len(self.batch_arguments), self.program.__name__) if self.progress_bar else None
        order = self.prefill.plan.dispatch_order() if self.prefill is not None else range(len(self.batch_arguments))
        try:
            with ThreadPoolExecutor(self.num_threads, thread_name_prefix="plait-batch") as pool:
                futures: dict[int, Future] = {}
                for index in order:
                    future = pool.submit(self._run_one, index)
                    if bar is not None:
                        future.add_done_callback(lambda _: bar.update(1))
                    futures[index] = future
                for index in range(len(self.batch_arguments)):
                    yield futures[index].result()
        finally:
            if bar is not None:
                bar.close()
            if self.prefill is not None:
                self.prefill.close()


def _progress_bar(total: int, name: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=f"run_batch {name}", unit="program")


def cache_program(program: Any, backend: Any) -> Optional[str]:
    """Prefill the constant text the program starts with (found by tracing); returns it."""
    backend = resolve_backend(backend)
    prefix = extract_prefix_by_tracing(program, backend)
    if prefix and len(prefix) > MIN_PRECACHE_CHARS:
        backend.cache_prefix(prefix)
        return prefix
    return None
