"""Top-k draft trees from a draft model (STANDALONE) or an EAGLE head, batched on the device.

Step 1 takes the top k tokens of the distribution after each request's root: the frontier. Each later
step runs the draft over the frontier (k nodes per request, `expand`), takes the top k children of each
frontier node scored by cumulative log-probability, adds all k * k to the candidates and keeps the best
k as the next frontier. The tree verified is the root and the `num_nodes - 1` best candidates: a child
never scores above its parent, and ties keep the earlier node first, so the choice holds every chosen
node's parent. With k = 1 this is a chain of greedy drafts. Sibling tokens are distinct (the top k of
one distribution), as rejection sampling needs.

`expand(tokens, parent_state, parents)` is the drafter's: the frontier's tokens (B, k), the state the
drafter attached to each one's parent (EAGLE: the draft hidden state that predicted it; None for a
draft model), and each one's parent among the nodes expanded before (B, k; -1: the root). It returns
the top-k (ids, logprobs) after each frontier node, (B, k, k) each, and each frontier node's own state.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .tree import DraftTree

Expand = Callable[[torch.Tensor, Any, torch.Tensor], tuple[torch.Tensor, torch.Tensor, Any]]


def draft_trees(
    first_ids: torch.Tensor,
    first_lps: torch.Tensor,
    root_state: Any,
    roots: list[int],
    steps: int,
    num_nodes: int,
    expand: Expand,
) -> list[DraftTree]:
    """first_ids, first_lps (B, k): the top k after each root; root_state: the drafter's state after the
    roots (per request, or None); roots (B,) the root tokens. One read back at the end."""
    B, k = first_ids.shape
    dev = first_ids.device
    pool_tokens, pool_scores, pool_parents = [first_ids], [first_lps], [torch.full((B, k), -1, device=dev)]
    frontier_tokens, frontier_scores = first_ids, first_lps  # (B, k)
    frontier_pool = torch.arange(k, device=dev).expand(B, k)  # (B, k) indices in the pool
    frontier_expanded_parent = torch.full((B, k), -1, device=dev)  # (B, k) among expanded nodes
    parent_state = _repeat_state(root_state, k)
    size = k
    for step in range(1, steps):
        child_ids, child_lps, state = expand(frontier_tokens, parent_state, frontier_expanded_parent)
        cand = (frontier_scores[:, :, None] + child_lps).reshape(B, k * k)  # (B, k*k)
        pool_tokens.append(child_ids.reshape(B, k * k))
        pool_scores.append(cand)
        pool_parents.append(frontier_pool.repeat_interleave(k, dim=1))  # (B, k*k)
        best = cand.topk(k, dim=-1).indices  # (B, k) among the candidates
        frontier_tokens = child_ids.reshape(B, k * k).gather(1, best)
        frontier_scores = cand.gather(1, best)
        frontier_pool = size + best
        frontier_expanded_parent = (step - 1) * k + best // k  # the expanded node (this step's input) above
        parent_state = _gather_state(state, best // k)
        size += k * k
    tokens, scores, parents = (torch.cat(pool_tokens, 1), torch.cat(pool_scores, 1), torch.cat(pool_parents, 1))
    take = min(num_nodes - 1, size)
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :take]  # (B, take)
    chosen = torch.sort(order, dim=1).values  # creation order: parents before children
    rows = [chosen.tolist(), tokens.gather(1, chosen).tolist(), parents.gather(1, chosen).tolist()]
    trees = []
    for b in range(B):
        where = {p: i + 1 for i, p in enumerate(rows[0][b])}  # pool index -> node index
        par = [-1] + [0 if p < 0 else where[p] for p in rows[2][b]]
        trees.append(DraftTree([roots[b], *rows[1][b]], par))
    return trees


def _repeat_state(state: Optional[torch.Tensor], k: int) -> Optional[torch.Tensor]:
    return None if state is None else state[:, None].expand(state.shape[0], k, *state.shape[1:])


def _gather_state(state: Optional[torch.Tensor], index: torch.Tensor) -> Optional[torch.Tensor]:
    """state (B, k, ...) at index (B, k) along dim 1."""
    if state is None:
        return None
    idx = index.reshape(*index.shape, *([1] * (state.dim() - 2))).expand(*index.shape, *state.shape[2:])
    return state.gather(1, idx)
