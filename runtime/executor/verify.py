"""The model runner's VERIFY steps: every node of every request's draft tree scored in one forward (eager,
or a CUDA graph: verify_graphs.py), then the drafts accepted (speculative/acceptance.py) and the
target's logprobs read for what was.

The logits of a node are adjusted as a decode step's would be for the same tokens (logit bias, and the
grammar mask after the node's path: speculative/grammar_drafts.py walks each matcher down its tree and
back), then greedy requests take the longest match and sampled ones rejection-sample. Requests with
penalties, a pending min_new_tokens or a seed never get drafts (scheduler/speculation.py), so nothing
here depends on a node's depth beyond its grammar state.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..constrained.bitmask import allocate_token_bitmask, apply_token_bitmask_inplace, unpack_bitmask
from ..speculative.acceptance import accept_greedy, accept_sampled
from ..speculative.grammar_drafts import fill_tree_bitmask
from ..speculative.tree import DraftTree
from ..speculative.verify_step import step_trees
from ..step import StepInput, StepOutput, VerifiedTokens
from .sampler import (
    NARROW_TOKENS,
    SamplingBatchInfo,
    apply_logit_adjustments,
    compute_logprobs,
    greedy_tokens,
    sampling_probs,
)
from .step_forward import StepForward


class VerifySteps:
    """The model runner's part that runs VERIFY steps over the target's forward (and, on a GPU, their
    CUDA graphs)."""

    def __init__(self, forward: StepForward, vocab_size: int):
        self.forward = forward
        self.vocab_size = vocab_size
        self.verifier = Verifier(vocab_size)
        self.graphs = None  # verify_graphs.VerifyGraphRunner, GPU

    def capture_graphs(self, nodes: int, max_bs: int, capture_layers: tuple) -> None:
        from .verify_graphs import VerifyGraphRunner

        f = self.forward
        self.graphs = VerifyGraphRunner(f.model, f.memory, self.vocab_size, nodes, max_bs, capture_layers, f.lora)

    def run(self, step: StepInput, capture_layers: tuple = ()) -> tuple[StepOutput, torch.Tensor, Any]:
        """(what each request accepted, the nodes' hidden states (T, hidden), an object whose
        `captured_hidden` holds the inputs of `capture_layers`)."""
        if self.graphs is not None and self.graphs.can_run(step) and capture_layers == self.graphs.capture_layers:
            self.forward.write_adapters(step)
            logits, hidden, captured = self.graphs.replay(step)
            return self.verifier.accept(step, logits), hidden, CapturedStates(captured)
        fb = self.forward.batch(step)
        if capture_layers:
            fb.capture_layers, fb.captured_hidden = capture_layers, []
        hidden = self.forward.hidden(fb)  # (T, hidden)
        return self.verifier.score(step, hidden, self.forward.model), hidden, fb


class CapturedStates:
    """A graph-replayed verify step's captured layer inputs (what a drafter reads of a ForwardBatch)."""

    def __init__(self, captured_hidden: Optional[list]):
        self.captured_hidden = captured_hidden


