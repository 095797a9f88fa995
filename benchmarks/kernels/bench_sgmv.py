"""The LoRA SGMV kernels (runtime/lora/sgmv.py) at Llama-3.1-8B's four LoRA targets (qkv, o, gate_up, down),
rank 16: the split-K shrink + one expand per target against the kernels before the split (kept here only, a
copy of the launch main had: one shrink program per (segment, 16 rows) over all input features, one expand
launch per sub-projection), beside the base projection's matmul (torch.matmul, cuBLAS) at the same rows.

T = 1, 8, 32, 128, 512 rows, 8 adapters, in both forms a step gives the kernels: one segment per token (the
decode CUDA graphs) and runs of one adapter (T / 8 rows each, eager steps). Each call timed as CUDA-graph
replays over 32 layers of adapters (each replay walks every layer, so L2 does not keep a layer's A and B
between calls) and the base over 8 weight copies; microseconds per call. Results checked old against new.

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


def old_launch():
    """The kernels before split-K (their launch as main had it), for this comparison only."""
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["layer"])
    def shrink(X, A, Out, SegStart, SegLen, SegSlot, layer, stride_xt, stride_as, stride_al, stride_ak,
               IN: tl.constexpr, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
               BLOCK_IN: tl.constexpr):  # fmt: skip
        seg, tile = tl.program_id(0), tl.program_id(1)
        slot = tl.load(SegSlot + seg)
        n = tl.load(SegLen + seg)
        if (slot == 0) | (tile * BLOCK_T >= n):
            return
        local = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        rows = tl.load(SegStart + seg).to(tl.int64) + local
        row_mask = local < n
        ks = tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a_base = A + slot.to(tl.int64) * stride_as + layer * stride_al
        acc = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
        for i0 in range(0, IN, BLOCK_IN):
            cols = i0 + tl.arange(0, BLOCK_IN)
            c_mask = cols < IN
            x = tl.load(X + rows[:, None] * stride_xt + cols[None, :], mask=row_mask[:, None] & c_mask[None, :])
            a = tl.load(a_base + ks[:, None] * stride_ak + cols[None, :], mask=k_mask[:, None] & c_mask[None, :])
            acc += tl.dot(x, tl.trans(a), input_precision="ieee")
        out_ptrs = Out + rows[:, None] * K + ks[None, :]
        tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=row_mask[:, None] & k_mask[None, :])

    @triton.jit(do_not_specialize=["layer", "col_offset", "sub"])
    def expand(Shrunk, B, Y, SegStart, SegLen, SegSlot, layer, col_offset, sub, stride_yt, stride_bs, stride_bl,
               stride_bo, SIZE: tl.constexpr, K: tl.constexpr, R: tl.constexpr, BLOCK_T: tl.constexpr,
               BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
        seg, tile, tile_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        slot = tl.load(SegSlot + seg)
        n = tl.load(SegLen + seg)
        if (slot == 0) | (tile * BLOCK_T >= n):
            return
        local = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        rows = tl.load(SegStart + seg).to(tl.int64) + local
        row_mask = local < n
        rs = tl.arange(0, BLOCK_R)
        r_mask = rs < R
        within = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = within < SIZE
        cols = col_offset + within
        s = tl.load(Shrunk + rows[:, None] * K + sub * R + rs[None, :], mask=row_mask[:, None] & r_mask[None, :])
        b_base = B + slot.to(tl.int64) * stride_bs + layer * stride_bl
        b = tl.load(b_base + cols[:, None] * stride_bo + rs[None, :], mask=n_mask[:, None] & r_mask[None, :])
        delta = tl.dot(s, tl.trans(b), input_precision="ieee")
        y_ptrs = Y + rows[:, None] * stride_yt + cols[None, :]
        mask = row_mask[:, None] & n_mask[None, :]
        y = tl.load(y_ptrs, mask=mask, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + delta).to(Y.dtype.element_ty), mask=mask)

    def block(n: int) -> int:
        return max(16, triton.next_power_of_2(n))

    def apply(segments, a_all, b_all, layer, rank, splits, x, y):
        T, fan_in = x.shape
        num_segs = segments.starts.shape[0]
        K = a_all.shape[2]
        shrunk = torch.empty(T, K, dtype=x.dtype, device=x.device)
        row_tiles = triton.cdiv(segments.longest, 16)
        seg_args = (segments.starts, segments.lengths, segments.slots, layer)
        shrink[(num_segs, row_tiles)](x, a_all, shrunk, *seg_args, x.stride(0), *a_all.stride()[:3],
                                      IN=fan_in, K=K, BLOCK_T=16, BLOCK_K=block(K), BLOCK_IN=64)  # fmt: skip
        col = 0
        for sub, size in enumerate(splits):
            expand[(num_segs, row_tiles, triton.cdiv(size, 64))](
                shrunk, b_all, y, *seg_args, col, sub, y.stride(0), *b_all.stride()[:3],
                SIZE=size, K=K, R=rank, BLOCK_T=16, BLOCK_R=block(rank), BLOCK_N=64,
            )  # fmt: skip
            col += size
        return y

    return apply


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
    ap.add_argument("--rows", type=int, nargs="+", default=None, help="T (default 1 8 32 128 512; smoke 1 33)")
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
    from plait.runtime.lora.sgmv import sgmv_apply, shrink_plan

    device = "cuda" if cuda else "cpu"
    # NOTE: the interpreter's tl.dot over bf16 is wrong (numpy has no bf16), so the CPU smoke runs float32.
    dtype = torch.bfloat16 if cuda else torch.float32
    targets = TARGETS_TOY if args.smoke else TARGETS_8B
    rows = args.rows or ([1, 33] if args.smoke else [1, 8, 32, 128, 512])
    layers = 1 if args.smoke else args.layers
    R, S = args.rank, args.adapters
    if cuda:
        from bench_gemv import graph_time

        timer = graph_time
        print(f"GPU {torch.cuda.get_device_name()}", flush=True)
    else:
        timer = wall_time
        print("CPU smoke under TRITON_INTERPRET=1: it runs; the times mean nothing", flush=True)
    old_apply = old_launch()
    gen = torch.Generator(device=device).manual_seed(0)
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu (interpreter)", "rank": R, "adapters": S,
              "layers": layers, "dtype": str(dtype), "smoke": args.smoke, "rows": []}  # fmt: skip
    print(f"{'target':>8} {'T':>4} {'form':>9} {'splits':>6} {'old us':>8} {'new us':>8} {'old/new':>7} "
          f"{'base us':>8} {'new/base':>8} {'max |new-old|':>13}")  # fmt: skip
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
        for T in rows:
            x = torch.randn(T, fan_in, device=device, generator=gen).to(dtype)
            y = torch.randn(T, out, device=device, generator=gen).to(dtype)
            base_s = timer(lambda: [torch.matmul(x, w.t()) for w in ws]) / copies
            for form in ("per_token", "runs"):
                segs = segments_of(form, T, S, device)
                num_splits = shrink_plan(segs.starts.shape[0], segs.longest, fan_in, a_all.shape[2])[0]
                got_new = sgmv_apply(segs, a_all, b_all, 0, R, splits, x, y.clone())
                got_old = old_apply(segs, a_all, b_all, 0, R, splits, x, y.clone())
                diff = (got_new.float() - got_old.float()).abs().max().item()
                ys = y.clone()
                times = {}
                for kind, fn in (("old", old_apply), ("new", sgmv_apply)):
                    walk = lambda fn=fn: [fn(segs, a_all, b_all, i, R, splits, x, ys) for i in range(layers)]  # noqa: E731
                    times[kind] = timer(walk) / layers
                row = {"target": name, "T": T, "form": form, "splits": num_splits, "old_us": times["old"] * 1e6,
                       "new_us": times["new"] * 1e6, "base_us": base_s * 1e6, "max_abs_diff": diff}  # fmt: skip
                result["rows"].append(row)
                print(f"{name:>8} {T:>4} {form:>9} {num_splits:>6} {row['old_us']:>8.1f} {row['new_us']:>8.1f} "
                      f"{times['old'] / times['new']:>7.2f} {row['base_us']:>8.1f} {times['new'] / base_s:>8.2f} "
                      f"{diff:>13.2e}", flush=True)  # fmt: skip
        a_all = b_all = ws = None
        if cuda:
            torch.cuda.empty_cache()
    save("bench_sgmv_smoke" if args.smoke else "bench_sgmv", result)


if __name__ == "__main__":
    main()
