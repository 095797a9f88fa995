"""Time the triton attention kernels against torch_native at real sizes on one GPU.

One attention layer call at the Llama-3.2-1B (32 heads / 8 KV heads, head_dim 64) and Llama-3.1-8B
(32 / 8, head_dim 128) shapes, bf16, over a paged pool whose slots are shuffled in 64-token chunks:
- decode: batch 1..256 at context 512+128 and 4096, triton eager, triton replayed from a CUDA graph,
  torch_native eager; the KV bytes read against the copy bandwidth measured in the same run;
- extend: prefill without prefix and with a cached prefix, TFLOP/s (causal FLOPs only);
- a small sweep of tile configs (decode and extend) to pick defaults.
Each timed case is first checked against torch_native (max abs difference printed).

    python benchmarks/kernels/bench_attention_kernels.py [--out PATH] [--quick] [--no-sweep]

Prints a table and writes JSON to --out (default: $OUT/bench_attention_kernels.json when $OUT is set,
else benchmarks/results/bench_attention_kernels.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import git_commit  # noqa: E402
from plait.runtime.attention import AttentionContext, AttentionHeads  # noqa: E402
from plait.runtime.attention.base import AttentionLayerSpec  # noqa: E402
from plait.runtime.attention.torch_native import TorchNativeAttnBackend  # noqa: E402
from plait.runtime.attention.triton_backend import TritonAttnBackend  # noqa: E402
from plait.runtime.attention.triton_ops import (  # noqa: E402
    DecodeConfig,
    DecodeSplits,
    ExtendConfig,
    decode_attention,
    extend_attention,
    needs_plan,
    plan_splits,
)
from plait.runtime.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from plait.runtime.kvcache.memory_pool import KVPool, ReqToTokenPool  # noqa: E402
from triton.testing import do_bench

SHAPES = {"llama-3.2-1b": (32, 8, 64), "llama-3.1-8b": (32, 8, 128)}
DTYPE = torch.bfloat16
DEV = "cuda"


def make_pools(seq_lens, num_kv_heads, head_dim, chunk=64):
    total = sum(seq_lens)
    kv = KVPool(total, 1, num_kv_heads, head_dim, DTYPE, DEV)
    kv.k_buffer[0].normal_()
    kv.v_buffer[0].normal_()
    r2t = ReqToTokenPool(len(seq_lens), max(seq_lens), DEV)
    # Slots shuffled in chunks: neither perfectly contiguous (fresh pool) nor token-scattered.
    n_chunks = -(-total // chunk)
    order = torch.randperm(n_chunks, device=DEV)
    slots = (order[:, None] * chunk + torch.arange(chunk, device=DEV)).flatten()
    slots = slots[slots < total][:total] + 1
    start = 0
    for row, n in enumerate(seq_lens):
        r2t.write(row, 0, slots[start : start + n])
        start += n
    return kv, r2t


def make_fb(mode, kv, r2t, seq_lens, prefix_lens=None, backend=None):
    b = len(seq_lens)
    sl = torch.tensor(seq_lens, device=DEV)
    common = dict(
        batch_size=b,
        req_pool_indices=torch.arange(b, device=DEV),
        seq_lens=sl,
        seq_lens_cpu=list(seq_lens),
        req_to_token_pool=r2t,
        kv_pool=kv,
        attn_backend=backend,
    )
    if mode is ForwardMode.DECODE:
        return ForwardBatch(
            forward_mode=mode,
            input_ids=torch.zeros(b, dtype=torch.long, device=DEV),
            positions=sl - 1,
            out_cache_loc=torch.zeros(b, dtype=torch.long, device=DEV),
            **common,
        )
    ext = [s - p for s, p in zip(seq_lens, prefix_lens)]
    ext_t = torch.tensor(ext, device=DEV)
    return ForwardBatch(
        forward_mode=mode,
        input_ids=torch.zeros(sum(ext), dtype=torch.long, device=DEV),
        positions=torch.zeros(sum(ext), dtype=torch.long, device=DEV),
        out_cache_loc=torch.zeros(sum(ext), dtype=torch.long, device=DEV),
        extend_prefix_lens=torch.tensor(prefix_lens, device=DEV),
        extend_seq_lens=ext_t,
        extend_start_loc=torch.cumsum(ext_t, 0) - ext_t,
        extend_prefix_lens_cpu=list(prefix_lens),
        extend_seq_lens_cpu=ext,
        **common,
    )


def context(heads, kv_heads, head_dim):
    return AttentionContext(DEV, AttentionHeads.split(heads, kv_heads, head_dim))


def copy_bandwidth_gbs():
    x = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), warmup=50, rep=200)
    return 2 * x.numel() / ms / 1e6  # read + write


def bench_decode(name, heads, kv_heads, head_dim, bs, ctx, copy_gbs, run_native):
    layer = AttentionLayerSpec(0, heads, kv_heads, head_dim, head_dim**-0.5)
    seq_lens = [ctx] * bs
    kv, r2t = make_pools(seq_lens, kv_heads, head_dim)
    q = torch.randn(bs, heads, head_dim, dtype=DTYPE, device=DEV)
    tri = TritonAttnBackend(context(heads, kv_heads, head_dim))
    fb = make_fb(ForwardMode.DECODE, kv, r2t, seq_lens, backend=tri)
    tri.init_forward_metadata(fb)
    out = tri.forward_decode(q, layer, fb)
    row = {"kind": "decode", "shape": name, "batch": bs, "context": ctx}
    t_eager = do_bench(lambda: tri.forward_decode(q, layer, fb))

    # The same call replayed from a CUDA graph (what the decode step really runs).
    tri.init_cuda_graph_state(bs)
    tri.init_forward_metadata_capture_cuda_graph(fb)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        tri.forward_decode(q, layer, fb)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = tri.forward_decode(q, layer, fb)
    graph.replay()
    t_graph = do_bench(graph.replay)

    kv_bytes = 2 * bs * ctx * kv_heads * head_dim * DTYPE.itemsize
    floor_ms = kv_bytes / copy_gbs / 1e6
    row.update(
        triton_ms=t_eager,
        triton_graph_ms=t_graph,
        kv_bytes=kv_bytes,
        floor_ms=floor_ms,
        graph_fraction_of_floor=floor_ms / t_graph,
        graph_vs_eager_max_diff=(graph_out - out).abs().max().item(),
    )
    if run_native:
        nat = TorchNativeAttnBackend(AttentionContext(DEV))
        fbn = make_fb(ForwardMode.DECODE, kv, r2t, seq_lens, backend=nat)
        nat.init_forward_metadata(fbn)
        ref = nat.forward_decode(q, layer, fbn)
        row["max_abs_diff"] = (out.float() - ref.float()).abs().max().item()
        row["torch_native_ms"] = do_bench(lambda: nat.forward_decode(q, layer, fbn))
        row["speedup_vs_native"] = row["torch_native_ms"] / t_graph
    del kv, r2t, graph
    torch.cuda.empty_cache()
    return row


def bench_extend(name, heads, kv_heads, head_dim, prefix_lens, extend_lens, run_native):
    layer = AttentionLayerSpec(0, heads, kv_heads, head_dim, head_dim**-0.5)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    kv, r2t = make_pools(seq_lens, kv_heads, head_dim)
    q = torch.randn(sum(extend_lens), heads, head_dim, dtype=DTYPE, device=DEV)
    tri = TritonAttnBackend(context(heads, kv_heads, head_dim))
    fb = make_fb(ForwardMode.EXTEND, kv, r2t, seq_lens, prefix_lens, backend=tri)
    tri.init_forward_metadata(fb)
    out = tri.forward_extend(q, layer, fb)
    t = do_bench(lambda: tri.forward_extend(q, layer, fb))
    # Causal FLOPs: QK^T and PV over the visible keys only.
    visible = sum(e * p + e * (e + 1) / 2 for p, e in zip(prefix_lens, extend_lens))
    flops = 4 * heads * head_dim * visible
    row = {
        "kind": "extend",
        "shape": name,
        "batch": len(seq_lens),
        "prefix": prefix_lens[0],
        "extend": extend_lens[0],
        "triton_ms": t,
        "triton_tflops": flops / t / 1e9,
    }
    if run_native:
        nat = TorchNativeAttnBackend(AttentionContext(DEV))
        fbn = make_fb(ForwardMode.EXTEND, kv, r2t, seq_lens, prefix_lens, backend=nat)
        nat.init_forward_metadata(fbn)
        ref = nat.forward_extend(q, layer, fbn)
        row["max_abs_diff"] = (out.float() - ref.float()).abs().max().item()
        row["torch_native_ms"] = do_bench(lambda: nat.forward_extend(q, layer, fbn))
        row["speedup_vs_native"] = row["torch_native_ms"] / t
    del kv, r2t
    torch.cuda.empty_cache()
    return row


def sweep(quick):
    """Tile configs of both kernels at the 8B shape; the best per case is what defaults should be."""
    heads, kv_heads, head_dim = SHAPES["llama-3.1-8b"]
    rows = []
    dec_cases = [(1, 4096), (32, 4096), (256, 640)] if not quick else [(1, 4096)]
    for bs, ctx in dec_cases:
        kv, r2t = make_pools([ctx] * bs, kv_heads, head_dim)
        q = torch.randn(bs, heads, head_dim, dtype=DTYPE, device=DEV)
        out = torch.empty_like(q)
        req, sl = torch.arange(bs, device=DEV), torch.full((bs,), ctx, device=DEV)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        # Tiles at the default split length, then split lengths at the default tiles (not a full grid:
        # every constexpr combination is a fresh compile).
        configs = [
            DecodeConfig(block_n=bn, num_warps=w, num_stages=st, target_programs=4 * sms)
            for bn in (32, 64, 128)
            for w in (4, 8)
            for st in (1, 2, 3)
        ]
        configs += [DecodeConfig(min_split_len=m, target_programs=4 * sms) for m in (64, 128, 512, 1024)]
        configs += [DecodeConfig(target_programs=t * sms) for t in (2, 8)]
        configs += [
            DecodeConfig(max_kv_splits=ms, min_split_len=m, target_programs=t * sms)
            for ms, m in ((32, 128), (64, 64))
            for t in (4, 8)
        ]
        for cfg in configs:
            # equal lengths: even splits, no plan, as the engine runs such a step
            lens = [ctx] * bs
            splits = None
            if needs_plan(lens, cfg, kv_heads):
                splits = DecodeSplits.upload(plan_splits(lens, cfg, kv_heads), q.device)

            def fn():
                return decode_attention(
                    q,
                    kv.k_buffer[0],
                    kv.v_buffer[0],
                    out,
                    r2t.req_to_token,
                    req,
                    sl,
                    0.1,
                    cfg,
                    splits=splits,
                )

            try:
                ms = do_bench(fn, warmup=10, rep=50)
            except Exception as exc:  # a config that does not compile (e.g. out of shared memory)
                ms = float("nan")
                print(f"  decode {cfg} failed: {exc!r}"[:200])
            rows.append(
                {
                    "kind": "sweep_decode",
                    "batch": bs,
                    "context": ctx,
                    "block_n": cfg.block_n,
                    "num_warps": cfg.num_warps,
                    "num_stages": cfg.num_stages,
                    "min_split_len": cfg.min_split_len,
                    "max_kv_splits": cfg.max_kv_splits,
                    "target_programs": cfg.target_programs,
                    "ms": ms,
                }
            )
        del kv, r2t
    for prefix, ext in [(0, 4096), (3072, 1024)] if not quick else [(0, 4096)]:
        kv, r2t = make_pools([prefix + ext], kv_heads, head_dim)
        q = torch.randn(ext, heads, head_dim, dtype=DTYPE, device=DEV)
        out = torch.empty_like(q)
        t = lambda v: torch.tensor([v], device=DEV)  # noqa: E731
        for bm, bn, warps, stages in [
            (128, 64, 8, 2),
            (128, 64, 8, 3),
            (128, 64, 4, 2),
            (128, 32, 4, 3),
            (64, 64, 4, 2),
            (64, 64, 4, 3),
            (128, 128, 8, 2),
            (64, 128, 4, 2),
        ]:
            cfg = ExtendConfig(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)

            def fn():
                return extend_attention(
                    q,
                    kv.k_buffer[0],
                    kv.v_buffer[0],
                    out,
                    r2t.req_to_token,
                    t(0),
                    t(prefix),
                    t(ext),
                    t(0),
                    ext,
                    0.1,
                    cfg,
                    splits=splits,
                )

            try:
                ms = do_bench(fn, warmup=10, rep=50)
            except Exception as exc:
                ms = float("nan")
                print(f"  extend cfg {cfg} failed: {exc!r}"[:200])
            rows.append(
                {
                    "kind": "sweep_extend",
                    "prefix": prefix,
                    "extend": ext,
                    "block_m": bm,
                    "block_n": bn,
                    "num_warps": warps,
                    "num_stages": stages,
                    "ms": ms,
                }
            )
        del kv, r2t
    torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    out_dir = os.environ.get("OUT")
    default_out = (
        Path(out_dir) / "bench_attention_kernels.json"
        if out_dir
        else Path(__file__).resolve().parents[1] / "results" / "bench_attention_kernels.json"
    )
    ap.add_argument("--out", type=Path, default=default_out)
    ap.add_argument("--quick", action="store_true", help="a few cases only (smoke run)")
    ap.add_argument("--no-sweep", action="store_true", help="skip the tile-config sweep")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_attention_kernels.py needs a CUDA GPU")
    torch.manual_seed(0)
    t0 = time.time()
    copy_gbs = copy_bandwidth_gbs()
    print(f"{torch.cuda.get_device_name(0)}: copy bandwidth {copy_gbs:.0f} GB/s")
    rows, nan = [], float("nan")
    batches = [1, 8, 32, 64, 128, 256] if not args.quick else [1, 32]
    for name, (h, hkv, d) in SHAPES.items():
        for ctx in (640, 4096):
            for bs in batches:
                # torch_native pads and gathers everything: skip it where that alone needs > ~20 GB.
                native = bs * ctx * hkv * d * 2 * 2 * 3 < 20e9
                r = bench_decode(name, h, hkv, d, bs, ctx, copy_gbs, native)
                rows.append(r)
                print(
                    f"decode {name:13s} bs={bs:4d} ctx={ctx:5d} triton {r['triton_ms'] * 1e3:8.1f}us "
                    f"graph {r['triton_graph_ms'] * 1e3:8.1f}us floor {r['floor_ms'] * 1e3:8.1f}us "
                    f"({100 * r['graph_fraction_of_floor']:5.1f}%) native "
                    f"{r.get('torch_native_ms', nan) * 1e3:9.1f}us diff {r.get('max_abs_diff', nan):.1e}",
                    flush=True,
                )
        for prefix, ext, bs in [(0, 512, 8), (0, 4096, 1), (3072, 1024, 1), (0, 1024, 16), (1024, 128, 32)]:
            r = bench_extend(name, h, hkv, d, [prefix] * bs, [ext] * bs, run_native=True)
            rows.append(r)
            print(
                f"extend {name:13s} bs={bs:3d} prefix={prefix:5d} ext={ext:5d} triton {r['triton_ms'] * 1e3:8.1f}us "
                f"({r['triton_tflops']:6.1f} TFLOP/s) native {r['torch_native_ms'] * 1e3:9.1f}us "
                f"diff {r['max_abs_diff']:.1e}",
                flush=True,
            )
    if not args.no_sweep:
        sw = sweep(args.quick)
        rows += sw
        for kind, keys in (("sweep_decode", ("batch", "context")), ("sweep_extend", ("prefix", "extend"))):
            cases = {tuple(r[k] for k in keys) for r in sw if r["kind"] == kind}
            for c in sorted(cases):
                cand = [r for r in sw if r["kind"] == kind and tuple(r[k] for k in keys) == c and r["ms"] == r["ms"]]
                best = sorted(cand, key=lambda r: r["ms"])[:3]
                print(
                    f"{kind} {dict(zip(keys, c))} best: "
                    + "; ".join(f"{ {k: v for k, v in r.items() if k not in ('kind',) + keys} }" for r in best)
                )
    commit = git_commit()
    result = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "commit": commit,
        "date": time.strftime("%Y-%m-%d"),
        "copy_bandwidth_gbs": copy_gbs,
        "rows": rows,
        "wall_s": time.time() - t0,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out} in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
