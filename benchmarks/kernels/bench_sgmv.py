"""The LoRA SGMV kernels (runtime/lora/sgmv.py) at Llama-3.1-8B's four LoRA targets (qkv, o, gate_up, down),
rank 16, 8 adapters, in both forms a step gives them, beside the base projection's matmul (torch.matmul,
cuBLAS) at the same rows:

- one segment per token (the decode CUDA graphs; T = 1 .. 256): the split-K shrink and the one-row expand
  at the rules' plan ("rule"), at each of `--expand-grids` (rows x output columns an expand program), and
  at each of `--splits` (the shrink's slices of the input features), the fastest marked;
- runs of one adapter (eager steps; T / 8 rows each, T = 64 .. 8,192): the SGMV kernels at the rule's
  expand tile and at each of `--run-tiles`, against two cuBLAS matmuls per run (`add_runs_by_matmul`).

Each call timed as CUDA-graph replays over 32 layers of adapters (each replay walks every layer, so L2 does
not keep a layer's A and B between calls) and the base over 8 weight copies; microseconds per call. Every
variant's result checked against the first's.

    python benchmarks/kernels/bench_sgmv.py                 # GPU: -> $OUT/bench_sgmv.json
    python benchmarks/kernels/bench_sgmv.py --smoke         # CPU (TRITON_INTERPRET=1), toy sizes: it runs
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # this room's scripts, then benchmarks/ (bench_common)
from bench_common import save  # noqa: E402

# name -> (fan-in, sub-projection output sizes) at Llama-3.1-8B (32 q heads, 8 kv heads of 128, MLP 14,336)
TARGETS_8B = {
    "qkv": (4096, [4096, 1024, 1024]),
    "o": (4096, [4096]),
    "gate_up": (4096, [14336, 14336]),
    "down": (14336, [4096]),
}
TARGETS_TOY = {"qkv": (200, [128, 32, 32]), "o": (128, [200]), "gate_up": (200, [330, 330]), "down": (330, [200])}


def segments_of(form: str, T: int, adapters: int, device: str):
    """`per_token`: token i on adapter i % adapters + 1 (the graphs' form); `runs`: `adapters` runs of T /
    adapters rows (the last takes the rest)."""
    from plait.runtime.lora.sgmv import Segments

    n = min(adapters, T)
    if form == "per_token":
        return Segments.per_token(torch.arange(T, device=device) % n + 1)
    bounds = [T * i // n for i in range(n + 1)]
    return Segments.of_runs([(bounds[i], bounds[i + 1], i + 1) for i in range(n)], device)


def wall_time(fn, reps: int = 1) -> float:
    """Seconds of one fn() call (the CPU smoke's stand-in for graph_time; its numbers mean nothing)."""
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="toy sizes, one layer (the CPU interpreter's run)")
    ap.add_argument("--rows", type=int, nargs="+", default=None, help="per-token T (default 1 8 32 64 128 256)")
    ap.add_argument("--run-rows", type=int, nargs="+", default=None, help="runs' T (default 64 .. 8192)")
    ap.add_argument("--expand-grids", nargs="+", default=["1x64", "2x64", "4x128", "4x256", "8x256"])
    ap.add_argument("--splits", type=int, nargs="+", default=[8, 16, 32, 64], help="the shrink's, one-row form")
    ap.add_argument("--run-tiles", nargs="+", default=["16x64", "64x128"], help="the runs' expand tiles")
    ap.add_argument("--targets", nargs="+", default=list(TARGETS_8B), choices=list(TARGETS_8B))
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--layers", type=int, default=32, help="layers of adapters walked per replay")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda:
        if not args.smoke:
            sys.exit("no GPU: run with --smoke (toy sizes under TRITON_INTERPRET=1)")
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton's first import: it picks its mode there
    from plait.runtime.lora import sgmv
    from plait.runtime.lora.matmul import add_runs_by_matmul

    device = "cuda" if cuda else "cpu"
    # NOTE: the interpreter's tl.dot over bf16 is wrong (numpy has no bf16), so the CPU smoke runs float32.
    dtype = torch.bfloat16 if cuda else torch.float32
    targets = TARGETS_TOY if args.smoke else TARGETS_8B
    token_rows = args.rows or ([1, 5] if args.smoke else [1, 8, 32, 64, 128, 256])
    run_rows = args.run_rows or ([33] if args.smoke else [64, 128, 512, 1024, 2048, 8192])
    grids = [tuple(int(v) for v in g.split("x")) for g in args.expand_grids]
    run_tiles = [tuple(int(v) for v in t.split("x")) for t in args.run_tiles]
    layers = 1 if args.smoke else args.layers
    R, S = args.rank, args.adapters
    if cuda:
        from bench_gemv import graph_time

        timer = graph_time
        print(f"GPU {torch.cuda.get_device_name()}", flush=True)
    else:
        timer = wall_time
        print("CPU smoke under TRITON_INTERPRET=1: it runs; the times mean nothing", flush=True)
    gen = torch.Generator(device=device).manual_seed(0)
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu (interpreter)", "rank": R, "adapters": S,
              "layers": layers, "dtype": str(dtype), "smoke": args.smoke, "rows": []}  # fmt: skip
    for name in args.targets:
        fan_in, splits = targets[name]
        out = sum(splits)
        # (S+1, L, subs * R, in), (S+1, L, out, R); slot 0 the base model's zeros
        a_all = torch.randn(S + 1, layers, len(splits) * R, fan_in, device=device, generator=gen).to(dtype) * 0.02
        b_all = torch.randn(S + 1, layers, out, R, device=device, generator=gen).to(dtype) * 0.02
        a_all[0].zero_()
        b_all[0].zero_()
        copies = 1 if args.smoke else 8
        ws = [torch.randn(out, fan_in, device=device, dtype=dtype) * 0.02 for _ in range(copies)]
        for form, rows in (("per_token", token_rows), ("runs", run_rows)):
            for T in rows:
                x = torch.randn(T, fan_in, device=device, generator=gen).to(dtype)
                y = torch.randn(T, out, device=device, generator=gen).to(dtype)
                reps = 20 if T <= 512 else 3
                time_of = (lambda fn: timer(fn, reps)) if cuda else timer
                base_s = time_of(lambda: [torch.matmul(x, w.t()) for w in ws]) / copies
                segs = segments_of(form, T, S, device)
                runs = [(int(s0), int(s0 + n), int(slot)) for s0, n, slot in
                        zip(segs.starts.tolist(), segs.lengths.tolist(), segs.slots.tolist())]  # fmt: skip
                # label -> (the shrink's splits, the one-row expand's grid, the runs' expand tile); None: the rule's
                variants: dict = {"rule": (None, None, None)}
                if form == "per_token":
                    variants.update({f"{g[0]}x{g[1]}": (None, g, None) for g in grids})
                    variants.update({f"P={p}": (p, None, None) for p in args.splits})
                else:
                    variants.update({f"{t[0]}x{t[1]}": (None, None, t) for t in run_tiles})
                    variants["cublas"] = (None, None, None)  # (not the kernels)

                def call(label, i, ys):
                    if label == "cublas":
                        add_runs_by_matmul(runs, a_all, b_all, i, R, splits, x, ys)
                    else:
                        sgmv.sgmv_apply(segs, a_all, b_all, i, R, splits, x, ys, *variants[label])

                times, first, diff = {}, None, 0.0
                for label in variants:
                    got = y.clone()
                    call(label, 0, got)
                    first = got if first is None else first
                    diff = max(diff, (got.float() - first.float()).abs().max().item())
                    ys = y.clone()
                    times[label] = time_of(lambda label=label: [call(label, i, ys) for i in range(layers)]) / layers
                best = min(times, key=times.get)
                row = {"target": name, "T": T, "form": form, "us": {k: v * 1e6 for k, v in times.items()},
                       "best": best, "base_us": base_s * 1e6, "max_abs_diff": diff}  # fmt: skip
                result["rows"].append(row)
                cells = "  ".join(f"{k} {v * 1e6:.1f}" for k, v in times.items())
                print(f"{name:>8} {form:>9} T={T:<5} base {base_s * 1e6:7.1f} us | {cells} | best {best} "
                      f"({times[best] / base_s:.2f}x base) diff {diff:.1e}", flush=True)  # fmt: skip
        a_all = b_all = ws = None
        if cuda:
            torch.cuda.empty_cache()
    save("bench_sgmv_smoke" if args.smoke else "bench_sgmv", result)


if __name__ == "__main__":
    main()
