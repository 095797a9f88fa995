"""Multi-turn chat whose working set is several times the device KV pool: the hierarchical cache (a host
tier under the radix cache, issue 33) off vs on, back to back in one run.

The workload is multiturn_workload.py's (shared with vLLM's side, vllm_multiturn_peer.py): between two
turns of a conversation every other conversation runs, so the prefixes it left are long gone from a device
pool sized at 1/`--pool-factor` of the working set (the last round's histories), unless a host tier kept them.

Reported per setting: seconds, throughput (prompt + output tokens/s, output tokens/s), TTFT (meta_info
`ttft`: from the request's arrival to its first token) mean / p50 / p99, the prompt tokens served from
cache by tier (meta_info `cached_tokens_details`), the host tier's traffic (get_stats `hicache_*`),
retractions, integrity, and whether the two settings gave the same tokens.

GPU (dummy weights at a real shape, the pool capped to a quarter of the working set):
    python benchmarks/engine/bench_multiturn.py --model llama-3.1-8b
CPU (a tiny random Llama, a small workload: checks it end to end):
    python benchmarks/engine/bench_multiturn.py
vLLM beside it, on the same GPU machine (its native CPU offloading sized as the host tier):
    PYTHONPATH=$HOME/site python3 benchmarks/engine/vllm_multiturn_peer.py
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: bench_common
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # engine/: bench_rounds (the engine flags)

from bench_common import git_commit, parse_engine_args, save  # noqa: E402
from bench_rounds import engine_kwargs_for  # noqa: E402
from multiturn_workload import (  # noqa: E402
    add_arguments,
    check_arguments,
    describe,
    make_conversations,
    make_turns,
    pauses,
    summarize,
    working_set,
)


def run_setting(args, engine_kwargs: dict, hicache: bool) -> dict:
    from plait.runtime import Engine

    label = "on" if hicache else "off"
    tier: dict = {}
    if hicache:
        tier = dict(
            enable_hierarchical_cache=True, hicache_ratio=args.hicache_ratio, hicache_write_policy=args.write_policy
        )
    with Engine(**engine_kwargs, **tier) as eng:
        # Warm-up: a small conversation set of another seed, then a cold cache.
        warm_histories = make_conversations(min(4, args.conversations), args.first_tokens, seed=1)
        eng.generate(input_ids=warm_histories, sampling_params={"max_new_tokens": 4, "temperature": 0})
        if not eng.flush_cache():
            raise RuntimeError("flush_cache refused: the engine is not idle")
        before = eng.get_stats()
        histories = make_conversations(args.conversations, args.first_tokens, seed=0)
        turns = make_turns(args.conversations, args.rounds, args.turn_tokens)
        outputs: dict[tuple[int, int], list[int]] = {}
        metas: list[dict] = []
        lock = threading.Lock()
        params = {"max_new_tokens": args.output_tokens, "temperature": 0, "ignore_eos": True}

        def user(u: int) -> None:
            mine = list(range(u, args.conversations, args.users))
            wait = pauses(args, u)
            for r in range(args.rounds):
                for c in mine:
                    time.sleep(next(wait))
                    out = eng.generate(input_ids=histories[c], sampling_params=params)
                    with lock:
                        outputs[(c, r)] = out["output_ids"]
                        metas.append({**out["meta_info"], "round": r})
                    histories[c] = histories[c] + out["output_ids"] + turns[c][r]

        t0 = time.perf_counter()
        threads = [threading.Thread(target=user, args=(u,)) for u in range(args.users)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - t0
        after = eng.get_stats()
        integrity = eng.check_integrity()
        max_total_tokens = eng.get_server_info().get("max_total_tokens")
    res = summarize(seconds, metas)
    res.update(
        retractions=after["num_retractions"] - before["num_retractions"],
        integrity_ok=integrity,
        max_total_tokens=max_total_tokens,
        hicache={k: v for k, v in after.items() if k.startswith("hicache_")},
        steps=after.get("steps"),  # the steps by kind, with device time under enable_step_timing
        exact_lengths=all(len(o) == args.output_tokens for o in outputs.values()),
    )
    print(f"{describe('hicache ' + label, res)}  retractions {res['retractions']}  integrity {integrity}", flush=True)
    print("  TTFT mean by round (ms): " + " ".join(f"{t:.0f}" for t in res["ttft_mean_by_round_ms"]), flush=True)
    return {"result": res, "outputs": outputs}


def main() -> None:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.1-8b" if cuda else "tiny", help="as bench_rounds.py's --model")
    p.add_argument("--load-format", default="dummy", choices=["dummy", "auto"], help="for a model folder")
    add_arguments(p, cuda)
    p.add_argument("--write-policy", default="write_through", choices=["write_through", "write_back"])
    p.add_argument("--max-running-requests", type=int, default=None, help="default: --users")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--num-threads", type=int, default=None if cuda else 1, help="CPU threads of the scheduler")
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE", help="any other ServerArgs field")
    p.add_argument("--skip-off", action="store_true", help="only run with the host tier on")
    args = p.parse_args()
    check_arguments(p, args)
    args.max_running_requests = args.max_running_requests or args.users
    ws = working_set(args)
    pool = args.max_total_tokens or int(ws / args.pool_factor)
    with tempfile.TemporaryDirectory(prefix="bench_multiturn_") as tmp:
        engine_kwargs, label = engine_kwargs_for(args, tmp)
        engine_kwargs.update(max_total_tokens=pool, **parse_engine_args(args.engine_arg))
        config = {k: v for k, v in vars(args).items() if k not in ("engine_arg",)}
        result = {
            "bench": "multiturn",
            "model": label,
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "date": time.strftime("%Y-%m-%d"),
            "commit": git_commit(),
            "config": config,
            "working_set_tokens": ws,
            "pool_tokens": pool,
            "engine_args": {k: v for k, v in engine_kwargs.items() if k != "model_path"},
        }
        print(f"{label}: working set {ws} tokens, device pool {pool} tokens ({ws / pool:.1f}x)", flush=True)
        runs = {}
        if not args.skip_off:
            runs["off"] = run_setting(args, engine_kwargs, hicache=False)
        runs["on"] = run_setting(args, engine_kwargs, hicache=True)
    for k, v in runs.items():
        result[k] = v["result"]
    if "off" in runs:
        on, off = result["on"], result["off"]
        result["summary"] = {
            "throughput_on_over_off": on["total_tok_s"] / off["total_tok_s"],
            "ttft_mean_on_over_off": on["ttft_mean_s"] / off["ttft_mean_s"],
            "same_outputs": runs["on"]["outputs"] == runs["off"]["outputs"],
        }
        s = result["summary"]
        print(
            f"throughput on/off {s['throughput_on_over_off']:.2f}x  mean TTFT on/off {s['ttft_mean_on_over_off']:.2f}  "
            f"same outputs {s['same_outputs']}"
        )
    save(f"bench_multiturn_{label}", result)


if __name__ == "__main__":
    main()
