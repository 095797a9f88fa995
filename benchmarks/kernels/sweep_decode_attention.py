"""Pick the split-KV decode defaults: every (min_split_len, max_kv_splits, target_programs, block_n)
combination on the decode shapes that matter, timed as CUDA-graph replays (a decode layer's
attention is a few microseconds: launch gaps would swamp a plain timer), against the KV bytes read.

    python benchmarks/kernels/sweep_decode_attention.py
    python benchmarks/kernels/sweep_decode_attention.py --policy-only --cases 80x1400 72x600+8x8000
      (a case BATCHxCONTEXT, or a mix of such groups joined by "+", its rows shuffled: the long-prompt serving
      mix's decode batch beside a uniform batch of about the same KV)
    python benchmarks/kernels/sweep_decode_attention.py --kv-dtype fp8_e4m3 --launch --cases 64x1536 256x1000
      (an FP8 pool: half the bytes a token; --launch / --pack sweep the tiles around the policy's)
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import itertools
import os
import sys

import torch
from triton.testing import do_bench_cudagraph

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # this room's scripts, then benchmarks/ (bench_common)
from bench_attention_kernels import make_pools  # noqa: E402
from bench_common import save  # noqa: E402
from plait.runtime.attention.triton_ops import (  # noqa: E402
    DecodeConfig,
    DecodeSplits,
    decode_attention,
    default_decode_policy,
    plan_splits,
)

SHAPES = {"8b": (32, 8, 128), "1b": (32, 8, 64)}
# The pool's dtype (--kv-dtype): bf16, or FP8 (e4m3 codes, scale 1.0 a layer) read and widened in the kernel.
KV_FP8 = {"fp8": False}
# Batch 512 x 700 is the offline run's decode step; 64 x 770 multiturn's; 256 x 2,000 a long-context batch.
CASES = [(1, 576), (8, 576), (64, 770), (256, 576), (512, 700), (256, 2000), (1, 4096), (32, 4096)]


def seq_lens_of(case) -> list[int]:
    """A case's context lengths: (batch, context), or a list of such groups (rows shuffled, fixed seed)."""
    if isinstance(case, tuple):
        return [case[1]] * case[0]
    lens = [ctx for bs, ctx in case for _ in range(bs)]
    order = torch.randperm(len(lens), generator=torch.Generator().manual_seed(0)).tolist()
    return [lens[i] for i in order]


