"""paper_programs: the SGLang paper's programs (paper_workloads.py) driven four ways (issue 35).

Drivers (`--drivers`, run in the order given; the first is the baseline of the speedup column):
  dsl-hints     plait's DSL in-process on a Runtime, program hints on (run_batch's shared-segment prefill,
                fork and state pins, the group hint)
  dsl-nohints   the same Runtime and programs with the hints off (what SGLang's frontend sends)
  http-plait    the same programs through plait's OpenAI backend as a completion model: one HTTP call per
                gen with the whole prompt, one per select (its endings scored by echoed prompt logprobs:
                `echo` + `logprobs` of /v1/completions) — the paper's `bench_other` shape; against
                `plait serve` (--plait-url; default: the in-process Runtime's own HTTP API)
  http-vllm     the same against `vllm serve` (--vllm-url); regex fields as vLLM's `structured_outputs`

`--parallel` programs in flight (64, as SGLang's harness). Per workload and driver: programs/s, output
tok/s, mean and p99 program latency, cached-token share (the Runtime's counters in-process; the
servers' `usage.prompt_tokens_details.cached_tokens` over HTTP, where reported: vLLM reports it with
--enable-prompt-tokens-details), accuracy where the workload has answers (0.0 on dummy weights).
Fixed lengths: free gens run with ignore_eos and no stop strings, so dummy weights do the same work.

    .venv/bin/python benchmarks/programs/paper_programs.py --scale 0.05            # CPU, default model
    python benchmarks/programs/paper_programs.py --model-path /tmp/llama8b-smol --load-format dummy \\
        --drivers dsl-hints,dsl-nohints                                             # GPU (vs_vllm_programs.sh)
    python benchmarks/programs/paper_programs.py --drivers http-vllm --vllm-url http://localhost:30200/v1

Results: $OUT or benchmarks/out/paper_programs[_TAG].json and a plot (.png, with matplotlib).
`--merge A.json B.json ...` joins runs of separate processes (the GPU script's) into one table and plot.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import paper_workloads as pw  # noqa: E402
import plait as sgl  # noqa: E402
from bench_common import results_dir, save  # noqa: E402
from http_driver import CompletionDriver, flush_server, served_model_name  # noqa: E402

DRIVERS = ("dsl-hints", "dsl-nohints", "http-plait", "http-vllm")
FIXED_LENGTHS = "fixed lengths: gens ignore EOS and carry no stop strings (the paper's stops replaced by lengths)"


@dataclass
class Row:
    workload: str
    driver: str
    programs: int
    wall_s: float
    programs_per_s: float
    output_tokens: int
    output_tok_per_s: float
    latency_mean_s: float
    latency_p99_s: float
    prompt_tokens: int
    cached_tokens: Optional[int]  # None: the server did not report it
    cached_share: Optional[float]
    accuracy: Optional[float]
    errors: int


def program_latency(state: Any) -> float:
    """Seconds from the program's start to the end of its last request (its run graph)."""
    ends = [
        n.stats.start_s + n.stats.latency_s
        for n in state.stream_executor.recorder.build().nodes
        if n.stats is not None and n.stats.start_s is not None and n.stats.latency_s is not None
    ]
    return max(ends, default=0.0)


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def run_workload(workload: pw.Workload, driver: str, backend: Any, runtime: Any, parallel: int) -> Row:
    if runtime is not None:
        for _ in range(200):  # flush refuses while requests are in flight
            if runtime.engine.flush_cache():
                break
            time.sleep(0.05)
        before = runtime.engine.get_stats()
    else:
        flush_server(str(backend.client.base_url), backend.regex_key == "regex")
        backend.token_usage.reset()
    started = time.perf_counter()
    states = workload.program.run_batch(workload.arguments(), temperature=0, backend=backend, num_threads=parallel)
    wall = time.perf_counter() - started
    if runtime is not None:
        after = runtime.engine.get_stats()
        # NOTE: the last requests' prefixes are unlocked by the scheduler a step after their outputs reach the
        # program (and a program's pins on its pin thread), so "nothing left behind" is given a moment.
        for _ in range(100):
            if after["protected_tokens"] == 0:
                break
            time.sleep(0.05)
            after = runtime.engine.get_stats()
        assert after["protected_tokens"] == 0, f"{workload.name}/{driver}: pins left behind"
        prompt = after["prompt_tokens"] - before["prompt_tokens"]
        cached: Optional[int] = after["cached_tokens"] - before["cached_tokens"]
        output = after["generation_tokens"] - before["generation_tokens"]
    else:
        usage = backend.token_usage
        prompt, output = usage.prompt_tokens, usage.completion_tokens
        cached = usage.cached_tokens if usage.cached_reported else None
    errors = [s.error() for s in states if s.error() is not None]
    if errors:
        print(f"  {workload.name}/{driver}: {len(errors)} errors, the first: {errors[0]!r}", flush=True)
    latencies = [program_latency(s) for s in states]
    return Row(
        workload.name,
        driver,
        len(states),
        wall,
        len(states) / wall,
        output,
        output / wall,
        statistics.mean(latencies),
        p99(latencies),
        prompt,
        cached,
        None if cached is None else cached / max(1, prompt),
        workload.score(states),
        len(errors),
    )


