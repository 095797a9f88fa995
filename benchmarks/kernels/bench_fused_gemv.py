"""The batch-1 decode matmuls with and without the small ops folded in (runtime/kernels/gemv_fused.py), on
the weight shapes of Llama-3.1-8B and Llama-3.2-1B, bf16, all CUDA-graph replayed.

1. Per op (8 weight copies in turn, so L2 never holds the next weight): the unfused ops the decode step
   ran before (add+RMSNorm kernel + skinny matmul or cuBLAS; SiLU-and-mul kernel + cuBLAS down) against
   the one fused launch.
2. The layer chain as the one-row path runs it (every layer its own weights: the real model's bytes;
   attention and rotary left out): unfused (the default decode path), fused, fused with gate_up's norm
   kept apart (cuBLAS gate_up), and each of those with programmatic dependent launch (the `pdl` kernel choice: the
   Triton skinny matmuls only, in the unfused chain). Per layer, per step, against the weight-only memory
   floor; PDL's output is checked to be bit-identical to the plain launch's.
--sweep: tile configs per fused op, fastest first (pick_fused_gemv_config takes gemv.py's tiles).
--fp8: part 1 with FP8 weights (per-row scales), the unfused side as an FP8 model's batch-1 step runs it (the norm or
activation kernel, then gemv.py's FP8 one-row matmul; the LM head stays bf16 and is left out), the fused side with
the FP8 tiles (gemv.pick_gemv_config(fp8=True)).

    python benchmarks/kernels/bench_fused_gemv.py                                  # both shapes, parts 1-2
    python benchmarks/kernels/bench_fused_gemv.py --sweep --model llama-3.1-8b     # + the config sweep
    python benchmarks/kernels/bench_fused_gemv.py --fp8 --sweep --model llama-3.1-8b --skip-chain
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # this room's scripts, then benchmarks/ (bench_common)
from bench_common import save  # noqa: E402
from bench_gemv import SHAPES, graph_time  # noqa: E402
from gpu_ceilings import copy_bandwidth  # noqa: E402

EPS = 1e-5
DT = torch.bfloat16


def rand(*shape, scale=1.0):
    return torch.randn(*shape, dtype=DT, device="cuda") * scale


def dims(model: str) -> dict:
    h, inter, layers, qh, kvh, d, vocab = SHAPES[model]
    return dict(hidden=h, inter=inter, layers=layers, q=qh * d, qkv=(qh + 2 * kvh) * d, vocab=vocab)


def op_cases(model: str, fp8: bool = False):
    """name -> (N, K, unfused launches, fused launches) of one decode step's one-row matmuls."""
    m = dims(model)
    cases = {
        "norm->qkv": (m["qkv"], m["hidden"], 2, 1),
        "o": (m["hidden"], m["q"], 1, 1),
        "norm->gate_up": (2 * m["inter"], m["hidden"], 2, 1),
        "silu->down": (m["hidden"], m["inter"], 2 if fp8 else 3, 1),  # bf16: + cuBLAS's split-K reduce
        "norm->lm_head": (m["vocab"], m["hidden"], 2, 1),
    }
    if fp8:
        del cases["norm->lm_head"]  # an FP8 model's LM head stays bf16 (quant/apply.quantize_fp8)
    return cases


def fp8_op_fns(name: str, n: int, k: int, copies: int):
    """op_fns with FP8 weights: the unfused side as an FP8 model's one-row step runs it."""
    from plait.runtime import kernels as kn
    from plait.runtime.quant.fp8 import quantize_per_channel

    ws = [quantize_per_channel(rand(n, k, scale=0.02)) for _ in range(copies)]  # (codes, scales) each
    if name == "silu->down":
        gate_up = rand(1, 2 * k, scale=3.0)
        unfused = lambda: [kn.gemv(kn.silu_and_mul(gate_up), w, weight_scale=sc) for w, sc in ws]  # noqa: E731
        fused = lambda cfg=None: [kn.silu_mul_gemv(gate_up, w, config=cfg, weight_scale=sc) for w, sc in ws]  # noqa: E731
    elif name == "o":
        x = rand(1, k)
        unfused = lambda: [kn.gemv(x, w, weight_scale=sc) for w, sc in ws]  # noqa: E731
        fused = lambda cfg=None: [kn.gemv_row(x, w, config=cfg, weight_scale=sc) for w, sc in ws]  # noqa: E731
    else:
        x, residual, nw = rand(1, k), rand(1, k), rand(k, scale=0.1) + 1

        def unfused():
            for w, sc in ws:
                a, _ = kn.fused_add_rmsnorm(x, residual, nw, EPS)
                kn.gemv(a, w, weight_scale=sc)

        def fused(cfg=None):
            return [kn.rmsnorm_gemv(x, residual, nw, EPS, w, config=cfg, weight_scale=sc) for w, sc in ws]

    return unfused, fused, n * k