def decode_case(shape: str, case):
    """One case: a function running the decode kernel on it with a given config, and the KV bytes it reads."""
    heads, kv_heads, head_dim = SHAPES[shape]
    lens = seq_lens_of(case)
    bs = len(lens)
    kv, r2t = make_pools(lens, kv_heads, head_dim)
    k_buf, v_buf, scales, elem = kv.k_buffer[0], kv.v_buffer[0], None, 2
    if KV_FP8["fp8"]:
        k_buf, v_buf = k_buf.to(torch.float8_e4m3fn), v_buf.to(torch.float8_e4m3fn)
        one = torch.ones((), dtype=torch.float32, device="cuda")
        scales, elem = (one, one), 1
    q = torch.randn(bs, heads, head_dim, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    req, sl = torch.arange(bs, device="cuda"), torch.tensor(lens, device="cuda")
    plans: dict = {}

    def run(cfg: DecodeConfig, graph: bool = False) -> None:
        """One decode call as a step makes it: even splits where they serve (no plan), else the step's split
        plan, planned (and uploaded) at the first call of a config, with the items it uses (eager) or its
        batch size's whole item capacity and the merge stage (a ragged decode graph)."""
        if (cfg, graph) not in plans:
            plan = plan_splits(lens, cfg, kv_heads, bs + cfg.extra_items(kv_heads) if graph else None)
            splits = None
            if plan.max_splits > cfg.even_splits(bs, kv_heads):
                splits = DecodeSplits.upload(plan, q.device)
                splits.merge = splits.merge or graph
            plans[(cfg, graph)] = splits
            torch.cuda.synchronize()
        splits = plans[(cfg, graph)]
        decode_attention(q, k_buf, v_buf, out, r2t.req_to_token, req, sl, 0.1, cfg, splits=splits, kv_scales=scales)

    return run, 2 * sum(lens) * kv_heads * head_dim * elem


def case_name(case) -> tuple[int, object]:
    """(batch, context): 576, or "600x72+8000x8" for a mix."""
    if isinstance(case, tuple):
        return case[0], case[1]
    return sum(bs for bs, _ in case), "+".join(f"{ctx}x{bs}" for bs, ctx in case)


def parse_case(text: str):
    groups = [tuple(int(v) for v in g.lower().split("x")) for g in text.split("+")]
    return groups[0] if len(groups) == 1 else groups


def each_case(shapes: list[str]):
    """(shape, batch, context, run, KV bytes) for every case of CASES on every shape, one case's pools
    alive at a time (the caller drops `run` before asking for the next)."""
    for shape in shapes:
        for case in CASES:
            run, kv_bytes = decode_case(shape, case)
            bs, ctx = case_name(case)
            yield shape, bs, ctx, run, kv_bytes
            del run


def timed_configs(run, configs: list[DecodeConfig]) -> list[tuple[float, DecodeConfig]]:
    """(us per call, config) for each config that compiles, in the order given."""
    results = []
    for cfg in configs:
        try:
            run(cfg)  # its split plan, uploaded before any capture
            results.append((do_bench_cudagraph(lambda cfg=cfg: run(cfg), rep=20) * 1e3, cfg))
        except Exception as exc:  # a config that does not compile
            print(f"  {cfg} failed: {exc!r}"[:160])
    return results


def _key(cfg: DecodeConfig) -> tuple:
    return (cfg.block_n, cfg.max_kv_splits, cfg.min_split_len, cfg.target_programs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument(
        "--launch",
        action="store_true",
        help="around the engine's config for each case, sweep the launch parameters the main sweep "
        "keeps fixed (num_warps, num_stages) with block_n",
    )
    ap.add_argument(
        "--pack",
        action="store_true",
        help="around the engine's config for each case, sweep KV heads per stage-1 program (1, 2, 4) "
        "with block_n, num_warps, num_stages and target_programs",
    )
    ap.add_argument(
        "--cases",
        nargs="+",
        default=None,
        metavar="BATCHxCONTEXT",
        help="only these cases, e.g. 64x770 512x700, or a mix such as 72x600+8x8000 (default: all of CASES)",
    )
    ap.add_argument(
        "--policy-only",
        action="store_true",
        help="time only the engine's config for each case (default_decode_policy): a quick check "
        "of a kernel change, no sweep",
    )
    ap.add_argument("--kv-dtype", default="bf16", choices=["bf16", "fp8_e4m3"], help="the KV pool's dtype")
    ap.add_argument(
        "--widen",
        default="f16",
        choices=["f16", "bf16"],
        help="what an FP8 pool's rows widen to in the kernel with bf16 queries (the engine's: f16)",
    )
    args = ap.parse_args()
    KV_FP8["fp8"] = args.kv_dtype == "fp8_e4m3"
    # (the package's `decode_attention` is the function; its module holds the switch)
    kernel_module = importlib.import_module("plait.runtime.attention.triton_ops.decode_attention")
    kernel_module.WIDEN_FP8_TO_F16 = args.widen == "f16"
    shapes = args.shapes
    if args.cases:
        CASES[:] = [parse_case(c) for c in args.cases]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if args.policy_only:
        return policy_only(shapes, sms)
    if args.launch:
        return launch_sweep(
            shapes,
            sms,
            lambda base: [
                dataclasses.replace(base, block_n=bn, num_warps=warps, num_stages=stages)
                for bn, warps, stages in itertools.product(
                    (32, 64, 128) if KV_FP8["fp8"] else (32, 64), (2, 4, 8), (1, 2, 3, 4)
                )
            ],
            "launch",
        )
    if args.pack:
        return launch_sweep(
            shapes,
            sms,
            lambda base: [
                dataclasses.replace(
                    base,
                    kv_heads_per_program=hpp,
                    block_n=bn,
                    num_warps=warps,
                    num_stages=stages,
                    target_programs=t * sms,
                )
                for hpp, bn, warps, stages, t in itertools.product((1, 2, 4), (16, 32), (4, 8), (2, 3), (2, 4, 8))
            ],
            "pack",
        )
    default = DecodeConfig(target_programs=4 * sms)
    configs = [
        DecodeConfig(block_n=bn, max_kv_splits=ms, min_split_len=ml, target_programs=t * sms)
        for bn, ms, ml, t in itertools.product((32, 64), (64,), (32, 64, 128, 256), (4, 8, 16, 32, 64))
    ]
    rows = []
    per_case: list[dict] = []  # per case: config key -> us
    for shape, bs, ctx, run, kv_bytes in each_case(shapes):
        results = timed_configs(run, [default] + configs)
        per_case.append({_key(c): u for u, c in results[1:]})
        base_us = results[0][0]
        results_sorted = sorted(results[1:], key=lambda r: r[0])
        best_us, best = results_sorted[0]
        rows.append(
            {
                "shape": shape,
                "bs": bs,
                "ctx": ctx,
                "default_us": base_us,
                "best_us": best_us,
                "best": vars(best),
                "kv_gb_s_best": kv_bytes / best_us / 1e3,
                "top5": [(u, vars(c)) for u, c in results_sorted[:5]],
            }
        )
        print(
            f"{shape} bs={bs:4d} ctx={ctx:>5}: default {base_us:7.1f} us  best {best_us:7.1f} us "
            f"({kv_bytes / best_us / 1e3:6.0f} GB/s) bn={best.block_n} splits<={best.max_kv_splits} "
            f"min_len={best.min_split_len} programs={best.target_programs // sms}xSM",
            flush=True,
        )
        run = None  # free the case's pools before the next one
    # One config for every case: the smallest mean slowdown against each case's own best.
    keys = set.intersection(*(set(c) for c in per_case))
    slowdown = {k: sum(c[k] / min(c.values()) for c in per_case) / len(per_case) for k in keys}
    ranked = sorted(slowdown.items(), key=lambda kv: kv[1])
    for k, v in ranked[:5]:
        print(
            f"overall: block_n={k[0]} max_kv_splits={k[1]} min_split_len={k[2]} target_programs={k[3] // sms}xSM "
            f"-> {v:.3f}x the per-case best on average"
        )
    rows.append({"overall": [(list(k), v) for k, v in ranked[:10]]})
    save("sweep_decode_attention", rows)


def launch_sweep(shapes: list[str], sms: int, variants, name: str) -> None:
    """Per case, the policy's config against `variants(policy config)`."""
    policy = default_decode_policy(sms, kv_fp8=KV_FP8["fp8"])
    rows = []
    for shape, bs, ctx, run, kv_bytes in each_case(shapes):
        base = policy.for_batch(bs)
        results = timed_configs(run, variants(base))
        run(base)
        base_us = do_bench_cudagraph(lambda: run(base), rep=50) * 1e3
        results.sort(key=lambda r: r[0])
        best_us, best = results[0]
        rows.append(
            {
                "shape": shape,
                "bs": bs,
                "ctx": ctx,
                "policy_us": base_us,
                "best_us": best_us,
                "best": vars(best),
                "top5": [(u, vars(c)) for u, c in results[:5]],
            }
        )
        print(
            f"{shape} bs={bs:4d} ctx={ctx:>5}: policy {base_us:7.1f} us ({kv_bytes / base_us / 1e3:5.0f} GB/s, "
            f"bn={base.block_n} w={base.num_warps} st={base.num_stages})  best {best_us:7.1f} us "
            f"({kv_bytes / best_us / 1e3:5.0f} GB/s) bn={best.block_n} w={best.num_warps} st={best.num_stages} "
            f"heads/program={best.kv_heads_per_program} programs={best.target_programs // sms}xSM",
            flush=True,
        )
        run = None
    save(f"sweep_decode_attention_{name}" + ("_fp8" if KV_FP8["fp8"] else ""), rows)


def policy_only(shapes: list[str], sms: int) -> None:
    policy = default_decode_policy(sms, kv_fp8=KV_FP8["fp8"])
    rows = []
    for shape, bs, ctx, run, kv_bytes in each_case(shapes):
        cfg = policy.for_batch(bs)
        run(cfg), run(cfg, graph=True)  # their split plans, uploaded before any capture
        us = do_bench_cudagraph(lambda: run(cfg), rep=50) * 1e3
        graph_us = do_bench_cudagraph(lambda: run(cfg, graph=True), rep=50) * 1e3
        rows.append(
            {"shape": shape, "bs": bs, "ctx": ctx, "us": us, "graph_us": graph_us, "kv_gb_s": kv_bytes / us / 1e3}
        )
        print(
            f"{shape} bs={bs:4d} ctx={ctx:>5}: policy {us:7.1f} us ({kv_bytes / us / 1e3:6.0f} GB/s), as a decode "
            f"graph launches it {graph_us:7.1f} us",
            flush=True,
        )
        run = None
    save("sweep_decode_attention_policy" + ("_fp8" if KV_FP8["fp8"] else ""), rows)


if __name__ == "__main__":
    main()
