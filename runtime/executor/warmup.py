"""A prefill run once at start-up on the GPU, so the first user request does not pay for first use.

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

from ..kvcache.memory_pool import ReqToTokenPool, TokenAllocator
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
