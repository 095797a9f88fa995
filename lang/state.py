"""ProgramState (`s` inside a program) and ProgramStateGroup (what `s.fork(n)` returns)."""

from __future__ import annotations

import asyncio
import json
from contextlib import contextmanager
from typing import Any, Iterator, Optional

from .interpreter import StreamExecutor
from .ir import (
    SglConcateAndAppend,
    SglExpr,
    SglExprList,
    SglRoleBegin,
    SglRoleEnd,
    SglVarScopeBegin,
    SglVarScopeEnd,
    as_expr,
)
from .subprogram import append_with_calls, contains_call, inside_a_program


class ProgramState:
    """The state of one running program: its text, chat messages and variables."""

    def __init__(self, stream_executor: StreamExecutor):
        self.stream_executor = stream_executor
        self.ret_value: Any = None

    # ---- building the program ----
    def __iadd__(self, other: Any) -> "ProgramState":
        if other is None:
            raise ValueError("tried to append None to the program state")
        if isinstance(other, SglExpr) and contains_call(other):
            append_with_calls(self, other)  # `s += other_program(x)`: its body runs on this state
        else:
            self.stream_executor.submit(other)
        return self

    def _role_common(self, role: str, expr: Any = None):
        if expr is not None:
            role_expr = SglExprList([SglRoleBegin(role), as_expr(expr), SglRoleEnd(role)])
            self.stream_executor.submit(role_expr)
            return role_expr

        @contextmanager
        def role_scope() -> Iterator[None]:
            self.stream_executor.submit(SglRoleBegin(role))
            yield
            self.stream_executor.submit(SglRoleEnd(role))

        return role_scope()

    def system(self, expr: Any = None):
        """`s.system("...")` appends a system turn; `with s.system():` wraps what the block appends."""
        return self._role_common("system", expr)

    def user(self, expr: Any = None):
        return self._role_common("user", expr)

    def assistant(self, expr: Any = None):
        return self._role_common("assistant", expr)

    @contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        """Everything the block appends becomes variable `name` as well."""
        self.stream_executor.submit(SglVarScopeBegin(name))
        yield
        self.stream_executor.submit(SglVarScopeEnd(name))

    def fork(self, size: int = 1, position_ids_offset: Any = None) -> "ProgramStateGroup":
        """`size` copies of this state that continue concurrently; the shared text is prefilled once."""
        parent = self.stream_executor
        executors, prefix_pin = parent.fork(size)
        return ProgramStateGroup([ProgramState(e) for e in executors], self, prefix_pin)

    @contextmanager
    def copy(self, position_ids_offset: Any = None) -> Iterator["ProgramState"]:
        group = self.fork(1)
        try:
            yield group[0]
        finally:
            group.join()

    # ---- reading results ----
    def text(self) -> str:
        return self.stream_executor.text()

    def messages(self) -> list[dict]:
        """The chat turns so far, in OpenAI's format: [{"role": ..., "content": ...}]."""
        return self.stream_executor.messages()

    def sync(self) -> None:
        self.stream_executor.sync()

    def error(self) -> Optional[BaseException]:
        """The exception that stopped the program (its __traceback__ intact), or None."""
        return self.stream_executor.error()

    def _await_submission(self, name: str) -> None:
        # NOTE: a streamed run's body keeps running after run() returns; a reader outside it waits for
        # the body to get to `name` (or end) instead of hearing that no such variable exists.
        exe = self.stream_executor
        if getattr(exe, "stream", False) and name not in exe.vars.events and not inside_a_program():
            exe.body_done.wait()

    def get_var(self, name: str) -> Any:
        self._await_submission(name)
        return self.stream_executor.get_var(name)

    def set_var(self, name: str, value: Any) -> None:
        self.stream_executor.set_var(name, value)

    def get_meta_info(self, name: str) -> Any:
        self._await_submission(name)
        return self.stream_executor.get_meta_info(name)

    def parsed(self, name: str) -> Any:
        """The JSON output of gen(name, json_schema=...) parsed: an instance of the Pydantic model when
        the schema was given as a model class, else the decoded JSON value."""
        value = self.get_var(name)
        return _parse_json(name, value, self.stream_executor.vars.output_models.get(name), self.get_meta_info(name))

    def graph(self):
        """The request graph of this run so far (plait.graph.RequestGraph): the text sent, each
        gen/select with the runtime's cached-token counts and timings, forks and joins. Waits for
        the work submitted so far; draw it with plait.graph_render (`save(graph, "run.html")`)."""
        self.stream_executor.sync()
        return self.stream_executor.recorder.build()

    def __getitem__(self, name: str) -> Any:
        return self.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.set_var(name, value)

    def __contains__(self, name: str) -> bool:
        # NOTE: run() returns while the program's gens still run; `"answer" in state` must see what
        # they will produce, as `state["answer"]` does, not what happens to be done yet.
        self._await_submission(name)
        self.stream_executor.sync()
        return name in self.stream_executor.vars.values

    def __repr__(self) -> str:
        # SGLang's exact form: programs slice the text out of str(state) (its cot_decoding example).
        return f"ProgramState({self.text()})"

    # ---- streaming (run(stream=True)) ----
    def text_iter(self, var_name: Optional[str] = None) -> Iterator[str]:
        """Yield text as it is produced: the whole program's text, or one variable's. If the program
        fails before the text (or the variable) is complete, the iterator raises once it has yielded
        what was produced."""
        exe = self.stream_executor
        if not exe.stream:
            yield self.text() if var_name is None else self.get_var(var_name)
            return
        for piece, _ in _stream_pieces(exe, var_name):
            yield piece

    async def text_async_iter(self, var_name: Optional[str] = None, return_meta_data: bool = False):
        """Async version of text_iter; with return_meta_data, yields (piece, meta_info)."""
        exe = self.stream_executor
        loop = asyncio.get_running_loop()
        if not exe.stream:
            if var_name is None:
                value = await loop.run_in_executor(None, self.text)
            else:
                value = await loop.run_in_executor(None, self.get_var, var_name)
            yield (value, exe.vars.meta_info.get(var_name)) if return_meta_data else value
            return
        # The waits block, so they run on the default executor while the event loop stays free.
        gen = _stream_pieces(exe, var_name)
        sentinel = object()
        while True:
            item = await loop.run_in_executor(None, next, gen, sentinel)
            if item is sentinel:
                return
            piece, meta = item
            yield (piece, meta) if return_meta_data else piece

    def __del__(self) -> None:
        try:
            self.stream_executor.end(wait_for_pins=False)
        except Exception:
            pass


