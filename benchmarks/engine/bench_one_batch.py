"""One static batch through the ModelRunner (no scheduler, no IPC): prefill latency and per-step decode
latency at several batch sizes, next to the memory floor of each decode step.

Decode is timed two ways: a step alone (build, launch, read the tokens back: one host sync per step)
and pipelined as the engine runs it (overlap scheduling: step i+1 launched from step i's tokens on the
device before step i's are read), which hides the host's part of the step.

The floor of a decode step is the bytes it must read — every weight once, plus the K/V of every
token attended to — over the device-to-device copy bandwidth measured in the same run. transformers
`generate` runs the same shapes in the same run for comparison.

    python benchmarks/engine/bench_one_batch.py --model llama-3.1-8b --batch-sizes 1 8 32 64 128 256
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: bench_common

from bench_common import save  # noqa: E402
from gpu_ceilings import copy_bandwidth  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def timed(fn, reps: int = 1) -> float:
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / 1e3 / reps


def run_plait(args, bw: float) -> list[dict]:
    from plait.runtime.executor.cuda_graphs import CudaGraphRunner
    from plait.runtime.executor.model_runner import ModelRunner
    from plait.runtime.forward_batch import ForwardMode
    from plait.runtime.kernel_choices import using as using_kernels
    from plait.runtime.kvcache.memory_pool import KVPool
    from plait.runtime.scheduler.batch import ScheduleBatch
    from plait.runtime.server_args import ServerArgs

    max_bs = max(args.batch_sizes)
    total = max_bs * (args.input_len + args.output_len) + 64
    sa = ServerArgs(
        model_path=args.model,
        load_format="dummy",
        max_total_tokens=total,
        max_running_requests=max_bs,
        cuda_graph_max_bs=max_bs,
        disable_cuda_graph=args.disable_cuda_graph,
        attention_backend=args.attention_backend,
        context_length=args.input_len + args.output_len + 16,
    )
    sa = _with_settings(sa, args.variants[0])
    mr = ModelRunner(sa, args.model)
    cfg = mr.model_config
    wbytes = weight_bytes(mr.model)
    kv_tok = KVPool.bytes_per_token(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, mr.info.dtype)
    rows = []
    for vi, variant in enumerate(args.variants):
        if vi:  # the kernels read their choices at capture time: capture the graphs again
            mr.forward.kernel_choices = _with_settings(sa, variant).kernel_choices()
            mr.forward.graphs = None
            torch.cuda.empty_cache()
            if not args.disable_cuda_graph:
                with using_kernels(mr.forward.kernel_choices):
                    mr.forward.graphs = CudaGraphRunner(mr.model, mr.memory, mr.info.vocab_size, max_bs)
        gen = torch.Generator().manual_seed(0)
        for bs in args.batch_sizes:
            reqs = _new_requests(mr, bs, args, gen)
            loc = mr.allocator.alloc(bs * args.input_len)
            batch = ScheduleBatch(ForwardMode.EXTEND, reqs, [0] * bs, [args.input_len] * bs, loc)

            def prefill():
                return mr.run(batch.to_step())

            prefill()  # warm-up (Triton compiles)
            t_prefill = timed(prefill)
            out = prefill()
            for r, tok in zip(reqs, out.next_token_ids):
                r.output_ids[:] = [tok]
                r.kv_len = args.input_len
            half = (args.output_len - 1) // 2
            sync_step = _sync_steps(mr, reqs, half)
            piped_step = _pipelined_steps(mr, reqs, args.output_len - 1 - half)
            mean_ctx = args.input_len + args.output_len / 2
            floor = (wbytes + bs * mean_ctx * kv_tok) / bw
            rows.append(
                {
                    "variant": variant,
                    "batch_size": bs,
                    "prefill_s": t_prefill,
                    "prefill_tok_s": bs * args.input_len / t_prefill,
                    "decode_step_ms": sync_step * 1e3,
                    "decode_tok_s": bs / sync_step,
                    "pipelined_step_ms": piped_step * 1e3,
                    "pipelined_tok_s": bs / piped_step,
                    "floor_ms": floor * 1e3,
                    "floor_fraction": floor / sync_step,
                    "pipelined_floor_fraction": floor / piped_step,
                }
            )
            print(
                f"plait [{variant or 'defaults'}] bs={bs:4d} prefill {t_prefill * 1e3:8.1f} ms  decode step "
                f"{sync_step * 1e3:7.3f} ms ({floor / sync_step:5.1%} of floor), pipelined {piped_step * 1e3:7.3f} ms "
                f"({floor / piped_step:5.1%})  floor {floor * 1e3:7.3f} ms  {bs / piped_step:8.0f} tok/s",
                flush=True,
            )
            for r in reqs:
                kv = mr.req_to_token_pool.req_to_token[r.req_pool_idx, : r.kv_len + 1].long().cpu()
                mr.allocator.free(kv)
                mr.req_to_token_pool.free(r.req_pool_idx)
    return rows, wbytes, kv_tok


def _with_settings(sa, variant: str):
    """ServerArgs with "NAME=value,NAME=value" (kernel settings, e.g. "enable_pdl=1,disable_decode_gemm=1")
    applied; "" keeps them as they are."""
    import dataclasses

    changes = {}
    for item in filter(None, variant.split(",")):
        name, _, value = item.partition("=")
        changes[name.strip()] = value.strip().lower() in ("1", "true", "on", "yes")
    return dataclasses.replace(sa, **changes)


def _new_requests(mr, bs, args, gen) -> list:
    from plait.runtime.request import Req
    from plait.runtime.sampling_params import SamplingParams

    reqs = []
    for i in range(bs):
        ids = torch.randint(100, 30000, (args.input_len,), generator=gen).tolist()
        r = Req(f"r{i}", ids, SamplingParams(max_new_tokens=args.output_len, temperature=0, ignore_eos=True))
        r.req_pool_idx = mr.req_to_token_pool.alloc()
        reqs.append(r)
    return reqs


def _sync_steps(mr, reqs, steps: int) -> float:
    """Median seconds of a decode step run alone: build, launch, read the tokens back (one host sync)."""
    from plait.runtime.forward_batch import ForwardMode
    from plait.runtime.scheduler.batch import ScheduleBatch

    times = []
    for _ in range(steps):
        dbatch = ScheduleBatch(ForwardMode.DECODE, reqs, out_cache_loc=mr.allocator.alloc(len(reqs)))
        torch.cuda.synchronize()
        t = time.perf_counter()
        o = mr.run(dbatch.to_step())
        times.append(time.perf_counter() - t)
        for r, tok in zip(reqs, o.next_token_ids):
            r.output_ids.append(tok)
            r.kv_len += 1
    return statistics.median(times[min(5, steps - 1) :])


def _pipelined_steps(mr, reqs, steps: int) -> float:
    """Seconds per decode step as the engine runs them (overlap scheduling): step i+1 is launched with
    step i's sampled tokens as its input, on the device, before step i's tokens are read back."""
    from plait.runtime.forward_batch import ForwardMode
    from plait.runtime.scheduler.batch import ScheduleBatch

    batch = ScheduleBatch(ForwardMode.DECODE, reqs, out_cache_loc=mr.allocator.alloc(len(reqs)))
    pending = mr.launch(batch.to_step())
    warm = min(5, (steps - 1) // 2)  # steps before the clock starts
    t0 = None
    for i in range(steps - 1):
        if i == warm:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        nxt = batch.next_decode(mr.allocator.alloc(len(reqs)))
        nxt_pending = mr.launch(nxt.to_step(), prev=pending)  # (its inputs: the samples in flight)
        out = mr.resolve(pending)
        for r, tok in zip(reqs, out.next_token_ids):
            r.output_ids.append(tok)
            r.kv_len += 1
        batch, pending = nxt, nxt_pending
    out = mr.resolve(pending)
    elapsed = time.perf_counter() - t0
    for r, tok in zip(reqs, out.next_token_ids):
        r.output_ids.append(tok)
        r.kv_len += 1
    return elapsed / (steps - 1 - warm)


def run_transformers(args) -> list[dict]:
    from plait.runtime.models.config import BUILTIN_SHAPES
    from transformers import AutoModelForCausalLM, LlamaConfig

    raw = {k: v for k, v in BUILTIN_SHAPES[args.model].items() if k != "architectures"}
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**raw), torch_dtype=torch.bfloat16).eval()
    rows = []
    for bs in args.hf_batch_sizes:
        ids = torch.randint(100, 30000, (bs, args.input_len), device="cuda")

        def gen(n):
            with torch.no_grad():
                model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    pad_token_id=0,
                )

        gen(2)
        t1 = timed(lambda: gen(1))
        tn = timed(lambda: gen(args.output_len))
        step = (tn - t1) / (args.output_len - 1)
        rows.append({"batch_size": bs, "prefill_s": t1, "decode_step_ms": step * 1e3, "decode_tok_s": bs / step})
        print(
            f"transformers bs={bs:4d} prefill {t1 * 1e3:8.1f} ms  decode step {step * 1e3:7.3f} ms  "
            f"{bs / step:8.0f} tok/s",
            flush=True,
        )
    model = None  # free the GPU memory before the next run
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    p.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[1, 32])
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument(
        "--variants",
        nargs="+",
        default=[""],
        help='kernel settings to compare in one process, each "NAME=value,NAME=value" of ServerArgs fields '
        "(e.g. enable_pdl=0 enable_pdl=1); the decode graphs are captured again for each",
    )
    args = p.parse_args()
    bw = copy_bandwidth()
    print(f"GPU {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    rows, wbytes, kv_tok = run_plait(args, bw)
    result = {
        "bench": "one_batch",
        "model": args.model,
        "gpu": torch.cuda.get_device_name(),
        "copy_bandwidth_TBps": bw / 1e12,
        "weight_bytes": wbytes,
        "kv_bytes_per_token": kv_tok,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "cuda_graph": not args.disable_cuda_graph,
        "plait": rows,
    }
    if not args.skip_transformers:
        result["transformers"] = run_transformers(args)
    save(f"bench_one_batch_{args.model}{'_nograph' if args.disable_cuda_graph else ''}", result)


if __name__ == "__main__":
    main()
