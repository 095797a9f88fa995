"""The program's intermediate representation: the expressions a program appends to its state.

`s += "Q: " + gen("a")` builds an `SglExprList([SglConstantText("Q: "), SglGen("a")])`; the
interpreter executes it, the tracer records it. Class names follow SGLang's `sglang.lang.ir` so
programs that import them keep working.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterable, List, Optional

# dtype= regexes (SGLang's values: programs compare against them).
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""

_node_ids = itertools.count()


class SglExpr:
    """Base of every node. `a + b` (or `"text" + b`) concatenates into a flat SglExprList."""

    def __init__(self) -> None:
        self.node_id = next(_node_ids)
        self.prev_node: Optional[SglExpr] = None  # set by the tracer: the node this one follows
        self.pid: Optional[str] = None

    def __add__(self, other: Any) -> "SglExprList":
        return _concat(self, as_expr(other))

    def __radd__(self, other: Any) -> "SglExprList":
        return _concat(as_expr(other), self)

    def print_graph_dfs(self) -> str:
        """The traced graph ending at this node, one `%id = ...` line per node."""
        lines: list[str] = []
        seen: set[int] = set()

        def visit(node: Optional[SglExpr]) -> None:
            if node is None or node.node_id in seen:
                return
            seen.add(node.node_id)
            visit(node.prev_node)
            if isinstance(node, SglExprList):
                for child in node.expr_list:
                    visit(child)
            elif isinstance(node, SglVariable):
                visit(node.source)
            if node.prev_node is not None and not isinstance(node, (SglFork, SglGetForkItem)):
                lines.append(f"%{node.node_id} = %{node.prev_node.node_id} + {node!r}")
            else:
                lines.append(f"%{node.node_id} = {node!r}")

        visit(self)
        return "\n".join(lines) + "\n"


def as_expr(value: Any) -> SglExpr:
    if isinstance(value, SglExpr):
        return value
    if isinstance(value, str):
        return SglConstantText(value)
    raise TypeError(f"cannot add a {type(value).__name__} to a program; use a str or a plait expression")


def _concat(a: SglExpr, b: SglExpr) -> "SglExprList":
    left = a.expr_list if isinstance(a, SglExprList) else [a]
    right = b.expr_list if isinstance(b, SglExprList) else [b]
    return SglExprList(left + right)


class SglExprList(SglExpr):
    def __init__(self, expr_list: List[SglExpr]):
        super().__init__()
        self.expr_list = expr_list

    def __repr__(self) -> str:
        return f"ExprList({self.expr_list})"


class SglConstantText(SglExpr):
    def __init__(self, value: str):
        super().__init__()
        self.value = value

    def __repr__(self) -> str:
        return f"Constant({self.value!r})"


class SglArgument(SglExpr):
    """A program argument while tracing; its value is unknown (None) unless given to trace()."""

    def __init__(self, name: str, value: Any):
        super().__init__()
        self.name = name
        self.value = value

    def __repr__(self) -> str:
        return f"Argument(name={self.name}, value={self.value!r})"

    def __format__(self, spec: str) -> str:
        # NOTE: an f-string would bake the placeholder into a constant and silently lose the
        # dependency on the argument; concatenate with + instead.
        raise TypeError(
            f"cannot put the traced argument {self.name!r} inside an f-string or format(); "
            f'write `"text " + {self.name}` so the tracer can follow it'
        )

    def __len__(self) -> int:
        return len(self.value)

    def __getitem__(self, i: Any) -> Any:
        return self.value[i]


class SglGen(SglExpr):
    """Generate text into variable `name`; `overrides` holds only what this call set."""

    def __init__(self, name: Optional[str], overrides: Any):
        super().__init__()
        self.name = name
        self.overrides = overrides  # gen_params.GenOverrides
        self.output_model = None  # a Pydantic model class the output parses into (json_schema=Model)
        self.reasoning = None  # reasoning.ReasoningMarkers: separate_reasoning(gen(...)) splits the output

    def __repr__(self) -> str:
        return f"Gen({self.name!r})"


class SglSelect(SglExpr):
    def __init__(self, name: Optional[str], choices: List[str], temperature: float, choices_method: Any):
        super().__init__()
        self.name = name
        self.choices = choices
        self.temperature = temperature
        self.choices_method = choices_method

    def __repr__(self) -> str:
        return f"Select({self.name!r}, choices={self.choices}, choices_method={self.choices_method})"


class SglRoleBegin(SglExpr):
    def __init__(self, role: str):
        super().__init__()
        self.role = role

    def __repr__(self) -> str:
        return f"RoleBegin({self.role})"


class SglRoleEnd(SglExpr):
    def __init__(self, role: str):
        super().__init__()
        self.role = role

    def __repr__(self) -> str:
        return f"RoleEnd({self.role})"


class SglImage(SglExpr):
    """An image (a path, bytes, base64, a data: URL or a PIL image): the chat template's image token in
    the text, the image beside it."""

    def __init__(self, path: Any):
        super().__init__()
        self.path = path

    def images(self) -> list[Any]:
        return [self.path]

    def __repr__(self) -> str:
        return f"Image({self.path!r})" if isinstance(self.path, str) else f"Image(<{type(self.path).__name__}>)"


class SglVideo(SglImage):
    """A video: `num_frames` frames sampled from the file, each an image (read when the program runs)."""

    def __init__(self, path: str, num_frames: int):
        super().__init__(path)
        self.num_frames = num_frames

    def images(self) -> list[Any]:
        from .media import video_frames

        return video_frames(self.path, self.num_frames)

    def __repr__(self) -> str:
        return f"Video({self.path!r}, {self.num_frames})"


class SglVarScopeBegin(SglExpr):
    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def __repr__(self) -> str:
        return f"VarScopeBegin({self.name!r})"


class SglVarScopeEnd(SglExpr):
    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def __repr__(self) -> str:
        return f"VarScopeEnd({self.name!r})"


class SglVariable(SglExpr):
    """The value of another state's variable (tracing), produced by node `source`."""

    def __init__(self, name: str, source: Optional[SglExpr]):
        super().__init__()
        self.name = name
        self.source = source

    def __repr__(self) -> str:
        return f"Variable({self.name!r})"