def _parse_json(name: str, value: Any, model: Any, meta: Any) -> Any:
    """One JSON output parsed (by `model`, a Pydantic class, when there is one); a list of them (gen(n > 1),
    or the branches a fork's join gathered) parsed item by item."""
    if isinstance(value, list):
        metas = meta if isinstance(meta, list) else [meta] * len(value)
        return [_parse_json(name, item, model, item_meta) for item, item_meta in zip(value, metas)]
    try:
        return model.model_validate_json(value) if model is not None else json.loads(value)
    except ValueError as e:  # JSONDecodeError and pydantic's ValidationError
        reason = meta.get("finish_reason") if isinstance(meta, dict) else None
        if isinstance(reason, dict) and reason.get("type") == "length":
            raise ValueError(
                f"variable {name!r} is not complete JSON: its gen() stopped at max_tokens "
                f"({reason.get('length')} tokens) before the JSON was done; raise max_tokens. "
                f"Text: {value!r}"
            ) from e
        raise


def _stream_pieces(exe: StreamExecutor, var_name: Optional[str]) -> Iterator[tuple[str, Any]]:
    """Yield (new text, meta_info) pieces until the program (or the variable) is complete; then raise
    if the program failed before that, or finished without ever producing the variable."""
    prev = 0
    if var_name is None:
        event = exe.stream_text_event
        while True:
            event.wait()
            event.clear()
            out = exe.text_[prev:]
            prev += len(out)
            if out:
                yield out, None
            if exe.is_finished:
                _raise_if_cut_short(exe, None)
                return
    # The variable's events exist once its gen() has been submitted; until then poll for them.
    variables = exe.vars
    while var_name not in variables.stream_events:
        if exe.is_finished:
            _raise_if_cut_short(exe, None)  # the program failed before it got to the variable
            if var_name in variables.values:
                # Not a gen/select of this state (a fork's join gathered it, or the body set it): there
                # were no pieces to stream, only the value.
                value = variables.values[var_name]
                if not isinstance(value, str):
                    raise TypeError(
                        f"variable {var_name!r} is a {type(value).__name__} (what a fork's join "
                        f"gathers from its branches), not streamed text: read state[{var_name!r}]"
                    )
                yield value, variables.meta_info.get(var_name)
                return
            raise KeyError(
                f"the program finished without producing variable {var_name!r}; it produced "
                f"{sorted(map(str, variables.values))}"
            )
        exe.stream_text_event.wait(0.05)
    event = variables.stream_events[var_name]
    while True:
        event.wait()
        event.clear()
        value = variables.values.get(var_name, "")
        out = value[prev:] if isinstance(value, str) else ""
        prev += len(out)
        if out:
            yield out, variables.meta_info.get(var_name)
        if variables.events[var_name].is_set():
            _raise_if_cut_short(exe, var_name)
            return


