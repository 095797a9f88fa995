"""Request graphs: a program seen as the requests it sends and the text those requests share.

A node is one piece of a program's text or one request:

- `text`: constant text (role markup included); consecutive constants on one branch merge into one
  segment. `arg` / `var`: a value not known when tracing (a program argument, another state's
  variable); in a recorded run everything is text.
- `gen` / `select`: a request to the runtime; its prompt is every piece of text before it on its path.
- `fork`: the branches start here (each branch's first node hangs off it by a `fork` edge); `join`:
  the branches end here (`join` edges from each branch's last node, in branch order). A
  `concate_and_append` join puts the branches' text into the parent's prompt; `gather_variable` does not.
- `program` (batch graphs only): one program of a run_batch, under the shared segment it starts with.

Edges: `next` (sequence on one branch), `fork`, `join`. Every node has at most one `next`/`fork`
predecessor, so a node's prompt is a walk back to the root (`prompt_path`), plus the branches' text
at a concatenating join. A node shared by several requests' prompts is a prefix the runtime can
compute once: `sharing()` says which requests share which node.

Graphs come from tracing (`program.graph(...)`, `program.trace().graph()`), from a run
(`state.graph()`: the text really sent, with per-request `NodeStats`: cached tokens from the runtime's
`meta_info`, timings), and from run_batch's plan (`plan.to_graph()`), all built with
`graph_builder.GraphBuilder`. A graph is plain data: `graph_render`'s functions draw it
(`to_dot(graph)`, `to_svg`, `to_html`, `save(graph, path)`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

NODE_KINDS = ("text", "arg", "var", "gen", "select", "fork", "join", "program")
REQUEST_KINDS = ("gen", "select")
EDGE_KINDS = ("next", "fork", "join")
MAIN_BRANCH = "main"


@dataclass
class NodeStats:
    """What the runtime reported for the requests a node made (a select makes two or three)."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    start_s: Optional[float] = None  # seconds after the program (or batch) started
    latency_s: Optional[float] = None

    @property
    def hit_rate(self) -> Optional[float]:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None

    def add_meta(self, meta: Optional[dict]) -> None:
        """Count one request's meta_info (missing fields, as from an OpenAI server, count as 0)."""
        if not isinstance(meta, dict):
            return
        self.requests += 1
        self.prompt_tokens += int(meta.get("prompt_tokens") or 0)
        self.cached_tokens += int(meta.get("cached_tokens") or 0)
        self.completion_tokens += int(meta.get("completion_tokens") or 0)

    def __add__(self, other: "NodeStats") -> "NodeStats":
        return NodeStats(
            self.requests + other.requests,
            self.prompt_tokens + other.prompt_tokens,
            self.cached_tokens + other.cached_tokens,
            self.completion_tokens + other.completion_tokens,
        )


@dataclass
class GraphNode:
    id: int
    kind: str
    branch: str
    text: str = ""  # what this node adds to its branch's prompt: segment text, generated output
    name: Optional[str] = None  # variable name (gen, select, arg, var)
    detail: dict = field(default_factory=dict)  # fork: size; join: mode, fork; select: choices
    stats: Optional[NodeStats] = None

    @property
    def is_request(self) -> bool:
        return self.kind in REQUEST_KINDS


@dataclass(frozen=True)
class GraphEdge:
    src: int
    dst: int
    kind: str


