"""Accepting drafts so that the output is the target's own.

Greedy (`accept_greedy`): walk down the tree while a child's token is the target's argmax at its parent;
the target's argmax where the walk stops is the next token. The output is token for token what
decoding without drafts gives.

Sampled (`accept_sampled`): rejection sampling with deterministic drafts (a draft is a token, not a
draw from a draft distribution: prompt lookup, forced tokens, a draft model's top-k). At a node with
target distribution p, its children c1, c2, ... are tried in order: c_i is accepted with probability
p(c_i) / (1 - p(c_1) - ... - p(c_{i-1})); when all are rejected, the next token is drawn from p with
the rejected tokens removed (renormalized). Each token so chosen has probability exactly p(t): the
sequence keeps the target's distribution (tests/spec/test_spec_units.py checks it on synthetic trees).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .tree import DraftTree


def accept_greedy(tree: DraftTree, target: Sequence[int]) -> tuple[list[int], list[int]]:
    """(tokens, nodes) where target[i] is the target's argmax after node i: the accepted drafts and the
    target's next token, and the node of each accepted draft."""
    kids = tree.children()
    node, tokens, nodes = 0, [], []
    while True:
        want = int(target[node])
        tokens.append(want)
        nxt = next((c for c in kids[node] if tree.tokens[c] == want), None)
        if nxt is None:
            return tokens, nodes
        nodes.append(nxt)
        node = nxt


def accept_sampled(
    trees: Sequence[DraftTree],
    probs: torch.Tensor,
    first_rows: Sequence[int],
    generator: Optional[torch.Generator] = None,
) -> list[tuple[list[int], list[int]]]:
    """Per tree, (tokens, nodes) as `accept_greedy`, by rejection sampling. probs (R, V): row
    first_rows[b] + i is the target's distribution after node i of tree b. Two reads from the device:
    the probabilities of the draft tokens, then the draws of the next tokens."""
    edge_rows, edge_toks = [], []
    for tree, first in zip(trees, first_rows):
        for i, p in enumerate(tree.parents[1:], 1):
            edge_rows.append(first + p)
            edge_toks.append(tree.tokens[i])
    if edge_rows:
        dev = probs.device
        p_edges = probs[torch.tensor(edge_rows, device=dev), torch.tensor(edge_toks, device=dev)].tolist()
        uniforms = torch.rand(len(edge_rows), generator=generator).tolist()
    else:
        p_edges, uniforms = [], []
    results, final_rows, removed = [], [], []
    edge = 0
    for tree, first in zip(trees, first_rows):
        kids = tree.children()
        edge_of = {}  # node -> its edge index (edges are listed in node order)
        for i in range(1, tree.size):
            edge_of[i] = edge + i - 1
        edge += tree.size - 1
        node, tokens, nodes = 0, [], []
        while True:
            rejected_mass, rejected = 0.0, []
            nxt = None
            for c in kids[node]:
                e = edge_of[c]
                left = 1.0 - rejected_mass
                if left > 0 and uniforms[e] * left < p_edges[e]:
                    nxt = c
                    break
                rejected_mass += p_edges[e]
                rejected.append(tree.tokens[c])
            if nxt is None:
                break
            tokens.append(tree.tokens[nxt])
            nodes.append(nxt)
            node = nxt
        results.append((tokens, nodes))
        final_rows.append(first + node)
        removed.append(rejected)
    nxt_tokens = _draw_without(probs, final_rows, removed, generator)
    for (tokens, _), tok in zip(results, nxt_tokens):
        tokens.append(tok)
    return results


def _draw_without(
    probs: torch.Tensor, rows: list[int], removed: list[list[int]], generator: Optional[torch.Generator]
) -> list[int]:
    """One token per row of probs[rows], with the tokens in `removed[i]` taken out (renormalizing is
    implied: the draw is an exponential race, argmax of p / Exp(1))."""
    dev = probs.device
    p = probs.index_select(0, torch.tensor(rows, device=dev))  # (n, V)
    at = [(i, t) for i, toks in enumerate(removed) for t in toks]
    if at:
        keep = p.clone()
        keep[torch.tensor([i for i, _ in at], device=dev), torch.tensor([t for _, t in at], device=dev)] = 0.0
        # NOTE: a row whose whole mass was on rejected tokens (only by rounding: each was rejected with
        # probability 1 - p(c)/left < 1) falls back to its full distribution.
        empty = keep.sum(dim=-1, keepdim=True) <= 0
        p = torch.where(empty, p, keep)
    noise = torch.empty(p.shape, dtype=p.dtype).exponential_(generator=generator).to(dev)
    return (p / noise).argmax(dim=-1).tolist()