class Verifier:
    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self._bitmask: Optional[torch.Tensor] = None  # (rows, W) int32 on the host

    def score(self, step: StepInput, hidden: torch.Tensor, model) -> StepOutput:
        """What each request accepted, from the nodes' hidden states (T, hidden) and the model's LM head.
        On the CPU, when every request is greedy (no logprobs, no bias) and one has a grammar, the masks
        are filled first and a node the grammar allows few tokens at gets logits for those alone (-inf
        elsewhere, as its mask would make them): its argmax under the mask is the same."""
        rows = step.sampling
        if (
            hidden.is_cuda
            or model.parallel.tp.size != 1
            or not any(r.grammar is not None for r in rows)
            or any(not r.params.is_greedy or r.return_logprob or r.params.logit_bias for r in rows)
        ):
            return self.accept(step, model.compute_logits(hidden))  # (T, V): every node is scored whole
        trees = step_trees(step)
        filled = self._fill(rows, trees, step.req_rows[4].tolist(), hidden.shape[0])
        return self.accept(step, self._narrow_logits(hidden, model, *filled), trees, filled)

    def _narrow_logits(self, hidden: torch.Tensor, model, bitmask: torch.Tensor, masked: list[int]) -> torch.Tensor:
        """(T, V) float32: whole rows for the nodes without a narrow mask, the allowed tokens' alone else."""
        total = hidden.shape[0]
        narrow: dict[int, torch.Tensor] = {}
        if masked:
            allowed = unpack_bitmask(bitmask[masked], self.vocab_size)  # (M, V)
            counts = allowed.sum(dim=1).tolist()
            for i, row, n in zip(range(len(masked)), masked, counts):
                if n <= NARROW_TOKENS:
                    narrow[row] = allowed[i].nonzero().squeeze(1)  # (n,) the allowed token ids
        whole = [i for i in range(total) if i not in narrow]
        if not narrow:
            return model.compute_logits(hidden)
        logits = torch.full((total, self.vocab_size), float("-inf"), dtype=torch.float32)
        if whole:
            logits[whole] = model.compute_logits(hidden[whole])
        for row, ids in narrow.items():
            logits[row, ids] = model.logits_at(hidden[row : row + 1], ids)[0]  # (n,)
        return logits

    def accept(
        self,
        step: StepInput,
        logits: torch.Tensor,
        trees: Optional[list[DraftTree]] = None,
        filled: Optional[tuple[torch.Tensor, list[int]]] = None,
    ) -> StepOutput:
        """logits (T, V) float32 of every node of the step (the raw model's) -> what each request accepted.
        `filled`: the grammar masks, when `score` filled them already (`_fill`)."""
        trees = trees or step_trees(step)
        starts = step.req_rows[4].tolist()
        rows = step.sampling  # per request (every request of a VERIFY step samples)
        want_lp = [r.return_logprob for r in rows]
        raw = logits.clone() if any(want_lp) else None
        node_rows = [r for r, t in zip(rows, trees) for _ in range(t.size)]  # (T,) each node's request row
        if any(not r.plain_greedy() for r in rows):
            info = SamplingBatchInfo.from_rows(node_rows, logits.shape[1], logits.device)
            apply_logit_adjustments(logits, node_rows, info)
            if info.has_grammar:
                self._mask(logits, rows, trees, starts, filled or self._fill(rows, trees, starts, logits.shape[0]))
        greedy = [b for b, r in enumerate(rows) if r.params.is_greedy]
        sampled = [b for b, r in enumerate(rows) if not r.params.is_greedy]
        accepted: list = [None] * len(rows)
        if greedy:
            target = greedy_tokens(logits).tolist()  # (T,) every node's argmax (one read back)
            for b in greedy:
                s = starts[b]
                accepted[b] = accept_greedy(trees[b], target[s : s + trees[b].size])
        if sampled:
            node_index = torch.tensor(
                [starts[b] + i for b in sampled for i in range(trees[b].size)], device=logits.device
            )
            sub_rows = [rows[b] for b in sampled for _ in range(trees[b].size)]
            info = SamplingBatchInfo.from_rows(sub_rows, logits.shape[1], logits.device)
            probs = sampling_probs(logits.index_select(0, node_index), info)  # (T_s, V)
            firsts, offset = [], 0
            for b in sampled:
                firsts.append(offset)
                offset += trees[b].size
            for b, res in zip(sampled, accept_sampled([trees[b] for b in sampled], probs, firsts)):
                accepted[b] = res
        out = StepOutput(
            next_token_ids=[toks[-1] for toks, _ in accepted],
            output_logprobs=[None] * len(rows),
            input_logprobs=[[] for _ in rows],
        )
        out.verified = [VerifiedTokens(toks, nodes, proposed=t.size - 1) for (toks, nodes), t in zip(accepted, trees)]
        if raw is not None:
            self._logprobs(raw, rows, out.verified, starts)
        return out

    def _fill(self, rows, trees: list[DraftTree], starts: list[int], total: int) -> tuple[torch.Tensor, list[int]]:
        """The (T, W) grammar masks of every node (fill_tree_bitmask) and the rows they apply to."""
        if self._bitmask is None or self._bitmask.shape[0] < total:
            self._bitmask = allocate_token_bitmask(max(total, 64), self.vocab_size)
        bitmask = self._bitmask[:total]  # (T, W)
        masked = []
        for b, r in enumerate(rows):
            if r.grammar is None:
                continue
            fill_tree_bitmask(r.grammar, trees[b], bitmask, starts[b])
            masked.extend(range(starts[b], starts[b] + trees[b].size))
        return bitmask, masked

    def _mask(
        self,
        logits: torch.Tensor,
        rows,
        trees: list[DraftTree],
        starts: list[int],
        filled: tuple[torch.Tensor, list[int]],
    ) -> None:
        bitmask, masked = filled
        for b, r in enumerate(rows):
            if r.grammar is not None:
                # The root's row as a decode step's (GrammarMasker): narrowed by its logits where the grammar
                # steers by the budget (the matcher is back at the root's state). The drafts' rows are plain
                # masks: where the budget would steer at a draft's node, the commit asks the grammar whether
                # plain decoding writes that node's token (GrammarMatcher.keeps_verified).
                r.grammar.refine_bitmask(logits[starts[b]], bitmask[starts[b]])
        apply_token_bitmask_inplace(logits, bitmask, masked)

    @staticmethod
    def _logprobs(raw: torch.Tensor, rows, verified: list[VerifiedTokens], starts: list[int]) -> None:
        """The raw model's logprob of each committed token at the node before it (as a decode step
        reports them), for the requests that asked."""
        want = [b for b, r in enumerate(rows) if r.return_logprob]
        at, toks = [], []
        for b in want:
            path = [0] + verified[b].nodes  # node j predicts tokens[j]
            at.extend(starts[b] + n for n in path)
            toks.extend(verified[b].tokens)
        top_k = max(rows[b].top_logprobs_num for b in want)
        dev = raw.device
        chosen, top_v, top_i = compute_logprobs(
            raw.index_select(0, torch.tensor(at, device=dev)), torch.tensor(toks, device=dev), top_k
        )
        chosen = chosen.tolist()
        top_v = top_v.tolist() if top_v is not None else None
        top_i = top_i.tolist() if top_i is not None else None
        j = 0
        for b in want:
            k = rows[b].top_logprobs_num
            lps = []
            for _ in verified[b].tokens:
                top = list(zip(top_v[j][:k], top_i[j][:k])) if (k and top_v is not None) else None
                lps.append((chosen[j], top))
                j += 1
            verified[b].logprobs = lps
