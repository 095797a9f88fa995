"""Tracing: run a program's body with placeholder arguments and record its expression graph.

`prog.trace()` returns a TracerProgramState whose `nodes` are the program's expressions in order
(each node's `prev_node` links to the one before, forks branch through SglFork/SglGetForkItem);
`last_node.print_graph_dfs()` prints the graph. Python control flow that reads generated values
cannot be traced (the value is a placeholder), and an f-string over an argument raises TypeError.

`extract_prefix_by_tracing` stops at the first node that is not constant text: the text every run
starts with, which run_batch prefills once.
"""

from __future__ import annotations

import contextvars
import uuid
from typing import Any, Optional

from .backend.base import BaseBackend
from .graph_builder import graph_from_trace
from .ir import (
    SglArgument,
    SglConstantText,
    SglExpr,
    SglExprList,
    SglFork,
    SglGen,
    SglGetForkItem,
    SglJoin,
    SglRoleBegin,
    SglRoleEnd,
    SglSelect,
    SglVariable,
    SglVarScopeBegin,
    SglVarScopeEnd,
    as_expr,
)
from .state import ProgramState, ProgramStateGroup
from .variables import ProgramVariables


class StopTracing(Exception):
    """Raised to end a prefix-only trace at the first non-constant node."""


_current_scope: contextvars.ContextVar[Optional["TracingScope"]] = contextvars.ContextVar(
    "plait_tracing_scope", default=None
)


