"""Start-up runs so the first user requests do not pay for first use: a prefill on the GPU, and on the CPU the
half-precision matmuls at a decode step's row counts.

The decode path is exercised by CUDA-graph capture; nothing runs a prefill before the first request.
That request would otherwise wait while Triton compiles the prefill kernels (extend attention, the
rotary+store and norm variants a token batch takes) and cuBLAS loads its kernels for large row counts:
seconds on a fresh machine (Triton's on-disk cache makes later starts cheap). Two requests of unequal
length, the second with a cached prefix, cover both extend cases; their slots are released after.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch
from torch import nn

from ..kvcache.memory_pool import ReqToTokenPool, TokenAllocator
from ..models.cpu_matmul import HALF_DTYPES, cpu_matmul_rows
from ..models.layers import skinny_linear
from ..sampling_params import SamplingParams
from ..step import SamplingRow, StepInput, StepOutput

logger = logging.getLogger("plait.warmup")

# Long enough for the multi-tile paths of the extend kernel; short enough to cost nothing.
WARMUP_PROMPT_TOKENS = (160, 96)


def warm_up_prefill(
    run: Callable[[StepInput], StepOutput], allocator: TokenAllocator, req_to_token: ReqToTokenPool, vocab: int
) -> None:
    """Two prefill steps through `run` (a runner's), over slots and table rows taken from `allocator` and
    `req_to_token` and given back after."""
    need = sum(WARMUP_PROMPT_TOKENS)
    if allocator.available() < need or req_to_token.available() < len(WARMUP_PROMPT_TOKENS):
        return  # a pool this small is a test setup: nothing to warm
    t = time.perf_counter()
    lens, prefix = WARMUP_PROMPT_TOKENS, WARMUP_PROMPT_TOKENS[1] // 2
    prompts = [[1 + (7 * j) % (vocab - 1) for j in range(n)] for n in lens]
    greedy = SamplingParams(max_new_tokens=1, temperature=0)
    rows = [req_to_token.alloc() for _ in prompts]
    slots = allocator.alloc(need)
    try:
        # First both prompts whole, then the second one again over a cached prefix of its first half.
        whole = StepInput.extend(rows, [0, 0], lens, (t for p in prompts for t in p), slots.numpy())
        again = StepInput.extend(
            rows[1:], [prefix], [lens[1] - prefix], prompts[1][prefix:], slots[lens[0] + prefix : need].numpy()
        )
        for step, sampled in ((whole, prompts), (again, prompts[1:])):
            step.sample_rows = (step.req_rows[4] + step.req_rows[3] - 1).tolist()  # each request's last token
            step.sampling_reqs = list(range(step.batch_size))
            step.sampling = [SamplingRow(greedy, p, [], set()) for p in sampled]
            run(step)
    finally:
        allocator.free(slots)
        for row in rows:
            req_to_token.free(row)
    logger.info("prefill warm-up took %.2f s", time.perf_counter() - t)


# Row counts up to this many (as cpu_matmul_rows rounds them) are built at start-up on the CPU: a decode step's,
# and a mixed step's with a few prefill tokens. Larger counts are prefill steps, whose matmuls dwarf the build.
CPU_WARM_ROWS = 64


def warm_up_cpu_matmuls(model: nn.Module, max_rows: int = CPU_WARM_ROWS) -> None:
    """Every bf16/fp16 weight shape of `model` (its linears, a tied LM head) multiplied once at each row count
    up to `max_rows`, as a step multiplies it (models/layers.skinny_linear): torch's CPU matmul (oneDNN) builds a
    kernel for each new shape on first use, ~3 ms a matrix on an AMX Xeon (models/cpu_matmul.py), which
    the first steps of a server would otherwise pay at every layer shape. ~0.2 s for the default model."""
    layers = {}
    for module in model.modules():
        w = getattr(module, "weight", None)
        if isinstance(module, (nn.Linear, nn.Embedding)) and w is not None and w.dtype in HALF_DTYPES:
            packed = hasattr(module, "cpu_packed_weight")
            layers.setdefault((tuple(w.shape), w.dtype, getattr(module, "bias", None) is not None, packed), module)
    if not layers:
        return
    t = time.perf_counter()
    with torch.inference_mode():
        for module in layers.values():
            for rows in sorted({cpu_matmul_rows(m) for m in range(1, max_rows + 1)}):
                skinny_linear(module.weight.new_zeros(rows, module.weight.shape[1]), module)
    logger.info("CPU matmul warm-up (%d weight shapes) took %.2f s", len(layers), time.perf_counter() - t)
