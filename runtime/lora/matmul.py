"""The segmented LoRA matmul: a batch whose rows belong to different adapters (or none) gets each row's
adapter added beside the base projection, y += (x @ A^T) @ B^T, A and B the row's adapter's in the pool.

Two ways to pick each row's A and B, one result:
- segments (eager steps): the step's rows are its requests' runs of tokens, one adapter each, known on
  the host; each run of one adapter is two small matmuls over a slice. Rows of the base model (slot 0)
  are not touched at all.
- gathered (what a CUDA graph can hold): each token's slot is data, (T,) on the device, and A and B are
  gathered per token (a batched matmul); slot 0 holds zeros, so base rows add exactly zero. No host
  value decides anything, so a graph captured once replays with any adapters in any rows.

On a GPU both are the Triton SGMV kernels (sgmv.py): the runs as segments, or one segment per token. The
model starts a target's shrink before its base matmul (`begin`) and adds the expand after it (`finish`):
the shrink reads only x, so in a CUDA graph it runs on a stream of its own beside the base matmul.
NOTE: cuBLAS's two matmuls per run (`add_runs_by_matmul` on a GPU) measured 1.2-7x slower than the kernels
for runs of 16 to 1,024 rows on an H100 (bench_sgmv.py's runs rows), so prefills take the kernels too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from ..uploads import to_device
from .slots import LoraSlots

if TYPE_CHECKING:
    from .sgmv import Segments, Shrunk

# NOTE: in a CUDA graph (decode), the shrink on a second stream, where it may run beside the base
# projection's matmul: the 32 x 8 cell of bench_lora 0.844x -> 0.856x the base (H100). Not in eager steps,
# where the streams' joins cost host time a short prefill waits for (no graph hides it).
OVERLAP_SHRINK = True
_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


class Pending:
    """A target's adapters begun over x (`LoraBatch.begin`), waiting for the base projection's y."""

    def __init__(
        self,
        layer: int,
        target: str,
        x: torch.Tensor,
        shrunk: "Optional[Shrunk]",
        stream: Optional[torch.cuda.Stream],
    ):
        self.layer, self.target, self.x = layer, target, x
        self.shrunk = shrunk  # the GPU's partials (None on the CPU, or with no adapter rows)
        self.stream = stream  # where the shrink was launched, if not the current stream


def add_runs_by_matmul(
    runs: list[tuple[int, int, int]],
    a_all: torch.Tensor,
    b_all: torch.Tensor,
    layer: int,
    rank: int,
    splits: list[int],
    x: torch.Tensor,
    y: torch.Tensor,
) -> None:
    """y[start:end] += x[start:end] @ A^T @ B^T for each (start, end, slot) run, A and B the slot's at
    `layer` in `a_all` (S+1, L, subs * R, in) and `b_all` (S+1, L, out, R); `splits` the sub-projections'
    output sizes (each its own R columns of the shrunk rows)."""
    for start, end, slot in runs:
        shrunk = x[start:end] @ a_all[slot, layer].t()  # (n, subs * R)
        out = 0
        for j, size in enumerate(splits):
            b = b_all[slot, layer, out : out + size]  # (size, R)
            # NOTE: the product rounded to y's dtype, then added (not one fused addmm_): PEFT's unmerged
            # forward rounds the same way, so low-precision outputs follow it more closely
            y[start:end, out : out + size] += shrunk[:, j * rank : (j + 1) * rank] @ b.t()
            out += size


class LoraBatch:
    """One step's adapters, as the model's projections read them (`ForwardBatch.lora`)."""

    def __init__(
        self,
        slots: LoraSlots,
        token_slots: torch.Tensor,
        segments: Optional[list[tuple[int, int, int]]] = None,
    ):
        self.pool = slots
        self.token_slots = token_slots  # (T,) int64 on the device: each token's slot (0: no adapter)
        # (first token, end, slot) runs of one adapter, base runs left out; None: gather per token.
        self.segments = segments
        # On a GPU, the same as device data for the Triton kernels, made once per step (every layer reads it).
        self.device_segments: Optional[Segments] = None
        if token_slots.is_cuda:
            # (imported here: Triton is a GPU dependency; a CPU process never loads it)
            from .sgmv import Segments

            on_host = segments is not None
            self.device_segments = (
                Segments.of_runs(segments, token_slots.device) if on_host else Segments.per_token(token_slots)
            )

    @classmethod
    def of_rows(cls, slots: LoraSlots, request_slots: list[int], tokens_per_request: list[int]) -> "LoraBatch":
        """Requests in step order with their slot and their number of new tokens (contiguous in T)."""
        segments: list[tuple[int, int, int]] = []
        start = 0
        for slot, n in zip(request_slots, tokens_per_request):
            if slot and segments and segments[-1][2] == slot and segments[-1][1] == start:
                segments[-1] = (segments[-1][0], start + n, slot)  # the same adapter continues the run
            elif slot and n:
                segments.append((start, start + n, slot))
            start += n
        token_slots = to_device(
            torch.repeat_interleave(
                torch.tensor(request_slots, dtype=torch.int64), torch.tensor(tokens_per_request, dtype=torch.int64)
            ),
            slots.device,
        )
        return cls(slots, token_slots, segments)

    def begin(self, layer: int, target: str, x: torch.Tensor) -> Pending:
        """Start the adapters of the base projection `target` of layer `layer` over x (T, in), before the
        base matmul: on a GPU, the shrink (on a side stream in a graph's capture, with OVERLAP_SHRINK)."""
        if self.device_segments is None:
            return Pending(layer, target, x, None, None)
        from .sgmv import sgmv_shrink

        if x.stride(-1) != 1:
            x = x.contiguous()
        a_all = self.pool.a[target]  # (S+1, L, subs * R, in)
        rank, splits = self.pool.max_rank, self.pool.out_splits[target]
        if not (OVERLAP_SHRINK and torch.cuda.is_current_stream_capturing()):
            return Pending(layer, target, x, sgmv_shrink(self.device_segments, a_all, layer, rank, splits, x), None)
        side = _side_stream(x.device)
        side.wait_stream(torch.cuda.current_stream(x.device))  # x is written
        # (the partials are allocated on this stream, which waits for the side one in `finish`, before it
        # reads them or drops them or x)
        shrunk = sgmv_shrink(self.device_segments, a_all, layer, rank, splits, x, stream=side)
        return Pending(layer, target, x, shrunk, side)

    def finish(self, pending: Pending, y: torch.Tensor) -> torch.Tensor:
        """y (T, out) of the base projection begun as `pending`, with each row's adapter added (in place
        where y is written; returned)."""
        if pending.stream is not None:
            torch.cuda.current_stream(y.device).wait_stream(pending.stream)
        if self.device_segments is not None:
            if pending.shrunk is None:
                return y
            from .sgmv import sgmv_expand

            return sgmv_expand(pending.shrunk, self.pool.b[pending.target], pending.layer, y)
        return self.apply(pending.layer, pending.target, pending.x, y)

    def apply(self, layer: int, target: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (T, out) of the base projection `target` of layer `layer` over x (T, in), with each row's
        adapter added (in place where y is written; returned)."""
        a_all, b_all = self.pool.a[target], self.pool.b[target]  # (S+1, L, n*R, in), (S+1, L, out, R)
        rank, splits = self.pool.max_rank, self.pool.out_splits[target]
        if self.device_segments is not None:
            return self.finish(self.begin(layer, target, x), y)
        if self.segments is not None:
            add_runs_by_matmul(self.segments, a_all, b_all, layer, rank, splits, x, y)
            return y
        a = a_all[:, layer].index_select(0, self.token_slots)  # (T, subs * R, in)
        shrunk = torch.bmm(a, x.unsqueeze(-1))  # (T, subs * R, 1)
        out = 0
        for j, size in enumerate(splits):
            b = b_all[:, layer, out : out + size].index_select(0, self.token_slots)  # (T, size, R)
            y[:, out : out + size] += torch.bmm(b, shrunk[:, j * rank : (j + 1) * rank]).squeeze(-1)  # (T, size)
            out += size
        return y
