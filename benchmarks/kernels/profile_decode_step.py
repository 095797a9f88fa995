"""Where a decode step's time goes: GPU time per kernel (torch.profiler over eager steps) next to the
CUDA-graph step time, for one batch size and context length.

The difference between the graph step and the sum of kernel times is the launch gaps between kernels
inside the graph; the per-kernel table says which ops are worth fusing or rewriting.

    python benchmarks/kernels/profile_decode_step.py --model llama-3.1-8b --batch-size 1 --context 512
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: bench_common

from bench_common import parse_engine_args, save  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    from plait.runtime.executor.model_runner import ModelRunner
    from plait.runtime.forward_batch import ForwardMode
    from plait.runtime.request import Req
    from plait.runtime.sampling_params import SamplingParams
    from plait.runtime.scheduler.batch import ScheduleBatch
    from plait.runtime.server_args import ServerArgs

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument(
        "--ragged",
        type=float,
        default=0.0,
        metavar="SPREAD",
        help="contexts drawn uniformly from context x [1 - SPREAD, 1 + SPREAD] (same mean)",
    )
    ap.add_argument(
        "--scatter",
        action="store_true",
        help="kv slots in random order, as a long-running pool's free list hands them out, "
        "instead of one contiguous run per request",
    )
    ap.add_argument("--trace", default=None, help="write the graph replays' Chrome trace (kernel timeline) here")
    ap.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other ServerArgs field, e.g. --engine-arg quantization=fp8 --engine-arg kv_cache_dtype=fp8_e4m3",
    )
    args = ap.parse_args()
    bs, ctx = args.batch_size, args.context
    gen = torch.Generator().manual_seed(0)
    spread = int(ctx * args.ragged)
    lens = torch.randint(ctx - spread, ctx + spread + 1, (bs,), generator=gen).tolist() if spread else [ctx] * bs
    longest = max(lens)
    sa = ServerArgs(
        model_path=args.model,
        load_format="dummy",
        max_total_tokens=sum(lens) + 64 * bs + 64,
        max_running_requests=bs,
        cuda_graph_max_bs=bs,
        context_length=longest + 80,
        **parse_engine_args(args.engine_arg),
    )
    mr = ModelRunner(sa, args.model)
    reqs = []
    for i in range(bs):
        r = Req(
            f"r{i}",
            torch.randint(100, 30000, (lens[i],), generator=gen).tolist(),
            SamplingParams(max_new_tokens=64, temperature=0, ignore_eos=True),
        )
        r.req_pool_idx = mr.req_to_token_pool.alloc()
        reqs.append(r)
    slots = mr.allocator.alloc(sum(lens))
    if args.scatter:
        slots = slots[torch.randperm(slots.numel(), generator=gen)]
    out = mr.run(ScheduleBatch(ForwardMode.EXTEND, reqs, [0] * bs, lens, slots).to_step())
    for r, n, tok in zip(reqs, lens, out.next_token_ids):
        r.output_ids, r.kv_len = [tok], n

    def decode_step():
        o = mr.run(ScheduleBatch(ForwardMode.DECODE, reqs, out_cache_loc=mr.allocator.alloc(bs)).to_step())
        for r, tok in zip(reqs, o.next_token_ids):
            r.output_ids.append(tok)
            r.kv_len += 1

    # 1) graph step time (the path the engine uses), measured on the device.
    graph_ms = []
    for _ in range(args.steps + 3):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        decode_step()
        e.record()
        torch.cuda.synchronize()
        graph_ms.append(s.elapsed_time(e))
    graph = statistics.median(graph_ms[3:])

    # 2) steps under the profiler, eager and then as graph replays (CUPTI reports a replayed graph's
    # kernels one by one): GPU time per kernel name, and the short gaps between a step's kernels (launch
    # gaps inside the graph; the event-timed step above also holds the host's preparation of the step).
    runner, mr.forward.graphs = mr.forward.graphs, None
    eager_rows, eager_total, _ = profile_kernels(decode_step, args.steps)
    mr.forward.graphs = runner
    graph_rows, graph_total, graph_gaps = profile_kernels(decode_step, args.steps, args.trace)
    kernels_per_step = sum(c for _, _, c in eager_rows)
    layout = f"{'ragged +-' + str(spread) if spread else 'uniform'}, {'scattered' if args.scatter else 'contiguous'}"
    print(
        f"{args.model} bs={bs} ctx={ctx} ({layout}): event-timed graph step {graph:.3f} ms; graph replay: kernels "
        f"{graph_total / 1e3:.3f} ms + {graph_gaps / 1e3:.3f} ms of gaps under {SHORT_GAP_US} us between them; "
        f"eager kernels sum "
        f"{eager_total / 1e3:.3f} ms in {kernels_per_step} kernels/step"
    )
    graph_by_name = {name: us for name, us, _ in graph_rows}
    print(f"  {'eager':>9} {'graph':>9} us/step  calls  name")
    for name, us, count in eager_rows[:22]:
        print(f"  {us:9.1f} {graph_by_name.get(name, 0.0):9.1f}          {count:4d}x  {name}")
    save(
        f"profile_decode_{args.model}_bs{bs}" + "".join(f"_{item.replace('=', '-')}" for item in args.engine_arg),
        {
            "graph_step_ms": graph,
            "graph_kernel_sum_ms": graph_total / 1e3,
            "graph_short_gaps_ms": graph_gaps / 1e3,
            "kernel_sum_ms": eager_total / 1e3,
            "kernels": eager_rows,
            "graph_kernels": graph_rows,
        },
    )


SHORT_GAP_US = 50  # longer gaps between two kernels are the host preparing a step or synchronizing


def profile_kernels(step, steps: int, trace_path=None):
    """([(kernel name, us per step, calls per step)], kernel us per step, us per step of short gaps between
    kernels)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
            torch.cuda.synchronize()
    if trace_path:
        prof.export_chrome_trace(trace_path)
    per_name = collections.defaultdict(lambda: [0.0, 0])
    kernels = []
    for ev in prof.events():
        us = ev.time_range.elapsed_us()
        if ev.device_type == torch.autograd.DeviceType.CUDA and us > 0:
            rec = per_name[ev.name[:90]]
            rec[0] += us / steps
            rec[1] += 1
            kernels.append((ev.time_range.start, ev.time_range.end))
    kernels.sort()
    short_gaps, end = 0.0, kernels[0][1]
    for s, e in kernels[1:]:
        if 0 < s - end < SHORT_GAP_US:
            short_gaps += s - end
        end = max(end, e)
    rows = sorted(((n, us, c // steps) for n, (us, c) in per_name.items()), key=lambda r: -r[1])
    return rows, sum(r[1] for r in rows), short_gaps / steps


if __name__ == "__main__":
    main()
