"""What a drafter is (`Drafter`: a STANDALONE draft model, an EAGLE head) and the drafting both share.

A drafter runs beside the target in lockstep (its KV at the target's slots: draft_batch.py): it sees
each prefill and decode step the target ran (`observe`) and the kept path of each verify step
(`after_verify`: `KeptPaths`), and fills in the draft trees of a VERIFY step's requests the scheduler left to it
(`draft`). The drafting is the same skeleton for both (`draft_trees_of`): the first k candidates after
each request's root, then one tree level per step over the frontier (tree_draft.py), each level a
VERIFY forward of k tokens per request in the scratch area, its ancestor masks grown level by level.
What differs is the `TreeSource`: where the first candidates come from (a draft model runs its root, in
the scratch area's first column; an EAGLE head kept them from its lockstep run, so its tree has no root
column) and what one level's forward is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch

from ..forward_batch import ForwardBatch
from ..step import StepInput, StepOutput
from .draft_batch import DraftMemory, ancestor_rows
from .tree_draft import draft_trees
from .verify_step import refresh_masks, set_tree


class Drafter(Protocol):
    """What the draft-and-verify runner (executor/spec_runner.py) needs of a drafter."""

    capture_layers: tuple  # the target's layers whose inputs it reads (EAGLE-3), else ()
    needs_hidden: bool  # it reads the target's hidden states

    def observe(self, step: StepInput, out: StepOutput, hidden: Any = None, fb: Any = None) -> None: ...
    def after_verify(self, step: StepInput, out: StepOutput, hidden: Any = None, fb: Any = None) -> None: ...
    def draft(self, step: StepInput) -> None: ...


class DraftRequests:
    """The requests of a VERIFY step the runner drafts for, as device rows."""

    def __init__(self, step: StepInput, device: str):
        self.index = [b for b, m in enumerate(step.draft.model_draft) if m]
        starts = step.req_rows[4]
        self.rows_cpu = [int(step.req_rows[0, b]) for b in self.index]
        self.prefix_cpu = [int(step.prefix_lens[b]) for b in self.index]
        self.roots = [int(step.token_rows[0, starts[b]]) for b in self.index]
        self.sizes = [int(step.extend_lens[b]) for b in self.index]
        self.rows = torch.tensor(self.rows_cpu, dtype=torch.int64, device=device)
        self.prefix = torch.tensor(self.prefix_cpu, dtype=torch.int64, device=device)

    def __len__(self) -> int:
        return len(self.index)


@dataclass
class KeptPaths:
    """What a VERIFY step kept, per request: the root and each accepted draft, in order down the tree."""

    rows: list[int]  # request rows of req_to_token
    prefix: list[int]  # tokens before the root
    slots: list[list[int]]  # the kept nodes' kv slots
    tokens: list[list[int]]  # the kept nodes' tokens, or (`next_tokens`) the token after each
    positions: list[list[int]]  # prefix, prefix + 1, ..
    nodes: list[int]  # the kept nodes' rows in the step (T), all requests

    @classmethod
    def of(cls, step: StepInput, out: StepOutput, next_tokens: bool = False) -> "KeptPaths":
        """`next_tokens`: each kept node's next token (the drafts after it, then the target's own): an
        EAGLE head's entries are one token ahead of the target's."""
        kept = cls([], [], [], [], [], [])
        starts = step.req_rows[4]
        for b, v in enumerate(out.verified):
            s, pre = int(starts[b]), int(step.prefix_lens[b])
            path = [0] + v.nodes
            kept.rows.append(int(step.req_rows[0, b]))
            kept.prefix.append(pre)
            kept.slots.append([int(step.token_rows[2, s + n]) for n in path])
            kept.tokens.append(v.tokens if next_tokens else [int(step.token_rows[0, s + n]) for n in path])
            kept.positions.append(list(range(pre, pre + len(path))))
            kept.nodes.extend(s + n for n in path)
        return kept

    def batch(self, mem: DraftMemory) -> ForwardBatch:
        """The EXTEND of every kept path over the drafter's pool (the table's device copy gets its slots)."""
        return mem.extend_paths(self.rows, self.prefix, self.slots, self.tokens, self.positions)


class TreeLevels:
    """One VERIFY step's drafting in the drafter's scratch area: the forward batch of each tree level
    and the ancestor masks grown level by level. With a root column (a draft model) column 0 is the
    root and level l's k nodes are columns 1 + (l - 1) k ..; without (an EAGLE head) level l's nodes
    are columns (l - 1) k .., and a node's parent column -1 means the root (outside the scratch)."""

    def __init__(self, reqs: DraftRequests, mem: DraftMemory, topk: int, columns: int, root_column: bool):
        self.reqs, self.mem, self.k = reqs, mem, topk
        self.root = 1 if root_column else 0
        B = len(reqs)
        # (B, M, M) ancestors over tree columns; without a root column a last row M: "no parent"
        self.anc = torch.zeros(B, columns + 1 - self.root, columns, dtype=torch.bool, device=mem.device)
        if root_column:
            self.anc[:, 0, 0] = True
        self._none = 0 if root_column else columns
        self.level = 0

    def root_batch(self) -> ForwardBatch:
        """Level 0 of a tree with a root column: each request's root, at its sequence position."""
        r, mem = self.reqs, self.mem
        roots = torch.tensor(r.roots, dtype=torch.int64, device=mem.device)[:, None]  # (B, 1)
        slots = mem.scratch_slots(r.rows, 0, 1)
        return mem.tree_level(r.rows, roots, r.prefix[:, None], r.prefix, r.prefix_cpu, 1, 1, slots, None)

    def next_batch(self, tokens: torch.Tensor, parents: torch.Tensor) -> ForwardBatch:
        """The next level: tokens (B, k) the frontier, parents (B, k) each one's parent among the nodes
        expanded before (-1: the root). A node at depth d has its entry at position prefix + d - 1 + root
        (an EAGLE head's at its parent's)."""
        self.level += 1
        k, r = self.k, self.reqs
        first = self.root + (self.level - 1) * k  # this level's first tree column
        rows = ancestor_rows(torch.where(parents < 0, self._none, parents + self.root), self.anc, first)  # (B, k, M)
        n_cols = first + k
        return self.mem.tree_level(
            r.rows,
            tokens,
            r.prefix[:, None] + (self.level - 1 + self.root),
            r.prefix,
            r.prefix_cpu,
            n_cols,
            k,
            self.mem.scratch_slots(r.rows, first, k),
            rows[:, :, :n_cols] if k > 1 else None,
        )


