"""Soak test: drive `python -m plait.runtime.server` with a realistic mix for a while and watch it.

    python benchmarks/soak/soak_server.py --minutes 12                 # CPU: embedded model, --num-threads 1
    python benchmarks/soak/soak_server.py --minutes 10 --workers 32 --server-flag=--max-total-tokens=200000

It starts the server (or attaches to one with --url), warms it up, then runs `--workers` client threads
for `--minutes`, each picking scenarios at random through real clients (the `openai` client, `requests`
and `aiohttp`): short / long / prefix-sharing prompts, streaming and not, n > 1, json_schema and regex
constraints (a few fixed schemas and a stream of new ones that fills the grammar cache), streams the
client drops, /abort_request, bad requests that must be a 4xx, and now and then a pause in which the
server must go idle and /flush_cache must succeed. Every --sample-s seconds it records the RSS of the
server and of its scheduler subprocess (/proc), fds, threads, KV usage, integrity errors and queues.
After the load it waits idle and checks: KV used 0, no integrity errors, no request left, RSS and fds
back near their post-warm-up values. Prints a table, saves JSON (bench_common.save), exits 1 on a failed
check.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from typing import Any, Optional

import requests

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # this room's scripts, then benchmarks/ (bench_common)
from bench_common import save  # noqa: E402
from soak_scenarios import INFO_KEYS, Soak, Tally  # noqa: E402

# ---------------------------------------------------------------- process probes (/proc, no psutil)


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS (KiB) and Threads of a process, from /proc/<pid>/status."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "Threads"):
                out[key] = int(value.split()[0])
    return out


def child_pids(pid: int) -> list[int]:
    kids: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids += [int(p) for p in f.read().split()]
        except FileNotFoundError:
            pass
    return kids


def probe(pid: int) -> dict[str, Any]:
    st = proc_status(pid)
    return {"rss_mb": st["VmRSS"] / 1024, "threads": st["Threads"], "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def scheduler_pid(server_pid: int) -> Optional[int]:
    """The scheduler is the server's child running plait.runtime.scheduler.process."""
    for kid in child_pids(server_pid):
        try:
            with open(f"/proc/{kid}/cmdline", "rb") as f:
                if b"plait.runtime.scheduler" in f.read():
                    return kid
        except FileNotFoundError:
            pass
    return None


def metric_values(text: str, name: str) -> dict[str, float]:
    """Prometheus text → {label-string: value} for one metric name."""
    out = {}
    for line in text.splitlines():
        m = re.match(rf"^{name}(\{{[^}}]*\}})?\s+(\S+)$", line)
        if m:
            out[m.group(1) or ""] = float(m.group(2))
    return out


