"""The matmul library's rate on a model's linear layers by row count: how far a decode step at batch M (or a
prefill chunk of M tokens) is from the dense bf16 ceiling. TFLOP/s and read bandwidth per (M, layer), and
the whole layer stack (4 matrices x layers + LM head) per M, timed as CUDA-graph replays over distinct
weight copies.

    python benchmarks/kernels/matmul_rates.py --model llama-3.1-8b --rows 64 256 512 1024 8192
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # this room's scripts, then benchmarks/ (bench_common)
from bench_common import save  # noqa: E402
from bench_gemv import SHAPES, graph_time, layer_shapes  # noqa: E402
from gpu_ceilings import matmul_flops  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256, 384, 512, 768, 1024, 2048, 8192])
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument(
        "--swapped",
        action="store_true",
        help="also time y = (W @ x^T)^T made contiguous: the "
        "library's tiles for the transposed problem (the weight's rows as its M axis)",
    )
    args = ap.parse_args()
    peak = matmul_flops()
    print(f"GPU {torch.cuda.get_device_name()}  dense bf16 matmul rate {peak / 1e12:.0f} TFLOP/s", flush=True)
    shapes = layer_shapes(args.model)
    _, _, layers, *_ = SHAPES[args.model]
    weights = {
        nm: [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(args.copies)]
        for nm, (n, k) in shapes.items()
    }
    result = {"model": args.model, "matmul_flops": peak, "rows": {}}
    for m in args.rows:
        row, step_s = {}, 0.0
        for nm, (n, k) in shapes.items():
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            ws = weights[nm]

            def run():
                for w in ws:
                    torch.matmul(x, w.t())

            t = graph_time(run, reps=2) / len(ws)
            row[nm] = {"us": t * 1e6, "tflops": 2 * m * n * k / t / 1e12, "tb_s": n * k * 2 / t / 1e12}
            if args.swapped:

                def run_swapped():
                    for w in ws:
                        torch.matmul(w, x.t()).t().contiguous()

                ts = graph_time(run_swapped, reps=2) / len(ws)
                row[nm]["swapped_us"] = ts * 1e6
                row[nm]["swapped_tflops"] = 2 * m * n * k / ts / 1e12
            step_s += t * (1 if nm == "lm_head" else layers)
        flops = 2 * m * sum(n * k * (1 if nm == "lm_head" else layers) for nm, (n, k) in shapes.items())
        result["rows"][m] = {"layers": row, "step_ms": step_s * 1e3, "step_tflops": flops / step_s / 1e12}
        print(
            f"M={m:5d}: "
            + "  ".join(
                f"{nm} {v['us']:7.1f}us {v['tflops']:4.0f}TF"
                + (f" (swapped {v['swapped_us']:7.1f})" if args.swapped else "")
                for nm, v in row.items()
            )
            + f" | stack {step_s * 1e3:7.2f} ms {flops / step_s / 1e12:4.0f} TF ({flops / step_s / peak:.0%})",
            flush=True,
        )
    save(f"matmul_rates_{args.model}", result)


if __name__ == "__main__":
    main()
