"""How long the runtime takes to become ready: a fresh Python process per run builds an Engine on the embedded
default model (what `make demo` and `plait serve` do), then answers one token.

Each run is its own interpreter, so imports are counted as a user pays them; the first run of a fresh machine
also converts the model and fills the OS file cache ("cold"), the later ones are warm starts.

    python benchmarks/engine/bench_startup.py --runs 4           # prints a table, saves startup.json
    python benchmarks/engine/bench_startup.py --profile          # where a warm start goes

`--profile` prints, in fresh interpreters, the cProfile of the Engine's own process while it starts (its wait
for the scheduler process included), then that of building the scheduler in-process (what the scheduler
process does before it reports ready: model, KV pool, tokenizer, warm-up), with the imports each one pays.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: bench_common

from bench_common import save

# One run, in a fresh interpreter: JSON on the last line of stdout.
RUN = r"""
import json, time
t0 = time.perf_counter()
from plait.runtime import Engine
t1 = time.perf_counter()
eng = Engine(num_threads=1, **json.loads(__ENGINE_ARGS__))
t2 = time.perf_counter()
eng.generate(prompt="Hi", sampling_params={"max_new_tokens": 1, "temperature": 0})
t3 = time.perf_counter()
eng.shutdown()
print(json.dumps({"import_s": t1 - t0, "engine_s": t2 - t1, "first_token_s": t3 - t2, "ready_s": t2 - t0}))
"""

PROFILE_ENGINE = r"""
import cProfile, pstats, time, json
profile = cProfile.Profile()
t = time.perf_counter()
profile.enable()
from plait.runtime import Engine
eng = Engine(num_threads=1, **json.loads(__ENGINE_ARGS__))
profile.disable()
print(f"== the Engine's process: import + Engine() {time.perf_counter() - t:.2f}s")
pstats.Stats(profile).sort_stats("cumulative").print_stats(30)
eng.shutdown()
"""

PROFILE_SCHEDULER = r"""
import cProfile, pstats, time, json
profile = cProfile.Profile()
t = time.perf_counter()
profile.enable()
import torch
torch.set_num_threads(1)
from plait.runtime.models.default_model import resolve_model_path
from plait.runtime.scheduler.scheduler import create_scheduler
from plait.runtime.server_args import ServerArgs
args = ServerArgs.from_kwargs(num_threads=1, **json.loads(__ENGINE_ARGS__))
create_scheduler(args, resolve_model_path(args.model_path))
profile.disable()
print(f"== the scheduler's process, in-process: import + create_scheduler() {time.perf_counter() - t:.2f}s")
pstats.Stats(profile).sort_stats("cumulative").print_stats(30)
"""


def one_run(engine_args: dict) -> dict:
    code = RUN.replace("__ENGINE_ARGS__", repr(json.dumps(engine_args)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--engine-args", default="{}", help="JSON of extra Engine arguments")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    engine_args = json.loads(args.engine_args)
    if args.profile:
        for code in (PROFILE_ENGINE, PROFILE_SCHEDULER):
            subprocess.run(
                [sys.executable, "-c", code.replace("__ENGINE_ARGS__", repr(json.dumps(engine_args)))], check=True
            )
        return
    runs = []
    for i in range(args.runs):
        runs.append(one_run(engine_args))
        r = runs[-1]
        print(
            f"run {i}: import {r['import_s']:.2f}s  Engine() {r['engine_s']:.2f}s  ready {r['ready_s']:.2f}s  "
            f"first token {r['first_token_s']:.2f}s",
            flush=True,
        )
    warm = runs[1:] or runs
    summary = {key: statistics.median(r[key] for r in warm) for key in runs[0]}
    print(
        f"warm median ({len(warm)} runs): ready {summary['ready_s']:.2f}s (import {summary['import_s']:.2f}s, "
        f"Engine() {summary['engine_s']:.2f}s), first token {summary['first_token_s']:.2f}s"
    )
    load = os.getloadavg()
    save(
        "startup",
        {
            "runs": runs,
            "warm_median": summary,
            "engine_args": engine_args,
            "loadavg": load,
            "python": sys.version.split()[0],
            "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        },
    )


if __name__ == "__main__":
    main()
