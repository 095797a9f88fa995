"""Pictures of request graphs: DOT (for graphviz), a self-contained SVG/HTML page, and PNG.

DOT and the HTML page need nothing installed: the SVG inside the page is laid out here (a row per
step along the longest path, a column per branch), so a graph can be looked at on any machine. PNG
goes through graphviz's `dot`, when it is installed. Every node shows what it is and the text it adds;
a request node that ran also shows its runtime stats, with a bar for the share of its prompt tokens
that came from the prefix cache.

    from plait.graph_render import save, to_svg
    save(state.graph(), "run.html")                    # .dot/.gv, .html, .svg, .png/.pdf (graphviz)
    IPython.display.SVG(to_svg(program.graph()))       # in a notebook
"""

from __future__ import annotations

import html
import shutil
import subprocess
from pathlib import Path
from typing import Optional

from .graph import GraphNode, NodeStats, RequestGraph

FILL = {
    "text": "#f3f4f6",
    "arg": "#fef3c7",
    "var": "#fef3c7",
    "gen": "#dbeafe",
    "select": "#ede9fe",
    "fork": "#e5e7eb",
    "join": "#e5e7eb",
    "program": "#dcfce7",
}
DOT_SHAPE = {
    "text": "box",
    "arg": "box",
    "var": "box",
    "gen": "box",
    "select": "box",
    "fork": "invtrapezium",
    "join": "trapezium",
    "program": "folder",
}
EXCERPT_CHARS = 36
BOX_W, BOX_H, GAP_X, GAP_Y, MARGIN = 220, 66, 24, 34, 16


# ---------------------------------------------------------------- labels


def visible(text: str) -> str:
    """Text with its line breaks and tabs made visible, on one line."""
    return text.replace("\r", "").replace("\n", "\u23ce").replace("\t", "\u21e5")


def excerpt(text: str, limit: int = EXCERPT_CHARS) -> str:
    text = visible(text)
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


def title_line(node: GraphNode) -> str:
    if node.kind == "fork":
        return f"fork \u00d7{node.detail.get('size', '?')}"
    if node.kind == "join":
        return "join" + (" (concatenate)" if node.detail.get("mode") == "concate_and_append" else "")
    if node.kind == "text" and "members" in node.detail:
        return f"shared by {len(node.detail['members'])} programs"
    return f"{node.kind} {node.name}" if node.name is not None else node.kind


def body_line(graph: RequestGraph, node: GraphNode) -> str:
    if node.kind in ("fork", "join"):
        return ""
    text = graph.display_text(node)
    if node.kind == "select" and not node.text:
        text = " | ".join(node.detail.get("choices", []))
    return excerpt(text) if text else "(empty)"


def stats_line(stats: Optional[NodeStats]) -> str:
    if stats is None or not stats.requests:
        return ""
    parts = [f"cached {stats.cached_tokens}/{stats.prompt_tokens}"]
    if stats.hit_rate is not None:
        parts[0] += f" ({100 * stats.hit_rate:.0f}%)"
    if stats.completion_tokens:
        parts.append(f"+{stats.completion_tokens} tok")
    if stats.latency_s is not None:
        parts.append(f"{stats.latency_s:.2f}s")
    return " \u00b7 ".join(parts)


def node_lines(graph: RequestGraph, node: GraphNode) -> list[str]:
    return [line for line in (title_line(node), body_line(graph, node), stats_line(node.stats)) if line]


# ---------------------------------------------------------------- DOT


