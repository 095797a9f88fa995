"""Pick the extend (prefill) attention tiles: block_m (tile rows = new token x query head of a KV
group), block_n, warps and pipeline stages, on the prefill shapes the benchmarks run, timed with
triton's do_bench, as attention TFLOP/s (causal work only: keys a query does not see are not counted).

    python benchmarks/kernels/sweep_extend_attention.py            # 8B head shape (32 query / 8 KV heads, 128)
    python benchmarks/kernels/sweep_extend_attention.py chunk --default-only   # named cases, default tiles
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
from triton.testing import do_bench

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # this room's scripts, then benchmarks/ (bench_common)
from bench_common import save  # noqa: E402
from plait.runtime.attention.triton_ops import ExtendConfig, default_extend_config, extend_attention  # noqa: E402
from plait.runtime.kvcache.memory_pool import KVPool, ReqToTokenPool  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
# (name, requests, prefix tokens, new tokens, prefix shared by all requests?)
CASES = [
    ("fewshot", 163, 2000, 50, True),  # a fewshot prefill step (8,150 rows)
    ("tree", 64, 1100, 120, True),  # forks extending a shared history
    ("offline", 8, 0, 1024, False),  # fresh prompts, causal only
    ("multiturn", 16, 700, 400, False),  # a history each, then the new turn
    ("chunk", 1, 2048, 128, True),  # one arrival of a shared-prefix stream: its own 128 tokens in a mixed step
    ("long", 1, 0, 8000, False),  # the serving long-prompt mix's 8,000-token prompt in one step
    ("longchunk", 1, 6144, 2048, False),  # its last 2,048-token chunk where a step's budget is 2,048
    ("short", 1, 0, 512, False),  # one 512-token arrival of the random rows
]


def make_case(reqs: int, prefix: int, new: int, shared: bool):
    per_req = new + (0 if shared else prefix)
    total = (prefix if shared else 0) + reqs * per_req
    kv = KVPool(total, 1, KV_HEADS, HEAD_DIM, torch.bfloat16, "cuda")
    kv.k_buffer[0].normal_()
    kv.v_buffer[0].normal_()
    r2t = ReqToTokenPool(reqs, prefix + new, "cuda")
    slots = torch.randperm(total, device="cuda") + 1
    base, start = (slots[:prefix], prefix) if shared else (None, 0)
    for row in range(reqs):
        own = slots[start : start + per_req]
        start += per_req
        r2t.write(row, 0, torch.cat([base, own]) if shared else own)
    q = torch.randn(reqs * new, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    t = lambda v: torch.full((reqs,), v, device="cuda")  # noqa: E731
    meta = (torch.arange(reqs, device="cuda"), t(prefix), t(new), torch.arange(reqs, device="cuda") * new)
    flops = 4 * reqs * HEADS * HEAD_DIM * (new * prefix + new * (new + 1) / 2)
    return kv, r2t, q, meta, flops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="*", choices=[[]] + [c[0] for c in CASES], help="default: every case")
    ap.add_argument("--default-only", action="store_true", help="time the default tiles alone (no sweep)")
    args = ap.parse_args()
    configs = [
        ExtendConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=st)
        for bm, bn, w, st in itertools.product((64, 128, 256), (32, 64, 128), (4, 8), (2, 3))
        if not args.default_only
    ]
    default = default_extend_config(HEAD_DIM)
    rows, per_case = [], []
    wanted = args.cases or [c[0] for c in CASES]
    for name, reqs, prefix, new, shared in (c for c in CASES if c[0] in wanted):
        kv, r2t, q, (idx, pre_t, ext_t, start_t), flops = make_case(reqs, prefix, new, shared)
        out = torch.empty_like(q)
        results = []
        for cfg in [default] + configs:

            def fn(cfg=cfg):
                extend_attention(
                    q, kv.k_buffer[0], kv.v_buffer[0], out, r2t.req_to_token, idx, pre_t, ext_t, start_t, new, 0.1, cfg
                )

            try:
                ms = do_bench(fn, warmup=5, rep=30)
            except Exception as exc:  # out of shared memory or registers
                print(f"  {name} {cfg} failed: {exc!r}"[:160])
                continue
            results.append((ms, cfg))
        base = results[0][0]
        ranked = sorted(results[1:], key=lambda r: r[0]) or results[:1]
        per_case.append({(c.block_m, c.block_n, c.num_warps, c.num_stages): ms for ms, c in results[1:]})
        best_ms, best = ranked[0]
        print(
            f"{name:9s} {reqs}x({prefix}+{new}): default {base * 1e3:8.1f} us ({flops / base / 1e9:5.0f} TFLOP/s)"
            f"  best {best_ms * 1e3:8.1f} us ({flops / best_ms / 1e9:5.0f} TFLOP/s) {vars(best)}",
            flush=True,
        )
        rows.append(
            {
                "case": name,
                "reqs": reqs,
                "prefix": prefix,
                "new": new,
                "default_us": base * 1e3,
                "default_tflops": flops / base / 1e9,
                "best_us": best_ms * 1e3,
                "best": vars(best),
                "top5": [(ms * 1e3, vars(c)) for ms, c in ranked[:5]],
            }
        )
        del kv, r2t, q, out
    keys = set.intersection(*(set(c) for c in per_case)) if configs else set()
    slowdown = {k: sum(c[k] / min(c.values()) for c in per_case) / len(per_case) for k in keys}
    for k, v in sorted(slowdown.items(), key=lambda kv: kv[1])[:5]:
        print(
            f"overall: block_m={k[0]} block_n={k[1]} num_warps={k[2]} num_stages={k[3]} -> {v:.3f}x the "
            f"per-case best on average"
        )
    rows.append({"overall": [(list(k), v) for k, v in sorted(slowdown.items(), key=lambda kv: kv[1])[:10]]})
    save("sweep_extend_attention", rows)


if __name__ == "__main__":
    main()
