"""ProgramVariables: the variables of one program state, and what their readers wait on.

A state's variables are the values its gens, selects and var scopes produced, what the program set, and
what a fork's join gathered, each with its meta_info. A program reads a variable while the expression that
produces it may still be running, so every name gets an event when that expression is submitted (`expect`),
set once its value is final; on a streamed run each name also gets a stream event, set at every new piece.
A failure wakes every reader at once (`wake_all`), remembering which names it cut short.
"""

from __future__ import annotations

import threading
from typing import Any, Iterable, Optional

from .ir import SglExpr, SglGen, SglSelect, SglVarScopeBegin, flatten
from .reasoning import ReasoningMarkers, reasoning_var_name, split_reasoning


class ProgramVariables:
    def __init__(self, stream: bool = False) -> None:
        self.values: dict[str, Any] = {}
        # The names this state itself wrote (not inherited from the state it was forked from), in order:
        # what a join gathers, even when the parent already has a variable of that name.
        self.own: dict[str, None] = {}
        self.meta_info: dict[str, Any] = {}
        self.output_models: dict[str, Any] = {}  # name -> Pydantic class (gen(json_schema=Model))
        self.events: dict[str, threading.Event] = {}  # name -> set when its value is final
        self.stream_events: Optional[dict[str, threading.Event]] = {} if stream else None  # a new piece
        self.unfinished: set[str] = set()  # the names a failure cut short

    def fork(self, stream: bool = False) -> "ProgramVariables":
        """A branch's variables: this state's values, meta_info and models, none of them its own yet."""
        branch = ProgramVariables(stream)
        branch.values = dict(self.values)
        branch.meta_info = dict(self.meta_info)
        branch.output_models = dict(self.output_models)
        return branch

    # ---- readers ----
    def wait(self, name: str, timeout: Optional[float] = None) -> bool:
        """Wait until `name` is final, when an expression submitted will produce it; False on a timeout."""
        event = self.events.get(name)
        return event is None or event.wait(timeout)

    def value(self, name: str, error: Optional[BaseException]) -> Any:
        """`name`'s value; else the program's `error` (the reason it was not produced), or a KeyError."""
        if name in self.values:
            return self.values[name]
        if error is not None:
            raise RuntimeError(
                f"variable {name!r} was not produced because the program failed: {type(error).__name__}: {error}"
            ) from error
        raise KeyError(f"the program has no variable {name!r}; known: {sorted(map(str, self.values))}")

    # ---- writers ----
    def expect(self, expr: SglExpr) -> list[threading.Event]:
        """The events of every name `expr` will produce (its gens, selects and var scopes), new."""
        created = []
        for node in flatten(expr):
            if isinstance(node, (SglGen, SglSelect, SglVarScopeBegin)) and node.name is not None:
                names = [node.name]
                if isinstance(node, SglGen) and node.reasoning is not None:
                    names.append(reasoning_var_name(node.name))
                for name in names:
                    event = self.events[name] = threading.Event()
                    created.append(event)
                    if self.stream_events is not None:
                        event = self.stream_events[name] = threading.Event()
                        created.append(event)
        return created

    def set(self, name: str, value: Any) -> None:
        """What the program itself sets (`s[name] = value`)."""
        self.values[name] = value
        self.own[name] = None

    def set_result(
        self, name: Optional[str], value: Any, meta: Any, reasoning: Optional[ReasoningMarkers] = None
    ) -> None:
        """A gen's, select's or var scope's final value: its readers wake. With `reasoning` (a gen wrapped in
        separate_reasoning) the value is the answer and `<name>_reasoning_content` the thinking (a list of
        each for n > 1)."""
        if name is None:
            return
        if reasoning is not None:
            splits = [split_reasoning(v, reasoning) for v in (value if isinstance(value, list) else [value])]
            thinking, answers = [t for t, _ in splits], [a for _, a in splits]
            if not isinstance(value, list):
                thinking, answers = thinking[0], answers[0]
            self.set_result(reasoning_var_name(name), thinking, None)
            value = answers
        self.values[name] = value
        self.own[name] = None
        self.meta_info[name] = meta
        self.events[name].set()
        if self.stream_events is not None:
            self.stream_events[name].set()

    def start_stream(self, name: str) -> None:
        """A streamed gen's value starts empty and grows by `add_piece`; `set_result` ends it."""
        self.set(name, "")
        self.stream_events[name].set()  # type: ignore[index]

    def add_piece(self, name: str, piece: str, meta: Any) -> None:
        self.values[name] += piece
        self.meta_info[name] = meta
        self.stream_events[name].set()  # type: ignore[index]

    def mark_unfinished(self) -> None:
        """A failure: the names still waiting for their value are cut short (their streams end in the error)."""
        self.unfinished = {name for name, event in self.events.items() if not event.is_set()}

    def wake_all(self) -> None:
        for event in list(self.events.values()):
            event.set()
        for event in list((self.stream_events or {}).values()):
            event.set()

    def gather(self, branches: Iterable["ProgramVariables"]) -> None:
        """A join: each variable a branch wrote becomes a list here (one item per branch that wrote it),
        replacing what this state had under that name, and this state's own in turn (a fork of a fork)."""
        values: dict[str, list] = {}
        metas: dict[str, list] = {}
        for branch in branches:
            for name in branch.own:
                values.setdefault(name, []).append(branch.values[name])
                metas.setdefault(name, []).append(branch.meta_info.get(name))
                if name in branch.output_models:  # parsed(name) here parses every branch's
                    self.output_models[name] = branch.output_models[name]
        for name, gathered in values.items():
            self.values[name] = gathered
            self.meta_info[name] = metas[name]
            self.own[name] = None