def _raise_if_cut_short(exe: StreamExecutor, var_name: Optional[str]) -> None:
    """A stream that ended because the program failed ends in that failure (a streamed program's body
    runs on its own thread, so nothing else would show the error to the reader)."""
    error = exe.error_
    if error is None:
        return
    if var_name is not None and var_name not in exe.vars.unfinished and var_name in exe.vars.values:
        return  # the variable was complete before the failure
    what = "the program" if var_name is None else f"variable {var_name!r}"
    raise RuntimeError(
        f"streaming stopped: {what} failed before it was complete: {type(error).__name__}: {error}"
    ) from error


class ProgramStateGroup:
    """The branches of a fork. `forks += expr` appends to every branch (a callable gets the index,
    a list gives one item per branch); `join()` waits for them and gathers their new variables."""

    def __init__(self, states: list[ProgramState], src_state: Optional[ProgramState] = None, pin: Any = None):
        self.states = states
        self.src_state = src_state
        self._pin = pin
        self._joined = False

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __setitem__(self, i: int, value: ProgramState) -> None:
        # `forks[i] += ...` assigns the (same) state back after __iadd__.
        if value is not self.states[i]:
            raise TypeError("cannot replace a forked state; append to it with forks[i] += ...")

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __iadd__(self, other: Any) -> "ProgramStateGroup":
        if isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(f"got {len(other)} items for {len(self.states)} forked states")
            for state, item in zip(self.states, other):
                state += item
        elif callable(other) and not isinstance(other, SglExpr):
            for i, state in enumerate(self.states):
                state += other(i)
        elif isinstance(other, (SglExpr, str)):
            for state in self.states:
                state += other
        else:
            raise TypeError(f"cannot append a {type(other).__name__} to forked states")
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for every branch. 'gather_variable': each variable a branch wrote becomes a list (one
        item per branch that wrote it) on the parent, replacing what the parent had under that name
        (a fork in a loop gathers each round's values). 'concate_and_append': the branches' new text is
        appended to the parent's text, in branch order."""
        if mode not in ("gather_variable", "concate_and_append"):
            raise ValueError(f"join mode must be 'gather_variable' or 'concate_and_append', got {mode!r}")
        if self.src_state is None:
            raise ValueError("this group has no parent state to join into")
        try:
            if mode == "gather_variable":
                self._gather_variables()
                self.src_state.stream_executor.record_join(self.states, mode)
            else:
                self.src_state += SglConcateAndAppend(self.states)
                self.src_state.stream_executor.sync()
        finally:
            self._release()

    def _gather_variables(self) -> None:
        # NOTE: SGLang gathers only the names the parent did not have before the fork, so the second
        # round of a fork in a loop silently kept the first round's values; here a branch's own
        # writes are what is gathered.
        parent = self.src_state.stream_executor
        parent.sync()
        branches = []
        for state in self.states:
            child = state.stream_executor
            child.sync()
            if child.error_ is not None:
                raise RuntimeError("a forked branch failed") from child.error_
            branches.append(child.vars)
        parent.vars.gather(branches)

    def _release(self) -> None:
        if self._joined:
            return
        self._joined = True
        for state in self.states:
            state.stream_executor.end()
        if self._pin is not None:  # the shared prefix the branches no longer need
            self.src_state.stream_executor.pins.unpin(self._pin)
            self._pin = None
