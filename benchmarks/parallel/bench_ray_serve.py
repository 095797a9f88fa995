"""plait on Ray Serve (runtime/integrations/ray_serve.py) against `plait router`, on the CPU, on the same
multi-tenant shared-prefix workload as `bench_parallel.py --part router` (tenants with long system prompts,
several users each, two turns per user, through /generate):

- `plait router` over 2 `plait serve` processes, cache-aware and round-robin (bench_parallel's run, as is);
- Ray Serve, on a local cluster: 1 replica, 2 replicas with plait's prefix-aware request router, 2 replicas
  round-robin (each a fresh application, so every run starts with empty caches).

Reported per run: requests/s, output tokens/s and the replicas' cache hit rate (cached / prompt tokens,
from each response's meta_info), and how the requests spread over replicas.

    python benchmarks/parallel/bench_ray_serve.py
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

from bench_common import save  # noqa: E402
from bench_parallel import free_port, run_router, run_tenants  # noqa: E402

RAY_CONFIGS = (("1 replica", 1, "cache_aware"), ("2 replicas, prefix-aware", 2, "cache_aware"))
RAY_CONFIGS += (("2 replicas, round-robin", 2, "round_robin"),)


def run_ray(args) -> dict:
    import ray
    from plait.runtime.integrations.ray_serve import build_app
    from ray import serve

    ray.init(num_cpus=2, object_store_memory=80 << 20, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    engine_kwargs = {"num_threads": args.num_threads, "max_total_tokens": args.replica_kv_tokens}
    runs = {}
    try:
        for name, replicas, policy in RAY_CONFIGS:
            t = time.perf_counter()
            app = build_app(engine_kwargs, num_replicas=replicas, policy=policy, replica_cpus=0.5)
            serve.run(app, name="plait", route_prefix="/")
            start_s = time.perf_counter() - t
            r = run_tenants(f"http://127.0.0.1:{port}", args)
            r["start_s"] = start_s
            runs[name] = r
            serve.delete("plait")
            print(
                f"ray serve, {name:26s} {r['requests']} requests in {r['seconds']:.1f} s: {r['requests_per_s']:.2f} "
                f"req/s, {r['output_tok_s']:.1f} out tok/s, cache hit rate {r['cache_hit_rate']:.1%} "
                f"(per replica: {sorted(r['requests_per_replica'].values())})"
            )
    finally:
        serve.shutdown()
        ray.shutdown()
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["router", "ray", "both"], default="both")
    p.add_argument("--num-threads", type=int, default=1, help="CPU torch threads per replica's scheduler")
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--replica-kv-tokens", type=int, default=4096)
    p.add_argument("--tenants", type=int, default=12)
    p.add_argument("--users", type=int, default=2, help="per tenant")
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--system-words", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=4)
    args = p.parse_args()
    args.replicas = 2
    result = {
        "bench": "ray-serve-cpu",
        "model": "SmolLM2-135M-Instruct (float32)",
        "workload": {k: getattr(args, k) for k in ("tenants", "users", "turns", "system_words", "output_len")},
        "concurrency": args.concurrency,
        "replica_kv_tokens": args.replica_kv_tokens,
    }
    if args.part in ("router", "both"):
        result["plait_router"] = run_router(args)["policies"]
    if args.part in ("ray", "both"):
        result["ray_serve"] = run_ray(args)
    save("bench_ray_serve_cpu", result)


if __name__ == "__main__":
    main()