def sample(url: str, server_pid: Optional[int], sched_pid: Optional[int], t0: float, phase: str) -> dict:
    row: dict[str, Any] = {"t_s": round(time.time() - t0, 1), "phase": phase}
    for name, pid in (("server", server_pid), ("sched", sched_pid)):
        if pid:
            try:
                row.update({f"{name}_{k}": v for k, v in probe(pid).items()})
            except FileNotFoundError:
                row[f"{name}_rss_mb"] = None  # the process is gone
    try:
        info = requests.get(url + "/get_server_info", timeout=30).json()
        row.update({k: info.get(k) for k in INFO_KEYS})
        row["grammar_cache_size"] = info.get("grammar_cache_size")
        metrics = requests.get(url + "/metrics", timeout=30).text
        row["finished_by_reason"] = {
            re.sub(r'.*finish_reason="([^"]*)".*', r"\1", k): v
            for k, v in metric_values(metrics, "plait_requests_total").items()
        }
        row["in_flight_http"] = sum(metric_values(metrics, "plait_num_in_flight_reqs").values())
    except Exception as e:  # noqa: BLE001 - a hung or dead server is what the soak looks for
        row["error"] = f"{type(e).__name__}: {e}"
    return row


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "plait.runtime.server", "--port", str(port), *args.server_flag]
    log = open(args.log, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 900
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {args.log}")
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except requests.ConnectionError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError("server not healthy after 900 s")


def print_table(rows: list[dict], header: bool = True) -> None:
    cols = [
        ("t_s", 7),
        ("phase", 8),
        ("server_rss_mb", 10),
        ("sched_rss_mb", 10),
        ("server_fds", 6),
        ("sched_fds", 6),
        ("server_threads", 6),
        ("sched_threads", 6),
        ("kv_used_tokens", 8),
        ("evictable_tokens", 8),
        ("num_running_reqs", 5),
        ("num_waiting_reqs", 5),
        ("num_finished", 8),
        ("integrity_errors", 5),
        ("grammar_cache_size", 6),
    ]
    heads = [
        "t",
        "phase",
        "srv MB",
        "sch MB",
        "s.fd",
        "c.fd",
        "s.thr",
        "c.thr",
        "kv used",
        "evictbl",
        "run",
        "wait",
        "finished",
        "integ",
        "gram",
    ]
    if header:
        print(" ".join(h.rjust(w) for h, (_, w) in zip(heads, cols)))
    for r in rows:
        cells = []
        for key, w in cols:
            v = r.get(key)
            cells.append((f"{v:.0f}" if isinstance(v, float) else str(v if v is not None else "-")).rjust(w))
        print(" ".join(cells))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=12.0, help="length of the load phase")
    p.add_argument("--url", help="drive a running server instead of starting one (no RSS/fd probes)")
    p.add_argument(
        "--server-flag",
        action="append",
        default=None,
        help="flag for the started server (repeat; default --num-threads 1 --max-total-tokens 3072)",
    )
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--sample-s", type=float, default=20.0)
    p.add_argument("--idle-every-s", type=float, default=150.0, help="pause, wait idle and flush this often")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--long-words", type=int, default=900, help="words in a long prompt")
    p.add_argument("--prefix-words", type=int, default=350)
    p.add_argument("--num-prefixes", type=int, default=10)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--settle-s", type=float, default=30.0, help="idle wait after the load")
    p.add_argument("--log", default="/tmp/plait_soak_server.log")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.server_flag is None:
        args.server_flag = ["--num-threads", "1", "--max-total-tokens", "3072"]

    proc, url = (None, args.url) if args.url else start_server(args)
    server_pid = proc.pid if proc else None
    sched_pid = scheduler_pid(server_pid) if server_pid else None
    soak = Soak(url, args)
    t0 = time.time()
    rows: list[dict] = [sample(url, server_pid, sched_pid, t0, "start")]
    idle_checks: list[dict] = []

    def idle_probe() -> dict:
        row = sample(url, server_pid, sched_pid, t0, "flushed")
        return {k: v for k, v in row.items() if k.endswith(("_rss_mb", "_fds", "_threads")) or k == "t_s"}

    try:
        # Warm-up: every scenario once, so lazily loaded code and buffers are in the baseline.
        for k, (name, _, fn) in enumerate(soak.scenarios):
            try:
                fn(random.Random(k))
            except Exception as e:  # noqa: BLE001
                soak.tally.add(name, "FAIL", 0.0, f"warm-up: {type(e).__name__}: {e}")
        idle_checks.append(soak.idle_check("warm", idle_probe))
        rows.append(sample(url, server_pid, sched_pid, t0, "warm"))
        deadline = time.time() + args.minutes * 60
        threads = [
            threading.Thread(target=soak.worker, args=(args.seed * 1000 + i, deadline), daemon=True)
            for i in range(args.workers)
        ]
        for t in threads:
            t.start()
        next_idle = time.time() + args.idle_every_s
        while any(t.is_alive() for t in threads):
            time.sleep(args.sample_s)
            if time.time() >= next_idle and time.time() < deadline - 30:
                idle_checks.append(soak.idle_check(f"t={time.time() - t0:.0f}", idle_probe))
                next_idle = time.time() + args.idle_every_s
            rows.append(sample(url, server_pid, sched_pid, t0, "load"))
            print_table(rows if len(rows) == 3 else rows[-1:], header=len(rows) == 3)
        for t in threads:
            t.join(args.request_timeout)
        time.sleep(args.settle_s)
        idle_checks.append(soak.idle_check("end", idle_probe))
        for _ in range(2):
            rows.append(sample(url, server_pid, sched_pid, t0, "idle"))
            time.sleep(min(args.sample_s, 10))
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()

    print()
    print_table(rows)
    checks = evaluate(rows, idle_checks, soak.tally)
    print("\nrequests by scenario:outcome:")
    for key, n in sorted(soak.tally.outcomes.items()):
        print(f"  {key:40s} {n}")
    for f in soak.tally.failures[:20]:
        print("  FAIL", f)
    print("\nidle checks:", json.dumps(idle_checks, indent=None))
    print("\nchecks:")
    for name, (ok, detail) in checks.items():
        print(f"  {'PASS' if ok else 'FAIL'} {name}: {detail}")
    save(
        "soak_server",
        {
            "args": vars(args),
            "samples": rows,
            "idle_checks": idle_checks,
            "outcomes": dict(soak.tally.outcomes),
            "failures": soak.tally.failures,
            "checks": {k: {"ok": ok, "detail": d} for k, (ok, d) in checks.items()},
        },
    )
    return 0 if all(ok for ok, _ in checks.values()) else 1


