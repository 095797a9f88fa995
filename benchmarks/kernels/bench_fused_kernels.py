"""Time the fused Triton kernels (runtime/kernels/) against the torch reference ops on one GPU.

Ops, at the Llama-3.2-1B (hidden 2048, I 8192, 32/8 heads, head_dim 64) and Llama-3.1-8B (4096, 14336,
32/8, 128) shapes, bf16, for several token counts T:
- add_rmsnorm: residual += x, RMSNorm(residual)          (two per decoder layer)
- rmsnorm:     plain RMSNorm                             (first layer)
- qk_norm:     per-head RMSNorm of q and k, strided views of a fused QKV output (Qwen3)
- rotary:      rotate-half RoPE of q and k               (fused: in place, one launch)
- silu_and_mul: (T, 2I) -> (T, I)
- layer_small_ops: everything a Llama layer runs besides the GEMMs and attention
  (2 x add_rmsnorm + rotary + silu_and_mul)
For each: microseconds per call replayed from a CUDA graph (what a decode step pays: no launch
overhead on the host, but one GPU kernel per op), eager microseconds (triton.testing.do_bench: host
launch overhead included), kernels per call (torch.profiler), bytes moved over the graph time in
GB/s next to the device-to-device copy bandwidth measured in the same run, and the largest
difference from torch.

    python benchmarks/kernels/bench_fused_kernels.py [--quick] [--out PATH]

Prints a table and writes JSON to --out (default: $OUT/bench_fused_kernels.json when $OUT is set,
else benchmarks/out/bench_fused_kernels.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_common

from bench_common import git_commit  # noqa: E402
from plait.runtime import kernels  # noqa: E402
from plait.runtime.models.layers import rms_norm_torch, silu_and_mul_torch  # noqa: E402
from plait.runtime.models.rotary import RotaryEmbedding, rotary_torch  # noqa: E402
from triton.testing import do_bench

SHAPES = {  # hidden, intermediate, heads, kv heads, head_dim, rope theta
    "llama-3.2-1b": (2048, 8192, 32, 8, 64, 500000.0),
    "llama-3.1-8b": (4096, 14336, 32, 8, 128, 500000.0),
}
DTYPE = torch.bfloat16
DEV = "cuda"
EPS = 1e-5
MAX_POS = 131072


def graph_us(fn: Callable[[], object], calls_per_graph: int = 20, replays: int = 50) -> float:
    """Microseconds per call of `fn` replayed from a CUDA graph holding `calls_per_graph` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls_per_graph):
            fn()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000.0 / (replays * calls_per_graph)


def kernels_per_call(fn: Callable[[], object]) -> int | None:
    try:
        from torch.profiler import ProfilerActivity, profile

        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    except Exception:  # the profiler is a nice-to-have; never fail the benchmark over it
        return None


def copy_bandwidth_gbs() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=10, rep=50)
    return 2 * src.numel() / (ms * 1e-3) / 1e9  # read + write


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


