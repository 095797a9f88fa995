"""Speculative decoding's part of the scheduler: the VERIFY batch made of a decode batch, and the KV a verify
step keeps.

`upgrade` hands the decode batch (one slot per running request, allocated by `KVShortage`) to the policy
(speculative/policy.py), which asks the requests for drafts (speculative/proposer.py) when it wants them
and says which are worth verifying; when any are and the pool has their slots, the batch becomes a VERIFY
batch of every request's draft tree (a request without drafts is a one-node tree in the same step),
otherwise it stays a plain decode. `may_speculate` is the policy's answer before a decode step is planned
past the one in flight.

After the step (`commit_kv`, called by `StepResults` once the stop checks said how many of the accepted
tokens a request keeps) the `KVManager` keeps the kept nodes' slots (the table rewritten where a tree's
path is not its first nodes) and frees every other node's: rejected drafts never reach the prefix cache.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from ..forward_batch import ForwardMode
from ..request import Req
from ..server_args import ServerArgs
from ..speculative.policy import Proposal, SpeculationPolicy
from ..speculative.proposer import DraftProposer
from ..speculative.settings import SpecSettings
from ..step import StepOutput
from .batch import ScheduleBatch, VerifyPlan
from .kv_manager import KVManager


class _BatchRequests:
    """The requests of one decode step, answering the policy's questions (policy.StepRequests)."""

    def __init__(self, reqs: list[Req], proposer: DraftProposer):
        self.reqs = reqs
        self.proposer = proposer
        self.rids = tuple(r.rid for r in reqs)

    def output_lens(self) -> list[int]:
        return [len(r.output_ids) for r in self.reqs]

    def may_draft(self, guesses: bool) -> bool:
        return any(self.proposer.may_draft(r, guesses) for r in self.reqs)

    def propose(self, guesses: bool) -> list[Proposal]:
        out = []
        for r in self.reqs:
            tree, by_model = self.proposer.plan(r, guesses)
            out.append(Proposal(tree, by_model, self.proposer.state(r)))
        return out

    def skip_step(self) -> None:
        self.proposer.skip_step(self.reqs)

    def forced_possible(self) -> bool:
        return any(self.proposer.forced(r) for r in self.reqs)

    def host_sampled(self) -> bool:
        return any(r.sampling.needs_host_sampling() for r in self.reqs)


class Speculation:
    def __init__(self, server_args: ServerArgs, kv: KVManager, tokenizer: Any, context_len: int):
        self.settings = SpecSettings.of(server_args)
        self.kv = kv
        sa = server_args
        window = (sa.speculative_ngram_min_match_window_size, sa.speculative_ngram_max_match_window_size)
        self.proposer = DraftProposer(self.settings, tokenizer, window, context_len)
        self.policy = SpeculationPolicy(self.settings, forced_drafts=self.proposer.grammar_drafts is not None)
        self.clock = time.perf_counter  # what steps are timed with (scheduler tests give a fake one)
        # Request-steps verified with at least one draft, drafts proposed, drafts accepted (and kept),
        # VERIFY forward steps.
        self.totals = {
            "spec_verify_steps": 0,
            "spec_draft_tokens": 0,
            "spec_accepted_tokens": 0,
            "spec_verify_batches": 0,
        }

    @property
    def enabled(self) -> bool:
        return self.settings.enabled

    # ------------------------------------------------------------------ decisions
    def replaces_jump_forward(self, r: Req) -> bool:
        """The grammar's forced tokens are this request's drafts: jump-forward must not append them."""
        return self.proposer.forced(r) and self.proposer.eligible(r)

    def may_speculate(self, reqs: list[Req], prefill_next: bool = False) -> bool:
        """Whether the next step could be a VERIFY (so a decode step must not be launched ahead of it);
        `prefill_next`: the next step likely has prefill rows (then it never verifies)."""
        if not self.enabled:
            return False
        return self.policy.may_verify(_BatchRequests(reqs, self.proposer), self.clock(), prefill_next)

    def upgrade(self, batch: ScheduleBatch) -> ScheduleBatch:
        """The decode `batch` as a VERIFY batch of every request's draft tree, when the policy finds drafts
        worth verifying and the pool has their slots; else `batch` itself."""
        if not self.enabled:
            return batch
        proposals = self.policy.decide(_BatchRequests(batch.reqs, self.proposer), self.clock())
        out = self._verify_batch(batch, proposals) if proposals is not None else batch
        nodes = out.out_cache_loc  # (T,) a VERIFY batch's: every node of every tree
        self.policy.observed(len(nodes) if out is not batch and nodes is not None else None)
        return out

    def observe_step(self, batch: ScheduleBatch, seconds: float) -> None:
        """A step ran synchronously: a prefill between two decisions makes the time between them no
        decode or verify step's cost (those are timed between decisions: StepCosts.begin)."""
        if self.enabled and batch.mode.is_extend():
            self.policy.interrupted()

    def _verify_batch(self, batch: ScheduleBatch, proposals: list[Proposal]) -> ScheduleBatch:
        """The VERIFY batch of the proposals' trees (their draft slots allocated), or `batch` when no tree
        has drafts or the pool has no room for them."""
        trees = [p.tree for p in proposals]
        extra = sum(t.size - 1 for t in trees)
        if extra == 0:
            return batch
        loc = self.kv.alloc(extra)
        if loc is None:  # no room for drafts this step: decode as usual
            return batch
        assert batch.out_cache_loc is not None  # (a decode batch's slots, one per request)
        roots = batch.out_cache_loc.numpy()
        slots = np.empty(len(roots) + extra, dtype=np.int64)
        extra_np = loc.numpy()
        at = used = 0
        for i, t in enumerate(trees):
            slots[at] = roots[i]
            slots[at + 1 : at + t.size] = extra_np[used : used + t.size - 1]
            at += t.size
            used += t.size - 1
        self.totals["spec_verify_batches"] += 1
        plan = VerifyPlan(trees, [p.by_model for p in proposals])
        return ScheduleBatch(ForwardMode.VERIFY, batch.reqs, out_cache_loc=torch.from_numpy(slots), verify=plan)

    # ------------------------------------------------------------------ after the step
    def commit_kv(self, batch: ScheduleBatch, out: StepOutput, committed: list[int]) -> None:
        """Request i kept `committed[i]` of its accepted tokens: the slots of its root and of the first
        committed - 1 accepted drafts hold their KV now (kv_len grows by that many); the others are freed."""
        assert batch.out_cache_loc is not None and batch.verify is not None  # (a VERIFY batch's)
        slots = batch.out_cache_loc.numpy()
        kept = []
        at = 0
        for r, tree, v, m in zip(batch.reqs, batch.verify.trees, out.verified, committed):
            n = tree.size
            # (an aborted request keeps its root's KV, as a decode step's)
            kept.append((r, slots[at : at + n], [0] + v.nodes[: max(1, m) - 1]))
            at += n
            if self.proposer.record(r, v.proposed, min(len(v.nodes), m)):
                t = self.totals
                t["spec_verify_steps"] += 1
                t["spec_draft_tokens"] += v.proposed
                t["spec_accepted_tokens"] += min(len(v.nodes), m)
        self.kv.keep_tree_paths(kept)

    def stats(self) -> dict:
        t = self.totals
        steps = t["spec_verify_steps"]
        out: dict[str, Any] = {**t}
        out["avg_spec_accept_length"] = (t["spec_accepted_tokens"] + steps) / steps if steps else 0.0
        report = self.policy.report()
        if report is not None and self.settings.enabled:
            out["spec_guard"] = report
        return out