class TreeSource(Protocol):
    """What a drafter brings to the shared drafting (`draft_trees_of`)."""

    root_column: bool  # its tree's root has a scratch column (it runs the root itself)

    def scratch_per_row(self, steps: int, topk: int) -> int: ...

    def first(self, levels: TreeLevels) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """(ids (B, k), logprobs (B, k), each request's state or None): the top k after each root."""
        ...

    def expand(
        self, fb: ForwardBatch, parent_state: Optional[torch.Tensor], B: int, k: int
    ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """One level's forward: the top k (ids, logprobs) after each frontier node, (B, k, k) each, and
        each frontier node's own state (B, k, ...) or None."""
        ...


def draft_trees_of(step: StepInput, mem: DraftMemory, topk: int, steps: int, num_nodes: int, src: TreeSource) -> None:
    """Fill the trees of the requests the scheduler left to the runner (step.draft.model_draft): top-k
    trees of `num_nodes` nodes from `steps` levels, or, with k = 1, chains as long as each request asked."""
    reqs = DraftRequests(step, mem.device)
    if not len(reqs):
        return
    k = topk
    if k == 1:
        steps = max(reqs.sizes) - 1  # chains: as long as the longest asked
    levels = TreeLevels(reqs, mem, k, src.scratch_per_row(steps, k), src.root_column)
    first_ids, first_lps, root_state = src.first(levels)
    B = len(reqs)

    def expand(tokens: torch.Tensor, parent_state: Any, parents: torch.Tensor):
        return src.expand(levels.next_batch(tokens, parents), parent_state, B, k)

    trees = draft_trees(first_ids, first_lps, root_state, reqs.roots, steps, steps + 1 if k == 1 else num_nodes, expand)
    for b, tree, size in zip(reqs.index, trees, reqs.sizes):
        if k == 1:  # a chain of the length this request asked for
            tree = type(tree).chain(tree.tokens[0], tree.tokens[1:size])
        set_tree(step, b, tree)
    refresh_masks(step)
