"""Calling one program from another: `s += header(doc)` runs header's body on the caller's state.

Inside a running (or traced) program, calling another `@function` does not start a separate run: it
returns an `SglSubprogramCall`, and appending that to a state (`s += ...`, `forks += ...`, also inside
`"text" + call` or a role) runs the callee's body right there, on the caller's thread, against the
caller's state. The callee's text joins the caller's text (so it shares the caller's prefix cache),
its variables become the caller's variables, and an exception in it is the caller's exception.

Used any other way (`sub = other(x); sub["answer"]`), the call is a separate run, started the first
time something reads it; that is what calling a program did before, and what it does outside one.
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager
from typing import Any, Iterator, Optional

from .ir import SglExpr, SglExprList, flatten

# The state whose body is running on this thread (set by run.py while it calls the body, and by the
# tracer). NOTE: a ContextVar, not a global: each program body runs on its own thread (run_batch's
# pool, a stream's thread), and each sees only its own program.
_running_state: contextvars.ContextVar[Optional[Any]] = contextvars.ContextVar(
    "plait_running_program_state", default=None
)


@contextmanager
def running_body(state: Any) -> Iterator[None]:
    """Mark `state` as the program whose body runs inside this block."""
    token = _running_state.set(state)
    try:
        yield
    finally:
        _running_state.reset(token)


def inside_a_program() -> bool:
    return _running_state.get() is not None


_STATE_API = frozenset(
    {
        "text",
        "messages",
        "error",
        "get_var",
        "set_var",
        "get_meta_info",
        "parsed",
        "sync",
        "graph",
        "ret_value",
        "stream_executor",
    }
)


class SglSubprogramCall(SglExpr):
    """`other(x)` written inside a program: the callee and its (already checked) arguments."""

    def __init__(self, program: Any, kwargs: dict, args: tuple = ()):
        super().__init__()
        self.program = program
        self.kwargs = kwargs  # the callee's parameters by name, bind() arguments included
        self.args = args  # only where the callee takes *args: every positional value, in order
        self._separate_run: Optional[Any] = None

    def __repr__(self) -> str:
        return f"Call({self.program.__name__}, {sorted(self.kwargs)})"

    def inline_into(self, state: Any) -> None:
        """Run the callee's body against `state` (its submissions go to state's stream)."""
        self.program.func(state, *self.args, **self.kwargs)

    # ---- used as a value instead: a separate run, as calling a program outside one does ----
    def _state(self) -> Any:
        if self._separate_run is None:
            self._separate_run = self.program.run(*self.args, **self.kwargs)
        return self._separate_run

    def __getattr__(self, name: str) -> Any:
        # NOTE: only ProgramState's reading API starts the separate run; any other probe
        # (hasattr(x, "endpoint"), copy, pickle) must not launch a program as a side effect.
        if name not in _STATE_API:
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        return getattr(self._state(), name)

    def __getitem__(self, name: str) -> Any:
        return self._state()[name]

    def __contains__(self, name: str) -> bool:
        return name in self._state()


def contains_call(expr: SglExpr) -> bool:
    return any(isinstance(node, SglSubprogramCall) for node in flatten(expr))


def append_with_calls(state: Any, expr: SglExpr) -> None:
    """Append `expr` to `state`, running each subprogram call in it in place, in order."""
    pending: list[SglExpr] = []
    for node in flatten(expr):
        if not isinstance(node, SglSubprogramCall):
            pending.append(node)
            continue
        if pending:
            state.stream_executor.submit(SglExprList(pending))
            pending = []
        node.inline_into(state)
    if pending:
        state.stream_executor.submit(SglExprList(pending))