class SglFork(SglExpr):
    def __init__(self, number: int):
        super().__init__()
        self.number = number

    def __repr__(self) -> str:
        return f"Fork({self.number})"


class SglGetForkItem(SglExpr):
    def __init__(self, index: int):
        super().__init__()
        self.index = index

    def __repr__(self) -> str:
        return f"GetForkItem({self.index})"


class SglCommitLazy(SglExpr):
    """Send the text so far to the backend now (prefill it into the prefix cache)."""

    def __repr__(self) -> str:
        return "CommitLazy()"


class SglConcateAndAppend(SglExpr):
    """Append the text each forked state added after the fork (join mode 'concate_and_append')."""

    def __init__(self, states: list):
        super().__init__()
        self.states = states

    def __repr__(self) -> str:
        return f"ConcateAndAppend({len(self.states)} states)"


class SglJoin(SglExpr):
    """Where a fork's branches end (join mode 'gather_variable'); recorded by the tracer for the
    program's request graph, never executed."""

    def __init__(self, states: list, mode: str = "gather_variable"):
        super().__init__()
        self.states = states
        self.mode = mode

    def __repr__(self) -> str:
        return f"Join({len(self.states)} states, {self.mode})"


def flatten(expr: SglExpr) -> Iterable[SglExpr]:
    """The leaf expressions of an expression (lists expanded, in order)."""
    if isinstance(expr, SglExprList):
        for child in expr.expr_list:
            yield from flatten(child)
    else:
        yield expr


def open_role_after(role: Optional[str], expr: SglExpr) -> Optional[str]:
    """The role turn left open after `expr` is appended to a state whose open turn is `role` (None: none).
    ValueError where turns nest or an end has no matching begin."""
    for node in flatten(expr):
        if isinstance(node, SglRoleBegin):
            if role is not None:
                raise ValueError(
                    f"cannot begin a {node.role!r} turn inside the unfinished {role!r} turn: roles do "
                    f"not nest; end the {role!r} turn first"
                )
            role = node.role
        elif isinstance(node, SglRoleEnd):
            if role != node.role:
                raise ValueError(
                    f"{node.role}_end() without a {node.role!r} turn in progress"
                    + (f" (the open turn is {role!r})" if role else "")
                )
            role = None
    return role