@dataclass
class RequestGraph:
    name: str
    nodes: list[GraphNode]
    edges: list[GraphEdge]
    source: str = "trace"  # "trace" | "run" | "batch"

    def __post_init__(self) -> None:
        self._pred: dict[int, int] = {}
        self._joins_in: dict[int, list[int]] = {}
        for i, node in enumerate(self.nodes):
            if node.id != i:
                raise ValueError(f"node ids must be 0..n-1 in order; node {i} has id {node.id}")
            if node.kind not in NODE_KINDS:
                raise ValueError(f"node {i} has unknown kind {node.kind!r}; kinds are {NODE_KINDS}")
        for e in self.edges:
            if e.kind not in EDGE_KINDS:
                raise ValueError(f"edge {e} has unknown kind {e.kind!r}; kinds are {EDGE_KINDS}")
            if not (0 <= e.src < len(self.nodes) and 0 <= e.dst < len(self.nodes)):
                raise ValueError(f"edge {e} names a node that does not exist")
            if e.kind == "join":
                self._joins_in.setdefault(e.dst, []).append(e.src)
            elif e.dst in self._pred:
                raise ValueError(f"node {e.dst} has two predecessors ({self._pred[e.dst]} and {e.src})")
            else:
                self._pred[e.dst] = e.src

    # ---- structure ----
    def node(self, node_id: int) -> GraphNode:
        return self.nodes[node_id]

    def predecessor(self, node_id: int) -> Optional[int]:
        """The node this one follows on its path (by a `next` or `fork` edge); None at the root."""
        return self._pred.get(node_id)

    def requests(self) -> list[GraphNode]:
        return [n for n in self.nodes if n.is_request]

    def edge_tuples(self) -> list[tuple[int, int, str]]:
        return [(e.src, e.dst, e.kind) for e in self.edges]

    def prompt_path(self, node_id: int) -> list[int]:
        """The nodes whose text forms everything before `node_id` on its path, in order."""
        chain = []
        cur = self.predecessor(node_id)
        while cur is not None:  # NOTE: a loop, not recursion: an agent loop makes long chains
            chain.append(cur)
            cur = self.predecessor(cur)
        out: list[int] = []
        for c in reversed(chain):
            out.extend(self._contribution(c))
        return out

    def _contribution(self, node_id: int) -> list[int]:
        node = self.nodes[node_id]
        if node.kind == "join" and node.detail.get("mode") == "concate_and_append":
            base = len(self.prompt_path(node.detail["fork"]))
            out = []
            for tail in self._joins_in.get(node_id, []):
                out.extend((self.prompt_path(tail) + self._contribution(tail))[base:])
            return out
        if node.kind in ("fork", "join", "program"):
            return []
        return [node_id]

    def prompt_text(self, node_id: int) -> str:
        """The prompt a request node sends (in a trace, unknown values appear as {name})."""
        return "".join(self.display_text(self.nodes[i]) for i in self.prompt_path(node_id))

    def display_text(self, node: GraphNode) -> str:
        """The node's text; in a trace, a value not known yet shows as {name}."""
        if self.source == "trace" and node.kind in ("arg", "var", "gen", "select"):
            return "{" + str(node.name) + "}"
        return node.text

    def sharing(self) -> dict[int, list[int]]:
        """For every node in some request's prompt: the request nodes whose prompt contains it."""
        shared: dict[int, list[int]] = {}
        for req in self.requests():
            for n in self.prompt_path(req.id):
                shared.setdefault(n, []).append(req.id)
        return shared

    def shared_segments(self) -> dict[int, list[int]]:
        """`sharing()` restricted to nodes in the prompts of two or more requests."""
        return {n: reqs for n, reqs in self.sharing().items() if len(reqs) >= 2}

    # ---- stats ----
    def totals(self) -> NodeStats:
        total = NodeStats()
        for node in self.nodes:
            if node.stats is not None:
                total = total + node.stats
        return total

    def summary(self) -> str:
        head = f"{self.name}: {len(self.nodes)} nodes, {len(self.requests())} requests"
        if self.source == "batch":
            programs = sum(1 for n in self.nodes if n.kind == "program")
            head = f"{self.name}: {programs} programs, {len(self.nodes) - programs} shared segments"
        if self.source == "trace":
            return head + f", {len(self.shared_segments())} nodes shared by two or more requests"
        t = self.totals()
        rate = f"{100 * t.hit_rate:.0f}%" if t.hit_rate is not None else "n/a"
        return (
            head + f"; runtime requests {t.requests}, prompt tokens {t.prompt_tokens}, cached {t.cached_tokens} "
            f"({rate}), completion tokens {t.completion_tokens}"
        )