def _dot_str(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _dot_node(graph: RequestGraph, node: GraphNode) -> str:
    attrs = {
        "shape": DOT_SHAPE[node.kind],
        "style": "rounded,filled" if DOT_SHAPE[node.kind] == "box" else "filled",
        "fillcolor": FILL[node.kind],
        "label": "\n".join(node_lines(graph, node)),
        "tooltip": visible(graph.display_text(node))[:500] or node.kind,
    }
    if node.kind in ("arg", "var"):
        attrs["style"] = "rounded,filled,dashed"
    if node.kind in ("gen", "select", "program") and node.stats is not None and node.stats.hit_rate is not None:
        good = node.stats.hit_rate >= 0.5  # green frame: most of the prompt came from the cache
        attrs["color"], attrs["penwidth"] = ("#16a34a", "2.5") if good else ("#dc2626", "1.5")
    return f"n{node.id} [" + ", ".join(f"{k}={_dot_str(v)}" for k, v in attrs.items()) + "];"


def to_dot(graph: RequestGraph) -> str:
    lines = [
        f"digraph {_dot_str(graph.name)} {{",
        '  rankdir=TB; node [fontname="Helvetica", fontsize=10]; edge [fontname="Helvetica", fontsize=9];',
        f"  label={_dot_str(graph.summary())}; labelloc=t;",
    ]
    by_branch: dict[str, list[GraphNode]] = {}
    for node in graph.nodes:
        by_branch.setdefault(node.branch, []).append(node)
    # A fork's branches are drawn as clusters nested inside the cluster of the branch that forked.
    parent_of = {graph.nodes[e.dst].branch: graph.nodes[e.src].branch for e in graph.edges if e.kind == "fork"}
    children: dict[str, list[str]] = {}
    for branch in by_branch:
        children.setdefault(parent_of.get(branch, ""), []).append(branch)

    def emit(branch: str, depth: int) -> None:
        indent = "  " * depth
        clustered = graph.source != "batch" and branch in parent_of
        if clustered:
            lines.append(
                f"{indent}subgraph {_dot_str('cluster_' + branch)} {{ label={_dot_str(branch)}; "
                'style="rounded,dashed"; color="#9ca3af";'
            )
        for node in by_branch[branch]:
            lines.append(f"{indent}  {_dot_node(graph, node)}")
        for child in children.get(branch, []):
            emit(child, depth + 1)
        if clustered:
            lines.append(f"{indent}}}")

    for root in children.get("", []):
        emit(root, 0)
    for edge in graph.edges:
        style = {"next": "", "fork": ' [style=dashed, label="fork"]', "join": ' [style=dotted, label="join"]'}
        lines.append(f"  n{edge.src} -> n{edge.dst}{style[edge.kind]};")
    lines.append("}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- SVG (own layout)


def layout(graph: RequestGraph) -> dict[int, tuple[int, int]]:
    """node id -> (row, column): the row is the longest path from a root (edges always point from
    an older node to a newer one), the column is the node's branch in order of first appearance."""
    row: dict[int, int] = {}
    incoming: dict[int, list[int]] = {}
    for e in graph.edges:
        incoming.setdefault(e.dst, []).append(e.src)
    columns: dict[str, int] = {}
    out = {}
    for node in graph.nodes:
        row[node.id] = max((row[s] + 1 for s in incoming.get(node.id, []) if s in row), default=0)
        column = columns.setdefault(node.branch, len(columns))
        out[node.id] = (row[node.id], column)
    return out


def to_svg(graph: RequestGraph) -> str:
    pos = layout(graph)
    rows = 1 + max((r for r, _ in pos.values()), default=0)
    cols = 1 + max((c for _, c in pos.values()), default=0)
    width, height = 2 * MARGIN + cols * (BOX_W + GAP_X), 2 * MARGIN + rows * (BOX_H + GAP_Y)

    def xy(node_id: int) -> tuple[int, int]:
        r, c = pos[node_id]
        return MARGIN + c * (BOX_W + GAP_X), MARGIN + r * (BOX_H + GAP_Y)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="Helvetica, Arial, sans-serif" font-size="11">',
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" markerHeight="7" '
        'orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" fill="#6b7280"/></marker></defs>',
    ]
    for e in graph.edges:
        (x1, y1), (x2, y2) = xy(e.src), xy(e.dst)
        dash = {"next": "", "fork": ' stroke-dasharray="6 3"', "join": ' stroke-dasharray="2 3"'}[e.kind]
        parts.append(
            f'<line x1="{x1 + BOX_W // 2}" y1="{y1 + BOX_H}" x2="{x2 + BOX_W // 2}" y2="{y2}" '
            f'stroke="#6b7280"{dash} marker-end="url(#arrow)"/>'
        )
    for node in graph.nodes:
        x, y = xy(node.id)
        dashed = ' stroke-dasharray="4 2"' if node.kind in ("arg", "var") else ""
        tip = html.escape(visible(graph.display_text(node))[:500] or node.kind)
        parts.append(
            f"<g><title>#{node.id} {html.escape(node.branch)}: {tip}</title>"
            f'<rect x="{x}" y="{y}" width="{BOX_W}" height="{BOX_H}" rx="6" fill="{FILL[node.kind]}" '
            f'stroke="#6b7280"{dashed}/>'
        )
        for i, line in enumerate(node_lines(graph, node)):
            weight = ' font-weight="bold"' if i == 0 else ""
            parts.append(f'<text x="{x + 8}" y="{y + 16 + 15 * i}"{weight}>{html.escape(line)}</text>')
        if node.stats is not None and node.stats.hit_rate is not None:
            bar = int((BOX_W - 16) * node.stats.hit_rate)
            parts.append(
                f'<rect x="{x + 8}" y="{y + BOX_H - 9}" width="{BOX_W - 16}" height="5" fill="#fecaca"/>'
                f'<rect x="{x + 8}" y="{y + BOX_H - 9}" width="{bar}" height="5" fill="#16a34a"/>'
            )
        parts.append("</g>")
    parts.append("</svg>")
    return "\n".join(parts)


# ---------------------------------------------------------------- HTML


def to_html(graph: RequestGraph) -> str:
    """One self-contained page: the picture, then a table of every node with who shares it."""
    sharing = graph.sharing()
    rows = []
    for node in graph.nodes:
        s = node.stats
        cells = [
            str(node.id),
            node.kind,
            node.branch,
            node.name or "",
            visible(graph.display_text(node))[:300],
            ", ".join(f"#{r}" for r in sharing.get(node.id, [])),
            *(
                ("", "", "", "", "")
                if s is None
                else (
                    str(s.prompt_tokens),
                    str(s.cached_tokens),
                    "" if s.hit_rate is None else f"{100 * s.hit_rate:.0f}%",
                    f"{s.start_s:.2f}" if s.start_s is not None else "",
                    f"{s.latency_s:.2f}" if s.latency_s is not None else "",
                )
            ),
        ]
        rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    header = [
        "#",
        "kind",
        "branch",
        "name",
        "text",
        "in the prompt of",
        "prompt tok",
        "cached tok",
        "hit",
        "start s",
        "latency s",
    ]
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{html.escape(graph.name)} - plait request graph</title>
<style>
body {{ font-family: Helvetica, Arial, sans-serif; margin: 1.5em; color: #111827; }}
.picture {{ overflow: auto; border: 1px solid #e5e7eb; padding: 0.5em; }}
table {{ border-collapse: collapse; margin-top: 1em; font-size: 12px; }}
td, th {{ border: 1px solid #e5e7eb; padding: 3px 6px; text-align: left; vertical-align: top; }}
td:nth-child(5) {{ font-family: monospace; max-width: 40em; word-break: break-all; }}
</style></head><body>
<h1>{html.escape(graph.name)}</h1>
<p>{html.escape(graph.summary())} (a {html.escape(graph.source)} graph). Dashed edges: fork; dotted: join.
Under a request, green is the share of its prompt tokens the prefix cache already held.</p>
<div class="picture">{to_svg(graph)}</div>
<table><tr>{"".join(f"<th>{h}</th>" for h in header)}</tr>
{chr(10).join(rows)}
</table></body></html>
"""


# ---------------------------------------------------------------- files


def dot_available() -> bool:
    return shutil.which("dot") is not None


def render_with_dot(graph: RequestGraph, fmt: str) -> bytes:
    """Run graphviz's `dot` on the graph (fmt: png, svg, pdf, ...)."""
    if not dot_available():
        raise RuntimeError(
            f"rendering {fmt.upper()} needs graphviz's `dot` program (e.g. `apt-get install "
            "graphviz`); .html, .svg and .dot work without it"
        )
    done = subprocess.run(["dot", f"-T{fmt}"], input=to_dot(graph).encode(), capture_output=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"dot failed: {done.stderr.decode(errors='replace').strip()}")
    return done.stdout


def save(graph: RequestGraph, path: str) -> str:
    """Write `graph` to `path` in the format its suffix names; returns the path."""
    target = Path(path)
    suffix = target.suffix.lower()
    if suffix in (".dot", ".gv"):
        target.write_text(to_dot(graph), encoding="utf-8")
    elif suffix in (".html", ".htm"):
        target.write_text(to_html(graph), encoding="utf-8")
    elif suffix == ".svg":
        target.write_text(to_svg(graph), encoding="utf-8")
    elif suffix in (".png", ".pdf"):
        target.write_bytes(render_with_dot(graph, suffix[1:]))
    else:
        raise ValueError(
            f"cannot save a graph as {suffix or 'a file without a suffix'!r}: use .dot, .gv, .html, .svg, .png or .pdf"
        )
    return str(target)
