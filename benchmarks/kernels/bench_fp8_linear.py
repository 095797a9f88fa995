"""FP8 linear layers by row count (issue 38): the two FP8 paths against bf16 cuBLAS, on Llama-3.1-8B's
matrices (QKV 6144x4096, O 4096x4096, gate-up 28672x4096, down 4096x14336), at 1-2048 rows.

Paths, each timed as CUDA-graph replays over distinct weight copies (L2 never holds the next weight):
- `bf16`: torch.mm on the bf16 weight (cuBLAS), the baseline;
- `scaled_mm`: what an FP8 layer runs above FP8_DECODE_ROWS: the rows quantized per token, then
  torch._scaled_mm (rowwise scales, bf16 out); `scaled_mm_only`: the matmul alone (rows quantized before);
- `triton`: runtime/kernels/fp8_gemm.py (bf16 rows, FP8 weights widened in registers), up to its 64 rows,
  at the picked tiles.
Reported: microseconds, the weight read bandwidth they imply, and each FP8 path's speed-up over bf16; the
dispatch constant (models/layers.FP8_DECODE_ROWS) should sit where `triton` stops beating `scaled_mm`.

    python benchmarks/kernels/bench_fp8_linear.py                  # every shape, rows 1 8 32 64 256 2048
    python benchmarks/kernels/bench_fp8_linear.py --rows 1 16 --only gate_up
    python benchmarks/kernels/bench_fp8_linear.py --sweep --rows 1 16 64   # the triton path's tiles and splits
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # this room's scripts, then benchmarks/ (bench_common)
from bench_common import save  # noqa: E402
from bench_gemv import graph_time  # noqa: E402
from gpu_ceilings import copy_bandwidth  # noqa: E402

SHAPES_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)


def time_paths(n: int, k: int, rows: int, copies: int) -> dict[str, float]:
    """Seconds per call of each path at x (rows, k) @ W (n, k)^T, cycling over `copies` weights."""
    from plait.runtime.kernels.decode_gemm import SplitKWorkspace
    from plait.runtime.kernels.fp8_gemm import MAX_ROWS, fp8_gemm
    from plait.runtime.quant.fp8 import Fp8Linear, quantize_rows

    floats = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(copies)]
    layers = [Fp8Linear.from_float(w, None, torch.bfloat16) for w in floats]
    x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
    x_codes, x_scales = quantize_rows(x)
    workspace = SplitKWorkspace()
    calls = [0]  # how many weights the paths have taken: each call takes the next copy

    def cycle(items):
        calls[0] += 1
        return items[calls[0] % copies]

    def scaled_mm_only():
        layer = cycle(layers)
        return torch._scaled_mm(
            x_codes,
            layer.weight.t(),
            scale_a=x_scales,
            scale_b=layer.weight_scale.view(1, -1),
            out_dtype=torch.bfloat16,
        )

    paths = {
        "bf16": lambda: torch.mm(x, cycle(floats).t()),
        "scaled_mm": lambda: cycle(layers).linear(x),
        "scaled_mm_only": scaled_mm_only,
    }
    if rows <= MAX_ROWS:
        paths["triton"] = lambda: (lambda layer: fp8_gemm(x, layer.weight, layer.weight_scale, workspace=workspace))(
            cycle(layers)
        )
    # Correctness first: every FP8 path near the bf16 product of the dequantized weight.
    ref = x.float() @ layers[0].dequantized().float().t()
    for name, fn in paths.items():
        calls[0] = -1  # the next call takes copy 0
        y = fn().float()
        err = float((y - (x.float() @ floats[0].float().t() if name == "bf16" else ref)).norm() / ref.norm())
        if err > 0.05:
            raise AssertionError(f"{name} at {rows}x{n}x{k}: relative error {err:.3g}")
    return {name: graph_time(fn) for name, fn in paths.items()}


def sweep_triton(n: int, k: int, rows: int, copies: int) -> tuple[float, list]:
    """The triton path over tile shapes, K splits and stages at x (rows, k) @ W (n, k)^T: (seconds of the
    picked config, [(seconds, config)] fastest first), each config checked against the dequantized product."""
    import itertools

    from plait.runtime.kernels.decode_gemm import DecodeGemmConfig, SplitKWorkspace
    from plait.runtime.kernels.fp8_gemm import fp8_gemm, pick_fp8_gemm_config
    from plait.runtime.quant.fp8 import Fp8Linear

    layers = [
        Fp8Linear.from_float(torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02, None, torch.bfloat16)
        for _ in range(copies)
    ]
    x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
    ref = x.float() @ layers[0].dequantized().float().t()
    workspace = SplitKWorkspace()
    picked = pick_fp8_gemm_config(n, k, rows)
    grid = itertools.product((64, 128), (128, 256, 512), (1, 2, 4, 8), (3, 4))
    configs = [picked] + [DecodeGemmConfig(bn, bk, sp, 4, st) for bn, bk, sp, st in grid]
    results, t_picked = [], float("nan")
    for cfg in configs:
        try:
            y = fp8_gemm(x, layers[0].weight, layers[0].weight_scale, config=cfg, workspace=workspace)
        except Exception:  # a tile that does not fit in shared memory
            continue
        if float((y.float() - ref).norm() / ref.norm()) > 0.02:
            print(f"  {n}x{k} rows {rows} {cfg}: WRONG")
            continue

        def run(cfg=cfg):
            for layer in layers:
                fp8_gemm(x, layer.weight, layer.weight_scale, config=cfg, workspace=workspace)

        t = graph_time(run, reps=5) / copies
        if cfg is picked:
            t_picked = t
        else:
            results.append((t, cfg))
    results.sort(key=lambda r: r[0])
    return t_picked, results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 256, 2048])
    p.add_argument("--only", nargs="+", choices=sorted(SHAPES_8B), default=None)
    p.add_argument("--copies", type=int, default=4, help="distinct weights cycled (L2 holds none of the next)")
    p.add_argument("--sweep", action="store_true", help="the triton path's configs instead (rows <= 64)")
    args = p.parse_args()
    from plait.runtime.models.layers import FP8_DECODE_ROWS

    torch.manual_seed(0)
    bw = copy_bandwidth()
    print(f"GPU {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s  FP8_DECODE_ROWS {FP8_DECODE_ROWS}")
    if args.sweep:
        sweeps = []
        for rows in [r for r in args.rows if r <= 64]:
            for name, (n, k) in SHAPES_8B.items():
                if args.only and name not in args.only:
                    continue
                t_picked, results = sweep_triton(n, k, rows, args.copies)
                best = results[0]
                print(
                    f"rows {rows:>3} {name:>8}: picked"
                    f" {t_picked * 1e6:7.1f} us ({n * k / t_picked / 1e12:.2f} TB/s); best "
                    f"{best[0] * 1e6:7.1f} us ({n * k / best[0] / 1e12:.2f} TB/s) {vars(best[1])}; next "
                    + ", ".join(
                        f"{t * 1e6:.1f} {c.block_n}/{c.block_k}/s{c.split_k}/st{c.num_stages}" for t, c in results[1:4]
                    ),
                    flush=True,
                )
                sweeps.append(
                    {"rows": rows, "shape": name, "picked_s": t_picked, "best": [(t, vars(c)) for t, c in results[:8]]}
                )
        save("fp8_gemm_sweep", {"gpu": torch.cuda.get_device_name(), "copy_bandwidth": bw, "sweeps": sweeps})
        return
    columns = ("bf16 us", "sc_mm us", "mm only", "triton", "fp8 TB/s")
    print(f"{'rows':>5} {'shape':>8} " + " ".join(f"{c:>8}" for c in columns) + f" {'best x':>7}")
    records = []
    for rows in args.rows:
        for name, (n, k) in SHAPES_8B.items():
            if args.only and name not in args.only:
                continue
            t = time_paths(n, k, rows, args.copies)
            fp8_best = min(v for key, v in t.items() if key in ("scaled_mm", "triton"))
            records.append({"rows": rows, "shape": name, "n": n, "k": k, "seconds": t})
            triton = f"{t['triton'] * 1e6:8.1f}" if "triton" in t else f"{'-':>8}"
            print(
                f"{rows:>5} {name:>8} {t['bf16'] * 1e6:8.1f} {t['scaled_mm'] * 1e6:8.1f} "
                f"{t['scaled_mm_only'] * 1e6:8.1f} {triton} {n * k / fp8_best / 1e12:8.2f} {t['bf16'] / fp8_best:7.2f}",
                flush=True,
            )
    save(
        "fp8_linear",
        {
            "gpu": torch.cuda.get_device_name(),
            "copy_bandwidth": bw,
            "fp8_decode_rows": FP8_DECODE_ROWS,
            "records": records,
        },
    )


if __name__ == "__main__":
    main()