def make_runtime(args: argparse.Namespace) -> Any:
    settings: dict[str, Any] = dict(log_level="warning", schedule_policy=args.schedule_policy)
    if args.model_path:
        settings["model_path"] = args.model_path
    if args.load_format:
        settings["load_format"] = args.load_format
    for key in ("num_threads", "max_total_tokens", "chunked_prefill_size", "context_length"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    settings.update(json.loads(args.runtime_args))
    return sgl.Runtime(**settings)


def run_drivers(
    args: argparse.Namespace,
    workloads: list[pw.Workload],
    drivers: list[str],
    only_for: Optional[dict[str, set[str]]] = None,
) -> list[Row]:
    """Each workload on each driver in turn (`only_for`: a driver's workloads, where not all)."""
    needs_runtime = any(d.startswith("dsl") for d in drivers) or ("http-plait" in drivers and not args.plait_url)
    runtime = make_runtime(args) if needs_runtime else None
    rows = []
    try:
        backends: dict[str, Any] = {}
        for driver in drivers:
            if driver.startswith("dsl"):
                backends[driver] = runtime
            elif driver == "http-plait":
                backends[driver] = CompletionDriver(args.plait_url or runtime.url + "/v1")
            else:
                backends[driver] = CompletionDriver(args.vllm_url, regex_key="structured_outputs")
            if not driver.startswith("dsl"):
                backends[driver].model_name = served_model_name(str(backends[driver].client.base_url))
        for driver in drivers:  # warm each path once (first-call costs are not a workload's)
            pw.mmlu.run(examples="Warm up.", question=" Q:", backend=backends[driver], temperature=0)
        if args.warm_pass:
            # NOTE: a warm-up program or two does not meet the batch's step shapes, and a kernel variant first met
            # by a timed batch compiles inside its figure: on an H100 the first driver's MMLU (hints on, 0.25 s
            # of work) read 1.38 s and the second's 0.25 s. Each workload once whole on the first driver, untimed
            # (every timed run flushes the cache first, so nothing it cached carries over).
            for workload in workloads:
                if runtime is not None:
                    runtime.endpoint.program_hints = drivers[0] == "dsl-hints"
                workload.program.run_batch(
                    workload.arguments(), temperature=0, backend=backends[drivers[0]], num_threads=args.parallel
                )
        for workload in workloads:
            for driver in drivers:
                if only_for and driver in only_for and workload.name not in only_for[driver]:
                    continue
                if runtime is not None:
                    runtime.endpoint.program_hints = driver == "dsl-hints"
                backend = backends[driver]
                if args.warm:  # untimed: what a workload meets first (its constraints compiled, forks' threads)
                    warm = workload.arguments()[: args.warm]
                    workload.program.run_batch(warm, temperature=0, backend=backend, num_threads=len(warm))
                row = run_workload(
                    workload, driver, backend, runtime if driver.startswith("dsl") else None, args.parallel
                )
                share = "n/a" if row.cached_share is None else f"{100 * row.cached_share:.0f}%"
                print(
                    f"{workload.name:10s} {driver:11s} {row.wall_s:7.2f}s {row.programs_per_s:8.2f} prog/s "
                    f"{row.output_tok_per_s:8.0f} tok/s  cached {share}",
                    flush=True,
                )
                rows.append(row)
                if getattr(args, "tag", None):  # so far, for a run its time limit stops
                    partial = Path(results_dir()) / f"paper_programs_{args.tag}.json"
                    partial.write_text(json.dumps({"partial": True, "rows": [asdict(r) for r in rows]}, indent=1))
    finally:
        if runtime is not None:
            runtime.shutdown()
    return rows


def print_table(rows: list[Row], baseline: str, peer: Optional[str]) -> None:
    print(f"\n({FIXED_LENGTHS}; accuracy is 0.0-ish on dummy weights)")
    print(
        "| workload | driver | programs | wall s | programs/s | out tok/s | latency mean / p99 s | cached | accuracy |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        share = "n/a" if r.cached_share is None else f"{100 * r.cached_share:.0f}%"
        acc = "" if r.accuracy is None else f"{r.accuracy:.2f}"
        print(
            f"| {r.workload} | {r.driver} | {r.programs} | {r.wall_s:.2f} | {r.programs_per_s:.2f} | "
            f"{r.output_tok_per_s:.0f} | {r.latency_mean_s:.2f} / {r.latency_p99_s:.2f} | {share} | {acc} |"
            + (f" {r.errors} errors" if r.errors else "")
        )
    drivers = list(dict.fromkeys(r.driver for r in rows))
    if len(drivers) < 2:
        return
    others = [d for d in drivers if d != baseline]
    print("\n| workload | " + " | ".join(f"{baseline} vs {d}" for d in others) + " |")
    print("|---|" + "---|" * len(others))
    for name in dict.fromkeys(r.workload for r in rows):
        wall = {r.driver: r.wall_s for r in rows if r.workload == name}
        cells = [f"{wall[d] / wall[baseline]:.2f}x" if d in wall and baseline in wall else "" for d in others]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if peer and peer in drivers:
        print(f"(speedup: the driver's wall time over {baseline}'s; {peer} is the peer of the issue's targets)")


def plot(rows: list[Row], path: Path) -> Optional[Path]:
    """Programs/s per workload and driver, relative to the first driver's (matplotlib, else no plot)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = list(dict.fromkeys(r.workload for r in rows))
    drivers = list(dict.fromkeys(r.driver for r in rows))
    rate = {(r.workload, r.driver): r.programs_per_s for r in rows}
    fig, ax = plt.subplots(figsize=(11, 4))
    width = 0.8 / len(drivers)
    for k, driver in enumerate(drivers):
        ax.bar(
            [i + (k - (len(drivers) - 1) / 2) * width for i in range(len(names))],
            [rate.get((n, driver), 0.0) / rate[(n, drivers[0])] for n in names],
            width,
            label=driver,
        )
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel(f"programs/s relative to {drivers[0]}")
    ax.axhline(1.0, color="gray", linewidth=0.5)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drivers", default="dsl-hints,dsl-nohints,http-plait", help=f"comma-separated, of {DRIVERS}")
    parser.add_argument("--only", default="", help=f"comma-separated workloads (default: all of {pw.NAMES})")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply program counts (and lengths)")
    parser.add_argument("--length-scale", type=float, default=None, help="multiply lengths (default: --scale)")
    parser.add_argument("--parallel", type=int, default=64, help="programs in flight")
    parser.add_argument(
        "--warm-pass",
        action="store_true",
        help="first run each workload whole on the first driver, untimed (the batch's kernel variants compiled)",
    )
    parser.add_argument(
        "--warm",
        type=int,
        default=1,
        help="programs of each workload run untimed on each driver first: what a workload meets first in a process "
        "(its regexes compiled, its forks' batch shapes) was paid by whichever driver ran it first (0.4x on a CPU)",
    )
    parser.add_argument("--model-path", default=None, help="the DSL Runtime's model (default: the embedded one)")
    parser.add_argument("--load-format", default=None, help="e.g. dummy")
    parser.add_argument("--schedule-policy", default="lpm", help="the DSL Runtime's (plait serve's default: lpm)")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--max-total-tokens", type=int, default=None)
    parser.add_argument("--chunked-prefill-size", type=int, default=None)
    parser.add_argument("--context-length", type=int, default=None)
    parser.add_argument("--runtime-args", default="{}", help="more ServerArgs for the Runtime, as JSON")
    parser.add_argument("--plait-url", default=None, help="plait serve's /v1 (default: the Runtime's own HTTP API)")
    parser.add_argument("--vllm-url", default="http://localhost:30200/v1")
    parser.add_argument("--tag", default="", help="suffix of the output file")
    parser.add_argument("--merge", nargs="*", default=None, help="JSON files of earlier runs: one table and plot")
    return parser


def select_workloads(args: argparse.Namespace) -> list[pw.Workload]:
    workloads = pw.all_workloads(args.scale, length_scale=args.length_scale)
    if not args.only:
        return workloads
    wanted = args.only.split(",")
    if set(wanted) - set(pw.NAMES):
        raise SystemExit(f"unknown workload(s) {sorted(set(wanted) - set(pw.NAMES))}; choose from {pw.NAMES}")
    return [w for w in workloads if w.name in wanted]


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    if args.warm < 0:
        parser.error(f"--warm must be >= 0 (programs run untimed per workload and driver), got {args.warm}")
    if args.merge:
        loaded = [json.loads(Path(f).read_text()) for f in args.merge]
        rows = [Row(**r) for d in loaded for r in d["rows"]]
        drivers = list(dict.fromkeys(r.driver for r in rows))
    else:
        drivers = args.drivers.split(",")
        if not drivers or any(d not in DRIVERS for d in drivers):
            parser.error(f"--drivers takes names from {DRIVERS}, got {args.drivers!r}")
        workloads = select_workloads(args)
        started = time.perf_counter()
        rows = run_drivers(args, workloads, drivers)
        print(f"total {time.perf_counter() - started:.0f}s")
    print_table(rows, drivers[0], "http-vllm")
    name = "paper_programs" + (f"_{args.tag}" if args.tag else "")
    out = save(name, {"args": vars(args), "note": FIXED_LENGTHS, "rows": [asdict(r) for r in rows]})
    picture = plot(rows, Path(out).with_suffix(".png"))
    print(f"wrote {out}" + (f" and {picture}" if picture else " (no matplotlib: no plot)"))


if __name__ == "__main__":
    main()
