"""vLLM's side of the multi-turn benchmark (issue 33): bench_multiturn.py's workload through vLLM's AsyncLLM,
on the GPU machine where vLLM is staged (the lead's .shared/bench/vllm/README.md), right after bench_multiturn.py:

    PYTHONPATH=$HOME/site python3 benchmarks/engine/vllm_multiturn_peer.py              # 8B, offloading on
    PYTHONPATH=$HOME/site python3 benchmarks/engine/vllm_multiturn_peer.py --settings offload prefix

The same conversations, rounds and users (multiturn_workload.py: the same token ids, the same order), the same
device pool (`num_gpu_blocks_override` = plait's max_total_tokens in vLLM's blocks) and the same number of running
requests (`max_num_seqs` = users). Settings, each in a process of its own (vLLM frees a GPU when its process ends):
- `offload`: vLLM's native CPU offloading (`kv_offloading_backend="native"`, `kv_offloading_size` = plait's host
  tier in GiB: hicache_ratio x the pool's bytes), prefix caching on;
- `prefix`: its prefix cache alone (what vLLM ships by default).
If this vLLM has no offloading arguments, `offload` says so and runs as `prefix`. Otherwise vLLM's defaults,
dummy weights, bf16, no tokenizer, greedy, exact output lengths. TTFT: from the call to the first output token
(plait's meta_info `ttft` runs from arrival to first token, in the same process). Cached: `num_cached_tokens`.

Prints a line per setting and saves $OUT/vllm_multiturn_peer.json (bench_multiturn.json's figures).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: bench_common

from bench_common import save  # noqa: E402
from lora_folders import builtin_shape  # noqa: E402
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

RESULT = "RESULT "  # the line prefix a child's results come back to the parent under


def write_model(folder: str, shape: dict) -> str:
    """A config.json of plait's built-in `shape` for vLLM's dummy weights."""
    config = dict(
        shape, model_type="llama", torch_dtype="bfloat16", hidden_act="silu", attention_bias=False, mlp_bias=False
    )
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return folder


def kv_bytes_per_token(shape: dict) -> int:
    """bf16 K and V of every layer for one token."""
    head_dim = shape.get("head_dim") or shape["hidden_size"] // shape["num_attention_heads"]
    return 2 * 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * head_dim


async def maybe_await(value):
    return await value if inspect.isawaitable(value) else value


# ------------------------------------------------------------------ one engine (a child process)
async def run_setting(args) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import vllm
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    shape = builtin_shape(args.model)
    pool = args.max_total_tokens or int(working_set(args) / args.pool_factor)
    block = 16
    kw = dict(
        model=args.model_dir,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=args.max_model_len,
        gpu_memory_utilization=0.88,
        seed=0,
        block_size=block,
        num_gpu_blocks_override=-(-pool // block),
        max_num_seqs=args.users,
        enable_prefix_caching=True,
    )
    host_gib = args.hicache_ratio * pool * kv_bytes_per_token(shape) / 2**30
    offload = args.part == "offload"
    if offload:
        try:
            engine_args = AsyncEngineArgs(**kw, kv_offloading_backend="native", kv_offloading_size=host_gib)
        except TypeError as e:  # this vLLM has no native offloading arguments
            print(f"vLLM {vllm.__version__} has no kv_offloading arguments ({e}): running its prefix cache alone")
            offload = False
            engine_args = AsyncEngineArgs(**kw)
    else:
        engine_args = AsyncEngineArgs(**kw)
    start = time.perf_counter()
    engine = AsyncLLM.from_engine_args(engine_args)
    settings = dict(
        vllm=vllm.__version__,
        setting=args.part,
        offloading=offload,
        offload_gib=round(host_gib, 2) if offload else 0,
        pool_tokens=pool,
        startup_s=round(time.perf_counter() - start, 1),
    )
    print(RESULT + json.dumps({"settings": settings}), flush=True)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True, detokenize=False)
    counter = [0]

    async def generate(ids: list[int]) -> tuple[list[int], dict]:
        counter[0] += 1
        t0 = time.perf_counter()
        ttft, final = None, None
        async for out in engine.generate({"prompt_token_ids": ids}, params, request_id=f"r{counter[0]}"):
            if ttft is None and out.outputs and out.outputs[0].token_ids:
                ttft = time.perf_counter() - t0
            final = out
        assert final is not None
        tokens = list(final.outputs[0].token_ids)
        meta = dict(
            ttft=ttft or time.perf_counter() - t0,
            prompt_tokens=len(ids),
            completion_tokens=len(tokens),
            cached_tokens=final.num_cached_tokens or 0,
        )
        return tokens, meta

    # Warm-up: a small conversation set of another seed (as plait's side), then a cold prefix cache.
    warm = make_conversations(min(4, args.conversations), args.first_tokens, seed=1)
    await asyncio.gather(*(generate(w) for w in warm))
    try:  # the offloaded copies too, where this vLLM can say so
        await maybe_await(engine.reset_prefix_cache(reset_connector=True))
    except TypeError:
        await maybe_await(engine.reset_prefix_cache())

    histories = make_conversations(args.conversations, args.first_tokens, seed=0)
    turns = make_turns(args.conversations, args.rounds, args.turn_tokens)
    metas: list[dict] = []
    exact = [True]

    async def user(u: int) -> None:
        mine = list(range(u, args.conversations, args.users))
        wait = pauses(args, u)
        for r in range(args.rounds):
            for c in mine:
                await asyncio.sleep(next(wait))
                tokens, meta = await generate(histories[c])
                metas.append({**meta, "round": r})
                exact[0] &= len(tokens) == args.output_tokens
                histories[c] = histories[c] + tokens + turns[c][r]

    t0 = time.perf_counter()
    await asyncio.gather(*(user(u) for u in range(args.users)))
    res = summarize(time.perf_counter() - t0, metas)
    res["exact_lengths"] = exact[0]
    print(RESULT + json.dumps({"result": res}), flush=True)
    engine.shutdown()


def run_child(args, setting: str) -> list[dict]:
    """`setting` in a process of its own (this script again): its RESULT lines, parsed."""
    argv = [sys.executable, os.path.abspath(__file__), "--part", setting, "--model-dir", args.model_dir]
    for name, value in vars(args).items():
        if name not in ("part", "model_dir", "settings") and value is not None:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    results = []
    with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:  # passed through as it comes (vLLM logs to stdout too)
            print(line, end="", flush=True)
            if line.startswith(RESULT):
                results.append(json.loads(line[len(RESULT) :]))
    if proc.returncode != 0:
        print(f"vLLM's {setting} engine failed (exit {proc.returncode}): its output is above", flush=True)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.1-8b", help="one of plait's built-in shapes (models/config.py)")
    add_arguments(p, cuda=True)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--settings", nargs="+", default=["offload"], choices=["offload", "prefix"])
    p.add_argument("--part", choices=["offload", "prefix"], help=argparse.SUPPRESS)  # a child's setting
    p.add_argument("--model-dir", help=argparse.SUPPRESS)  # the config the parent wrote
    args = p.parse_args()
    check_arguments(p, args)
    if args.part is not None:
        asyncio.run(run_setting(args))
        return
    ws = working_set(args)
    pool = args.max_total_tokens or int(ws / args.pool_factor)
    print(f"vLLM, {args.model}: working set {ws} tokens, device pool {pool} tokens ({ws / pool:.1f}x)", flush=True)
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        args.model_dir = write_model(os.path.join(tmp, "model"), builtin_shape(args.model))
        for setting in args.settings:
            results = run_child(args, setting)
            settings = next((r["settings"] for r in results if "settings" in r), None)
            result = next((r["result"] for r in results if "result" in r), None)
            if result is None and setting == "offload" and "prefix" not in args.settings:
                print("offloading failed: the prefix cache alone instead", flush=True)
                setting, results = "prefix", run_child(args, "prefix")
                settings = next((r["settings"] for r in results if "settings" in r), None)
                result = next((r["result"] for r in results if "result" in r), None)
            runs[setting] = {"settings": settings, "result": result}
    for setting, run in runs.items():
        if run["result"] is not None:
            print(describe(f"vllm {setting}", run["result"]) + f"  exact lengths {run['result']['exact_lengths']}")
    config = {k: v for k, v in vars(args).items() if k not in ("part", "model_dir")}
    save("vllm_multiturn_peer", {"engine": "vllm", "model": args.model, "config": config, "pool_tokens": pool, **runs})


if __name__ == "__main__":
    main()
