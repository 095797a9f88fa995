"""Where a run's device time went between kernels: busy time, idle gaps and what they sit between, from a
Chrome trace of CUDA kernels (the engine writes one with PLAIT_SCHEDULER_TRACE=path; profile_decode_step.py
with --trace).

Each kernel is put in the phase of the last attention kernel before it (prefill: the extend kernel; decode:
split-KV stage 1), so the report says how much of each phase the GPU spent computing and how much waiting,
and which kernel pairs the waits fall between (a large gap before a step's first kernel is the host
preparing that step).

    PLAIT_SCHEDULER_TRACE=/tmp/t.json python benchmarks/engine/bench_offline.py --model llama-3.1-8b --skip-transformers
    python benchmarks/tools/analyze_kernel_trace.py /tmp/t.json

With --segments MS it also cuts the run at idle gaps longer than MS (the host between a benchmark's rounds,
or between its warm-up and the timed run) and sums each piece's kernel time by kind (matmul, prefill or
decode attention, other), with the gaps inside it: where one round of bench_rounds.py goes.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json

PHASE_MARKERS = (("_extend_attention", "prefill"), ("_decode_stage1", "decode"))


def load_kernels(path: str) -> list[tuple[float, float, str]]:
    """[(start us, end us, name)] of the device events (kernels, memsets, copies), in start order."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    out = [
        (e["ts"], e["ts"] + e["dur"], e["name"])
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")
    ]
    return sorted(out)


def phase_of(name: str, current: str) -> str:
    for marker, phase in PHASE_MARKERS:
        if marker in name:
            return phase
    return current


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--idle-over-us", type=float, default=20.0, help="gaps longer than this count as idle")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument(
        "--segments",
        type=float,
        default=None,
        metavar="MS",
        help="also report the pieces of the run between idle gaps longer than MS milliseconds",
    )
    args = ap.parse_args()
    kernels = load_kernels(args.trace)
    if args.segments is not None:
        print_segments(kernels, args.segments * 1e3)
    busy = collections.Counter()
    gaps = collections.Counter()
    long_gaps = collections.Counter()
    long_count = collections.Counter()
    by_kernel = collections.Counter()
    phase = "startup"
    end = kernels[0][0]
    prev_name = ""
    for start, stop, name in kernels:
        nxt = phase_of(name, phase)
        gap = start - end
        if gap > 0:
            gaps[phase] += gap
            if gap > args.idle_over_us:
                key = (phase, prev_name[:48], name[:48])
                long_gaps[key] += gap
                long_count[key] += 1
        phase = nxt
        busy[phase] += max(0.0, stop - max(start, end))  # overlapping events (two streams) counted once
        by_kernel[(phase, name[:70])] += stop - start
        end = max(end, stop)
        prev_name = name
    span = kernels[-1][1] - kernels[0][0]
    print(f"{len(kernels)} device events over {span / 1e6:.3f} s")
    for ph in busy:
        print(
            f"  {ph:8s} busy {busy[ph] / 1e6:8.3f} s  gaps {gaps[ph] / 1e6:7.3f} s "
            f"(of which over {args.idle_over_us:.0f} us: "
            f"{sum(v for k, v in long_gaps.items() if k[0] == ph) / 1e6:.3f} s)"
        )
    print(f"longest-summed gaps over {args.idle_over_us:.0f} us (phase, kernel before -> kernel after):")
    for key, us in long_gaps.most_common(args.top):
        print(f"  {us / 1e3:9.1f} ms  {long_count[key]:6d}x  {key[0]}: {key[1]} -> {key[2]}")
    print("device time by kernel:")
    for (ph, name), us in by_kernel.most_common(args.top * 2):
        print(f"  {us / 1e3:9.1f} ms  {ph}: {name}")


KINDS = (
    ("_extend_attention", "prefill attention"),
    ("_decode_stage", "decode attention"),
    ("gemm", "matmul"),
    ("nvjet", "matmul"),
    ("cutlass", "matmul"),
    ("gemv", "matmul"),
)


def kind_of(name: str) -> str:
    return next((kind for marker, kind in KINDS if marker in name), "other")


def print_segments(kernels: list[tuple[float, float, str]], split_us: float) -> None:
    """The run cut at idle gaps over split_us: per piece its wall time, kernel time by kind, and its own gaps."""
    pieces, current, end = [], [kernels[0]], kernels[0][1]
    for k in kernels[1:]:
        if k[0] - end > split_us:
            pieces.append((current, k[0] - end))
            current = []
        current.append(k)
        end = max(end, k[1])
    pieces.append((current, 0.0))
    print(f"pieces of the run between idle gaps over {split_us / 1e3:.1f} ms (ms):")
    for i, (piece, gap_after) in enumerate(pieces):
        by_kind = collections.Counter()
        inner_gaps, end = 0.0, piece[0][1]
        for start, stop, name in piece:
            by_kind[kind_of(name)] += stop - start
            inner_gaps += max(0.0, start - end)
            end = max(end, stop)
        wall = end - piece[0][0]
        kinds = "  ".join(f"{kind} {us / 1e3:.1f}" for kind, us in sorted(by_kind.items()))
        print(
            f"  {i:3d}: wall {wall / 1e3:8.1f}  kernels {len(piece):6d}  {kinds}  gaps inside {inner_gaps / 1e3:.1f}"
            f"  then idle {gap_after / 1e3:.1f}"
        )


if __name__ == "__main__":
    main()
