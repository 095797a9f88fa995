"""run_batch's plan: the prefixes the batch's programs share, prefilled once before any of them runs.

SGLang's run_batch traces the program with placeholder arguments and prefills the constant text every
run starts with. That misses most of what a batch shares: a few-shot header passed as an argument,
or the same examples before different questions, in groups. plait traces each program with its real
arguments up to its first request (gen, select or fork), so it knows every program's first prompt,
and finds the segments the prompts share, as a tree:

    header (all 64 programs) ─┬─ examples A (programs 0-31) ── questions ...
                              └─ examples B (programs 32-63) ── questions ...

Each segment is prefilled once, shallowest first (a level's segments in one batched request, each
reusing its parent), pinned until its last program has finished, and programs are dispatched in
segment order so a group runs together. The prompts are compared as token ids when the backend can
tokenize exactly as the runtime does (the colocated Engine), else as text (over HTTP: a cut inside a
token costs the one token that straddles it).

NOTE: tracing runs the program's Python body up to its first request once more per program; a body
with side effects before its first gen repeats them (SGLang's precache traces too, once).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

from .graph import NodeStats, RequestGraph
from .graph_builder import GraphBuilder
from .pins import ProgramPins
from .tracer import extract_prefix_by_tracing

Prefix = Union[str, list[int]]

# A segment shorter than this (its own part, after its parent) is not worth a prefill of its own.
MIN_SEGMENT_TOKENS = 16
MIN_SEGMENT_CHARS = 64


@dataclass
class SharedSegment:
    """Positions [start, end) of the prompts of `members`, identical in all of them; `parent` is
    the enclosing segment (whose end is this one's start), None for a root."""

    id: int
    parent: Optional[int]
    start: int
    end: int
    members: tuple[int, ...]
    prefill: Optional[NodeStats] = None  # the prefill request's meta_info, once sent
    ticket: Any = None  # its pin while members still run (plait.pins)
    remaining: int = 0  # members not finished yet


def find_shared_segments(sequences: Sequence[Sequence[Any]], min_len: int = 1) -> list[SharedSegment]:
    """The tree of prefixes shared by two or more sequences (strings or token-id lists).

    A segment is the longest prefix a set of >= 2 sequences has in common, where the set is every
    sequence that continues the parent segment with the same next element. Segments whose own part
    (end - start) is shorter than `min_len` are left out, and their children attach to the nearest
    ancestor kept. Parents come before children; siblings in order of their first member.
    """
    if min_len < 1:
        raise ValueError(f"min_len must be >= 1, got {min_len}")
    segments: list[SharedSegment] = []
    # (members, depth they are known to share, nearest kept ancestor's id, its end)
    stack: list[tuple[list[int], int, Optional[int], int]] = [(list(range(len(sequences))), 0, None, 0)]
    while stack:
        members, depth, parent, parent_end = stack.pop()
        if len(members) < 2:
            continue
        end = depth + _common_length(sequences, members, depth)
        if end - parent_end >= min_len and end > 0:
            segments.append(SharedSegment(len(segments), parent, parent_end, end, tuple(members)))
            parent, parent_end = segments[-1].id, end
        groups: dict[Any, list[int]] = {}
        for m in members:
            if len(sequences[m]) > end:
                groups.setdefault(sequences[m][end], []).append(m)
        # NOTE: pushed in reverse so the first group is processed (and numbered) first: ids are
        # then a depth-first preorder, parents before children.
        for group in reversed(list(groups.values())):
            if len(group) > 1:
                stack.append((group, end + 1, parent, parent_end))
    return segments


def _common_length(sequences: Sequence[Sequence[Any]], members: list[int], depth: int) -> int:
    first = sequences[members[0]]
    n = min(len(sequences[m]) for m in members) - depth
    for k in range(n):
        x = first[depth + k]
        if any(sequences[m][depth + k] != x for m in members[1:]):
            return k
    return max(n, 0)


@dataclass
class BatchPlan:
    unit: str  # "tokens" | "chars"
    texts: list[str]  # each program's first prompt as text ("" when tracing could not tell)
    prefixes: list[Prefix]  # the same as compared: token ids or text
    segments: list[SharedSegment]
    leaf_stats: dict[int, NodeStats] = field(default_factory=dict)  # program index -> its run's totals

    def distinct_length(self) -> int:
        """The batch's prompts with every shared segment counted once (in `unit`s): what the cache holds
        while all of them are in it."""
        deepest = self.deepest_segment()
        ends = {seg.id: seg.end for seg in self.segments}
        own = sum(len(p) - ends[deepest[i]] if i in deepest else len(p) for i, p in enumerate(self.prefixes))
        return own + sum(seg.end - seg.start for seg in self.segments)

    def segment_prefix(self, seg: SharedSegment) -> Prefix:
        return self.prefixes[seg.members[0]][: seg.end]

    def deepest_segment(self) -> dict[int, int]:
        """Program index -> the id of the deepest segment it belongs to."""
        out: dict[int, int] = {}
        for seg in self.segments:  # parents first, so children overwrite
            for m in seg.members:
                out[m] = seg.id
        return out

    def dispatch_order(self) -> list[int]:
        """Program indices grouped by segment (depth-first), so programs of one group run together."""
        deepest = self.deepest_segment()
        rank = {seg.id: i for i, seg in enumerate(self._depth_first())}
        return sorted(range(len(self.prefixes)), key=lambda i: (rank.get(deepest.get(i), len(rank)), i))

    def _depth_first(self) -> list[SharedSegment]:
        children: dict[Optional[int], list[SharedSegment]] = {}
        for seg in self.segments:
            children.setdefault(seg.parent, []).append(seg)
        out: list[SharedSegment] = []
        stack = list(reversed(children.get(None, [])))
        while stack:
            seg = stack.pop()
            out.append(seg)
            stack.extend(reversed(children.get(seg.id, [])))
        return out

    def levels(self) -> list[list[SharedSegment]]:
        depth: dict[int, int] = {}
        for seg in self.segments:
            depth[seg.id] = 0 if seg.parent is None else depth[seg.parent] + 1
        out: list[list[SharedSegment]] = []
        for seg in self.segments:
            while len(out) <= depth[seg.id]:
                out.append([])
            out[depth[seg.id]].append(seg)
        return out

    def summary(self) -> str:
        parts = [f"{len(self.prefixes)} programs, {len(self.segments)} shared segments ({self.unit})"]
        for seg in self.segments:
            hit = ""
            if seg.prefill is not None:
                hit = f", prefilled {seg.prefill.prompt_tokens - seg.prefill.cached_tokens} new tokens"
            parts.append(
                f"  segment {seg.id} [{seg.start}:{seg.end}) x{len(seg.members)}"
                f"{'' if seg.parent is None else f' under {seg.parent}'}{hit}"
            )
        return "\n".join(parts)

    def to_graph(self, name: str = "run_batch") -> RequestGraph:
        """Segments as text nodes (the text their members share), each program as a leaf."""
        builder = GraphBuilder(name, "batch")
        node_of: dict[int, int] = {}
        text_end: dict[Optional[int], int] = {None: 0}
        for seg in self.segments:
            shared = _common_text([self.texts[m] for m in seg.members])
            branch = f"s{seg.id}"
            if seg.parent is not None:
                builder.attach(branch, node_of[seg.parent])
            node_of[seg.id] = builder.add(
                branch,
                "text",
                shared[text_end[seg.parent] :],
                detail={"members": list(seg.members), "span": [seg.start, seg.end], "unit": self.unit},
                stats=seg.prefill,
            )
            text_end[seg.id] = len(shared)
        deepest = self.deepest_segment()
        for i, text in enumerate(self.texts):
            branch = f"p{i}"
            seg = deepest.get(i)
            if seg is not None:
                builder.attach(branch, node_of[seg])
            builder.add(branch, "program", text[text_end[seg] :], name=f"#{i}", stats=self.leaf_stats.get(i))
        return builder.build()


def _common_text(texts: list[str]) -> str:
    if not texts:
        return ""
    first = texts[0]
    n = min(len(t) for t in texts)
    for k in range(n):
        if any(t[k] != first[k] for t in texts[1:]):
            return first[:k]
    return first[:n]


def plan_batch(program: Any, backend: Any, batch_arguments: list[dict]) -> BatchPlan:
    """Trace each program with its arguments to its first prompt, and find what the prompts share."""
    texts = [extract_prefix_by_tracing(program, backend, arguments) for arguments in batch_arguments]
    token_ids = [backend.tokenize(t) if t else [] for t in texts]
    if texts and all(ids is not None for ids in token_ids):
        prefixes: list[Prefix] = token_ids
        unit, min_len = "tokens", MIN_SEGMENT_TOKENS
    else:
        prefixes, unit, min_len = list(texts), "chars", MIN_SEGMENT_CHARS
    return BatchPlan(unit, texts, prefixes, find_shared_segments(prefixes, min_len))


class BatchPrefill:
    """Runs a plan against a backend: prefill every segment, pin it until its programs finish."""

    def __init__(self, plan: BatchPlan, backend: Any) -> None:
        self.plan = plan
        self.pins = ProgramPins(backend.pin_service())
        self._lock = threading.Lock()
        started = time.perf_counter()
        for level in plan.levels():  # a child's prefill reuses its parent's, so parents go first
            t0 = time.perf_counter()
            metas = backend.cache_prefixes([plan.segment_prefix(seg) for seg in level])
            for seg, meta in zip(level, metas):
                seg.prefill = NodeStats(start_s=t0 - started, latency_s=time.perf_counter() - t0)
                seg.prefill.add_meta(meta)
        for seg in plan.segments:
            seg.remaining = len(seg.members)
            seg.ticket = self.pins.pin(plan.segment_prefix(seg))

    def program_done(self, index: int) -> None:
        """Release the segments whose last program this was (called from the batch's threads)."""
        with self._lock:
            done = []
            for seg in self.plan.segments:
                if index in seg.members:
                    seg.remaining -= 1
                    if seg.remaining == 0:
                        done.append(seg)
        for seg in done:
            self.pins.unpin(seg.ticket)
            seg.ticket = None

    def close(self) -> None:
        self.pins.release_all(wait=True)