class TracingScope:
    def __init__(self, tracer_state: "TracerProgramState"):
        self.tracer_state = tracer_state
        self._token: Optional[contextvars.Token] = None

    def __enter__(self) -> "TracingScope":
        self._token = _current_scope.set(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _current_scope.reset(self._token)

    @staticmethod
    def get_current_scope() -> Optional["TracingScope"]:
        return _current_scope.get()


class TracerProgramState(ProgramState):
    def __init__(self, backend: Any, arguments: dict, only_trace_prefix: bool):
        # NOTE: the tracer is its own "executor": ProgramState's methods (roles, var_scope, +=)
        # submit to self.stream_executor, and here that records instead of running.
        self.stream_executor = self
        self.ret_value = None
        self.pid = uuid.uuid4().hex
        backend = backend if backend is not None else BaseBackend()
        self.backend = backend.endpoint if hasattr(backend, "endpoint") else backend
        self.arguments = arguments
        self.only_trace_prefix = only_trace_prefix
        self.chat_template = self.backend.get_chat_template()
        self.nodes: list[SglExpr] = []
        self.last_node: Optional[SglExpr] = None
        self.vars = ProgramVariables()  # as StreamExecutor's (placeholders for values): what join() gathers
        self.messages_: list[dict] = []
        self.cur_role: Optional[str] = None
        self.error_ = None
        self.child_states: list[TracerProgramState] = []
        self._scope_starts: dict[str, Optional[SglExpr]] = {}

    # ---- the executor duck type ----
    def submit(self, expr: Any) -> None:
        self._execute(as_expr(expr))

    def sync(self) -> None:
        pass

    def end(self) -> None:
        pass

    def get_var(self, name: str) -> Any:
        if name in self.arguments and self.arguments[name] is not None:
            return self.arguments[name]
        if name not in self.vars.values:
            raise KeyError(f"the traced program has no variable {name!r} yet")
        v = self.vars.values[name]
        return SglVariable(v.name, v.source) if isinstance(v, SglVariable) else v

    def text(self) -> str:
        """The traced text, with each generated value shown as {name}."""
        parts = []
        for node in self.flatten_nodes():
            if isinstance(node, SglConstantText):
                parts.append(node.value)
            elif isinstance(node, (SglGen, SglSelect)):
                parts.append("{" + str(node.name) + "}")
            elif isinstance(node, SglArgument):
                parts.append("{" + node.name + "}")
        return "".join(parts)

    def fork(self, size: int = 1, position_ids_offset: Any = None) -> ProgramStateGroup:
        if self.only_trace_prefix:
            raise StopTracing()
        fork_node = SglFork(size)
        self._append_node(fork_node)
        children = []
        for i in range(size):
            child = TracerProgramState(self.backend, self.arguments, self.only_trace_prefix)
            item = SglGetForkItem(i)
            item.prev_node = fork_node
            child.last_node = item
            child.vars = self.vars.fork()
            child.messages_ = list(self.messages_)
            child.cur_role = self.cur_role
            children.append(child)
        self.child_states.extend(children)
        fork_node.states = children  # the request graph walks into the branches from here
        return ProgramStateGroup(children, self)

    def record_join(self, states: list, mode: str) -> None:
        self._append_node(SglJoin([getattr(s, "stream_executor", s) for s in states], mode))

    def graph(self, name: Optional[str] = None):
        """The traced program as a request graph (plait.graph.RequestGraph): draw it with
        plait.graph_render (`save(graph, "program.html")`, `to_dot(graph)`, ...)."""
        return graph_from_trace(self, name or getattr(self, "program_name", "program"))

    def flatten_nodes(self) -> list[SglExpr]:
        return list(self.nodes)

    def __repr__(self) -> str:
        return f"TracerProgramState({len(self.nodes)} nodes)"

    def __del__(self) -> None:
        pass

    # ---- recording ----
    def _append_node(self, node: SglExpr) -> None:
        node.pid = self.pid
        node.prev_node = self.last_node
        self.nodes.append(node)
        self.last_node = node

    def _execute(self, expr: SglExpr) -> None:
        if isinstance(expr, SglExprList):
            for child in expr.expr_list:
                self._execute(child)
        elif isinstance(expr, SglConstantText):
            self._append_node(expr)
        elif isinstance(expr, SglRoleBegin):
            self._role_begin(expr.role)
        elif isinstance(expr, SglRoleEnd):
            self._role_end(expr.role)
        elif isinstance(expr, SglVarScopeBegin):
            self._scope_starts[expr.name] = self.last_node
        elif isinstance(expr, SglVarScopeEnd):
            self._scope_starts.pop(expr.name, None)
            self.vars.set(expr.name, SglVariable(expr.name, source=self.last_node))
        else:
            if self.only_trace_prefix:
                raise StopTracing()
            if isinstance(expr, (SglGen, SglSelect)):
                kind = "gen" if isinstance(expr, SglGen) else "select"
                name = expr.name if expr.name is not None else f"{kind}_{len(self.vars.values)}"
                self.vars.set(name, SglVariable(name, source=expr))
            self._append_node(expr)

    def _role_begin(self, role: str) -> None:
        if self.cur_role is not None:
            raise ValueError(f"cannot begin a {role!r} turn inside the unfinished {self.cur_role!r} turn")
        template = self.chat_template
        if not self.messages_ and role != "system" and template.default_system_prompt is not None:
            self._role_begin("system")
            self._append_node(SglConstantText(template.default_system_prompt))
            self._role_end("system")
        self.cur_role = role
        self._append_node(SglConstantText(template.get_prefix_and_suffix(role, self.messages_)[0]))

    def _role_end(self, role: str) -> None:
        self._append_node(SglConstantText(self.chat_template.get_prefix_and_suffix(role, self.messages_)[1]))
        self.messages_.append({"role": role, "content": ""})
        self.cur_role = None


def trace_program(program: Any, arguments: dict, backend: Any) -> TracerProgramState:
    arguments = dict(arguments)
    for name in program.arg_names:
        arguments.setdefault(name, SglArgument(name, None))
    arguments.update(program.bind_arguments)
    tracer = TracerProgramState(backend, arguments, only_trace_prefix=False)
    tracer.program_name = getattr(program, "__name__", "program")
    with TracingScope(tracer):
        tracer.ret_value = program.func(tracer, **arguments)
    return tracer


def extract_prefix_by_tracing(program: Any, backend: Any, arguments: Optional[dict] = None) -> str:
    """The constant text the program sends before its first request. Without `arguments`, every
    argument is a placeholder (the text *every* run starts with); with them, one run's first prompt."""
    placeholders: dict[str, Any] = {name: SglArgument(name, None) for name in program.arg_names}
    arguments = {**placeholders, **(arguments or {}), **program.bind_arguments}
    tracer = TracerProgramState(backend, arguments, only_trace_prefix=True)
    try:
        with TracingScope(tracer):
            tracer.ret_value = program.func(tracer, **arguments)
    except Exception:  # noqa: BLE001 -- any Python the placeholders break ends the prefix there
        pass
    prefix = []
    for node in tracer.flatten_nodes():
        if not isinstance(node, SglConstantText):
            break
        prefix.append(node.value)
    return "".join(prefix)