def evaluate(rows: list[dict], idle_checks: list[dict], tally: Tally) -> dict[str, tuple[bool, str]]:
    end = idle_checks[-1]
    warm = next(r for r in rows if r["phase"] == "warm")
    last = rows[-1]
    out = {
        "kv_used_0": (end.get("kv_used_tokens") == 0, f"kv_used_tokens {end.get('kv_used_tokens')}"),
        "integrity_errors_0": (
            not last.get("integrity_errors") and not last.get("last_integrity_error"),
            f"{last.get('integrity_errors')} ({last.get('last_integrity_error')})",
        ),
        "no_requests_left": (
            not (last.get("num_running_reqs") or last.get("num_waiting_reqs") or last.get("num_open_http_requests")),
            f"running {last.get('num_running_reqs')} waiting {last.get('num_waiting_reqs')} "
            f"open http {last.get('num_open_http_requests')}",
        ),
        "flushes_ok": (
            all(c["flush_status"] == 200 for c in idle_checks),
            str([c["flush_status"] for c in idle_checks]),
        ),
        "no_client_failures": (
            not any(k.endswith(":FAIL") for k in tally.outcomes),
            f"{sum(n for k, n in tally.outcomes.items() if k.endswith(':FAIL'))} failed",
        ),
    }
    for proc in ("server", "sched"):
        if warm.get(f"{proc}_rss_mb") and last.get(f"{proc}_rss_mb"):
            # NOTE: allocator high-water marks keep some growth after the warm-up; a leak grows with
            # the number of requests, far past this margin over a soak of thousands of requests.
            growth = last[f"{proc}_rss_mb"] - warm[f"{proc}_rss_mb"]
            out[f"{proc}_rss_back_near_warm"] = (
                growth < max(150.0, 0.25 * warm[f"{proc}_rss_mb"]),
                f"{warm[f'{proc}_rss_mb']:.0f} -> {last[f'{proc}_rss_mb']:.0f} MB",
            )
            fd_growth = last[f"{proc}_fds"] - warm[f"{proc}_fds"]
            out[f"{proc}_fds_stable"] = (fd_growth <= 5, f"{warm[f'{proc}_fds']} -> {last[f'{proc}_fds']}")
        # Growth per request, measured idle and flushed, from the first check under load to the end:
        # what a leak would show however large the allocator's high-water mark.
        points = [c for c in idle_checks[1:] if c.get(f"{proc}_rss_mb")]
        if len(points) >= 2 and points[-1]["num_finished"] > points[0]["num_finished"]:
            a, b = points[0], points[-1]
            growth = b[f"{proc}_rss_mb"] - a[f"{proc}_rss_mb"]
            per_1000 = growth / (b["num_finished"] - a["num_finished"]) * 1000
            # NOTE: idle RSS moves by tens of MB with what malloc keeps from the last long prompt, so
            # a short run's slope is noise: a leak must both grow past that and scale with requests.
            out[f"{proc}_rss_per_1000_requests"] = (
                growth < 50.0 or per_1000 < 50.0,
                f"{per_1000:+.1f} MB per 1000 requests ({a['label']} -> {b['label']}: "
                f"{a[f'{proc}_rss_mb']:.0f} -> {b[f'{proc}_rss_mb']:.0f} MB over "
                f"{b['num_finished'] - a['num_finished']} requests)",
            )
    return out


if __name__ == "__main__":
    sys.exit(main())
