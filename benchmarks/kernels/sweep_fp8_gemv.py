"""The one-row FP8 matmul (batch-1 decode with FP8 weights, issue 38): which kernel shape streams the FP8 weights
fastest, on Llama-3.1-8B's four matrices (QKV 6144x4096, O 4096x4096, gate-up 28672x4096, down 4096x14336).

Timed as CUDA-graph replays over distinct weight copies (L2 never holds the next weight), microseconds a call, with
the weight-read bandwidth each implies:
- `gemv`: runtime/kernels/gemv.py (bf16 row, FP8 codes widened in registers) at its picked tiles, then over a grid
  of tiles: whole-row tiles (the picked family) and short K tiles in a pipelined K loop (`num_stages` >= 3: the
  compiler's software pipeline keeps several tiles of weights in flight per program);
- `bf16`: torch.mm on the bf16 weight (cuBLAS), and `pt_mm`: torch._scaled_mm with unit scales on an FP8 row
  (cuBLASLt's FP8 kernel, the matmul alone: what the tensor cores' library reaches at one row);
- `decode_a8` (2 rows and more): the engine's path there, the tensor-core decode matmul on FP8 rows.
Each config's product is checked against the dequantized weight's before it is timed.

    python benchmarks/kernels/sweep_fp8_gemv.py                 # every shape, one row
    python benchmarks/kernels/sweep_fp8_gemv.py --rows 1 2 4 --quick
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import torch
import triton

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # this room's scripts, then benchmarks/ (bench_common)
from bench_common import save  # noqa: E402
from bench_gemv import graph_time  # noqa: E402

SHAPES_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)


def per_thread(bn: int, bk: int, warps: int, rows: int = 1) -> int:
    """fp32 values of one tile's product each thread holds: above ~64 the kernel spills."""
    return max(1, triton.next_power_of_2(rows)) * bn * bk // (32 * warps)


def plain_grid(quick: bool) -> list:
    """GemvConfig fields (block_n, block_k, num_warps, num_stages): whole-row tiles and pipelined short tiles."""
    whole = list(itertools.product((1, 2, 4, 8), (2048, 4096), (4, 8), (1, 2)))
    piped = list(itertools.product((4, 8, 16, 32), (256, 512, 1024), (4, 8), (3, 4, 6)))
    if quick:
        whole = [c for c in whole if c[2] == 4 and c[3] == 2]
        piped = [c for c in piped if c[3] == 4]
    return [c for c in whole + piped if per_thread(c[0], c[1], c[2]) <= 64]


