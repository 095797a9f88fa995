"""STANDALONE drafts: a smaller model with the target's tokenizer proposes chains (top-k 1) or top-k trees.

Its KV lives at the target's slots in its own pool (draft_batch.py), kept in lockstep: after each of the
target's prefill and decode steps it runs over the same tokens (`observe`), after each verify step over
the kept path (`after_verify`). So a request's drafts always start from the draft model's view of the
whole sequence, cached prefixes and retracted requests included, and a verify step needs only the
drafting itself (`draft`): the root, then one level of the tree per step, in the scratch area.

What the drafter gets wrong costs acceptance only: the target verifies every draft.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..step import StepInput, StepOutput
from .draft_batch import DraftMemory, ancestor_rows
from .tree_draft import draft_trees
from .verify_step import refresh_masks, set_tree


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


def kept_paths(step: StepInput, out: StepOutput):
    """Per request of a VERIFY step: (its row, prefix, the kept path's slots, tokens and positions): the
    root and each accepted draft, in order down the tree."""
    starts = step.req_rows[4]
    for b, v in enumerate(out.verified):
        s, pre = int(starts[b]), int(step.prefix_lens[b])
        path = [0] + v.nodes
        slots = [int(step.token_rows[2, s + n]) for n in path]
        tokens = [int(step.token_rows[0, s + n]) for n in path]
        yield b, int(step.req_rows[0, b]), pre, slots, tokens, list(range(pre, pre + len(path))), path


class DraftModelDrafter:
    capture_layers: tuple = ()  # it reads no hidden states of the target
    needs_hidden = False

    def __init__(self, model: torch.nn.Module, memory: DraftMemory, steps: int, topk: int, num_nodes: int):
        self.model = model
        self.mem = memory
        self.steps, self.topk, self.num_nodes = steps, topk, num_nodes

    @staticmethod
    def scratch_per_row(steps: int, topk: int) -> int:
        return 1 + topk * (steps - 1)  # the root, then the frontier of each later step

    # ---- lockstep ----
    @torch.inference_mode()
    def observe(self, step: StepInput, out: StepOutput, hidden=None, fb=None) -> None:
        """The target ran a prefill or decode step: the draft's KV of the same tokens at the same slots."""
        dfb = self.mem.of_step(step)
        self._forward(dfb)

    @torch.inference_mode()
    def after_verify(self, step: StepInput, out: StepOutput, hidden=None, fb=None) -> None:
        rows, pre, slots, tokens, positions = [], [], [], [], []
        for _, row, p, s, t, pos, _ in kept_paths(step, out):
            rows.append(row)
            pre.append(p)
            slots.append(s)
            tokens.append(t)
            positions.append(pos)
        self._forward(self.mem.extend_paths(rows, pre, slots, tokens, positions))

    # ---- drafting ----
    @torch.inference_mode()
    def draft(self, step: StepInput) -> None:
        """Fill the trees of the requests the scheduler left to the runner (step.draft.model_draft)."""
        reqs = DraftRequests(step, self.mem.device)
        if not len(reqs):
            return
        k, mem, dev = self.topk, self.mem, self.mem.device
        B = len(reqs)
        steps = max(reqs.sizes) - 1 if k == 1 else self.steps  # chains: as long as the longest asked
        roots = torch.tensor(reqs.roots, dtype=torch.int64, device=dev)[:, None]  # (B, 1)
        fb = mem.tree_level(
            reqs.rows,
            roots,
            reqs.prefix[:, None],
            reqs.prefix,
            reqs.prefix_cpu,
            1,
            1,
            mem.scratch_slots(reqs.rows, 0, 1),
            None,
        )
        lps = torch.log_softmax(self._logits(fb), dim=-1)  # (B, V)
        first_lps, first_ids = lps.topk(k, dim=-1)
        M = self.scratch_per_row(steps, k)
        anc = torch.zeros(B, M, M, dtype=torch.bool, device=dev)  # column 0: the root
        anc[:, 0, 0] = True
        level = [0]

        def expand(tokens: torch.Tensor, _state, parents: torch.Tensor):
            level[0] += 1
            first = 1 + (level[0] - 1) * k  # this level's first tree column
            rows = ancestor_rows(torch.where(parents < 0, 0, parents + 1), anc, first)  # (B, k, M)
            n_cols = first + k
            fb = mem.tree_level(
                reqs.rows,
                tokens,
                reqs.prefix[:, None] + level[0],
                reqs.prefix,
                reqs.prefix_cpu,
                n_cols,
                k,
                mem.scratch_slots(reqs.rows, first, k),
                rows[:, :, :n_cols] if k > 1 else None,
            )
            lp = torch.log_softmax(self._logits(fb), dim=-1).view(B, k, -1)  # (B, k, V)
            vals, ids = lp.topk(k, dim=-1)  # (B, k, k)
            return ids, vals, None

        trees = draft_trees(
            first_ids, first_lps, None, reqs.roots, steps, steps + 1 if k == 1 else self.num_nodes, expand
        )
        for b, tree, size in zip(reqs.index, trees, reqs.sizes):
            if k == 1:  # a chain of the length this request asked for
                tree = type(tree).chain(tree.tokens[0], tree.tokens[1:size])
            set_tree(step, b, tree)
        refresh_masks(step)

    def _forward(self, fb) -> Optional[torch.Tensor]:
        self.mem.attn_backend.init_forward_metadata(fb)
        return self.model(fb.input_ids, fb.positions, fb)

    def _logits(self, fb) -> torch.Tensor:
        return self.model.compute_logits(self._forward(fb))
