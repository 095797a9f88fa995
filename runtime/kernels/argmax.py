"""Row-wise argmax over a large vocabulary: greedy decoding's token choice, in two short launches.

torch.argmax reduces one row with a single thread block, which over a 128k vocabulary takes more than a
whole decode layer's norms and activations together. Here stage 1 splits every
row into CHUNK-wide pieces (one program each) and stage 2 picks the best piece per row.

Ties go to the lowest index, like torch.argmax: within a piece tl.argmax keeps the first maximum, and
stage 2 keeps the first piece holding the row's maximum. Rows that are all -inf give index 0. NaNs
are not expected (logits of a healthy model) and are not handled specially.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import check_device, next_power_of_2, pdl_launch_args, pdl_wait_then_release

CHUNK = 4096  # vocabulary entries per stage-1 program


@triton.jit
def _argmax_chunks_kernel(X, PartVal, PartIdx, vocab, stride_x, num_chunks, CHUNK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_wait_then_release(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)  # (CHUNK,)
    x = tl.load(X + row * stride_x + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
    best = tl.argmax(x, axis=0, tie_break_left=True)
    tl.store(PartVal + row * num_chunks + chunk, tl.max(x, axis=0))
    tl.store(PartIdx + row * num_chunks + chunk, chunk * CHUNK + best)


@triton.jit
def _argmax_merge_kernel(PartVal, PartIdx, Out, num_chunks, BLOCK_C: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_wait_then_release(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)  # (BC,)
    mask = offs < num_chunks
    vals = tl.load(PartVal + row * num_chunks + offs, mask=mask, other=float("-inf"))
    best = tl.argmax(vals, axis=0, tie_break_left=True)
    tl.store(Out + row, tl.load(PartIdx + row * num_chunks + best).to(tl.int64))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """(B, V) -> (B,) int64 index of each row's maximum (first one on ties). No host sync."""
    check_device("argmax_rows", x)
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"argmax_rows expects (B, V) with unit stride on V, got {tuple(x.shape)}")
    rows, vocab = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    if vocab == 0:
        raise ValueError("argmax_rows over an empty vocabulary")
    num_chunks = triton.cdiv(vocab, CHUNK)
    pdl = pdl_launch_args(x.device)
    part_val = torch.empty(rows, num_chunks, dtype=torch.float32, device=x.device)
    part_idx = torch.empty(rows, num_chunks, dtype=torch.int32, device=x.device)
    _argmax_chunks_kernel[(rows, num_chunks)](
        x, part_val, part_idx, vocab, x.stride(0), num_chunks, CHUNK=CHUNK, num_warps=8, **pdl
    )
    _argmax_merge_kernel[(rows,)](
        part_val, part_idx, out, num_chunks, BLOCK_C=max(2, next_power_of_2(num_chunks)), num_warps=1, **pdl
    )
    return out
