"""FP8 linear layers by row count (issue 38): the two FP8 paths against bf16 cuBLAS, on Llama-3.1-8B's
matrices (QKV 6144x4096, O 4096x4096, gate-up 28672x4096, down 4096x14336), at 1-2048 rows.

Paths, each timed as CUDA-graph replays over distinct weight copies (L2 never holds the next weight):
- `bf16`: torch.mm on the bf16 weight (cuBLAS), the baseline;
- `scaled_mm`: what an FP8 layer runs above FP8_DECODE_ROWS: the rows quantized per token, then
  torch._scaled_mm (rowwise scales, bf16 out); `scaled_mm_only`: the matmul alone (rows quantized before);
- `triton`: runtime/kernels/fp8_gemm.py (bf16 rows, FP8 weights widened in registers), up to its 256 rows,
  at the picked tiles;
- `triton_a8`: the same kernel with the rows quantized first (quantize_rows, one kernel) and both operands on
  the FP8 tensor cores; `a8_only`: its matmul alone;
- `gemv`: runtime/kernels/gemv.py reading the FP8 codes (CUDA cores), up to 8 rows;
- `pt_mm_only`: torch._scaled_mm with one scale per tensor (cuBLASLt's FP8 kernels, not the rowwise CUTLASS
  ones), the matmul alone: whether per-tensor scales would pay for the extra amax pass;
- `unit_scaled`: quant/fp8_rows.unit_scaled_linear: the rows quantized, cuBLASLt at unit scales, the rows' and
  channels' scales after (kernels/fp8_epilogue.py); `unit_no_quant`: the same without the rows' quantization
  (what it costs behind a norm or SiLU-and-mul that writes FP8 rows itself).
Reported: microseconds, the weight read bandwidth they imply, and each FP8 path's speed-up over bf16; the
routing by rows (quant/fp8_rows.py) that the figures favour is printed as $PLAIT_FP8_ROWS's text.

    python benchmarks/kernels/bench_fp8_linear.py                  # every shape, rows 1 8 32 64 256 2048
    python benchmarks/kernels/bench_fp8_linear.py --rows 1 16 --only gate_up
    python benchmarks/kernels/bench_fp8_linear.py --sweep --rows 1 16 64   # the triton path's tiles and splits
    python benchmarks/kernels/bench_fp8_linear.py --sweep-wide --rows 1 64 128 256   # gemv / W8A16 / W8A8 tiles
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
    from plait.runtime.kernels.gemv import MAX_ROWS as GEMV_ROWS
    from plait.runtime.kernels.gemv import gemv
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

    # Per-tensor scales (cuBLASLt): each weight's one scale, the rows' one scale.
    pt_w = [(layer.weight.float() * layer.weight_scale[:, None]) for layer in layers]
    pt_scale_w = [w.abs().amax().reshape(()) / 448.0 for w in pt_w]
    pt_codes = [(w / sw).to(torch.float8_e4m3fn) for w, sw in zip(pt_w, pt_scale_w)]
    del pt_w
    pt_scale_x = x.float().abs().amax().reshape(()) / 448.0
    pt_x = (x.float() / pt_scale_x).to(torch.float8_e4m3fn)
    pt_pairs = list(zip(pt_codes, pt_scale_w))

    def pt_mm_only():
        codes, scale = cycle(pt_pairs)
        return torch._scaled_mm(pt_x, codes.t(), scale_a=pt_scale_x, scale_b=scale, out_dtype=torch.bfloat16)

    def triton_a8():
        layer = cycle(layers)
        codes, scales = quantize_rows(x)
        return fp8_gemm(codes, layer.weight, layer.weight_scale, workspace=workspace, x_scale=scales)

    def a8_only():
        layer = cycle(layers)
        return fp8_gemm(x_codes, layer.weight, layer.weight_scale, workspace=workspace, x_scale=x_scales)

    from plait.runtime.kernels.fp8_epilogue import scale_rows_cols
    from plait.runtime.kernels.fp8_quant import quantize_rows_fp8
    from plait.runtime.quant.fp8_rows import unit_scaled_linear

    def unit_no_quant():  # the unit-scaled path with its rows quantized before (a norm that writes FP8 rows)
        layer = cycle(layers)
        unit = layer.unit_scale
        y = torch._scaled_mm(x_codes, layer.weight.t(), scale_a=unit, scale_b=unit, out_dtype=torch.bfloat16)
        return scale_rows_cols(y, x_scales, layer.weight_scale, out=y)

    paths = {
        "quant_only": lambda: quantize_rows(x)[0],
        "quant_1pass": lambda: quantize_rows_fp8(x, None, 448.0, 1e-12, one_pass=True)[0],
        "quant_1p_mul": lambda: quantize_rows_fp8(x, None, 448.0, 1e-12, one_pass=True, mul_inverse=True)[0],
        "bf16": lambda: torch.mm(x, cycle(floats).t()),
        "scaled_mm": lambda: cycle(layers).linear(x),
        "scaled_mm_only": scaled_mm_only,
        "pt_mm_only": pt_mm_only,
        "unit_scaled": lambda: unit_scaled_linear(x, cycle(layers)),
        "unit_no_quant": unit_no_quant,
    }
    if rows <= MAX_ROWS:
        paths["triton"] = lambda: (lambda layer: fp8_gemm(x, layer.weight, layer.weight_scale, workspace=workspace))(
            cycle(layers)
        )
        if rows >= 16:
            paths["triton_a8"] = triton_a8
            paths["a8_only"] = a8_only
    if rows <= GEMV_ROWS:
        paths["gemv"] = lambda: (lambda layer: gemv(x, layer.weight, weight_scale=layer.weight_scale))(cycle(layers))
    # Correctness first: every FP8 path near the bf16 product of the dequantized weight.
    ref = x.float() @ layers[0].dequantized().float().t()
    for name, fn in paths.items():
        if name.startswith("quant"):
            continue
        calls[0] = -1  # the next call takes copy 0
        y = fn().float()
        err = float((y - (x.float() @ floats[0].float().t() if name == "bf16" else ref)).norm() / ref.norm())
        if err > 0.08:
            raise AssertionError(f"{name} at {rows}x{n}x{k}: relative error {err:.3g}")
    times = {}
    for name, fn in paths.items():
        try:
            times[name] = graph_time(fn)
        except Exception as exc:  # a path that does not compile or capture at this size: say so, go on
            print(f"  {name} at {rows}x{n}x{k}: {exc!r}"[:200], flush=True)
    return times


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


def sweep_wide(n: int, k: int, rows: int, copies: int) -> dict:
    """Tiles of the paths this session added, at x (rows, k) @ W (n, k)^T: the FP8-reading skinny matmul (rows <= 8)
    and the tensor-core decode matmul with bf16 rows (W8A16) and with FP8 rows (W8A8, the rows quantized
    before), each config checked against the dequantized product. {path: [(seconds, config dict)] fastest first}."""
    import itertools

    from plait.runtime.kernels.decode_gemm import DecodeGemmConfig, SplitKWorkspace
    from plait.runtime.kernels.fp8_gemm import fp8_gemm, pick_fp8_gemm_config
    from plait.runtime.kernels.gemv import GemvConfig, gemv, pick_gemv_config
    from plait.runtime.quant.fp8 import Fp8Linear, quantize_rows

    layers = [
        Fp8Linear.from_float(torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02, None, torch.bfloat16)
        for _ in range(copies)
    ]
    x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
    x_codes, x_scales = quantize_rows(x)
    ref = x.float() @ layers[0].dequantized().float().t()
    workspace = SplitKWorkspace()
    out: dict = {}

    def timed(name, call, cfg):
        try:
            y = call(layers[0], cfg)
        except Exception:  # a tile that does not fit in shared memory
            return
        if float((y.float() - ref).norm() / ref.norm()) > 0.08:
            print(f"  {name} {n}x{k} rows {rows} {cfg}: WRONG")
            return

        def run():
            for layer in layers:
                call(layer, cfg)

        out.setdefault(name, []).append((graph_time(run, reps=5) / copies, vars(cfg)))

    if rows <= 8:
        picked = pick_gemv_config(n, k)
        grid = itertools.product((4, 8, 16), (2048, 4096), (1, 2), (4, 8))
        for cfg in [picked] + [GemvConfig(bn, bk, w, st) for bn, bk, st, w in grid]:
            timed("gemv", lambda layer, cfg: gemv(x, layer.weight, config=cfg, weight_scale=layer.weight_scale), cfg)
    if rows >= 16:
        for x_fp8 in (False, True):
            name = "a8" if x_fp8 else "w8a16"
            picked = pick_fp8_gemm_config(n, k, rows, x_fp8)
            grid = itertools.product((64, 128), (128, 256), (1, 2, 4), (4, 8), (3,))
            configs = [picked] + [DecodeGemmConfig(bn, bk, sp, w, st) for bn, bk, sp, w, st in grid]

            def call(layer, cfg, x_fp8=x_fp8):
                if x_fp8:
                    return fp8_gemm(x_codes, layer.weight, layer.weight_scale, config=cfg, workspace=workspace,
                                    x_scale=x_scales)  # fmt: skip
                return fp8_gemm(x, layer.weight, layer.weight_scale, config=cfg, workspace=workspace)

            for cfg in configs:
                timed(name, call, cfg)
    for results in out.values():
        picked = results[0]
        results.sort(key=lambda r: r[0])
        results.insert(0, picked)  # the picked config first, then every config fastest first
    return out


# The paths that quantize their rows, and their matmul alone: what they cost where the kernel before the layer
# writes its rows in FP8 itself (the engine's default for QKV, gate-up and down: quant/fp8_rows.py).
QUANTIZED_ALONE = {"unit_scaled": "unit_no_quant", "triton_a8": "a8_only", "scaled_mm": "scaled_mm_only"}
FUSED_SHAPES = ("qkv", "gate_up", "down")  # their inputs come from RMSNorm or SiLU-and-mul; O's from attention


def pick_rows(records: list[dict], fused: bool = True) -> tuple[str, dict]:
    """The FP8 routing (quant/fp8_rows.py's bounds) that takes the least time summed over the four matrices at the
    measured row counts: the skinny matmul up to G rows, cuBLASLt at unit scales from U to V rows, the decode
    matmul with bf16 rows up to Q - 1 and with FP8 rows from Q to D, the rowwise `_scaled_mm` above. `fused`: a
    quantizing path's time for QKV, gate-up and down is its matmul alone (their rows arrive quantized).
    Returns ($PLAIT_FP8_ROWS's text, {rows: (path, microseconds summed)})."""
    import itertools

    names = ("gemv", "unit_scaled", "triton", "triton_a8", "scaled_mm")
    rows = sorted({r["rows"] for r in records})
    total = {(r, path): 0.0 for r in rows for path in names}
    for rec in records:
        for path in names:
            key = QUANTIZED_ALONE.get(path, path) if fused and rec["shape"] in FUSED_SHAPES else path
            total[(rec["rows"], path)] += rec["seconds"].get(key, float("inf"))

    def path_at(r, g, u, v, q, d):
        if r <= g:
            return "gemv"
        if u and u <= r <= v:
            return "unit_scaled"
        if r > d:
            return "scaled_mm"
        return "triton_a8" if r >= q else "triton"

    cuts = [0] + rows
    best = None
    gemv_cuts = [0] + [r for r in rows if r <= 8]
    for g, u, v, q, d in itertools.product(gemv_cuts, cuts, rows, rows + [257], cuts):
        if d > 256 or v > 256 or (u and v < u):
            continue
        cost = sum(total[(r, path_at(r, g, u, v, q, d))] for r in rows)
        if best is None or cost < best[0]:
            best = (cost, g, u, v, q, d)
    _, g, u, v, q, d = best
    q = min(q, d + 1)
    chosen = {r: (path_at(r, g, u, v, q, d), total[(r, path_at(r, g, u, v, q, d))] * 1e6) for r in rows}
    unit = f",unit_scaled_from={u},unit_scaled_to={v}" if u else ",unit_scaled_from=0"
    return f"gemv={g},decode={d},quantized_from={q}" + unit, chosen


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256, 2048])
    p.add_argument("--only", nargs="+", choices=sorted(SHAPES_8B), default=None)
    p.add_argument("--copies", type=int, default=4, help="distinct weights cycled (L2 holds none of the next)")
    p.add_argument("--sweep", action="store_true", help="the triton path's configs instead (rows <= 64)")
    p.add_argument(
        "--sweep-wide",
        action="store_true",
        help="the FP8-reading skinny matmul's tiles (rows <= 8) and the W8A16 / W8A8 decode matmul's (rows >= 16)",
    )
    args = p.parse_args()
    from plait.runtime.quant.fp8_rows import FP8_DECODE_ROWS

    torch.manual_seed(0)
    bw = copy_bandwidth()
    print(f"GPU {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s  FP8_DECODE_ROWS {FP8_DECODE_ROWS}")
    if args.sweep_wide:
        records = []
        for rows in args.rows:
            for name, (n, k) in SHAPES_8B.items():
                if args.only and name not in args.only:
                    continue
                for path, results in sweep_wide(n, k, rows, args.copies).items():
                    (t_picked, _), (t_best, best) = results[0], results[1]
                    print(
                        f"rows {rows:>3} {name:>8} {path:>5}: picked {t_picked * 1e6:7.1f} us;"
                        f" best {t_best * 1e6:7.1f} us ({n * k / t_best / 1e12:.2f} TB/s of FP8 weights) {best}; next "
                        + ", ".join(f"{t * 1e6:.1f} {c}" for t, c in results[2:4]),
                        flush=True,
                    )
                    records.append({"rows": rows, "shape": name, "path": path, "results": results[:10]})
        save("fp8_wide_sweep", {"gpu": torch.cuda.get_device_name(), "copy_bandwidth": bw, "records": records})
        return
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
    columns = ("quant", "q 1pass", "q 1p mul", "bf16 us", "sc_mm us", "mm only", "pt only", "triton", "tr_a8")
    columns += ("a8 only", "gemv", "unit", "unit nq", "fp8 TB/s")
    print(f"{'rows':>5} {'shape':>8} " + " ".join(f"{c:>8}" for c in columns) + f" {'best x':>7}")
    records = []
    for rows in args.rows:
        for name, (n, k) in SHAPES_8B.items():
            if args.only and name not in args.only:
                continue
            t = time_paths(n, k, rows, args.copies)
            # The best whole path (a8_only and the *_only matmuls leave the rows' quantization out).
            whole = ("scaled_mm", "triton", "triton_a8", "gemv", "unit_scaled")
            fp8_best = min(v for key, v in t.items() if key in whole)
            records.append({"rows": rows, "shape": name, "n": n, "k": k, "seconds": t})
            cells = ("quant_only", "quant_1pass", "quant_1p_mul", "bf16", "scaled_mm", "scaled_mm_only", "pt_mm_only")
            cells += ("triton", "triton_a8", "a8_only", "gemv", "unit_scaled", "unit_no_quant")
            text = " ".join(f"{t[c] * 1e6:8.1f}" if c in t else f"{'-':>8}" for c in cells)
            print(
                f"{rows:>5} {name:>8} {text} {n * k / fp8_best / 1e12:8.2f} {t['bf16'] / fp8_best:7.2f}",
                flush=True,
            )
    unfused, _ = pick_rows(records, fused=False)
    print(f"fastest routing, every layer quantizing its own rows: PLAIT_FP8_ROWS={unfused},fused=0")
    routing, chosen = pick_rows(records)
    print(f"fastest routing with the norms and SiLU-and-mul writing FP8 rows: PLAIT_FP8_ROWS={routing}")
    for rows, (path, us) in chosen.items():
        print(f"  {rows:>5} rows: {path} ({us:.1f} us for the four matrices)")
    save(
        "fp8_linear",
        {
            "gpu": torch.cuda.get_device_name(),
            "copy_bandwidth": bw,
            "fp8_decode_rows": FP8_DECODE_ROWS,
            "records": records,
            "routing": routing,
        },
    )


if __name__ == "__main__":
    main()
