"""StreamExecutor: runs one program's expressions, in order, on a worker thread.

The program's Python body runs in the caller's thread and only *submits* expressions
(`s += ...` returns at once); the worker executes them against the backend. Reading a variable
(`s["x"]`) blocks until the worker has produced it, so Python control flow can branch on model
output while text that does not depend on it is already being sent.

Failure model: the first exception stops execution; later expressions are skipped, every
waiting reader wakes, `error()` returns the exception (its `__traceback__` intact) and reading a
variable that was never produced raises a RuntimeError chained to it.
"""

from __future__ import annotations

import contextvars
import logging
import queue
import threading
import traceback
import uuid
from typing import Any, Iterable, Optional

from .gen_params import ResolvedGen, RunDefaults, resolve_gens
from .graph import MAIN_BRANCH
from .graph_builder import GraphBuilder, collect_requests
from .ir import (
    SglCommitLazy,
    SglConcateAndAppend,
    SglConstantText,
    SglExpr,
    SglExprList,
    SglGen,
    SglImage,
    SglRoleBegin,
    SglRoleEnd,
    SglSelect,
    SglVariable,
    SglVarScopeBegin,
    SglVarScopeEnd,
    as_expr,
    flatten,
    open_role_after,
)
from .pins import PinTicket, ProgramPins
from .variables import ProgramVariables

logger = logging.getLogger(__name__)