def op_fns(name: str, n: int, k: int, copies: int):
    """(unfused fn, fused fn(config), weight bytes per call) over `copies` weight copies in turn."""
    from plait.runtime import kernels as kn

    ws = [rand(n, k, scale=0.02) for _ in range(copies)]
    if name == "silu->down":
        gate_up = rand(1, 2 * k, scale=3.0)
        unfused = lambda: [torch.matmul(kn.silu_and_mul(gate_up), w.t()) for w in ws]  # noqa: E731
        fused = lambda cfg=None: [kn.silu_mul_gemv(gate_up, w, config=cfg) for w in ws]  # noqa: E731
    elif name == "o":
        x = rand(1, k)
        unfused = lambda: [kn.gemv(x, w) for w in ws]  # noqa: E731
        fused = lambda cfg=None: [kn.gemv_row(x, w, config=cfg) for w in ws]  # noqa: E731
    else:
        x, residual, nw = rand(1, k), rand(1, k), rand(k, scale=0.1) + 1
        out_dtype = torch.float32 if name == "norm->lm_head" else None

        def unfused():
            for w in ws:
                a, _ = kn.fused_add_rmsnorm(x, residual, nw, EPS)
                # the pre-fusion path: cuBLAS for gate_up, the Triton skinny matmul for QKV and the LM head
                torch.matmul(a, w.t()) if name == "norm->gate_up" else kn.gemv(a, w, out_dtype=out_dtype)

        def fused(cfg=None):
            return [kn.rmsnorm_gemv(x, residual, nw, EPS, w, out_dtype=out_dtype, config=cfg) for w in ws]

    return unfused, fused, n * k * 2


def sweep_configs(k: int):
    from plait.runtime.kernels.gemv_fused import MAX_RESIDENT_K, FusedGemvConfig, next_power_of_2

    for bn, bk, warps, stages in itertools.product((4, 8, 16, 32), (512, 1024, 2048, 4096), (4, 8), (2, 4)):
        if 2048 <= bn * bk <= 16384:
            yield FusedGemvConfig(bn, bk, warps, stages)
    if next_power_of_2(k) <= MAX_RESIDENT_K:
        for bn, sub, warps in itertools.product((16, 32, 64), (1, 2, 4), (4, 8)):
            yield FusedGemvConfig(bn, 0, warps, 3, resident=True, sub_n=sub)


def part_ops(model: str, copies: int, sweep: bool, result: dict, fp8: bool = False) -> None:
    from plait.runtime.kernels.gemv_fused import pick_fused_gemv_config

    fmt = "FP8" if fp8 else "bf16"
    print(f"\n{model}: one-row ops, {fmt} weights, {copies} copies in turn (us per call; TB/s of weight reads)")
    print(
        f"  {'op':14s} {'N x K':>14s} {'unfused':>9s} {'fused':>9s} {'saved':>8s} {'unf. TB/s':>9s} "
        f"{'fused TB/s':>10s}  launches"
    )
    for name, (n, k, l_unf, l_fus) in op_cases(model, fp8).items():
        unfused, fused, nbytes = (fp8_op_fns if fp8 else op_fns)(name, n, k, copies)
        t_u = graph_time(unfused, reps=2) / copies
        t_f = graph_time(fused, reps=2) / copies
        rec = {
            "n": n,
            "k": k,
            "unfused_us": t_u * 1e6,
            "fused_us": t_f * 1e6,
            "unfused_tb_s": nbytes / t_u / 1e12,
            "fused_tb_s": nbytes / t_f / 1e12,
            "config": vars(pick_fused_gemv_config(n, k, fp8)),
            "launches": [l_unf, l_fus],
        }
        print(
            f"  {name:14s} {n:6d} x {k:5d} {t_u * 1e6:9.2f} {t_f * 1e6:9.2f} {(t_u - t_f) * 1e6:8.2f}"
            f" {nbytes / t_u / 1e12:9.2f} {nbytes / t_f / 1e12:10.2f}  {l_unf} -> {l_fus}",
            flush=True,
        )
        if sweep:
            start, timed = time.time(), []
            for cfg in sweep_configs(k):
                try:
                    timed.append((graph_time(lambda cfg=cfg: fused(cfg), reps=2) / copies, cfg))
                except Exception as e:  # a config the compiler rejects (e.g. out of shared memory)
                    print(f"    {cfg}: {type(e).__name__}: {str(e)[:80]}")
            timed.sort(key=lambda p: p[0])
            rec["sweep"] = [(t * 1e6, vars(c)) for t, c in timed[:8]]
            for t, c in timed[:3]:
                print(f"    {t * 1e6:8.2f} us {nbytes / t / 1e12:5.2f} TB/s  {c}")
            print(f"    ({len(timed)} configs in {time.time() - start:.0f} s)", flush=True)
        result.setdefault("ops", {})[f"{model}/{fmt}/{name}"] = rec
        torch.cuda.empty_cache()