def sweep_shape(n: int, k: int, rows: int, copies: int, quick: bool, only: dict | None = None) -> dict:
    """{path: [(seconds, config)]} at x (rows, k) @ W (n, k)^T; `only` ({path: [configs]}) times those configs
    instead of the grids (rows after the first: the first row count's fastest)."""
    from plait.runtime.kernels.gemv import GemvConfig, gemv, pick_gemv_config
    from plait.runtime.quant.fp8 import Fp8Linear

    layers = [
        Fp8Linear.from_float(torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02, None, torch.bfloat16)
        for _ in range(copies)
    ]
    floats = [layer.dequantized() for layer in layers]
    x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
    ref = x.float() @ floats[0].float().t()
    x_fp8 = x.to(torch.float8_e4m3fn)
    unit = torch.ones((), dtype=torch.float32, device="cuda")
    results: dict = {}

    def timed(name, call, cfg):
        try:
            y = call(layers[0], cfg)
            torch.cuda.synchronize()
        except Exception as e:  # a tile the compiler or the descriptor refuses
            results.setdefault("refused", []).append((name, str(cfg), type(e).__name__))
            return
        if name not in ("bf16", "pt_mm", "decode_a8") and float((y.float() - ref).norm() / ref.norm()) > 0.02:
            print(f"  {name} {n}x{k} rows {rows} {cfg}: WRONG")
            return

        def run():
            for layer, w in zip(layers, floats):
                call(layer if name != "bf16" else w, cfg)

        results.setdefault(name, []).append((graph_time(run, reps=5) / copies, cfg))

    timed("bf16", lambda w, cfg: torch.mm(x, (w if isinstance(w, torch.Tensor) else floats[0]).t()), None)
    if rows >= 2:  # the engine's path at 2-64 rows today: the tensor-core decode matmul on FP8 rows
        from plait.runtime.kernels.decode_gemm import SplitKWorkspace
        from plait.runtime.kernels.fp8_gemm import fp8_gemm
        from plait.runtime.quant.fp8 import quantize_rows

        codes, scales, workspace = *quantize_rows(x), SplitKWorkspace()
        timed("decode_a8", lambda layer, cfg: fp8_gemm(
            codes, layer.weight, layer.weight_scale, workspace=workspace, x_scale=scales,
            out_dtype=torch.bfloat16), None)  # fmt: skip
    timed("pt_mm", lambda layer, cfg: torch._scaled_mm(
        x_fp8, layer.weight.t(), scale_a=unit, scale_b=unit, out_dtype=torch.bfloat16), None)  # fmt: skip
    picked = pick_gemv_config(n, k)
    plain = [(picked.block_n, picked.block_k, picked.num_warps, picked.num_stages)]
    plain += only["gemv"] if only else plain_grid(quick)
    for cfg in plain:
        timed("gemv", lambda layer, cfg: gemv(
            x, layer.weight, config=GemvConfig(*cfg), weight_scale=layer.weight_scale), cfg)  # fmt: skip
    for name, rs in results.items():
        if name != "refused":
            first = rs[0]
            rs.sort(key=lambda r: r[0])
            if name == "gemv":
                rs.insert(0, first)  # the picked config first, then the grid fastest first
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1])
    ap.add_argument("--only", nargs="+", choices=sorted(SHAPES_8B), default=None)
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="a smaller grid (fewer stages and warps)")
    args = ap.parse_args()
    record = {"gpu": torch.cuda.get_device_name(), "rows": {}}
    fastest: dict = {}  # shape -> {path: the first row count's 4 fastest configs}
    for rows in args.rows:
        totals: dict = {}
        per_shape = {}
        for name, (n, k) in SHAPES_8B.items():
            if args.only and name not in args.only:
                continue
            t0 = time.time()
            res = sweep_shape(n, k, rows, args.copies, args.quick, fastest.get(name))
            if name not in fastest:
                fastest[name] = {p: [c for _, c in res.get(p, [])[1:][:4]] for p in ("gemv",)}
            wbytes = n * k  # FP8: one byte a weight
            line = [f"rows {rows} {name} {n}x{k} ({time.time() - t0:.0f} s):"]
            for path in ("bf16", "pt_mm", "decode_a8", "gemv"):
                if path not in res:
                    continue
                if path == "gemv":
                    t_pick = res[path][0][0]
                    line.append(f"gemv picked {t_pick * 1e6:.1f}")
                    totals["gemv_picked"] = totals.get("gemv_picked", 0.0) + t_pick
                    best = res[path][1] if len(res[path]) > 1 else res[path][0]
                else:
                    best = res[path][0]
                totals[path] = totals.get(path, 0.0) + best[0]
                rate = (wbytes * (2 if path == "bf16" else 1)) / best[0] / 1e12
                line.append(f"{path} {best[0] * 1e6:.1f} ({rate:.2f} TB/s) {best[1] or ''}")
            print("  ".join(line), flush=True)
            for path in ("gemv",):
                top = res.get(path, [])[1:][:5]
                print(f"    {path} top: " + "; ".join(f"{t * 1e6:.1f} {c}" for t, c in top))
            if res.get("refused"):
                print(f"    refused: {len(res['refused'])} (first: {res['refused'][0]})")
            per_shape[name] = {
                p: [(t, list(c) if c else None) for t, c in v[:8]] for p, v in res.items() if p != "refused"
            }
        print(f"rows {rows} four matrices, us: " + ", ".join(f"{p} {t * 1e6:.1f}" for p, t in totals.items()))
        record["rows"][rows] = {"totals_us": {p: t * 1e6 for p, t in totals.items()}, "shapes": per_shape}
    save("sweep_fp8_gemv", record)


if __name__ == "__main__":
    main()
