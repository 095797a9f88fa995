"""Half-precision matmuls on the CPU: torch runs bf16/fp16 matmuls through oneDNN, which JIT-builds a kernel for
every new shape and (through F.linear) reorders the weight on every call. Row counts (a prefill's apart) are rounded
so a server meets a few dozen shapes (`cpu_matmul_rows`, `cpu_linear`), and each layer's weight is reordered once
at load (`pack_cpu_linears`). models/layers.skinny_linear sends a CPU half-precision matmul here; executor/warmup.py
builds the small row counts' kernels at start-up."""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

# The dtypes whose CPU matmuls run through oneDNN (float32's run through MKL, which builds nothing per shape).
HALF_DTYPES = (torch.bfloat16, torch.float16)


# From this many activation rows a matmul runs at their own count: a new count's kernels cost ~5 ms a step to build
# (the default model's four layer shapes, 517-6,190 rows, AMD EPYC), less than padding the activation would (its
# copy and the extra rows: a 966-token prefill step 0.89 -> 0.80 s, 6,190 tokens 6.47 -> 6.10 s). A weight's rows
# gathered per step stay rounded: there the matmul is a few rows and a build would cost more than it.
EXACT_ROWS_FROM = 512


def cpu_matmul_rows(rows: int, x: Optional[torch.Tensor] = None) -> int:
    """The row count a bf16/fp16 matmul of `rows` rows (of `x`, when given: the count as it is unless x is a
    half-precision CPU tensor) runs at on the CPU: up to 16 as it is, above that rounded up to eight counts an
    octave (at most 1/8 more rows).

    torch runs these matmuls through oneDNN, which builds (JIT-compiles) a kernel for every new shape and keeps
    it: ~3 ms a matrix on the developers' AMX Xeon, so an engine whose steps carry ever new token counts
    (prefill chunks beside decode rows) paid ~15 ms at each new count for the layer shapes and the LM head,
    more than such a step's matmuls themselves at a few rows. Rounded, the counts a server meets are a few
    dozen, each built once."""
    if x is not None and (x.is_cuda or x.dtype not in HALF_DTYPES):
        return rows
    if rows <= 16:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


def cpu_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, packed: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """F.linear(x, weight, bias) for x (M, K) on the CPU, its rows padded with zeros to cpu_matmul_rows(M, x)
    below EXACT_ROWS_FROM, and weight's to cpu_matmul_rows(N, weight) (rows of a weight gathered per step: the LM
    head's at a grammar's tokens), the (M, N) block of the product returned. `packed`: the weight as pack_cpu_linears
    reordered it for oneDNN, used in its place (the same product within bf16's rounding; bitwise at most
    shapes)."""
    m, n = x.shape[0], weight.shape[0]
    pm = m if m >= EXACT_ROWS_FROM else cpu_matmul_rows(m, x)
    pn = n if packed is not None else cpu_matmul_rows(n, weight)
    if pm != m:
        x = torch.cat([x, x.new_zeros(pm - m, x.shape[1])])
    if packed is not None:
        y = torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
        return y if pm == m else y[:m]
    if pn != n:
        weight = torch.cat([weight, weight.new_zeros(pn - n, weight.shape[1])])
        bias = None if bias is None else torch.cat([bias, bias.new_zeros(pn - n)])
    y = F.linear(x, weight, bias)
    return y if (pm, pn) == (m, n) else y[:m, :n]


def pack_cpu_linears(model: nn.Module, memory_share: float = 0.25) -> int:
    """Give each bf16/fp16 nn.Linear of `model` on the CPU (and a tied LM head: `model.head()`) its weight reordered
    into oneDNN's blocked layout (`cpu_packed_weight`, which skinny_linear then multiplies by): torch's F.linear
    reorders the weight on every call, and for a decode step's few rows that is a third of the matmul (the default
    model's 16-row step: layer matmuls 15 -> 9 ms on an AMX Xeon). The plain weight stays (checkpoint names, LoRA
    shapes, the tied LM head's rows), so the packed copies cost as many bytes again: none are made where they would
    take more than `memory_share` of the machine's memory. Returns how many layers were packed; none where torch has no
    oneDNN."""
    if not torch.backends.mkldnn.is_available():
        return 0
    layers = [
        m for m in model.modules() if type(m) is nn.Linear and not m.weight.is_cuda and m.weight.dtype in HALF_DTYPES
    ]
    # A tied LM head is the token embedding: packed too (the default model's, 32 rows: 9.0 -> 6.4 ms a step; one
    # row: 3.9 -> 2.5 ms on the AMD EPYC), its plain weight kept for the embedding's lookups.
    head = model.head() if hasattr(model, "head") else None
    if isinstance(head, nn.Embedding) and not head.weight.is_cuda and head.weight.dtype in HALF_DTYPES:
        layers.append(head)
    extra = sum(m.weight.numel() * m.weight.element_size() for m in layers)
    if extra > memory_share * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"):
        return 0
    for m in layers:
        m.cpu_packed_weight = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), 16)
    return len(layers)
