"""Building request graphs (plait.graph): node by node as a program runs (`GraphBuilder`, shared by
a program and its forks), from a trace (`graph_from_trace`), and the per-request meta_info that
backends report while a node executes (`observe_request`, `collect_requests`)."""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from dataclasses import replace
from typing import Any, Iterable, Iterator, Optional

from .graph import MAIN_BRANCH, GraphEdge, GraphNode, NodeStats, RequestGraph
from .ir import SglArgument, SglConcateAndAppend, SglConstantText, SglFork, SglGen, SglJoin, SglSelect, SglVariable


class GraphBuilder:
    """Appends nodes branch by branch; thread-safe, since forked branches run concurrently.

    Each branch has a tail (its last node) and the kind of edge its next node hangs off it by
    (`fork` for a branch's first node, `next` after that).
    """

    def __init__(self, name: str, source: str) -> None:
        self.name = name
        self.source = source
        self.started = time.perf_counter()
        self._nodes: list[GraphNode] = []
        self._edges: list[GraphEdge] = []
        self._tails: dict[str, tuple[Optional[int], str]] = {}
        self._fork_of: dict[str, int] = {}
        self._lock = threading.Lock()

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def add(
        self,
        branch: str,
        kind: str,
        text: str = "",
        name: Optional[str] = None,
        detail: Optional[dict] = None,
        stats: Optional[NodeStats] = None,
    ) -> int:
        with self._lock:
            return self._add(branch, kind, text, name, detail, stats)

    def _add(self, branch, kind, text="", name=None, detail=None, stats=None) -> int:
        tail, edge_kind = self._tails.get(branch, (None, "next"))
        node = GraphNode(len(self._nodes), kind, branch, text, name, dict(detail or {}), stats)
        self._nodes.append(node)
        if tail is not None:
            self._edges.append(GraphEdge(tail, node.id, edge_kind))
        self._tails[branch] = (node.id, "next")
        return node.id

    def attach(self, branch: str, node_id: int) -> None:
        """Start (an empty) `branch` after `node_id`, by a `next` edge."""
        with self._lock:
            self._tails[branch] = (node_id, "next")

    def add_text(self, branch: str, text: str) -> None:
        """Append text to the branch, merged into its last segment when that is text too."""
        if not text:
            return
        with self._lock:
            tail, edge_kind = self._tails.get(branch, (None, "next"))
            if tail is not None and edge_kind == "next" and self._nodes[tail].kind == "text":
                self._nodes[tail].text += text
            else:
                self._add(branch, "text", text)

    def fork(self, branch: str, size: int, stats: Optional[NodeStats] = None) -> tuple[int, list[str]]:
        """A fork node on `branch`; returns it and the names of its `size` branches."""
        with self._lock:
            fork_id = self._add(branch, "fork", detail={"size": size}, stats=stats)
            children = [f"f{fork_id}.{i}" for i in range(size)]
            for child in children:
                self._tails[child] = (fork_id, "fork")
                self._fork_of[child] = fork_id
            return fork_id, children

    def join(self, branch: str, children: Iterable[str], mode: str) -> int:
        with self._lock:
            children = list(children)
            forks = {self._fork_of.get(c) for c in children}
            if len(forks) != 1 or None in forks:
                raise ValueError(f"join needs the branches of one fork, got {children}")
            join_id = self._add(branch, "join", detail={"mode": mode, "fork": forks.pop()})
            for child in children:
                self._edges.append(GraphEdge(self._tails[child][0], join_id, "join"))
            return join_id

    def set_stats(self, node_id: int, stats: NodeStats) -> None:
        with self._lock:
            self._nodes[node_id].stats = stats

    def build(self) -> RequestGraph:
        """A snapshot (later additions do not change it), numbered in program order: each branch
        in full, in branch order, where it forks. Concurrent branches record their nodes interleaved;
        the numbering does not depend on that timing."""
        with self._lock:
            order = self._program_order()
            new_id = {old: new for new, old in enumerate(order)}
            nodes = [
                replace(
                    self._nodes[old],
                    id=new_id[old],
                    detail=dict(self._nodes[old].detail),
                    stats=replace(self._nodes[old].stats) if self._nodes[old].stats else None,
                )
                for old in order
            ]
            edges = sorted(
                (GraphEdge(new_id[e.src], new_id[e.dst], e.kind) for e in self._edges), key=lambda e: e.dst
            )  # stable: a join's edges stay in branch order
            return RequestGraph(self.name, nodes, edges, self.source)

    def _program_order(self) -> list[int]:
        successor: dict[int, list[int]] = {}
        branch_starts: dict[int, list[int]] = {}
        has_pred = set()
        for e in self._edges:
            if e.kind == "next":
                successor.setdefault(e.src, []).append(e.dst)
            elif e.kind == "fork":
                branch_starts.setdefault(e.src, []).append(e.dst)
            if e.kind != "join":
                has_pred.add(e.dst)
        order: list[int] = []
        # NOTE: an explicit stack, not recursion: an agent loop makes long chains.
        stack = [n.id for n in reversed(self._nodes) if n.id not in has_pred]
        while stack:
            node_id = stack.pop()
            order.append(node_id)
            # next: the branch continues after this node's forked branches (batch graphs: several)
            stack.extend(reversed(successor.get(node_id, [])))
            starts = sorted(branch_starts.get(node_id, []), key=lambda c: _branch_index(self._nodes[c].branch))
            stack.extend(reversed(starts))
        return order


