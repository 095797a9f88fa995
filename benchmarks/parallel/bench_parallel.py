"""Parallelism: a model split over ranks, replicas behind one engine, and the router, in one run.

CPU (default without a GPU), the embedded default model (SmolLM2-135M-Instruct, float32):
- `split`: the same greedy batch on one device, TP = 3, PP = 2 and DP = 2 (one engine at a time):
  output tok/s, ms per decode step, and how many outputs equal one device's token for token. On a
  2-core machine three ranks share two cores: the overhead measured is the group's messages and
  collectives plus that contention, not what GPUs would show.
- `router`: a multi-tenant workload (many system prompts, several users each, two turns per user)
  through `plait router` over 2-4 CPU replicas (`plait serve` processes), cache-aware against
  round-robin on the same replicas (caches flushed between): throughput and the replicas' cache hit
  rate (cached / prompt tokens, from each response's meta_info).

    python benchmarks/parallel/bench_parallel.py                          # both parts
    python benchmarks/parallel/bench_parallel.py --part router --replicas 3

GPU (issue 24; two GPUs, dummy weights at a real shape), TP = 1 vs TP = 2 and DP = 1 vs DP = 2 back to
back on the shared workloads through bench_offline's GPU path, against the targets (TP = 2 batch-1
decode step <= 0.62x TP = 1's; DP = 2 offline >= 1.9x DP = 1):

    python benchmarks/parallel/bench_parallel.py --model llama-3.1-8b --workload single batch64 offline
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [BENCHMARKS, os.path.join(BENCHMARKS, "engine")]  # bench_common; bench_offline's prompts

from bench_common import save  # noqa: E402
from bench_offline import cpu_prompts  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TP2_SINGLE_TARGET = 0.62  # TP = 2 batch-1 decode step time / TP = 1's, at most
DP2_OFFLINE_TARGET = 1.9  # DP = 2 offline throughput / DP = 1's, at least


# ---------------------------------------------------------------------------------------------- CPU: split
def run_split(args) -> dict:
    from plait.runtime import Engine
    from plait.runtime.models.default_model import default_model_path
    from transformers import AutoTokenizer

    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    ids = [tok.encode(p) for p in cpu_prompts(args.num_prompts, seed=1, max_words=args.max_words)]
    params = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
    configs = {"one device": {}, "TP=3": {"tp_size": 3}, "PP=2": {"pp_size": 2}, "DP=2": {"dp_size": 2}}
    result = {
        "bench": "parallel-split-cpu",
        "model": "SmolLM2-135M-Instruct (float32)",
        "prompts": len(ids),
        "input_tokens": sum(map(len, ids)),
        "output_len": args.output_len,
        "configs": {},
    }
    reference = None
    for name, extra in configs.items():
        t0 = time.perf_counter()
        with Engine(model_path=path, num_threads=args.num_threads, max_total_tokens=16384, **extra) as eng:
            start_s = time.perf_counter() - t0
            eng.generate(input_ids=ids[:2], sampling_params={"max_new_tokens": 2, "temperature": 0})  # warm-up
            eng.flush_cache()
            before = eng.get_stats()
            t = time.perf_counter()
            outs = eng.generate(input_ids=ids, sampling_params=params)
            dt = time.perf_counter() - t
            after = eng.get_stats()
        got = [o["output_ids"] for o in outs]
        reference = reference or got
        decode = _step_delta(before, after, "decode")
        prefill = _step_delta(before, after, "prefill")
        r = {
            "start_s": start_s,
            "seconds": dt,
            "output_tok_s": sum(map(len, got)) / dt,
            "decode_step_ms": 1e3 * decode["wall_s"] / max(1, decode["steps"]),
            "decode_steps": decode["steps"],
            "prefill_s": prefill["wall_s"],
            "same_as_one_device": sum(a == b for a, b in zip(got, reference)),
            "same_tokens": _same_token_share(got, reference),
        }
        result["configs"][name] = r
        print(
            f"{name:10s} start {start_s:5.1f} s | {r['output_tok_s']:6.1f} out tok/s ({dt:.1f} s) | decode step "
            f"{r['decode_step_ms']:6.1f} ms | prefill {r['prefill_s']:.2f} s | outputs equal to one device's: "
            f"{r['same_as_one_device']}/{len(got)} ({r['same_tokens']:.1%} of tokens)"
        )
    base = result["configs"]["one device"]
    for r in result["configs"].values():
        r["throughput_vs_one_device"] = r["output_tok_s"] / base["output_tok_s"]
        r["decode_step_vs_one_device"] = r["decode_step_ms"] / base["decode_step_ms"]
    return result


def _step_delta(before: dict, after: dict, kind: str) -> dict:
    b, a = before["steps"][kind], after["steps"][kind]
    return {k: a[k] - b[k] for k in a}


def _same_token_share(got: list[list[int]], want: list[list[int]]) -> float:
    """Share of output tokens before each output's first difference from the reference."""
    same = total = 0
    for g, w in zip(got, want):
        n = next((i for i, (x, y) in enumerate(zip(g, w)) if x != y), min(len(g), len(w)))
        same += n
        total += len(w)
    return same / max(1, total)


