"""Shared-prefix ("cascade") decode attention against the plain split-KV decode, on one GPU.

Decode attention at the Llama-3.1-8B shape (32 query heads, 8 KV heads, head_dim 128, bf16), as a
decode step runs it: CUDA graphs replaying LAYERS attention calls, each over its own layer's K/V
(so one layer's prefix is not still in L2 for the next), through TritonAttnBackend's graph hooks.
Cases (batch, shared prefix, suffix after it incl. the new token) model the prefix-sharing streams:
- fewshot (256, 2000, 60): one prefix shared by every request;
- tree (320, 1000, 150): 20 roots of 1,000 tokens, 16 requests each;
- long (64, 4000, 100): one long document, few requests;
- none (256, 0, 600), none16 (16, 0, 600): nothing shared, at a large batch and at the smallest one
  whose graph carries the cascade kernels (it must cost what the plain graph does).
Suffixes vary by +-25% around the given length. Each case checks the cascade output against the
plain one, and times the host side: finding the groups (after a prefill), the cached plan of a
repeated step, and the whole replay hook.

    python3 benchmarks/kernels/bench_cascade_attention.py [--layers 8] [--sweep] [--quick]

--sweep also times prefix-kernel tile configs on the fewshot and tree cases. Prints a table; the JSON
goes to $OUT/bench_cascade_attention.json (else benchmarks/out).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_common

from bench_common import save  # noqa: E402
from plait.runtime.attention import AttentionContext, AttentionHeads  # noqa: E402
from plait.runtime.attention.base import AttentionLayerSpec  # noqa: E402
from plait.runtime.attention.triton_backend import TritonAttnBackend  # noqa: E402
from plait.runtime.attention.triton_ops import PrefixConfig  # noqa: E402
from plait.runtime.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from plait.runtime.kvcache.memory_pool import KVPool, ReqToTokenPool  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPE, DEV = torch.bfloat16, "cuda"
CASES = {
    "fewshot": (256, 2000, 60, 1),
    "tree": (320, 1000, 150, 20),
    "long": (64, 4000, 100, 1),
    "none": (256, 0, 600, 0),
    "none16": (16, 0, 600, 0),
    "shared32": (36, 2048, 190, 8),  # bench_serving's shared-prefix stream at 32 req/s: ~36 running, 8 prefixes
}  # name: (batch, prefix, suffix, groups)


def build_case(batch, prefix, suffix, groups, layers, seed=0):
    """Pools where each group's members hold the same slots for the prefix (as the radix cache
    leaves them); slots shuffled in 64-token chunks, batch order shuffled."""
    rng = np.random.default_rng(seed)
    suffixes = np.maximum(1, (suffix * rng.uniform(0.75, 1.25, batch)).astype(np.int64))
    seq_lens = (prefix + suffixes).tolist() if groups else suffixes.tolist()
    total = prefix * max(groups, 1) + int(suffixes.sum())
    chunks = rng.permutation(-(-total // 64))
    slots = (chunks[:, None] * 64 + np.arange(64)).ravel()
    slots = slots[slots < total] + 1
    kv = KVPool(total, layers, KV_HEADS, HEAD_DIM, DTYPE, DEV)
    for buf in kv.k_buffer + kv.v_buffer:
        buf.normal_()
    r2t = ReqToTokenPool(batch + 1, max(seq_lens) + 8, DEV)
    shared = [slots[g * prefix : (g + 1) * prefix] for g in range(groups)]
    at = prefix * max(groups, 1) if groups else 0
    rows = (rng.permutation(batch) + 1).tolist()
    for i, (row, s) in enumerate(zip(rows, suffixes.tolist())):
        own = slots[at : at + s]
        at += s
        row_slots = np.concatenate([shared[i % groups], own]) if groups else own
        r2t.write(row, 0, torch.from_numpy(row_slots).to(DEV))
    return kv, r2t, rows, seq_lens


def make_backend(disable, prefix_config=None):
    ctx = AttentionContext(DEV, AttentionHeads.split(HEADS, KV_HEADS, HEAD_DIM), disable_cascade_attention=disable)
    return TritonAttnBackend(ctx, prefix_config=prefix_config)


def make_fb(backend, kv, r2t, rows, seq_lens):
    b = len(rows)
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=b,
        input_ids=torch.zeros(b, dtype=torch.long, device=DEV),
        positions=torch.tensor(seq_lens, device=DEV) - 1,
        req_pool_indices=torch.tensor(rows, device=DEV),
        seq_lens=torch.tensor(seq_lens, device=DEV),
        out_cache_loc=torch.zeros(b, dtype=torch.long, device=DEV),
        seq_lens_cpu=list(seq_lens),
        req_to_token_pool=r2t,
        kv_pool=kv,
        attn_backend=backend,
        req_pool_indices_cpu=np.asarray(rows, dtype=np.int64),
    )


def capture(backend, kv, r2t, rows, seq_lens, q, layers):
    """A graph of `layers` decode-attention calls (one per layer), as the decode step's graph has."""
    bs = len(rows)
    backend.init_cuda_graph_state(bs)
    fb = make_fb(backend, kv, r2t, rows, seq_lens)
    backend.init_forward_metadata_capture_cuda_graph(fb)
    specs = [AttentionLayerSpec(i, HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5) for i in range(layers)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for spec in specs:  # compile outside the capture
            backend.forward_decode(q, spec, fb)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [backend.forward_decode(q, spec, fb) for spec in specs]
    backend.init_forward_metadata_replay_cuda_graph(make_fb(backend, kv, r2t, rows, seq_lens))
    graph.replay()
    torch.cuda.synchronize()
    return graph, outs


def time_graph(graph, iters=50):
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return float(np.median(times))  # ms per replay


def host_times(backend, kv, r2t, rows, seq_lens, reps=50):
    """Microseconds on the host: groups found from the table (after a prefill), the replay hook of a
    repeated step (cached plan, no upload), and of a step where one request left (restricted groups)."""
    cascade = backend._cascade
    fb = make_fb(backend, kv, r2t, rows, seq_lens)
    layout = cascade.planner.layout(len(rows))
    t0 = time.perf_counter()
    for _ in range(reps):
        cascade.invalidate()
        cascade.planner.plan(r2t.host, fb.req_pool_indices_cpu, seq_lens, layout, cascade._partial_slots)
    recompute = (time.perf_counter() - t0) / reps * 1e6
    backend.init_forward_metadata_replay_cuda_graph(fb)
    t0 = time.perf_counter()
    for _ in range(reps):
        backend.init_forward_metadata_replay_cuda_graph(fb)
    cached_hook = (time.perf_counter() - t0) / reps * 1e6
    fewer = make_fb(backend, kv, r2t, rows[1:], seq_lens[1:])
    fewer.batch_size = len(rows)
    t_sub = []
    for _ in range(reps):
        backend.init_forward_metadata_replay_cuda_graph(fb)  # back to the full batch (cached)
        t0 = time.perf_counter()
        backend.init_forward_metadata_replay_cuda_graph(fewer)
        t_sub.append(time.perf_counter() - t0)
    return {
        "host_group_us": recompute,
        "host_replay_cached_us": cached_hook,
        "host_replay_one_left_us": float(np.median(t_sub)) * 1e6,
    }


def run_case(name, layers, prefix_config=None, with_plain=True):
    batch, prefix, suffix, groups = CASES[name]
    kv, r2t, rows, seq_lens = build_case(batch, prefix, suffix, groups, layers)
    q = torch.randn(batch, HEADS, HEAD_DIM, dtype=DTYPE, device=DEV)
    row = {
        "case": name,
        "batch": batch,
        "prefix": prefix,
        "suffix": suffix,
        "groups": groups,
        "mean_context": float(np.mean(seq_lens)),
    }
    cas = make_backend(False, prefix_config)
    g_cas, outs_cas = capture(cas, kv, r2t, rows, seq_lens, q, layers)
    plan = cas._cascade.planner._plan
    row["plan_groups"] = len(plan.groups) if plan else 0
    row["plan_work_items"] = plan.num_work if plan else 0
    row["cascade_us_per_layer"] = time_graph(g_cas) * 1e3 / layers
    if with_plain:
        plain = make_backend(True)
        g_plain, outs_plain = capture(plain, kv, r2t, rows, seq_lens, q, layers)
        row["plain_us_per_layer"] = time_graph(g_plain) * 1e3 / layers
        row["speedup"] = row["plain_us_per_layer"] / row["cascade_us_per_layer"]
        row["max_abs_diff"] = max((a.float() - b.float()).abs().max().item() for a, b in zip(outs_cas, outs_plain))
        row["step_saving_ms_32_layers"] = (row["plain_us_per_layer"] - row["cascade_us_per_layer"]) * 32 / 1e3
        row.update(host_times(cas, kv, r2t, rows, seq_lens))
        del g_plain, outs_plain, plain
    kv_bytes = 2 * sum(seq_lens) * KV_HEADS * HEAD_DIM * DTYPE.itemsize
    unique = (
        2 * (prefix * max(groups, 1) + sum(s - prefix for s in seq_lens)) * KV_HEADS * HEAD_DIM * DTYPE.itemsize
        if groups
        else kv_bytes
    )
    row["kv_gb_logical"], row["kv_gb_unique"] = kv_bytes / 1e9, unique / 1e9
    del g_cas, outs_cas, cas, kv, r2t
    torch.cuda.empty_cache()
    return row


def sweep(layers):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    configs = [
        (64, 64, 4, 2, 2),
        (64, 64, 8, 2, 1),
        (64, 32, 4, 3, 3),
        (64, 32, 4, 2, 3),
        (128, 64, 8, 2, 1),
        (128, 32, 8, 3, 1),
        (64, 64, 4, 3, 2),
        (64, 64, 4, 2, 4),
    ]
    rows = []
    for name in ("fewshot", "tree", "long"):
        for bm, bn, warps, stages, per_sm in configs:
            cfg = PrefixConfig(
                block_m=bm,
                block_n=bn,
                num_warps=warps,
                num_stages=stages,
                num_programs=per_sm * sms,
                target_programs=4 * sms,
            )
            try:
                r = run_case(name, layers, cfg, with_plain=False)
                us = r["cascade_us_per_layer"]
            except Exception as exc:  # a config that does not compile (shared memory, registers)
                us = float("nan")
                print(f"  {name} {cfg}: {exc!r}"[:200])
            rows.append(
                {
                    "case": name,
                    "block_m": bm,
                    "block_n": bn,
                    "num_warps": warps,
                    "num_stages": stages,
                    "programs_per_sm": per_sm,
                    "cascade_us_per_layer": us,
                }
            )
            print(f"sweep {name:8s} m{bm} n{bn} w{warps} s{stages} x{per_sm}/SM  {us:8.1f} us/layer")
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8, help="attention calls per graph, each its own layer's K/V")
    ap.add_argument("--sweep", action="store_true", help="also time prefix-kernel tile configs")
    ap.add_argument("--quick", action="store_true", help="fewshot and none only")
    ap.add_argument("--cases", nargs="+", choices=sorted(CASES), help="these cases only")
    args = ap.parse_args()
    names = args.cases or (["fewshot", "none", "none16"] if args.quick else list(CASES))
    rows = [run_case(name, args.layers) for name in names]
    print(
        f"\n{torch.cuda.get_device_name(0)}, Llama-3.1-8B shape ({HEADS}/{KV_HEADS} heads, head_dim {HEAD_DIM}, "
        f"bf16), CUDA graphs of {args.layers} layers"
    )
    print(
        f"{'case':8s} {'batch':>5s} {'prefix':>6s} {'suffix':>6s} {'plain us':>9s} {'cascade us':>10s} "
        f"{'speedup':>7s} {'step -ms':>8s} {'diff':>7s} {'group us':>8s} {'cached us':>9s} {'-1 req us':>9s}"
    )
    for r in rows:
        print(
            f"{r['case']:8s} {r['batch']:5d} {r['prefix']:6d} {r['suffix']:6d} {r['plain_us_per_layer']:9.1f} "
            f"{r['cascade_us_per_layer']:10.1f} {r['speedup']:6.2f}x {r['step_saving_ms_32_layers']:8.2f} "
            f"{r['max_abs_diff']:7.4f} {r['host_group_us']:8.0f} {r['host_replay_cached_us']:9.0f} "
            f"{r['host_replay_one_left_us']:9.0f}"
        )
    print(
        "us = microseconds per layer (graph replay); step -ms = saving per 32-layer decode step; group us = host "
        "time to find the groups (after a prefill); cached us / -1 req us = the replay hook's host time on a "
        "repeated step / when one request left"
    )
    result = {"device": torch.cuda.get_device_name(0), "layers": args.layers, "cases": rows}
    if args.sweep:
        result["sweep"] = sweep(args.layers)
    save("bench_cascade_attention", result)


if __name__ == "__main__":
    main()
