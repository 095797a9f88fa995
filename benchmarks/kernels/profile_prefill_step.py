"""Where a prefill step's time goes: GPU time per kernel (torch.profiler) of one EXTEND step in which
`--batch` requests add `--new` tokens each after a cached prefix of `--prefix` tokens (shared by all of
them, as the radix cache shares it), next to the step's wall time and the matmul-rate floor.

The `fewshot` stream is this shape (256 requests, 2,000 shared + 50 new tokens, prefilled in chunks of
8,192 tokens); `--prefix 0` gives a plain prefill of `--batch` prompts of `--new` tokens.

    python benchmarks/kernels/profile_prefill_step.py --model llama-3.1-8b --batch 163 --prefix 2000 --new 50
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: bench_common

from bench_common import save  # noqa: E402
from gpu_ceilings import matmul_flops  # noqa: E402


def main() -> None:
    from plait.runtime.executor.model_runner import ModelRunner
    from plait.runtime.forward_batch import ForwardMode
    from plait.runtime.request import Req
    from plait.runtime.sampling_params import SamplingParams
    from plait.runtime.scheduler.batch import ScheduleBatch
    from plait.runtime.server_args import ServerArgs

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--batch", type=int, default=163)
    ap.add_argument("--prefix", type=int, default=2000)
    ap.add_argument("--new", type=int, default=50)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    bs, pre, new = args.batch, args.prefix, args.new
    total = pre + bs * new
    sa = ServerArgs(
        model_path=args.model,
        load_format="dummy",
        max_total_tokens=total + 64,
        max_running_requests=bs + 1,
        disable_cuda_graph=True,
        context_length=pre + new + 16,
    )
    mr = ModelRunner(sa, args.model)
    gen = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(100, 30000, (n,), generator=gen).tolist()  # noqa: E731
    shared = ids(pre)
    slots = mr.allocator.alloc(total)
    shared_slots = slots[:pre]
    if pre:  # the shared prefix, computed once by a request of its own
        first = Req("p", shared + ids(1), SamplingParams(max_new_tokens=1, temperature=0))
        first.req_pool_idx = mr.req_to_token_pool.alloc()
        mr.run(ScheduleBatch(ForwardMode.EXTEND, [first], [0], [pre], shared_slots).to_step())
    reqs = []
    for i in range(bs):
        r = Req(f"r{i}", shared + ids(new), SamplingParams(max_new_tokens=1, temperature=0))
        r.req_pool_idx = mr.req_to_token_pool.alloc()
        if pre:
            mr.req_to_token_pool.write(r.req_pool_idx, 0, shared_slots)
        reqs.append(r)
    batch_slots = slots[pre:]

    def step():
        mr.run(ScheduleBatch(ForwardMode.EXTEND, reqs, [pre] * bs, [new] * bs, batch_slots).to_step())

    step()
    torch.cuda.synchronize()
    wall = []
    for _ in range(args.steps):
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall.append((time.perf_counter() - t) * 1e3)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    per_name = collections.defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        us = ev.time_range.elapsed_us()
        if ev.device_type == torch.autograd.DeviceType.CUDA and us > 0:
            rec = per_name[ev.name[:90]]
            rec[0] += us
            rec[1] += 1
    kernel_ms = sum(v[0] for v in per_name.values()) / 1e3
    cfg = mr.model_config
    n_params = cfg.num_hidden_layers * (
        cfg.hidden_size * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
        + cfg.num_attention_heads * cfg.head_dim * cfg.hidden_size
        + 3 * cfg.hidden_size * cfg.intermediate_size
    )
    floor_ms = 2 * n_params * bs * new / matmul_flops() * 1e3
    med = statistics.median(wall)
    print(
        f"{args.model} prefill of {bs} x {new} new tokens after a shared {pre}-token prefix: step {med:.2f} ms "
        f"(wall), kernels {kernel_ms:.2f} ms, matmul floor {floor_ms:.2f} ms ({bs * new / med * 1e3:.0f} tok/s)"
    )
    rows = sorted(per_name.items(), key=lambda kv: -kv[1][0])
    for name, (us, count) in rows[:14]:
        print(f"  {us:9.1f} us  {count:4d}x  {us / max(1, count):8.2f} us each  {name}")
    save(
        f"profile_prefill_{args.model}_b{bs}_p{pre}_n{new}",
        {
            "step_ms": med,
            "kernel_ms": kernel_ms,
            "matmul_floor_ms": floor_ms,
            "kernels": [(n, us, c) for n, (us, c) in rows],
        },
    )


if __name__ == "__main__":
    main()
