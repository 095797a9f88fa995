"""A VERIFY step as plain data (`StepInput`, mode VERIFY) from each request's draft tree.

Request b with `kv_len` tokens in the cache (all but its last committed token) and a tree of n nodes
gets n new tokens: node i at sequence position kv_len + depth(i), in req_to_token at position
kv_len + i (its kv slot written there), attending to the cached prefix and to its ancestors. After the
step the scheduler keeps the slots of the accepted path, rewrites the table where a tree's path is not
its first nodes, and frees the rest (scheduler/speculation.py).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ..forward_batch import ForwardMode
from ..step import DraftRows, StepInput
from .tree import DraftTree


def build_verify_step(
    req_rows: Sequence[int],
    kv_lens: Sequence[int],
    trees: Sequence[DraftTree],
    slots: np.ndarray,
    model_draft: Optional[Sequence[bool]] = None,
) -> StepInput:
    """trees[b]: request b's tree (a model-drafted request's placeholder: its root and n - 1 zeros,
    which the runner's drafter replaces with `set_tree`); slots (T,): the nodes' kv slots, in order."""
    sizes = np.fromiter((t.size for t in trees), np.int64, len(trees))  # (B,)
    pre = np.asarray(kv_lens, dtype=np.int64)  # (B,)
    pool = np.asarray(req_rows, dtype=np.int64)  # (B,)
    starts = np.cumsum(sizes) - sizes  # (B,)
    total = int(sizes.sum())
    rows = np.empty((5, total), dtype=np.int64)
    parents = np.empty(total, dtype=np.int64)
    for b, tree in enumerate(trees):
        s = int(starts[b])
        rows[0, s : s + tree.size] = tree.tokens
        rows[1, s : s + tree.size] = pre[b] + tree.depths()
        parents[s : s + tree.size] = tree.parents
    rows[2] = slots
    rows[3] = np.repeat(pool, sizes)
    rows[4] = np.arange(total, dtype=np.int64) + np.repeat(pre - starts, sizes)  # kv_len + node index
    req = np.stack([pool, pre + sizes, pre, sizes, starts])  # (5, B)
    step = StepInput(
        ForwardMode.VERIFY,
        len(trees),
        rows,
        req[1].tolist(),
        (rows[3], rows[4], rows[2]),
        req_rows=req,
        prefix_lens=pre.tolist(),
        extend_lens=sizes.tolist(),
        draft=DraftRows(parents, list(model_draft or [False] * len(trees))),
    )
    step.draft.tree_mask = tree_masks(trees)
    return step


def tree_masks(trees: Sequence[DraftTree]) -> Optional[np.ndarray]:
    """(sum n_b^2,) bool ancestor masks, row-major per tree; None when every tree is a chain."""
    if all(t.is_chain() for t in trees):
        return None
    return np.concatenate([t.ancestor_mask().reshape(-1) for t in trees])


def step_trees(step: StepInput) -> list[DraftTree]:
    """The trees of a VERIFY step, read back from its rows."""
    out = []
    for s, n in zip(step.req_rows[4].tolist(), step.extend_lens):
        out.append(DraftTree(step.token_rows[0, s : s + n].tolist(), step.draft.parents[s : s + n].tolist()))
    return out


def set_tree(step: StepInput, b: int, tree: DraftTree) -> None:
    """Put a drafted tree into request b's rows (its node count, fixed by the scheduler, must match);
    call `refresh_masks` after the last one."""
    s, n = int(step.req_rows[4, b]), step.extend_lens[b]
    if tree.size != n:
        raise ValueError(f"a drafted tree of {tree.size} nodes in the request's {n}")
    step.token_rows[0, s : s + n] = tree.tokens
    step.token_rows[1, s : s + n] = step.prefix_lens[b] + tree.depths()
    step.draft.parents[s : s + n] = tree.parents


def refresh_masks(step: StepInput) -> None:
    step.draft.tree_mask = tree_masks(step_trees(step))
