"""Pipeline parallelism: a step's requests cut into micro-batches that flow through the stages.

Stage s runs its layers on micro-batch m while stage s+1 runs micro-batch m-1 (the sends are
asynchronous), so with M micro-batches over S stages a step keeps every stage busy but for the fill
and drain (S - 1 of M + S - 1 slots). The last stage sends each micro-batch's final hidden states back
to the first, which holds the LM head and the sampler (rank 0 samples, as without stages). Each stage
writes its micro-batches' KV into its own pool (its layers only), at the slots rank 0 chose.

Micro-batches are whole requests (attention never looks across requests), as many as stages, balanced
by tokens; a stage's hidden states are re-assembled in the step's token order.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from ..executor.runner_info import RunnerInfo
from ..executor.step_forward import StepForward
from ..step import LoraRows, StepInput
from .group import RankContext


def split_micro_batches(step: StepInput, n: int) -> list[StepInput]:
    """`step` as up to `n` steps of consecutive requests (balanced by new tokens), each as the stages
    run it: token and request rows, lengths, kv writes and LoRA slots; no sampling rows (the whole step
    samples on the first stage)."""
    b = step.batch_size
    n = max(1, min(n, b))
    if step.mode.is_decode():
        bounds = np.linspace(0, b, n + 1).round().astype(int)
        cut = _decode_part
    else:
        ends = np.cumsum(step.req_rows[3])  # (B,) tokens up to and including each request
        targets = ends[-1] * np.arange(1, n) / n  # (n - 1,) where the cuts would ideally fall
        i = np.searchsorted(ends, targets)  # ends[i - 1] < target <= ends[i]
        below = np.where(i > 0, ends[np.maximum(i - 1, 0)], 0)
        cuts = np.where(targets - below <= ends[i] - targets, i, i + 1)  # requests before each cut: the nearer end
        bounds = np.unique(np.concatenate([[0], np.clip(cuts, 0, b), [b]]))
        cut = _extend_part
    return [_with_lora(cut(step, int(lo), int(hi)), step, int(lo), int(hi)) for lo, hi in zip(bounds[:-1], bounds[1:])]


def _with_lora(part: StepInput, step: StepInput, lo: int, hi: int) -> StepInput:
    """`part` (requests [lo, hi) of `step`) with its requests' LoRA slots; the step's adapter copies go
    with the first part, which every stage runs before the others."""
    if step.lora is not None:
        part.lora = LoraRows(step.lora.slots[lo:hi], step.lora.loads if lo == 0 else [])
    return part


def _decode_part(step: StepInput, lo: int, hi: int) -> StepInput:
    rows = step.token_rows[:5, lo:hi]  # (5, b)
    return StepInput(step.mode, hi - lo, rows, step.seq_lens[lo:hi], (rows[2], rows[1], rows[4]))


def _extend_part(step: StepInput, lo: int, hi: int) -> StepInput:
    req_rows = step.req_rows[:, lo:hi].copy()  # (5, b)
    t0 = int(req_rows[4, 0])
    t1 = int(req_rows[4, -1] + req_rows[3, -1])
    req_rows[4] -= t0
    tokens = step.token_rows[:, t0:t1]  # (4, t)
    return StepInput(
        step.mode,
        hi - lo,
        tokens,
        step.seq_lens[lo:hi],
        (tokens[3], tokens[1], tokens[2]),
        req_rows=req_rows,
        prefix_lens=step.prefix_lens[lo:hi],
        extend_lens=step.extend_lens[lo:hi],
    )


class StageRunner:
    """One rank's stage of the pipeline: its layers over each micro-batch of a step."""

    def __init__(self, forward: StepForward, info: RunnerInfo, ctx: RankContext):
        """`forward`: this rank's shard (its stage's layers) over its KV memory; `info`: its runner's facts."""
        self.step_forward = forward
        self.ctx = ctx
        topo = ctx.topology
        self.stage = topo.stage_of(ctx.rank)
        self.num_stages = topo.pp_size
        self.prev = topo.peer(ctx.rank, (self.stage - 1) % self.num_stages)
        self.next = topo.peer(ctx.rank, (self.stage + 1) % self.num_stages)
        self.hidden_size = info.hidden_size
        self.dtype = info.dtype
        self.device = torch.device("cuda", ctx.parallel.device_index) if info.device == "cuda" else torch.device("cpu")

    @torch.inference_mode()
    def forward(self, step: StepInput) -> Optional[torch.Tensor]:
        """This stage's part of `step`. On the first stage: the final hidden states (T, hidden) of the
        whole step, back from the last stage; elsewhere None."""
        parts = split_micro_batches(step, self.num_stages)
        model = self.step_forward.model
        dtype = self.dtype
        sends, sent = [], []  # the works, and the tensors they send (alive until done)
        if self.stage == 0:
            # The results come back from the last stage in order; their receives are posted first, so
            # the last stage's sends never wait on this rank's compute.
            finals = [torch.empty(p.num_tokens, self.hidden_size, dtype=dtype, device=self.device) for p in parts]
            receives = [dist.irecv(buf, src=self.prev) for buf in finals]
            for part in parts:
                fb = self.step_forward.prepared(part)
                sent.append(model.forward_stage(fb.input_ids, fb.positions, fb).contiguous())  # (2, t, hidden)
                sends.append(dist.isend(sent[-1], dst=self.next))
            for work in sends + receives:
                work.wait()
            return torch.cat(finals) if len(finals) > 1 else finals[0]  # (T, hidden)
        for part in parts:
            carried = torch.empty(2, part.num_tokens, self.hidden_size, dtype=dtype, device=self.device)
            dist.recv(carried, src=self.prev)
            fb = self.step_forward.prepared(part)
            # The last stage's `next` is the first: (t, hidden) final states; the others (2, t, hidden).
            sent.append(model.forward_stage(fb.input_ids, fb.positions, fb, carried).contiguous())
            sends.append(dist.isend(sent[-1], dst=self.next))
        for work in sends:
            work.wait()
        return None