def _branch_index(branch: str) -> int:
    """The i of a fork's branch named f<fork>.<i>."""
    return int(branch.rsplit(".", 1)[1]) if "." in branch else 0


def graph_from_trace(tracer: Any, name: str = "program") -> RequestGraph:
    """The request graph of a traced program (a `TracerProgramState`)."""
    builder = GraphBuilder(name, "trace")
    children_of: dict[int, list[str]] = {}  # id(child tracer state) -> its branch name

    def walk(state: Any, branch: str) -> None:
        for node in state.nodes:
            if isinstance(node, SglConstantText):
                builder.add_text(branch, node.value)
            elif isinstance(node, SglArgument):
                builder.add(branch, "arg", name=node.name)
            elif isinstance(node, SglVariable):
                builder.add(branch, "var", name=node.name)
            elif isinstance(node, SglGen):
                builder.add(branch, "gen", name=node.name, detail=_gen_detail(node))
            elif isinstance(node, SglSelect):
                builder.add(branch, "select", name=node.name, detail={"choices": list(node.choices)})
            elif isinstance(node, SglFork):
                _, names = builder.fork(branch, node.number)
                for child, child_branch in zip(node.states, names):
                    children_of[id(child)] = child_branch
                    walk(child, child_branch)
            elif isinstance(node, (SglJoin, SglConcateAndAppend)):
                mode = node.mode if isinstance(node, SglJoin) else "concate_and_append"
                states = [getattr(s, "stream_executor", s) for s in node.states]
                builder.join(branch, [children_of[id(s)] for s in states], mode)

    walk(tracer, MAIN_BRANCH)
    return builder.build()


def _gen_detail(node: Any) -> dict:
    sampling = getattr(getattr(node, "overrides", None), "sampling", None) or {}
    return {k: sampling[k] for k in ("max_new_tokens", "stop", "regex", "json_schema") if k in sampling}


# ---- per-request meta_info, collected while a node executes ----
# NOTE: a context variable, not a global: each program's worker thread runs in its own context, so
# concurrent programs never see each other's requests.
_request_sink: contextvars.ContextVar[Optional[list]] = contextvars.ContextVar("plait_request_sink", default=None)


def observe_request(meta: Optional[dict]) -> None:
    """Backends call this with each runtime request's meta_info."""
    sink = _request_sink.get()
    if sink is not None and isinstance(meta, dict):
        sink.append(meta)


@contextlib.contextmanager
def collect_requests(builder: Optional[GraphBuilder] = None) -> Iterator[NodeStats]:
    """Count the requests made inside the block into a NodeStats, with its start and duration
    (relative to `builder`'s start)."""
    stats = NodeStats(start_s=builder.elapsed() if builder is not None else None)
    metas: list = []
    token = _request_sink.set(metas)
    started = time.perf_counter()
    try:
        yield stats
    finally:
        _request_sink.reset(token)
        stats.latency_s = time.perf_counter() - started
        for meta in metas:
            stats.add_meta(meta)