# ---------------------------------------------------------------------------------------------- CPU: router
TOPICS = (
    "a bank",
    "a bakery",
    "a travel agency",
    "a law firm",
    "a hospital",
    "a school",
    "a bike shop",
    "a hotel",
    "an airline",
    "a museum",
    "a library",
    "a garden centre",
)


def tenant_system(i: int, words: int) -> str:
    rng = random.Random(i)
    from bench_offline import WORDS

    body = " ".join(rng.choice(WORDS) for _ in range(words))
    topic = TOPICS[i % len(TOPICS)]
    return f"<|im_start|>system\nYou are the assistant of {topic} (tenant {i}). Rules: {body}<|im_end|>\n"


def user_turn(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def start(argv: list[str], log: str) -> subprocess.Popen:
    with open(log, "w") as f:
        return subprocess.Popen(
            [sys.executable, *argv], stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )


def wait_healthy(urls: list[str], procs: list[subprocess.Popen], deadline_s: float = 900) -> None:
    import requests

    deadline = time.time() + deadline_s
    for url, proc in zip(urls, procs):
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{url} exited with {proc.returncode}")
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"{url} not healthy")
            time.sleep(0.5)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_tenants(router_url: str, args) -> dict:
    """Every user's first turn (shuffled), then every second turn, `args.concurrency` at a time."""
    import requests

    rng = random.Random(0)
    systems = [tenant_system(i, args.system_words) for i in range(args.tenants)]
    users = [(t, u) for t in range(args.tenants) for u in range(args.users)]
    history = {k: systems[k[0]] for k in users}
    sp = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
    totals = {"prompt": 0, "cached": 0, "out": 0}
    per_replica: dict[str, int] = {}
    lock = threading.Lock()

    def ask(key, question):
        text = history[key] + user_turn(question)
        r = requests.post(router_url + "/generate", json={"text": text, "sampling_params": sp}, timeout=600)
        r.raise_for_status()
        out = r.json()
        meta = out["meta_info"]
        with lock:
            history[key] = text + out["text"] + "<|im_end|>\n"
            totals["prompt"] += meta["prompt_tokens"]
            totals["cached"] += meta["cached_tokens"]
            totals["out"] += meta["completion_tokens"]
            replica = r.headers.get("X-Plait-Replica", "?")
            per_replica[replica] = per_replica.get(replica, 0) + 1

    t = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        for turn in range(args.turns):
            order = users[:]
            rng.shuffle(order)
            list(pool.map(lambda k: ask(k, f"user {k[1]}, question {turn}: what are your opening hours?"), order))
    dt = time.perf_counter() - t
    n = len(users) * args.turns
    return {
        "seconds": dt,
        "requests": n,
        "requests_per_s": n / dt,
        "output_tok_s": totals["out"] / dt,
        "prompt_tokens": totals["prompt"],
        "cached_tokens": totals["cached"],
        "cache_hit_rate": totals["cached"] / max(1, totals["prompt"]),
        "requests_per_replica": per_replica,
    }