class Case:
    """Inputs of one shape at one token count, plus fused/torch callables for each op."""

    def __init__(self, shape: str, tokens: int):
        hidden, inter, heads, kv_heads, head_dim, theta = SHAPES[shape]
        g = torch.Generator(device=DEV).manual_seed(0)

        def randn(*size):
            return torch.randn(*size, device=DEV, dtype=DTYPE, generator=g)

        self.x, self.residual, self.w = randn(tokens, hidden), randn(tokens, hidden), randn(hidden)
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        self.qkv = randn(tokens, q_size + 2 * kv_size)
        q, k, _ = self.qkv.split([q_size, kv_size, kv_size], dim=-1)
        self.q, self.k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
        self.head_w = randn(head_dim)
        self.rope = RotaryEmbedding(head_dim, MAX_POS, theta, None).to(DEV)
        self.positions = torch.randint(0, MAX_POS, (tokens,), device=DEV, generator=g)
        self.gate_up = randn(tokens, 2 * inter)
        e = self.x.element_size()
        t_h = tokens * hidden * e
        qk = (tokens * (heads + kv_heads) * head_dim) * e
        self.bytes = {  # minimum traffic of the fused kernel
            "add_rmsnorm": 4 * t_h,
            "rmsnorm": 2 * t_h,
            "qk_norm": 2 * qk,
            "rotary": 2 * qk,
            "silu_and_mul": 3 * tokens * inter * e,
        }
        self.bytes["layer_small_ops"] = (
            2 * self.bytes["add_rmsnorm"] + self.bytes["rotary"] + self.bytes["silu_and_mul"]
        )

    def ops(self) -> dict[str, tuple[Callable, Callable]]:
        cos, sin = self.rope.cos_cache, self.rope.sin_cache
        ops = {
            "add_rmsnorm": (
                lambda: kernels.fused_add_rmsnorm(self.x, self.residual, self.w, EPS)[0],
                lambda: rms_norm_torch(self.x, self.w, EPS, self.residual)[0],
            ),
            "rmsnorm": (lambda: kernels.rmsnorm(self.x, self.w, EPS), lambda: rms_norm_torch(self.x, self.w, EPS)),
            "qk_norm": (
                lambda: (kernels.rmsnorm(self.q, self.head_w, EPS), kernels.rmsnorm(self.k, self.head_w, EPS)),
                lambda: (rms_norm_torch(self.q, self.head_w, EPS), rms_norm_torch(self.k, self.head_w, EPS)),
            ),
            "rotary": (
                lambda: kernels.rotary_inplace(self.q, self.k, self.positions, cos, sin),
                lambda: rotary_torch(self.positions, self.q, self.k, cos, sin),
            ),
            "silu_and_mul": (lambda: kernels.silu_and_mul(self.gate_up), lambda: silu_and_mul_torch(self.gate_up)),
        }

        def layer(fused: bool):
            def run():
                for name in ("add_rmsnorm", "rotary", "add_rmsnorm", "silu_and_mul"):
                    ops[name][0 if fused else 1]()

            return run

        ops["layer_small_ops"] = (layer(True), layer(False))
        return ops

    def check(self) -> dict[str, float]:
        """Largest |fused - torch| per op, on copies so the timed inputs stay as they are."""
        cos, sin = self.rope.cos_cache, self.rope.sin_cache
        out, res = kernels.fused_add_rmsnorm(self.x, self.residual.clone(), self.w, EPS)
        ref_out, ref_res = rms_norm_torch(self.x, self.w, EPS, self.residual)
        q, k = self.q.clone(), self.k.clone()
        ref_q, ref_k = rotary_torch(self.positions, q, k, cos, sin)
        kernels.rotary_inplace(q, k, self.positions, cos, sin)
        return {
            "add_rmsnorm": max(max_diff(out, ref_out), max_diff(res, ref_res)),
            "rmsnorm": max_diff(kernels.rmsnorm(self.x, self.w, EPS), rms_norm_torch(self.x, self.w, EPS)),
            "qk_norm": max_diff(kernels.rmsnorm(self.q, self.head_w, EPS), rms_norm_torch(self.q, self.head_w, EPS)),
            "rotary": max(max_diff(q, ref_q), max_diff(k, ref_k)),
            "silu_and_mul": max_diff(kernels.silu_and_mul(self.gate_up), silu_and_mul_torch(self.gate_up)),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer token counts")
    parser.add_argument("--out", default=None, help="JSON output path")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_fused_kernels.py needs a CUDA GPU")
    token_counts = [1, 64, 4096] if args.quick else [1, 8, 32, 128, 512, 2048, 8192]
    bandwidth = copy_bandwidth_gbs()
    print(f"# {torch.cuda.get_device_name()}  copy bandwidth {bandwidth:.0f} GB/s  commit {git_commit()}")
    header = (
        f"{'shape':<14}{'op':<17}{'T':>6}{'graph fused':>12}{'graph torch':>12}{'speedup':>8}"
        f"{'eager fused':>12}{'eager torch':>12}{'kern f/t':>9}{'GB/s':>7}{'max diff':>10}"
    )
    print(header)
    rows = []
    for shape in SHAPES:
        for tokens in token_counts:
            case = Case(shape, tokens)
            diffs = case.check()
            for op, (fused, ref) in case.ops().items():
                g_f, g_t = graph_us(fused), graph_us(ref)
                e_f = do_bench(fused, warmup=10, rep=50) * 1000.0
                e_t = do_bench(ref, warmup=10, rep=50) * 1000.0
                k_f, k_t = kernels_per_call(fused), kernels_per_call(ref)
                gbs = case.bytes[op] / (g_f * 1e-6) / 1e9
                row = dict(
                    shape=shape,
                    op=op,
                    tokens=tokens,
                    graph_us_fused=g_f,
                    graph_us_torch=g_t,
                    eager_us_fused=e_f,
                    eager_us_torch=e_t,
                    kernels_fused=k_f,
                    kernels_torch=k_t,
                    bytes=case.bytes[op],
                    fused_gbs=gbs,
                    max_abs_diff=diffs.get(op),
                )
                rows.append(row)
                diff = "" if row["max_abs_diff"] is None else f"{row['max_abs_diff']:.2e}"
                print(
                    f"{shape:<14}{op:<17}{tokens:>6}{g_f:>12.2f}{g_t:>12.2f}{g_t / g_f:>7.1f}x"
                    f"{e_f:>12.2f}{e_t:>12.2f}{str(k_f) + '/' + str(k_t):>9}{gbs:>7.0f}{diff:>10}"
                )
            del case
            torch.cuda.empty_cache()
    out = Path(
        args.out
        or (
            Path(os.environ["OUT"]) / "bench_fused_kernels.json"
            if os.environ.get("OUT")
            else Path(__file__).resolve().parents[1] / "out" / "bench_fused_kernels.json"
        )
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "gpu": torch.cuda.get_device_name(),
                "date": time.strftime("%Y-%m-%d"),
                "commit": git_commit(),
                "dtype": str(DTYPE),
                "copy_bandwidth_gbs": bandwidth,
                "rows": rows,
            },
            indent=1,
        )
    )
    print(f"# wrote {out}")


if __name__ == "__main__":
    main()
