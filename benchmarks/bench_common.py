"""What every benchmark script shares: where results go, and where the shared workload file is."""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def results_dir() -> str:
    """$OUT (set on the device machine, whose files come back from there), else benchmarks/out."""
    out_dir = os.environ.get("OUT") or os.path.join(HERE, "out")
    os.makedirs(out_dir, exist_ok=True)
    return out_dir


def save(name: str, result) -> str:
    """Write `result` as <results_dir>/<name>.json and say where."""
    path = os.path.join(results_dir(), f"{name}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2, default=str)
    print(f"saved {path}")
    return path


def load_workload_module():
    """shared/bench/workload.py beside the repo, or the copy carried to the GPU machine (.shared/)."""
    for folder in (os.path.join(HERE, "..", "..", "shared", "bench"), os.path.join(HERE, "..", ".shared", "bench")):
        if os.path.isfile(os.path.join(folder, "workload.py")):
            sys.path.insert(0, os.path.abspath(folder))
            import workload  # noqa: E402

            return workload
    raise FileNotFoundError("workload.py not found in ../shared/bench (beside the repo) or .shared/bench (inside it)")