def part_chain(model: str, bw: float, result: dict) -> None:
    from plait.runtime import kernels as kn

    m = dims(model)
    h, q, L = m["hidden"], m["q"], m["layers"]
    layers = [
        dict(
            n1=rand(h, scale=0.1) + 1,
            n2=rand(h, scale=0.1) + 1,
            qkv=rand(m["qkv"], h, scale=0.02),
            o=rand(h, q, scale=0.02),
            gate_up=rand(2 * m["inter"], h, scale=0.02),
            down=rand(h, m["inter"], scale=0.02),
        )
        for _ in range(L)
    ]
    head, final_norm = rand(m["vocab"], h, scale=0.02), rand(h, scale=0.1) + 1
    nbytes = sum(w.numel() * 2 for lw in layers for w in lw.values()) + head.numel() * 2
    x0 = rand(1, h)

    def unfused():
        hs, res = x0, None
        for lw in layers:
            if res is None:
                a, res = kn.rmsnorm(hs, lw["n1"], EPS), hs.clone()
            else:
                a, res = kn.fused_add_rmsnorm(hs, res, lw["n1"], EPS)
            o = kn.gemv(kn.gemv(a, lw["qkv"])[:, :q], lw["o"])
            a, res = kn.fused_add_rmsnorm(o, res, lw["n2"], EPS)
            hs = torch.matmul(kn.silu_and_mul(torch.matmul(a, lw["gate_up"].t())), lw["down"].t())
        a, _ = kn.fused_add_rmsnorm(hs, res, final_norm, EPS)
        return kn.gemv(a, head, out_dtype=torch.float32)

    def fused(fuse_gate_up: bool):
        def run():
            hs, res = x0, None
            for lw in layers:
                qkv, res = kn.rmsnorm_gemv(hs, res, lw["n1"], EPS, lw["qkv"])
                o = kn.gemv_row(qkv[:, :q], lw["o"])
                if fuse_gate_up:
                    gate_up, res = kn.rmsnorm_gemv(o, res, lw["n2"], EPS, lw["gate_up"])
                else:
                    a, res = kn.fused_add_rmsnorm(o, res.clone() if res is x0 else res, lw["n2"], EPS)
                    gate_up = torch.matmul(a, lw["gate_up"].t())
                hs = kn.silu_mul_gemv(gate_up, lw["down"])
            return kn.rmsnorm_gemv(hs, res, final_norm, EPS, head, out_dtype=torch.float32)[0]

        return run

    variants = {
        "unfused": (unfused, False),
        "unfused + PDL": (unfused, True),
        "fused": (fused(True), False),
        "fused, gate_up norm apart": (fused(False), False),
        "fused + PDL": (fused(True), True),
        "fused + PDL, gate_up norm apart": (fused(False), True),
    }
    floor = nbytes / bw
    print(
        f"\n{model}: layer chain x {L} + LM head, attention left out ({nbytes / 1e9:.2f} GB, floor "
        f"{floor * 1e3:.3f} ms)"
    )
    outs, rec = {}, {}
    from plait.runtime.kernel_choices import KernelChoices, using

    for name, (fn, pdl) in variants.items():
        try:
            with using(KernelChoices(pdl=pdl)):  # read by the kernels' wrappers at capture time
                t = graph_time(lambda fn=fn: outs.__setitem__(name, fn()), reps=1)
        except Exception as e:  # e.g. PDL unsupported by this Triton / driver
            print(f"  {name:32s} failed: {type(e).__name__}: {str(e)[:120]}")
            continue
        rec[name] = {"step_ms": t * 1e3, "layer_us": (t * 1e6) / L, "floor_fraction": floor / t}
        print(f"  {name:32s} {t * 1e3:7.3f} ms/step {t * 1e6 / L:8.2f} us/layer  {floor / t:6.1%} of floor", flush=True)
    ref = outs.get("unfused")
    for name, out in outs.items():
        if ref is not None and name != "unfused":
            err = float((out.double() - ref.double()).norm() / ref.double().norm())
            rec[name]["rel_err_vs_unfused"] = err
            print(f"  {name:32s} logits rel err vs unfused {err:.2e}")
    for plain, pdl in (
        ("unfused", "unfused + PDL"),
        ("fused", "fused + PDL"),
        ("fused, gate_up norm apart", "fused + PDL, gate_up norm apart"),
    ):
        if plain in outs and pdl in outs:
            same = bool(torch.equal(outs[plain], outs[pdl]))
            rec[pdl]["identical_to_plain_launch"] = same
            print(f"  {pdl}: output identical to the plain launch: {same}")
    result.setdefault("chain", {})[model] = {"bytes": nbytes, "floor_ms": floor * 1e3, "variants": rec}
    layers = head = None
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", nargs="+", default=["llama-3.1-8b", "llama-3.2-1b"], choices=sorted(SHAPES))
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--sweep", action="store_true", help="also sweep tile configs per fused op")
    ap.add_argument("--skip-chain", action="store_true")
    ap.add_argument("--fp8", action="store_true", help="part 1 with FP8 weights (the chain stays bf16)")
    args = ap.parse_args()
    torch.manual_seed(0)
    bw = copy_bandwidth()
    print(f"GPU {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s (read+write)", flush=True)
    result = {"copy_bandwidth": bw}
    for model in args.model:
        part_ops(model, args.copies, args.sweep, result, args.fp8)
        if not args.skip_chain:
            part_chain(model, bw, result)
    save("bench_fused_gemv", result)


if __name__ == "__main__":
    main()