class StreamExecutor:
    def __init__(
        self,
        backend: Any,
        arguments: dict,
        default_sampling_para: RunDefaults,
        chat_template: Any = None,
        stream: bool = False,
        use_thread: bool = True,
    ) -> None:
        self.sid = uuid.uuid4().hex
        # Shared by a program and all its forks: requests carry it as a scheduling hint.
        self.program_id = self.sid
        self.backend = backend
        self.arguments = arguments
        self.default_sampling_para = default_sampling_para
        self.stream = stream

        self.vars = ProgramVariables(stream)
        self.is_finished = False
        self.error_: Optional[BaseException] = None

        self.text_ = ""
        self.images_: list = []  # image() / video() sources in text order (each behind an image token)
        self.messages_: list[dict] = []
        self.chat_template = chat_template or backend.get_chat_template()
        self.cur_role: Optional[str] = None
        self.cur_role_begin_pos: Optional[int] = None
        self.fork_start_text_pos: Optional[int] = None
        self._scope_starts: dict[str, int] = {}
        # The request graph of this run (shared with the forks), and the prefix pins the program holds
        # while it runs (plait.pins; None with program hints off). Forks overwrite these with the
        # parent's, as they do program_id.
        self.branch = MAIN_BRANCH
        self.is_root = True
        self.recorder = GraphBuilder("program", "run")
        self.pins = ProgramPins(backend.pin_service()) if backend.hints_enabled() else None
        self.vocab_size = backend.vocab_size()  # what each gen's sampling parameters are checked against
        # Role state as submitted (caller thread), so misuse raises where the user wrote it.
        self._submitted_role: Optional[str] = None
        self.stream_text_event = threading.Event() if stream else None

        self._lock = threading.Lock()
        self._failed = False
        self._ended = False
        self.body_done = threading.Event()  # end(): the body submits nothing more
        self.use_thread = use_thread
        if use_thread:
            self.queue: queue.Queue = queue.Queue()
            ctx = contextvars.copy_context()
            self.worker = threading.Thread(
                target=ctx.run, args=(self._worker_loop,), daemon=True, name=f"plait-program-{self.sid[:8]}"
            )
            self.worker.start()
        backend.begin_program(self)

    # ---------------- submission side (program thread) ----------------
    def submit(self, expr: Any) -> None:
        expr = as_expr(expr)
        # (ValueError here, where the program writes it: a gen's bad settings, misnested roles)
        gens = resolve_gens(expr, self.default_sampling_para, self.chat_template.stop_str, self.vocab_size)
        self._submitted_role = open_role_after(self._submitted_role, expr)
        with self._lock:
            if self._ended:
                # NOTE: its worker has exited: queued text would never run, and the next read would wait forever.
                raise RuntimeError(
                    "this program state has ended (a fork's branch after its join, or the state a "
                    "finished run returned): it takes no more text; call s.fork() again for "
                    "another round"
                )
            events = self.vars.expect(expr)
            if self._failed:
                for event in events:  # nobody will produce these: wake readers at once
                    event.set()
                return
            if self.use_thread:
                self.queue.put((expr, gens))
                return
        self._execute_guarded(expr, gens)

    def sync(self) -> None:
        if self.use_thread:
            self.queue.join()

    def get_var(self, name: str) -> Any:
        self.vars.wait(name)
        return self.vars.value(name, self.error_)

    def set_var(self, name: str, value: Any) -> None:
        self.vars.set(name, value)

    def get_meta_info(self, name: str, timeout: Optional[float] = None) -> Any:
        if not self.vars.wait(name, timeout):
            raise TimeoutError(f"timed out waiting for variable {name!r}")
        return self.vars.meta_info.get(name)

    def text(self) -> str:
        self.sync()
        return self.text_

    def messages(self) -> list[dict]:
        self.sync()
        return self.messages_

    def error(self) -> Optional[BaseException]:
        self.sync()
        return self.error_

    def fork(self, size: int = 1) -> tuple[list["StreamExecutor"], Optional[PinTicket]]:
        """`size` executors that continue from this state, and the pin that keeps their shared prefix
        cached until the caller joins them (None when there is nothing to share or no pins)."""
        size = int(size)
        if size < 1:
            raise ValueError(f"fork size must be >= 1, got {size}")
        self.sync()
        if self.error_ is not None:
            raise RuntimeError("cannot fork: the program failed earlier") from self.error_
        prefill = None
        if size > 1 and self.text_:
            # The branches all start with this text: prefill it once, before they race to do so.
            with collect_requests(self.recorder) as prefill:
                self._execute_guarded(SglCommitLazy())
            if self.error_ is not None:
                raise RuntimeError(
                    f"cannot fork: prefilling the shared prefix failed: {type(self.error_).__name__}: {self.error_}"
                ) from self.error_
        prefix_pin = self.pins.pin(self.text_) if self.pins is not None and size > 1 else None
        _, branches = self.recorder.fork(self.branch, size, stats=prefill)
        children = [
            StreamExecutor(self.backend, self.arguments, self.default_sampling_para, self.chat_template, self.stream)
            for _ in range(size)
        ]
        for child, branch in zip(children, branches):
            child.program_id = self.program_id
            child.recorder = self.recorder
            child.branch = branch
            child.is_root = False
            child.pins = self.pins
            child.vars = self.vars.fork(self.stream)
            child.text_, child.images_ = self.text_, list(self.images_)
            child.messages_ = list(self.messages_)
            child.cur_role = self.cur_role
            child.cur_role_begin_pos = self.cur_role_begin_pos
            child._submitted_role = self._submitted_role
            child.fork_start_text_pos = len(self.text_)
        return children, prefix_pin

    def record_join(self, states: list, mode: str) -> None:
        """The branches of one of this state's forks (their states or executors) were joined."""
        try:
            self.recorder.join(self.branch, [getattr(s, "stream_executor", s).branch for s in states], mode)
        except ValueError:  # states of another program: nothing to draw, nothing wrong with the run
            logger.debug("join of states outside this program's graph")

    def end(self, wait_for_pins: bool = True) -> None:
        """No more submissions: let the worker finish what is queued, then exit."""
        with self._lock:
            if self._ended:
                return
            self._ended = True
            self.body_done.set()
            idle = not self.use_thread or self.queue.unfinished_tasks == 0
            if self.use_thread:
                self.queue.put(None)
        if not self.use_thread:
            self._finish()
        try:
            if idle:  # nothing left to run: give the program's pins back now, not when the worker wakes
                self._release_pins(wait_for_pins)
            self.backend.end_program(self)
        except Exception:  # a backend's bookkeeping must not hide the program's own result
            logger.exception("releasing the program's runtime resources failed")

    def _release_pins(self, wait: bool = True) -> None:
        if self.pins is None:
            return
        if self.is_root:  # the program is over: every pin it and its forks hold
            self.pins.release_all(wait=wait)
        else:
            self.pins.drop_state_pin(self.branch)

    def __del__(self) -> None:
        try:
            self.end(wait_for_pins=False)  # NOTE: the collector may run on any thread: never block it
        except Exception:
            pass

    # ---------------- execution side (worker thread) ----------------
    def _worker_loop(self) -> None:
        # NOTE: every queued item gets its task_done (also after a failure, when items are only
        # skipped), so sync() never waits on work that will not happen.
        while True:
            item = self.queue.get()
            try:
                if item is None:
                    self._release_pins()  # before task_done: sync() returns with the pins given back
                    break
                if self.error_ is None:
                    self._execute_guarded(*item)
                if self.stream_text_event is not None:
                    self.stream_text_event.set()
            finally:
                self.queue.task_done()
        self._finish()

    def _execute_guarded(self, expr: SglExpr, gens: Optional[dict[int, ResolvedGen]] = None) -> bool:
        try:
            self._execute(expr, gens or {})
            return True
        except Exception as e:  # the program's failure: recorded, surfaced by error() and get_var
            if not self.backend.is_shutting_down():  # (forks cut off by the engine's shutdown at exit: quiet)
                logger.warning("program %s failed:\n%s", self.sid[:8], "".join(traceback.format_exception(e)))
            self._fail(e)
            return False

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            self.vars.mark_unfinished()
            self.error_ = error
            self._failed = True
        self.vars.wake_all()

    def _finish(self) -> None:
        self.is_finished = True
        if self.stream_text_event is not None:
            self.stream_text_event.set()

    def _execute(self, other: SglExpr, gens: dict[int, ResolvedGen]) -> None:
        """Run one expression; `gens`: its gens' parameters, resolved when it was submitted."""
        if isinstance(other, SglConstantText):
            self._execute_fill(other.value)
        elif isinstance(other, SglExprList):
            for child in other.expr_list:
                self._execute(child, gens)
        elif isinstance(other, SglGen):
            self._execute_gen(other, gens[id(other)])
        elif isinstance(other, SglSelect):
            self._execute_select(other)
        elif isinstance(other, SglRoleBegin):
            self._execute_role_begin(other.role)
        elif isinstance(other, SglRoleEnd):
            self._execute_role_end(other.role)
        elif isinstance(other, SglVarScopeBegin):
            self._scope_starts[other.name] = len(self.text_)
        elif isinstance(other, SglVarScopeEnd):
            self._execute_var_scope_end(other.name)
        elif isinstance(other, SglVariable):
            self._execute_fill(
                other.source.get_var(other.name) if hasattr(other.source, "get_var") else self.get_var(other.name)
            )
        elif isinstance(other, SglCommitLazy):
            self.backend.commit_lazy_operations(self)
        elif isinstance(other, SglConcateAndAppend):
            self._execute_concatenate(other.states)
        elif isinstance(other, SglImage):  # (a video: its frames, each an image)
            self.images_ += (images := other.images())
            self._execute_fill(self.chat_template.image_token * len(images))
        else:
            raise TypeError(f"cannot execute {other!r}")

    def _execute_fill(self, value: Any) -> None:
        value = str(value)
        self.text_ += value
        self.recorder.add_text(self.branch, value)

    def _execute_gen(self, expr: SglGen, params: ResolvedGen) -> None:
        start = len(self.text_)
        with collect_requests(self.recorder) as stats:
            self._run_gen(expr, params)
        detail = {
            k: v for k, v in (("max_new_tokens", expr.overrides.sampling.get("max_new_tokens")),) if v is not None
        }
        self.recorder.add(self.branch, "gen", self.text_[start:], expr.name, detail, stats)
        self._after_request()

    def _after_request(self) -> None:
        if self.pins is not None:
            self.pins.after_request(self.branch, self.text_, self._will_extend())

    def _will_extend(self) -> bool:
        """Whether another request will follow on this state: one is queued already, or the program
        body is still running (it may be reading this result to decide what to send next)."""
        if not self.use_thread:
            return not self._ended
        with self.queue.mutex:
            pending = list(self.queue.queue)
        for item in pending:
            if item is None:
                return False
            if any(isinstance(n, (SglGen, SglSelect, SglConcateAndAppend)) for n in flatten(item[0])):
                return True
        return not self._ended

    def _run_gen(self, expr: SglGen, params: ResolvedGen) -> None:
        name = expr.name
        if name is not None and getattr(expr, "output_model", None) is not None:
            self.vars.output_models[name] = expr.output_model
        if not self.stream:
            comp, meta = self.backend.generate(self, params)
            self.text_ += comp[0] if isinstance(comp, list) else comp
            params.warn_if_cut_short(name, comp, meta)
            self.vars.set_result(name, comp, meta, expr.reasoning)
            return
        if name is not None:
            self.vars.start_stream(name)
        for piece, meta in self.backend.generate_stream(self, params):
            self.text_ += piece
            if name is not None:
                self.vars.add_piece(name, piece, meta)
            self.stream_text_event.set()
        if name is not None:
            params.warn_if_cut_short(name, self.vars.values[name], self.vars.meta_info.get(name))
            self.vars.set_result(name, self.vars.values[name], self.vars.meta_info.get(name), expr.reasoning)

    def _execute_select(self, expr: SglSelect) -> None:
        with collect_requests(self.recorder) as stats:
            decision = self.backend.select(self, expr.choices, expr.temperature, expr.choices_method)
        self.text_ += decision.decision
        self.recorder.add(self.branch, "select", decision.decision, expr.name, {"choices": list(expr.choices)}, stats)
        self.vars.set_result(expr.name, decision.decision, decision.meta_info)
        self._after_request()

    def _execute_role_begin(self, role: str) -> None:
        template = self.chat_template
        if not self.messages_ and role != "system" and template.default_system_prompt is not None:
            # What the model's own template does when a conversation has no system turn.
            self._execute_role_begin("system")
            self._execute_fill(template.default_system_prompt)
            self._execute_role_end("system")
        prefix, _ = template.get_prefix_and_suffix(role, self.messages_)
        self.cur_role = role
        self._execute_fill(prefix)
        self.cur_role_begin_pos = len(self.text_)

    def _execute_role_end(self, role: str) -> None:
        content = self.text_[self.cur_role_begin_pos :].lstrip()
        _, suffix = self.chat_template.get_prefix_and_suffix(role, self.messages_)
        self._execute_fill(suffix)
        self.messages_.append({"role": role, "content": content})
        self.cur_role = None

    def _execute_var_scope_end(self, name: str) -> None:
        start = self._scope_starts.pop(name)
        self.vars.set_result(name, self.text_[start:], None)

    def _execute_concatenate(self, states: Iterable[Any]) -> None:
        executors = [state.stream_executor for state in states]
        for exe in executors:
            exe.sync()
            self.text_ += exe.text_[exe.fork_start_text_pos :]  # drawn as the branches, joined
        self.record_join(executors, "concate_and_append")
