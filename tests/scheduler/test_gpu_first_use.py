"""Start-up compiles every kernel a request can take: after it, no batch waits for a Triton compile.

Triton compiles a kernel variant per set of constexprs and per specialization of each integer argument
(== 1, a multiple of 16, other). Start-up runs a prefill warm-up and captures the decode graphs; a user
batch that reaches a variant those missed waits for its compile (~0.35 s on an H200 for the decode
matmul: multiturn's first round ran 1.35-1.50 s instead of ~1.0). The scheduler's CompileWatch counts
compiles after start-up; here prefills of every request count from 1 to 40 and odd token counts, then
decode, must compile nothing.
"""

from __future__ import annotations

import random

import pytest
from test_scheduler_state import run_until_idle, submit

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3: the q/k norms (rmsnorm over heads)
def test_gpu_no_kernel_compiles_after_start_up(random_models, arch):
    from plait.runtime.scheduler.scheduler import create_scheduler
    from plait.runtime.server_args import ServerArgs

    path = random_models[arch]
    s = create_scheduler(ServerArgs(model_path=path, device="cuda", max_total_tokens=32768), path)
    assert s.compile_watch.count == 0
    rng = random.Random(0)
    n = 0
    for batch in range(1, 41):  # prefills of every request count (the LM head takes one row per request)
        for _ in range(batch):
            submit(
                s,
                f"r{n}",
                [rng.randrange(2, 256) for _ in range(rng.randrange(1, 90))],
                max_new_tokens=rng.randrange(1, 4),
                **GREEDY,
            )
            n += 1
        finals = run_until_idle(s)
        assert len(finals) == batch
    stats = s.get_stats()
    assert stats["kernel_compiles_after_startup"] == 0, stats["kernels_compiled_after_startup"]
