"""One step's batch (`ScheduleBatch`): the requests of a forward step and how many new tokens each
contributes, and the host rows the step's input is built from."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from ..forward_batch import ForwardMode
from ..request import Req
from ..speculative.tree import DraftTree
from ..speculative.verify_step import build_verify_step
from ..step import LogprobRow, StepInput


@dataclass
class VerifyPlan:
    """A VERIFY batch's draft trees (one per request, a lone root where it has no drafts), and which of
    them the runner's drafter fills in (their nodes only sized here)."""

    trees: list[DraftTree]
    model_draft: list[bool]


@dataclass(eq=False)
class ScheduleBatch:
    """The requests of one forward step and how many new tokens each contributes."""

    mode: ForwardMode
    reqs: list[Req]
    prefix_lens: list[int] = field(default_factory=list)  # kv already in the pool (EXTEND)
    extend_lens: list[int] = field(default_factory=list)  # new tokens this step (EXTEND)
    out_cache_loc: Optional[torch.Tensor] = None  # (T,) kv slots allocated for the new tokens (host)
    # DECODE: (B,) int64 kv lengths including this step's token, and request rows; set when the step
    # is built, or derived from the previous step by `next_decode` (then not recomputed).
    seq_lens_host: Optional[np.ndarray] = None
    req_pool_host: Optional[np.ndarray] = None
    derived_rows: bool = False
    # A step derived by `next_decode` from a subset of the previous step's requests: (B,) int64 rows
    # of the previous step whose sampled tokens are this step's input ids (None: all, in order).
    prev_rows: Optional[np.ndarray] = None
    # Where this step's new tokens' kv slots go, once the step is built: (req slots, positions, kv
    # slots), each (T,) int64 on the host (the device table and its host copy get the same writes).
    kv_writes: Optional[tuple[np.ndarray, np.ndarray, np.ndarray]] = None
    verify: Optional[VerifyPlan] = None  # VERIFY: the trees; out_cache_loc holds every node's slot

    @property
    def batch_size(self) -> int:
        return len(self.reqs)

    def decode_host_rows(self, ahead: int, with_input_ids: bool) -> np.ndarray:
        """(5, B) int64: input ids, positions, req_pool_indices, seq_lens, out_cache_loc of a decode step;
        (6, B) with `prev_rows` as the last row.

        `ahead`: the requests are that many tokens further along than their CPU state says (overlap).
        Without `with_input_ids` the ids row is 0 (the caller has them on the device).
        """
        reqs, n = self.reqs, len(self.reqs)
        if not self.derived_rows:  # from the requests' CPU state (again if a caller reuses the batch)
            self.seq_lens_host = (
                np.fromiter((len(r.origin_input_ids) + len(r.output_ids) for r in reqs), np.int64, n) + ahead
            )
            self.req_pool_host = np.fromiter((r.req_pool_idx for r in reqs), np.int64, n)
        rows = np.empty((5 if self.prev_rows is None else 6, n), dtype=np.int64)
        if with_input_ids:
            rows[0] = np.fromiter(
                (r.output_ids[-1] if r.output_ids else r.origin_input_ids[-1] for r in reqs), np.int64, n
            )
        else:
            rows[0] = 0
        rows[1] = self.seq_lens_host - 1
        rows[2] = self.req_pool_host
        rows[3] = self.seq_lens_host
        rows[4] = self.out_cache_loc.cpu().numpy()
        if self.prev_rows is not None:
            rows[5] = self.prev_rows
        self.kv_writes = (rows[2], rows[1], rows[4])
        return rows

    def next_decode(self, out_cache_loc: torch.Tensor, keep: Optional[list[int]] = None) -> "ScheduleBatch":
        """The decode step after this one, launched before this one's results are read (overlap), for
        the requests of rows `keep` (default: all): each is one token further, so its host rows
        follow from ours, and its input id is this step's sampled token (on the device)."""
        if keep is None or len(keep) == len(self.reqs):
            nxt = ScheduleBatch(ForwardMode.DECODE, self.reqs, out_cache_loc=out_cache_loc)
            rows = None
        else:
            nxt = ScheduleBatch(ForwardMode.DECODE, [self.reqs[j] for j in keep], out_cache_loc=out_cache_loc)
            rows = nxt.prev_rows = np.asarray(keep, dtype=np.int64)
        if self.seq_lens_host is not None:
            nxt.seq_lens_host = (self.seq_lens_host if rows is None else self.seq_lens_host[rows]) + 1
            nxt.req_pool_host = self.req_pool_host if rows is None else self.req_pool_host[rows]
            nxt.derived_rows = True
        return nxt

    def to_step(self, ahead: int = 0, ids_from_prev: bool = False) -> StepInput:
        """The step as plain data for the runner. DECODE: `ahead` tokens further than the requests' host
        state says, with the input ids taken from the previous step on the device (`ids_from_prev`)."""
        reqs = self.reqs
        if self.mode.is_verify():
            step = build_verify_step(
                [r.req_pool_idx for r in reqs],
                [r.kv_len for r in reqs],
                self.verify.trees,
                self.out_cache_loc.numpy(),
                self.verify.model_draft,
            )
            step.sample_rows = []  # every node is scored; the runner reads the trees
            step.sampling_reqs = list(range(len(reqs)))
            step.sampling = [r.sampling for r in reqs]
            self.kv_writes = step.kv_writes
            return step
        if self.mode.is_decode():
            rows = self.decode_host_rows(ahead, with_input_ids=not ids_from_prev)  # (5 or 6, B)
            everyone = list(range(len(reqs)))
            return StepInput(
                self.mode,
                len(reqs),
                rows,
                self.seq_lens_host.tolist(),
                self.kv_writes,
                sample_rows=everyone,
                sampling_reqs=everyone,
                sampling=[r.sampling for r in reqs],
                ids_from_prev=ids_from_prev,
                has_prev_rows=self.prev_rows is not None,
            )
        new_ids = itertools.chain.from_iterable(
            r.origin_input_ids[p : p + e] if p + e <= len(r.origin_input_ids) else r.fill_ids[p : p + e]
            for r, p, e in zip(reqs, self.prefix_lens, self.extend_lens)
        )
        step = StepInput.extend(
            [r.req_pool_idx for r in reqs],
            self.prefix_lens,
            self.extend_lens,
            new_ids,
            self.out_cache_loc.cpu().numpy(),
        )
        self.kv_writes = step.kv_writes
        step.following_ids = [_token_at(r, p + e) for r, p, e in zip(reqs, self.prefix_lens, self.extend_lens)]
        offset = 0
        for i, (r, pre, ext) in enumerate(zip(reqs, self.prefix_lens, self.extend_lens)):
            if pre + ext == r.seq_len and not r.prefill_only:
                step.sample_rows.append(offset + ext - 1)
                step.sampling_reqs.append(i)
                step.sampling.append(r.sampling)
            if r.needs_input_logprobs():
                prompt = r.origin_input_ids
                first = max(r.logprob_start_len, 1, pre + 1, r.input_logprob_next)
                # NOTE: a chunk's last row predicts the next chunk's first prompt token: computed here,
                # since the next chunk has no row before it.
                for pos in range(first, min(pre + ext + 1, len(prompt))):
                    step.logprob_rows.append(
                        LogprobRow(i, offset + (pos - 1 - pre), pos, prompt[pos], r.top_logprobs_num)
                    )
            if pre + ext == r.seq_len and r.prefill_only and r.return_logprob and r.top_logprobs_num:
                # max_new_tokens=0 with top logprobs: no token, but the next token's distribution (the
                # "position" past the prompt; SGLang programs read it, e.g. to branch on the top-k).
                step.logprob_rows.append(
                    LogprobRow(i, offset + ext - 1, len(r.origin_input_ids), 0, r.top_logprobs_num, next_token=True)
                )
            offset += ext
        return step


def _token_at(r: Req, i: int) -> int:
    """r.fill_ids[i] without building fill_ids; -1 past the end."""
    n = len(r.origin_input_ids)
    if i < n:
        return r.origin_input_ids[i]
    return r.output_ids[i - n] if i - n < len(r.output_ids) else -1
