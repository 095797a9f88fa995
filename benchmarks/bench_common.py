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


def git_commit() -> str | None:
    """The checkout's commit, "-dirty" when its files differ from it (the device machine's copy of a working
    tree keeps the session's first commit under newer files: a bare hash there would name code that did not run).
    None outside a git checkout."""
    import subprocess

    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=7"],
            cwd=HERE,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def load_workload_module():
    """shared/bench/workload.py beside the repo, or the copy carried to the GPU machine (.shared/)."""
    for folder in (os.path.join(HERE, "..", "..", "shared", "bench"), os.path.join(HERE, "..", ".shared", "bench")):
        if os.path.isfile(os.path.join(folder, "workload.py")):
            sys.path.insert(0, os.path.abspath(folder))
            import workload  # noqa: E402

            return workload
    raise FileNotFoundError("workload.py not found in ../shared/bench (beside the repo) or .shared/bench (inside it)")


def parse_engine_args(items: list[str]) -> dict:
    """`--engine-arg KEY=VALUE` items → Engine keyword arguments (values parsed as JSON when they are)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--engine-arg wants KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def step_breakdown(before: dict, after: dict, seconds: float) -> dict:
    """Where a run's time went, from two `get_stats()` snapshots (engine started with
    enable_step_timing=True): per kind of step, how many, mean rows, wall and device seconds; and the
    share of the run's wall time the device was busy (the rest it waited on the host)."""
    b, a = before["steps"], after["steps"]
    out = {"decode_restarts": a["decode_restarts"] - b["decode_restarts"]}
    busy = 0.0
    for kind in ("prefill", "decode"):
        d = {k: a[kind][k] - b[kind][k] for k in a[kind]}
        d["mean_rows"] = d["rows"] / max(1, d["steps"])
        out[kind] = d
        busy += d["device_s"]
    out["device_busy_fraction"] = busy / seconds if a.get("device_timing") else None
    hb, ha = b.get("host_phases", {}), a.get("host_phases", {})
    out["host_phases"] = {k: ha[k] - hb.get(k, 0.0) for k in ha}
    return out


def format_breakdown(s: dict) -> str:
    p, d = s["prefill"], s["decode"]
    busy = s["device_busy_fraction"]
    return (
        f"steps: prefill {p['steps']} ({p['tokens']} tokens, {p['mean_rows']:.1f} reqs each, wall {p['wall_s']:.2f} s, "
        f"device {p['device_s']:.2f} s) | decode {d['steps']} (mean batch {d['mean_rows']:.1f}, wall "
        f"{d['wall_s']:.2f} s, "
        f"device {d['device_s']:.2f} s, pipeline restarts {s['decode_restarts']}) | device busy "
        + (f"{busy:.1%}" if busy is not None else "n/a")
        + "".join(f" | host {k} {v:.3f} s" for k, v in s.get("host_phases", {}).items())
    )