def run_router(args) -> dict:
    import requests

    tmp = tempfile.mkdtemp(prefix="bench-router-")
    ports = [free_port() for _ in range(args.replicas)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    replicas = [
        start(
            [
                "-m",
                "plait.runtime.server",
                "--port",
                str(p),
                "--num-threads",
                str(args.num_threads),
                "--max-total-tokens",
                str(args.replica_kv_tokens),
            ],
            f"{tmp}/replica{i}.log",
        )
        for i, p in enumerate(ports)
    ]
    result = {
        "bench": "parallel-router-cpu",
        "model": "SmolLM2-135M-Instruct (float32)",
        "replicas": args.replicas,
        "tenants": args.tenants,
        "users_per_tenant": args.users,
        "turns": args.turns,
        "system_words": args.system_words,
        "output_len": args.output_len,
        "concurrency": args.concurrency,
        "replica_kv_tokens": args.replica_kv_tokens,
        "policies": {},
    }
    try:
        wait_healthy(urls, replicas)
        for policy in ("cache_aware", "round_robin"):
            port = free_port()
            router_url = f"http://127.0.0.1:{port}"
            router = start(
                ["-m", "plait.runtime.router", "--worker-urls", *urls, "--port", str(port), "--policy", policy],
                f"{tmp}/router_{policy}.log",
            )
            try:
                wait_healthy([router_url], [router])
                requests.post(router_url + "/flush_cache", timeout=60).raise_for_status()
                r = run_tenants(router_url, args)
            finally:
                router.terminate()
                router.wait(timeout=30)
            result["policies"][policy] = r
            print(
                f"{policy:12s} {r['requests']} requests in {r['seconds']:.1f} s: {r['requests_per_s']:.2f} req/s, "
                f"{r['output_tok_s']:.1f} out tok/s, cache hit rate {r['cache_hit_rate']:.1%} "
                f"(per replica: {sorted(r['requests_per_replica'].values())})"
            )
    finally:
        for proc in replicas:
            proc.terminate()
        for proc in replicas:
            proc.wait(timeout=60)
    ca, rr = result["policies"]["cache_aware"], result["policies"]["round_robin"]
    result["throughput_ratio"] = ca["output_tok_s"] / rr["output_tok_s"]
    print(
        f"cache-aware / round-robin: {result['throughput_ratio']:.2f}x throughput, cache hits "
        f"{ca['cache_hit_rate']:.1%} vs {rr['cache_hit_rate']:.1%}"
    )
    return result


# ---------------------------------------------------------------------------------------------- GPU
def run_gpu(args) -> dict:
    """TP = 1 / TP = 2 and DP = 1 / DP = 2 through bench_offline's GPU path, back to back."""
    import bench_offline

    configs = {"TP=1": [], "TP=2": ["tp_size=2"], "DP=2": ["dp_size=2"]}
    out = {"bench": "parallel-gpu", "model": args.model, "workloads": args.workload, "configs": {}}
    for name, engine_args in configs.items():
        ns = argparse.Namespace(
            model=args.model,
            workload=args.workload,
            max_running_requests=None,
            attention_backend="auto",
            disable_cuda_graph=False,
            skip_transformers=True,
            engine_arg=engine_args + args.engine_arg,
            hf_batch_size=64,
        )
        print(f"---- {name}")
        out["configs"][name] = {r["bench"].removeprefix("offline-gpu-"): r for r in bench_offline.run_gpu(ns)}
    one, tp2, dp2 = (out["configs"][k] for k in ("TP=1", "TP=2", "DP=2"))
    if "single" in args.workload:
        step = {k: _decode_step_ms(c["single"]) for k, c in (("TP=1", one), ("TP=2", tp2))}
        out["tp2_single_step_ratio"] = step["TP=2"] / step["TP=1"]
        print(
            f"batch-1 decode step: TP=1 {step['TP=1']:.3f} ms, TP=2 {step['TP=2']:.3f} ms: "
            f"{out['tp2_single_step_ratio']:.3f}x (target <= {TP2_SINGLE_TARGET})"
        )
    if "offline" in args.workload:
        out["dp2_offline_ratio"] = dp2["offline"]["plait"]["output_tok_s"] / one["offline"]["plait"]["output_tok_s"]
        print(f"offline: DP=2 / DP=1 {out['dp2_offline_ratio']:.2f}x (target >= {DP2_OFFLINE_TARGET})")
    for w in args.workload:
        print(
            f"{w:8s} out tok/s: "
            + ", ".join(f"{k} {c[w]['plait']['output_tok_s']:.0f}" for k, c in out["configs"].items())
        )
    return out


def _decode_step_ms(result: dict) -> float:
    """Device time per decode step (CUDA events on rank 0; the wall time when the device was not timed)."""
    d = result["plait"]["steps"]["decode"]
    seconds = d["device_s"] if d["device_s"] else d["wall_s"]
    return 1e3 * seconds / max(1, d["steps"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GPU: a built-in dummy shape (llama-3.1-8b); default: the CPU parts")
    p.add_argument(
        "--workload", nargs="+", default=["single", "batch64", "offline"], choices=["single", "batch64", "offline"]
    )
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE", help="GPU: more Engine settings")
    p.add_argument("--part", choices=["split", "router", "both"], default="both", help="CPU: which part")
    p.add_argument("--num-threads", type=int, default=1, help="CPU torch threads per scheduler / rank")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-words", type=int, default=120)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--replicas", type=int, default=2, choices=[2, 3, 4])
    # NOTE: the tenants' system prompts (~12 x 400 tokens) fit one replica's KV cache only when each
    # replica holds about half of them: what cache-aware routing achieves and round-robin cannot.
    p.add_argument("--replica-kv-tokens", type=int, default=4096)
    p.add_argument("--tenants", type=int, default=12)
    p.add_argument("--users", type=int, default=2, help="per tenant")
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--system-words", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=4)
    args = p.parse_args()
    if args.model is not None:
        save(f"bench_parallel_gpu_{args.model}", run_gpu(args))
        return
    if args.part in ("split", "both"):
        save("bench_parallel_split_cpu", run_split(args))
    if args.part in ("router", "both"):
        args.output_len = min(args.output_len, 8)  # prefill-heavy, as a chat service with long system prompts
        save("bench_parallel_router_cpu", run_router(args))


if __name__ == "__main__":
    main()
