"""Decode-time linear layers at batch 1-8: the Triton skinny matmul (runtime/kernels/gemv.py) against
torch.matmul (cuBLAS), on the weight shapes of Llama-3.1-8B and Llama-3.2-1B.

Per shape: a sweep of tile configs, each timed as CUDA-graph replays over 8 distinct weight copies
(so the 60 MB L2 never holds the next weight), reported as achieved read bandwidth. Then the whole
weight-only decode step (every layer's four matrices + the LM head, the real model's bytes) with
cuBLAS and with the best config per shape: the physical limit of a decode step that ANCHORS quotes.

    python benchmarks/kernels/bench_gemv.py --model llama-3.1-8b --rows 1
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # this room's scripts, then benchmarks/ (bench_common)
from bench_common import save  # noqa: E402
from gpu_ceilings import copy_bandwidth  # noqa: E402

SHAPES = {  # name -> (hidden, intermediate, layers, q heads, kv heads, head_dim, vocab)
    "llama-3.1-8b": (4096, 14336, 32, 32, 8, 128, 128256),
    "llama-3.2-1b": (2048, 8192, 16, 32, 8, 64, 128256),
}


def layer_shapes(model: str) -> dict[str, tuple[int, int]]:
    h, inter, _, qh, kvh, d, vocab = SHAPES[model]
    return {
        "qkv": ((qh + 2 * kvh) * d, h),
        "o": (qh * d, h),
        "gate_up": (2 * inter, h),
        "down": (h, inter),
        "lm_head": (vocab, h),
    }


def graph_time(fn, reps: int = 20) -> float:
    """Median seconds of one fn() call, from CUDA-graph replays of `reps` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(12):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3 / reps)
    return statistics.median(times[2:])


def sweep_record(n: int, k: int, t_cublas: float, sweep: list) -> dict:
    """One shape's result: cuBLAS against the best of `sweep` ((seconds, config) pairs, sorted here in
    place, fastest first), with the five fastest configs."""
    sweep.sort(key=lambda p: p[0])
    t_best, cfg_best = sweep[0]
    nbytes = n * k * 2
    return {
        "n": n,
        "k": k,
        "cublas_us": t_cublas * 1e6,
        "cublas_tb_s": nbytes / t_cublas / 1e12,
        "triton_us": t_best * 1e6,
        "triton_tb_s": nbytes / t_best / 1e12,
        "config": vars(cfg_best),
        "top5": [(t * 1e6, vars(c)) for t, c in sweep[:5]],
    }


