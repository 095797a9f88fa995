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
from .draft_batch import DraftMemory
from .drafter import KeptPaths, TreeLevels, draft_trees_of


class DraftModelDrafter:
    """A `Drafter` (drafter.py) and its `TreeSource`: a draft model over its own KV pool."""

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
        """The target ran a verify step: the draft's KV of the kept path (the rejected nodes' is dropped)."""
        self._forward(KeptPaths.of(step, out).batch(self.mem))

    # ---- drafting (drafter.py's skeleton: a tree with a root column) ----
    root_column = True

    @torch.inference_mode()
    def draft(self, step: StepInput) -> None:
        """Fill the trees of the requests the scheduler left to the runner (step.draft.model_draft)."""
        draft_trees_of(step, self.mem, self.topk, self.steps, self.num_nodes, self)

    def first(self, levels: TreeLevels) -> tuple[torch.Tensor, torch.Tensor, None]:
        lps = torch.log_softmax(self._logits(levels.root_batch()), dim=-1)  # (B, V)
        first_lps, first_ids = lps.topk(levels.k, dim=-1)
        return first_ids, first_lps, None

    def expand(self, fb, parent_state: None, B: int, k: int) -> tuple[torch.Tensor, torch.Tensor, None]:
        lp = torch.log_softmax(self._logits(fb), dim=-1).view(B, k, -1)  # (B, k, V)
        vals, ids = lp.topk(k, dim=-1)  # (B, k, k)
        return ids, vals, None

    def _forward(self, fb) -> Optional[torch.Tensor]:
        self.mem.attn_backend.init_forward_metadata(fb)
        return self.model(fb.input_ids, fb.positions, fb)

    def _logits(self, fb) -> torch.Tensor:
        return self.model.compute_logits(self._forward(fb))
