"""bench_programs: SGLang-style frontend workloads, each run three ways in one run (issue 8).

- plait: program hints on (run_batch's shared segments prefilled and pinned, fork and state pins, the
  group hint) on a runtime with the `dfs-weight` schedule policy;
- hints-off: the same frontend sending only what SGLang's frontend sends (its traced-prefix precache
  and fork prefill), on SGLang's default `lpm` policy;
- radix-off: the runtime's prefix cache disabled (the frontend then prefills nothing ahead).

Three in-process Engines on the same model serve the three modes; every workload runs on each in
turn, `--repeats` times, the order rotated from one round to the next so machine-load drift biases no
mode; a mode's wall time is the median of its rounds. Greedy decoding, so the three modes should
produce the same text (reported). Per workload and mode: wall time, programs/s, output tokens/s, mean
and max program latency (from the start of the batch), the hit rate of the programs' own requests,
the runtime's prompt/cached token counters (all requests, run_batch's prefills included; so the
prefill tokens actually computed), and the speedups of plait over the two other modes.

Workloads (scaled down for a CPU; --scale multiplies the batch sizes):
  mmlu       5-shot MMLU-style: a header, four subjects' 5 examples, 8 questions each (32), 1 answer token
  hellaswag  2-shot HellaSwag-style: select over 4 endings
  tot        tree of thought: 2 plans, each expanded by 2 steps (nested forks), then a verdict
  sot        skeleton of thought: a skeleton, 3 points expanded in parallel (fork/join), a summary
  chat       4-turn chat with a shared system prompt
  json       JSON extraction from passages (regex-constrained fields when the runtime supports it)
  react      ReAct-style agent: thought, tool choice (select), tool input, Python tool, 3 steps

    .venv/bin/python benchmarks/programs/bench_programs.py            # ~8 min on the 2-core CPU box
    .venv/bin/python benchmarks/programs/bench_programs.py --only mmlu,chat --scale 0.5

Results: benchmarks/out/bench_programs.json and a plot (bench_programs.png with matplotlib, else
bench_programs.svg, drawn here).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_programs_workloads as wl  # noqa: E402
import plait as sgl  # noqa: E402

MODES = ("plait", "hints-off", "radix-off")
# Not run by default: plait's hints on SGLang's `lpm` policy (separates the policy from the hints).
EXTRA_MODES = ("plait-lpm",)
OUT = Path(__file__).resolve().parents[1] / "out"


@dataclass
class RunResult:
    workload: str
    mode: str
    programs: int
    wall_s: float  # the median round's
    wall_spread_s: tuple  # (min, max) over the rounds
    programs_per_s: float
    output_tok_per_s: float
    latency_mean_s: float
    latency_max_s: float
    runtime_requests: int
    prompt_tokens: int
    cached_tokens: int
    computed_prefill_tokens: int
    completion_tokens: int
    hit_rate: float
    program_prompt_tokens: int  # the programs' own requests (no run_batch prefill, no background traffic)
    program_cached_tokens: int
    errors: int
    outputs: list[str] = field(repr=False, default_factory=list)


def make_runtimes(args, modes: list[str]) -> dict[str, Any]:
    common = dict(
        num_threads=args.num_threads,
        max_total_tokens=args.max_total_tokens,
        chunked_prefill_size=args.chunked_prefill_size,
        log_level="warning",
    )
    settings = {
        "plait": dict(schedule_policy="dfs-weight", program_hints=True),
        "plait-lpm": dict(schedule_policy="lpm", program_hints=True),
        "hints-off": dict(schedule_policy="lpm", program_hints=False),
        "radix-off": dict(schedule_policy="lpm", disable_radix_cache=True, program_hints=False),
    }
    return {mode: sgl.Runtime(**settings[mode], **common) for mode in modes}


def program_latency(state, batch_started: float) -> float:
    """Seconds from the start of the batch (run_batch's own prefill included) to the end of the
    program's last request, from its run graph."""
    recorder = state.stream_executor.recorder
    ends = [
        n.stats.start_s + n.stats.latency_s
        for n in recorder.build().nodes
        if n.stats is not None and n.stats.start_s is not None and n.stats.latency_s is not None
    ]
    return recorder.started + max(ends, default=0.0) - batch_started


def run_once(workload: wl.Workload, mode: str, runtime: Any) -> RunResult:
    engine = runtime.engine
    for _ in range(200):  # flush refuses while requests (or another mode's leftovers) are in flight
        if engine.flush_cache():
            break
        time.sleep(0.05)
    before = engine.get_stats()
    started = time.perf_counter()
    states = workload.run(runtime)
    wall = time.perf_counter() - started
    after = engine.get_stats()
    assert after["protected_tokens"] == 0, f"{workload.name}/{mode}: pins left behind"
    delta = {k: after[k] - before[k] for k in ("prompt_tokens", "cached_tokens", "generation_tokens")}
    totals = [s.graph().totals() for s in states]
    requests = sum(t.requests for t in totals)
    latencies = [program_latency(s, started) for s in states]
    errors = [s.error() for s in states if s.error() is not None]
    return RunResult(
        workload.name,
        mode,
        len(states),
        wall,
        (wall, wall),
        len(states) / wall,
        delta["generation_tokens"] / wall,
        statistics.mean(latencies),
        max(latencies),
        requests,
        delta["prompt_tokens"],
        delta["cached_tokens"],
        delta["prompt_tokens"] - delta["cached_tokens"],
        delta["generation_tokens"],
        delta["cached_tokens"] / max(1, delta["prompt_tokens"]),
        sum(t.prompt_tokens for t in totals),
        sum(t.cached_tokens for t in totals),
        len(errors),
        [workload.output_of(s) for s in states],
    )


def median_round(runs: list[RunResult]) -> RunResult:
    """The round with the median wall time, with the spread of all rounds."""
    ordered = sorted(runs, key=lambda r: r.wall_s)
    chosen = ordered[(len(ordered) - 1) // 2]
    chosen.wall_spread_s = (ordered[0].wall_s, ordered[-1].wall_s)
    return chosen


def ratio_table(results: list[RunResult], modes: list[str]) -> list[dict]:
    rows = []
    for name in dict.fromkeys(r.workload for r in results):
        by_mode = {r.mode: r for r in results if r.workload == name}
        base = by_mode[modes[0]]
        row = {"workload": name}
        for mode in modes[1:]:
            other = by_mode[mode]
            row[f"speedup_vs_{mode}"] = other.wall_s / base.wall_s
            row[f"same_outputs_as_{mode}"] = sum(a == b for a, b in zip(base.outputs, other.outputs))
        row["programs"] = base.programs
        rows.append(row)
    return rows


def print_tables(results: list[RunResult], ratios: list[dict], modes: list[str]) -> None:
    print(
        "\n| workload | mode | programs | wall s, median (min-max) | programs/s | out tok/s | latency mean / max s | "
        "program requests | hit rate: programs | runtime prompt / cached tok | hit rate: runtime | prefill computed |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        program_hit = r.program_cached_tokens / max(1, r.program_prompt_tokens)
        print(
            f"| {r.workload} | {r.mode} | {r.programs} | {r.wall_s:.2f} ({r.wall_spread_s[0]:.2f}-"
            f"{r.wall_spread_s[1]:.2f}) | {r.programs_per_s:.3f} | "
            f"{r.output_tok_per_s:.1f} | {r.latency_mean_s:.2f} / {r.latency_max_s:.2f} | {r.runtime_requests} | "
            f"{100 * program_hit:.1f}% | {r.prompt_tokens} / {r.cached_tokens} | {100 * r.hit_rate:.1f}% | "
            f"{r.computed_prefill_tokens} |" + (f" {r.errors} errors" if r.errors else "")
        )
    others = modes[1:]
    print(
        "\n| workload | "
        + " | ".join(f"{modes[0]} vs {m}" for m in others)
        + f" | same outputs as {modes[0]} ({', '.join(others)}) |"
    )
    print("|---|" + "---|" * (len(others) + 1))
    for row in ratios:
        print(
            f"| {row['workload']} | "
            + " | ".join(f"{row['speedup_vs_' + m]:.2f}x" for m in others)
            + " | "
            + ", ".join(f"{row['same_outputs_as_' + m]}/{row['programs']}" for m in others)
            + " |"
        )


def plot(results: list[RunResult], path_stem: Path, modes: list[str]) -> Path:
    """Wall time per workload and mode: matplotlib when installed, else a plain SVG drawn here."""
    names = list(dict.fromkeys(r.workload for r in results))
    wall = {(r.workload, r.mode): r.wall_s for r in results}
    colors = {"plait": "#2563eb", "plait-lpm": "#7c3aed", "hints-off": "#f59e0b", "radix-off": "#9ca3af"}
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return _plot_svg(names, wall, colors, path_stem.with_suffix(".svg"), modes)
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(modes)
    for k, mode in enumerate(modes):
        ax.bar(
            [i + (k - (len(modes) - 1) / 2) * width for i in range(len(names))],
            [wall[(n, mode)] for n in names],
            width,
            label=mode,
            color=colors[mode],
        )
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("wall seconds (lower is better)")
    ax.legend()
    fig.tight_layout()
    out = path_stem.with_suffix(".png")
    fig.savefig(out, dpi=120)
    return out


def _plot_svg(names: list[str], wall: dict, colors: dict, out: Path, modes: list[str]) -> Path:
    top = max(wall.values())
    w, h, left, bottom, group = 120 * len(names) + 80, 320, 50, 40, 120
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="Helvetica" '
        f'font-size="11"><text x="{left}" y="14">wall seconds per workload (lower is better)</text>'
    ]
    for i, name in enumerate(names):
        for k, mode in enumerate(modes):
            value = wall[(name, mode)]
            bh = (h - bottom - 30) * value / top
            x, y = left + i * group + k * 32, h - bottom - bh
            parts.append(
                f'<rect x="{x}" y="{y:.1f}" width="28" height="{bh:.1f}" fill="{colors[mode]}"/>'
                f'<text x="{x}" y="{y - 3:.1f}" font-size="9">{value:.1f}</text>'
            )
        parts.append(f'<text x="{left + i * group}" y="{h - bottom + 15}">{name}</text>')
    for k, mode in enumerate(modes):
        parts.append(
            f'<rect x="{left + k * 110}" y="{h - 16}" width="10" height="10" fill="{colors[mode]}"/>'
            f'<text x="{left + k * 110 + 14}" y="{h - 7}">{mode}</text>'
        )
    parts.append("</svg>")
    out.write_text("\n".join(parts))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated workloads (default: all)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the batch sizes")
    parser.add_argument("--repeats", type=int, default=3, help="rounds per workload and mode (median reported)")
    parser.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"comma-separated, the first is the baseline of the ratios; from {MODES + EXTRA_MODES}",
    )
    parser.add_argument("--num-threads", type=int, default=1, help="torch threads per scheduler process")
    parser.add_argument("--max-total-tokens", type=int, default=16384)
    parser.add_argument("--chunked-prefill-size", type=int, default=1024)
    parser.add_argument("--out", default=str(OUT / "bench_programs.json"))
    args = parser.parse_args()
    workloads = wl.all_workloads(args.scale)
    if args.only:
        wanted = args.only.split(",")
        unknown = [w for w in wanted if w not in {x.name for x in workloads}]
        if unknown:
            parser.error(f"unknown workload(s) {unknown}; choose from {[x.name for x in workloads]}")
        workloads = [w for w in workloads if w.name in wanted]
    modes = args.modes.split(",")
    if not modes or any(m not in MODES + EXTRA_MODES for m in modes) or len(set(modes)) != len(modes):
        parser.error(f"--modes takes distinct names from {MODES + EXTRA_MODES}, got {args.modes!r}")
    started = time.perf_counter()
    runtimes = make_runtimes(args, modes)
    try:
        json_regex = wl.regex_supported(runtimes[modes[0]])
        print(f"engines ready in {time.perf_counter() - started:.1f}s; regex-constrained json fields: {json_regex}")
        for rt in runtimes.values():  # warm each engine once (first-call costs are not the workload's)
            rt.generate("Hello", {"max_new_tokens": 1, "temperature": 0})
        rounds: dict[tuple, list[RunResult]] = {}
        for i, workload in enumerate(workloads):
            workload.use_regex = json_regex
            for r in range(args.repeats):
                k = (i + r) % len(modes)
                for mode in modes[k:] + modes[:k]:
                    result = run_once(workload, mode, runtimes[mode])
                    print(
                        f"{workload.name:10s} {mode:10s} {result.wall_s:7.2f}s  hit {100 * result.hit_rate:5.1f}%  "
                        f"prefill computed {result.computed_prefill_tokens}",
                        flush=True,
                    )
                    rounds.setdefault((workload.name, mode), []).append(result)
        results = [median_round(rounds[(w.name, mode)]) for w in workloads for mode in modes]
    finally:
        for rt in runtimes.values():
            rt.shutdown()
    ratios = ratio_table(results, modes) if len(modes) > 1 else []
    print_tables(results, ratios, modes)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "args": vars(args),
                "json_regex": json_regex,
                "cpu_count": os.cpu_count(),
                "load_avg": os.getloadavg(),
                "total_s": time.perf_counter() - started,
                "results": [asdict(r) for r in results],
                "ratios": ratios,
            },
            indent=1,
        )
    )
    print(f"\nwrote {out} and {plot(results, out.with_suffix(''), modes)}; total {time.perf_counter() - started:.0f}s")


if __name__ == "__main__":
    main()
