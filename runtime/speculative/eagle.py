"""EAGLE / EAGLE-3 drafts: a head that reads the target's hidden states (feature-level drafting).

The head's KV entry at position t is computed from the token at t + 1 and the target's feature at t
(eagle_head.py), so it is written one token behind the target, in lockstep: after a prefill over tokens
x_p .. x_{p+e-1} the head runs over (x_{p+1} .. x_{p+e-1}, then the token after: the sampled one, or
the next prompt token of a chunk) with the target's features at p .. p+e-1; after a decode step over
(its sampled token, the step's feature); after a verify step over the kept path's next tokens and the
target's features at the path's nodes. The last row of each gives the head's state for the request's
next drafts (the distribution of the token after the next one and the head's own feature there),
kept per request row on the device.

Drafting (`draft`) then starts from that state: the top k after the root, then one tree level per step,
each node's entry at the position of its parent, fed its parent's output feature, in the scratch area.
"""

from __future__ import annotations

import numpy as np
import torch

from ..step import StepInput, StepOutput
from .draft_batch import DraftMemory
from .drafter import KeptPaths, TreeLevels, draft_trees_of
from .eagle_head import EagleHead


class EagleDrafter:
    """A `Drafter` (drafter.py) and its `TreeSource`: an EAGLE / EAGLE-3 head over the target's features."""

    needs_hidden = True

    def __init__(self, head: EagleHead, memory: DraftMemory, steps: int, topk: int, num_nodes: int, max_rows: int):
        self.head = head
        self.mem = memory
        self.steps, self.topk, self.num_nodes = steps, topk, num_nodes
        hc = head.hc
        self.capture_layers = hc.capture_layers()
        dev, h = memory.device, hc.model.hidden_size
        dtype = head.fc.weight.dtype
        # Per request row: the head's state after the last token it saw (see the module doc).
        self.next_feature = torch.zeros(max_rows, h, dtype=dtype, device=dev)
        self.next_ids = torch.zeros(max_rows, topk, dtype=torch.int64, device=dev)
        self.next_lps = torch.zeros(max_rows, topk, dtype=torch.float32, device=dev)

    @staticmethod
    def scratch_per_row(steps: int, topk: int) -> int:
        return max(1, topk * (steps - 1))

    def feature(self, hidden: torch.Tensor, fb) -> torch.Tensor:
        """The target's feature rows: its last hidden state (EAGLE), or three layers' inputs (EAGLE-3)."""
        if self.head.hc.kind == "EAGLE":
            return hidden
        at = self.capture_layers
        return torch.cat([fb.captured_hidden[at.index(a + 1)] for a in self.head.hc.aux_layer_ids], dim=-1)

    # ---- lockstep ----
    @torch.inference_mode()
    def observe(self, step: StepInput, out: StepOutput, hidden: torch.Tensor, fb) -> None:
        feature = self.feature(hidden, fb)  # (T, f)
        dfb = self.mem.of_step(step)
        if step.mode.is_decode():
            ids = torch.tensor(out.next_token_ids, dtype=torch.int64, device=self.mem.device)
            last = list(range(step.batch_size))
            self._run(ids, feature, dfb, last, step.token_rows[2].tolist())
            return
        # EXTEND: each request's tokens shifted by one, with the token after its last one.
        ids = step.token_rows[0].copy()
        following = list(step.following_ids or [-1] * step.batch_size)
        for i, tok in zip(step.sampling_reqs, out.next_token_ids):
            if tok is not None:
                following[i] = tok
        last, rows = [], []
        for b, (s, e) in enumerate(zip(step.req_rows[4].tolist(), step.extend_lens)):
            ids[s : s + e - 1] = step.token_rows[0, s + 1 : s + e]
            ids[s + e - 1] = max(following[b], 0)  # unknown (a prefill-only request): its entry goes unused
            if following[b] >= 0:
                last.append(s + e - 1)
                rows.append(int(step.req_rows[0, b]))
        self._run(self.mem.upload(ids), feature, dfb, last, rows)

    @torch.inference_mode()
    def after_verify(self, step: StepInput, out: StepOutput, hidden: torch.Tensor, fb) -> None:
        feature = self.feature(hidden, fb)  # (T, f) of every node
        kept = KeptPaths.of(step, out, next_tokens=True)
        dfb = kept.batch(self.mem)
        feats = feature.index_select(0, torch.tensor(kept.nodes, device=feature.device))
        last = list(np.cumsum([len(s) for s in kept.slots]) - 1)
        self._run(dfb.input_ids, feats, dfb, last, kept.rows)

    def _run(self, ids: torch.Tensor, feature: torch.Tensor, dfb, last: list[int], rows: list[int]) -> None:
        """The head over (ids, feature) of dfb's tokens; the rows `last` (one per request row in `rows`)
        become those requests' next-draft state."""
        self.mem.attn_backend.init_forward_metadata(dfb)
        logits, out = self.head(ids, feature, dfb.positions, dfb)
        if not last:
            return
        dev = out.device
        sel = torch.tensor(last, device=dev)
        r = torch.tensor(rows, device=dev)
        lps, ids_k = torch.log_softmax(logits.index_select(0, sel), dim=-1).topk(self.topk, dim=-1)
        self.next_feature[r] = out.index_select(0, sel).to(self.next_feature.dtype)
        self.next_ids[r] = self.head.to_target_ids(ids_k)
        self.next_lps[r] = lps

    # ---- drafting (drafter.py's skeleton: a tree without a root column) ----
    root_column = False

    @torch.inference_mode()
    def draft(self, step: StepInput) -> None:
        draft_trees_of(step, self.mem, self.topk, self.steps, self.num_nodes, self)

    def first(self, levels: TreeLevels) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The head's state after each root, kept from its lockstep run."""
        rows = levels.reqs.rows
        return self.next_ids[rows], self.next_lps[rows], self.next_feature[rows]

    def expand(
        self, fb, parent_feature: torch.Tensor, B: int, k: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each frontier node's entry at the position of its parent, fed its parent's output feature."""
        self.mem.attn_backend.init_forward_metadata(fb)
        logits, out = self.head(fb.input_ids, parent_feature.reshape(B * k, -1), fb.positions, fb)
        vals, ids = torch.log_softmax(logits, dim=-1).view(B, k, -1).topk(k, dim=-1)  # (B, k, k)
        return self.head.to_target_ids(ids), vals, out.view(B, k, -1)
