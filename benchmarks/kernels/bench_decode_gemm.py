"""Decode-time linear layers at batch 16-128: the tensor-core decode matmul (runtime/kernels/decode_gemm.py)
against torch.matmul (cuBLAS), on the weight shapes of Llama-3.1-8B / 3.2-1B.

Per (rows, shape): a sweep of tile configs and K splits, each checked against a float64 reference and for
run-to-run bitwise equality (the split-K reduction must be deterministic), timed as CUDA-graph replays
over distinct weight copies (so L2 never holds the next weight), reported as achieved read bandwidth.
Then the whole weight-only decode step (every layer's four matrices + the LM head) with cuBLAS and with
the best config per shape, next to the copy-bandwidth floor.

    python benchmarks/kernels/bench_decode_gemm.py --model llama-3.1-8b --rows 16 32 64 128
"""

from __future__ import annotations

import itertools
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # this room's scripts, then benchmarks/ (bench_common)
from bench_common import save  # noqa: E402
from bench_gemv import graph_time, layer_shapes, matmul_bench_args, sweep_record, weight_only_step_time  # noqa: E402
from gpu_ceilings import copy_bandwidth  # noqa: E402

SM_COUNT_FALLBACK = 132


def configs(n: int, k: int, sms: int):
    from plait.runtime.kernels.decode_gemm import DecodeGemmConfig

    for (bn, bk), warps, stages in itertools.product(
        ((64, 128), (64, 256), (128, 64), (128, 128), (128, 256)), (4, 8), (3, 4)
    ):
        tiles = -(-n // bn)
        k_tiles = -(-k // bk)
        splits = sorted({s for s in (1, 2, 3, 4, 6, 8) if s <= k_tiles and tiles * s <= 8 * sms})
        for split in splits:
            yield DecodeGemmConfig(bn, bk, split, warps, stages)


def main() -> None:
    from plait.runtime.kernels.decode_gemm import SplitKWorkspace, decode_gemm, pick_decode_gemm_config

    args = matmul_bench_args(rows=[16, 32, 64, 128], copies=4).parse_args()
    torch.manual_seed(0)
    bw = copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count or SM_COUNT_FALLBACK
    print(f"GPU {torch.cuda.get_device_name()}  {sms} SMs  copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    workspace = SplitKWorkspace()
    result = {"model": args.model, "copy_bandwidth": bw, "shapes": {}, "step": {}}
    best = {}
    shapes = layer_shapes(args.model)
    for rows in args.rows:
        for name, (n, k) in shapes.items():
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
            sweep, failed = [], 0
            default = pick_decode_gemm_config(n, k, rows)
            for cfg in [default] + [c for c in configs(n, k, sms) if c != default]:
                try:
                    y = decode_gemm(x, ws[0], cfg, workspace)
                    y2 = decode_gemm(x, ws[0], cfg, workspace)
                except Exception as e:  # e.g. a tile that does not fit in shared memory
                    failed += 1
                    if failed <= 2:
                        print(f"  {name} {cfg}: {type(e).__name__}: {str(e)[:120]}")
                    continue
                err = float((y.double() - ref).norm() / ref.norm())
                if not err < 1e-2 or not torch.equal(y, y2):
                    print(f"  {name} {cfg} WRONG rel err {err:.2e} deterministic {torch.equal(y, y2)}")
                    continue

                def triton_fn(cfg=cfg):
                    for w in ws:
                        decode_gemm(x, w, cfg, workspace)

                sweep.append((graph_time(triton_fn, reps=2) / len(ws), cfg))
            t_default = next((t for t, c in sweep if c == default), float("nan"))
            record = sweep_record(n, k, t_cublas, sweep)
            t_best, cfg_best = sweep[0]
            best[(rows, name)] = cfg_best
            result["shapes"][f"{name}/m{rows}"] = {
                **record,
                "default_us": t_default * 1e6,
                "default_config": vars(default),
            }
            print(
                f"m={rows:3d} {name:8s} ({n:6d}x{k:5d}) cuBLAS {t_cublas * 1e6:8.1f} us {nbytes / t_cublas / 1e12:5.2f}"
                f" TB/s | triton {t_best * 1e6:8.1f} us {nbytes / t_best / 1e12:5.2f} TB/s  {cfg_best} | default "
                f"{t_default * 1e6:8.1f} us",
                flush=True,
            )
            ws = None
            torch.cuda.empty_cache()
        if args.only:
            continue
        t_c, total_bytes = weight_only_step_time(args.model, rows, lambda nm, x, w: torch.matmul(x, w.t()))
        t_t, _ = weight_only_step_time(
            args.model, rows, lambda nm, x, w: decode_gemm(x, w, best[(rows, nm)], workspace)
        )
        floor = total_bytes / bw
        result["step"][f"m{rows}"] = {
            "bytes": total_bytes,
            "cublas_ms": t_c * 1e3,
            "triton_ms": t_t * 1e3,
            "floor_ms": floor * 1e3,
        }
        print(
            f"weight-only step m={rows}: cuBLAS {t_c * 1e3:.3f} ms ({floor / t_c:.1%} of floor)  triton "
            f"{t_t * 1e3:.3f} ms ({floor / t_t:.1%})  floor {floor * 1e3:.3f} ms",
            flush=True,
        )
    save(f"bench_decode_gemm_{args.model}", result)


if __name__ == "__main__":
    main()