def matmul_bench_args(rows: list[int], copies: int) -> argparse.ArgumentParser:
    """The command line of the per-layer matmul benchmarks (this one and bench_decode_gemm.py)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--rows", type=int, nargs="+", default=rows)
    ap.add_argument(
        "--copies", type=int, default=copies, help="weight copies cycled through, so L2 never holds the next one"
    )
    ap.add_argument(
        "--only",
        nargs="+",
        default=None,
        help="sweep these layers only (qkv o gate_up down lm_head); skips the whole-step timing",
    )
    return ap


def weight_only_step_time(model: str, rows: int, matmul) -> tuple[float, int]:
    """(seconds, weight bytes) of the whole weight-only decode step of `model` at `rows` rows: every
    layer's QKV, O, gate_up and down (each layer its own weights, the real model's bytes) and the LM head,
    as `matmul(layer name, x, w)` runs each, timed as CUDA-graph replays."""
    _, _, layers, *_ = SHAPES[model]
    shapes = layer_shapes(model)
    names = ("qkv", "o", "gate_up", "down")
    weights = [
        [torch.randn(*shapes[nm], dtype=torch.bfloat16, device="cuda") * 0.02 for nm in names] for _ in range(layers)
    ]
    head = torch.randn(*shapes["lm_head"], dtype=torch.bfloat16, device="cuda") * 0.02
    total_bytes = sum(w.numel() * 2 for ws in weights for w in ws) + head.numel() * 2
    xs = {nm: torch.randn(rows, shapes[nm][1], dtype=torch.bfloat16, device="cuda") for nm in shapes}

    def run():
        for ws in weights:
            for nm, w in zip(names, ws):
                matmul(nm, xs[nm], w)
        matmul("lm_head", xs["lm_head"], head)

    seconds = graph_time(run, reps=3)
    weights = head = None
    torch.cuda.empty_cache()
    return seconds, total_bytes


def configs():
    from plait.runtime.kernels.gemv import GemvConfig

    # NOTE: K tiles up to a whole 4,096 row: a program of a small matrix (QKV, O) walks only 4 tiles of
    # 1,024, so its loads are few and serial; one long tile puts all of them in flight at once.
    for bn, bk, w, st in itertools.product((2, 4, 8, 16), (512, 1024, 2048, 4096), (4, 8), (1, 2, 4)):
        yield GemvConfig(bn, bk, w, st)


def main() -> None:
    from plait.runtime.kernels.gemv import gemv

    args = matmul_bench_args(rows=[1], copies=8).parse_args()
    torch.manual_seed(0)
    bw = copy_bandwidth()
    print(f"GPU {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s (read+write)", flush=True)
    result = {"model": args.model, "copy_bandwidth": bw, "shapes": {}, "step": {}}
    best = {}
    for rows in args.rows:
        for name, (n, k) in layer_shapes(args.model).items():
            if args.only and name not in args.only:
                continue
            ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(args.copies)]
            x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
            ref = x.double() @ ws[0].double().T
            nbytes = n * k * 2

            def cublas():
                for w in ws:
                    torch.matmul(x, w.t())

            t_cublas = graph_time(cublas, reps=2) / len(ws)
            sweep = []
            for cfg in configs():
                y = gemv(x, ws[0], config=cfg)
                err = float((y.double() - ref).norm() / ref.norm())
                if not err < 1e-2:
                    print(f"  {name} {cfg} WRONG rel err {err:.2e}")
                    continue

                def triton_fn(cfg=cfg):
                    for w in ws:
                        gemv(x, w, config=cfg)

                sweep.append((graph_time(triton_fn, reps=2) / len(ws), cfg))
            record = sweep_record(n, k, t_cublas, sweep)
            t_best, cfg_best = sweep[0]
            best[(rows, name)] = cfg_best
            result["shapes"][f"{name}/m{rows}"] = record
            print(
                f"m={rows} {name:8s} ({n:6d}x{k:5d}) cuBLAS {t_cublas * 1e6:8.1f} us "
                f"{nbytes / t_cublas / 1e12:5.2f} TB/s"
                f" | triton {t_best * 1e6:8.1f} us {nbytes / t_best / 1e12:5.2f} TB/s  {cfg_best}",
                flush=True,
            )
            ws = None  # free before the next shape
            torch.cuda.empty_cache()
        if args.only:
            continue
        t_c, total_bytes = weight_only_step_time(args.model, rows, lambda nm, x, w: torch.matmul(x, w.t()))
        t_t, _ = weight_only_step_time(args.model, rows, lambda nm, x, w: gemv(x, w, config=best[(rows, nm)]))
        floor = total_bytes / bw
        result["step"][f"m{rows}"] = {
            "bytes": total_bytes,
            "cublas_ms": t_c * 1e3,
            "triton_ms": t_t * 1e3,
            "floor_ms": floor * 1e3,
        }
        print(
            f"weight-only step m={rows}: cuBLAS {t_c * 1e3:.3f} ms ({rows / t_c:.0f} tok/s, {floor / t_c:.1%} of floor)"
            f"  triton {t_t * 1e3:.3f} ms ({rows / t_t:.0f} tok/s, {floor / t_t:.1%})  floor {floor * 1e3:.3f} ms",
            flush=True,
        )
    save(f"bench_gemv_{args.model}", result)


if __name__ == "__main__":
    main()
