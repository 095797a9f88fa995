"""The ceilings GPU benchmarks compare against, measured in the same run: copy bandwidth and the
dense bf16 matmul rate."""

from __future__ import annotations

import statistics
import time

import torch


def copy_bandwidth() -> float:
    """Memory traffic per second of a device-to-device copy (a copy of n bytes moves 2n), median of 10."""
    x = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    times = []
    for _ in range(13):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        y.copy_(x)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del x, y
    torch.cuda.empty_cache()
    return 2 * 2 * 1024**3 / statistics.median(times[3:])


def matmul_flops() -> float:
    """Dense bf16 matmul rate (FLOP/s): the prefill compute ceiling."""
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 10 * 2 * 8192**3 / (time.perf_counter() - t)
