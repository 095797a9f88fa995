"""Offline throughput: the plait Engine against transformers `generate`, measured in one run.

CPU (default when there is no GPU): the embedded default model (SmolLM2-135M-Instruct, in each `--precision`:
the engine's default, float32, bfloat16, int8, int4, bf16-int8; interleaved over `--rounds`);
32 prompts of 8-400 words; 64 new tokens each (EOS ignored so both sides produce exactly as many);
transformers runs the same prompts batched with left padding; with `--llamacpp-python`, llama.cpp runs them on the
GGUF the model ships in (engine/llamacpp_peer.py).

GPU: dummy weights at a real shape (`--model llama-3.2-1b` / `llama-3.1-8b`) on the fixed workloads
of shared/bench/workload.py (`--workload offline|batch64|single`), against transformers `generate`
on a static batch of the same shape, and against a memory-bandwidth roofline measured in the same run.

    python benchmarks/engine/bench_offline.py                       # CPU, default model
    python benchmarks/engine/bench_offline.py --precision float32 --precision bfloat16 --precision int8 --rounds 2
    python benchmarks/engine/bench_offline.py --model llama-3.1-8b --workload offline
    python benchmarks/engine/bench_offline.py --model llama-3.1-8b --workload offline batch64 single \
        --quantization fp8 --skip-transformers
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: bench_common

from bench_common import format_breakdown, load_workload_module, parse_engine_args, save, step_breakdown  # noqa: E402
from gpu_ceilings import copy_bandwidth, matmul_flops  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
WORDS = (
    "the of and to in is was he for it with as his on be at by had are but from or have an they which "
    "one you were all her she there would their we him been has when who will more no if out so said what "
    "up its about into than them can only other new some could time these two may then do first any my now "
    "such like our over man me even most made after also did many before must through back years where much "
    "your way well down should because each just those people how too little state good very make world still "
    "own see men work long get here between both life being under never day same another know while last"
).split()


def cpu_prompts(n: int = 32, seed: int = 0, max_words: int = 400) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, max_words))) for _ in range(n)]


# ---------------------------------------------------------------------------------------------- CPU
def run_cpu(args) -> dict:
    from plait.runtime import Engine
    from plait.runtime.models.default_model import default_model_path
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    prompts = cpu_prompts(args.num_prompts)
    ids = [tok.encode(p) for p in prompts]
    n_out = args.output_len
    precisions = args.precision or ["default"]
    result = {
        "bench": "offline-cpu",
        "model": "SmolLM2-135M-Instruct",
        "num_prompts": len(ids),
        "input_tokens": sum(map(len, ids)),
        "output_len": n_out,
        "torch_threads": torch.get_num_threads(),
        "cpu": cpu_name(),
    }

    # Each precision once per round, the rounds interleaved, so a machine's load drifting (shared cores)
    # touches every precision alike; each one's best round is reported.
    runs: dict[str, list[dict]] = {p: [] for p in precisions}
    for _ in range(args.rounds):
        for precision in precisions:
            with Engine(model_path=path, **PRECISIONS[precision]) as eng:
                info = eng.get_server_info()
                eng.generate(input_ids=ids[:2], sampling_params={"max_new_tokens": 4, "temperature": 0})  # warm-up
                eng.flush_cache()
                t = time.perf_counter()
                outs = eng.generate(
                    input_ids=ids, sampling_params={"max_new_tokens": n_out, "temperature": 0, "ignore_eos": True}
                )
                dt = time.perf_counter() - t
            got = sum(len(o["output_ids"]) for o in outs)
            runs[precision].append({"seconds": dt, "output_tokens": got, "output_tok_s": got / dt})
            print(
                f"plait {precision:<10} ({info['dtype']}, {info['quantization']}) {got} tokens in {dt:.1f} s: "
                f"{got / dt:.1f} output tok/s"
            )
    result["cpu_features"] = info["cpu_features"]
    result["plait_by_precision"] = {p: max(r, key=lambda x: x["output_tok_s"]) for p, r in runs.items()}
    result["plait"] = result["plait_by_precision"][precisions[0]]

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    tok.padding_side = "left"
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    batch = torch.full((len(ids), max(map(len, ids))), pad)
    mask = torch.zeros_like(batch)
    for i, x in enumerate(ids):
        batch[i, -len(x) :] = torch.tensor(x)
        mask[i, -len(x) :] = 1
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            batch, attention_mask=mask, max_new_tokens=n_out, min_new_tokens=n_out, do_sample=False, pad_token_id=pad
        )
    dt = time.perf_counter() - t
    got = (out.shape[1] - batch.shape[1]) * len(ids)
    result["transformers"] = {"seconds": dt, "output_tokens": got, "output_tok_s": got / dt}
    print(f"transformers {got} tokens in {dt:.1f} s: {got / dt:.1f} output tok/s")
    result["speedup"] = result["plait"]["output_tok_s"] / result["transformers"]["output_tok_s"]
    for precision, best in result["plait_by_precision"].items():
        best["speedup"] = best["output_tok_s"] / result["transformers"]["output_tok_s"]
        print(f"plait {precision} / transformers (float32): {best['speedup']:.2f}x")
    if args.llamacpp_python:
        result["llama.cpp"] = run_llamacpp(args.llamacpp_python, ids, n_out)
        for precision, best in result["plait_by_precision"].items():
            best["vs_llamacpp"] = best["output_tok_s"] / result["llama.cpp"]["output_tok_s"]
            print(f"plait {precision} / llama.cpp (Q4_1): {best['vs_llamacpp']:.2f}x")
    return result


def run_llamacpp(python: str, ids: list[list[int]], n_out: int) -> dict:
    """llama.cpp on the default model's own GGUF, the same token ids (engine/llamacpp_peer.py, in `python`)."""
    import subprocess
    import tempfile

    from plait.runtime.models.default_model import gguf_path

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(ids, f)
    peer = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llamacpp_peer.py")
    cmd = [python, peer, "--gguf", gguf_path(), "--ids", f.name, "--output-len", str(n_out)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    os.unlink(f.name)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"llama.cpp {res['output_tokens']} tokens in {res['seconds']:.1f} s: {res['output_tok_s']:.1f} output tok/s")
    return res


# --precision: the Engine's settings for each name (runtime/quant/ for int8 / int4). "default" is dtype auto
# (bfloat16 on an AMX CPU, else float32); int8 / int4 keep float32 around their weights, as measured so far.
PRECISIONS = {
    "default": {},
    "float32": {"dtype": "float32"},
    "bfloat16": {"dtype": "bfloat16"},
    "int8": {"dtype": "float32", "quantization": "int8"},
    "int4": {"dtype": "float32", "quantization": "int4"},
    "bf16-int8": {"dtype": "bfloat16", "quantization": "int8"},
}


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (benchmarks/RESULTS.md names the machine of each row)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"


# ---------------------------------------------------------------------------------------------- GPU
def load_workload(name: str):
    return load_workload_module().make(name)


def roofline_seconds(
    reqs, weight_bytes: int, kv_bytes_per_token: int, bw: float, max_bs: int, n_params: int = 0, flops: float = 0.0
) -> float:
    """A lower bound: prefill is compute (2 x params FLOP per prompt token at the measured matmul rate);
    each decode step reads all weights once and every generated token reads its KV."""
    n_out = [o for _, o in reqs]
    steps = max(max(n_out), -(-sum(n_out) // max_bs))
    kv = sum(sum(len(i) + t for t in range(o)) for i, o in reqs) * kv_bytes_per_token
    prefill = 2 * n_params * sum(len(i) for i, _ in reqs) / flops if flops else 0.0
    return (steps * weight_bytes + kv) / bw + prefill


def run_gpu(args) -> list[dict]:
    """Each workload of --workload in turn on one Engine; one result dict per workload."""
    from plait.runtime import Engine
    from plait.runtime.kvcache.memory_pool import KVPool
    from plait.runtime.models.config import BUILTIN_SHAPES, ModelConfig

    cfg = ModelConfig.from_dict(BUILTIN_SHAPES[args.model])
    embed_params = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    linear_params = cfg.num_hidden_layers * (
        cfg.hidden_size * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
        + cfg.num_attention_heads * cfg.head_dim * cfg.hidden_size
        + 3 * cfg.hidden_size * cfg.intermediate_size
    )
    n_params = embed_params + linear_params
    # FP8 weights: one byte per weight of the layers' matrices; the embedding and the LM head stay bf16.
    weight_bytes = 2 * embed_params + (1 if args.quantization == "fp8" else 2) * linear_params
    kv_tok = KVPool.bytes_per_token(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, torch.bfloat16)
    bw, flops = copy_bandwidth(), matmul_flops()
    engine_args = parse_engine_args(args.engine_arg)
    results = []
    with Engine(
        model_path=args.model,
        load_format="dummy",
        max_running_requests=args.max_running_requests,
        disable_cuda_graph=args.disable_cuda_graph,
        attention_backend=args.attention_backend,
        enable_step_timing=True,
        quantization=args.quantization,
        **engine_args,
    ) as eng:
        eng.generate(
            input_ids=[[100 + i] * (16 + i) for i in range(4)],
            sampling_params={"max_new_tokens": 8, "ignore_eos": True, "temperature": 0},
        )
        for workload in args.workload:
            reqs = load_workload(workload)
            result = {
                "bench": f"offline-gpu-{workload}",
                "model": args.model,
                "gpu": torch.cuda.get_device_name(),
                "quantization": args.quantization or "none",
                "requests": len(reqs),
                "input_tokens": sum(len(i) for i, _ in reqs),
                "output_tokens": sum(o for _, o in reqs),
                "copy_bandwidth_GBps": bw / 1e9,
                "matmul_TFLOPs": flops / 1e12,
            }
            print(json.dumps(result))
            eng.flush_cache()
            before = eng.get_stats()
            t = time.perf_counter()
            outs = eng.generate(
                input_ids=[r[0] for r in reqs],
                sampling_params=[{"max_new_tokens": o, "ignore_eos": True, "temperature": 0} for _, o in reqs],
            )
            dt = time.perf_counter() - t
            info = eng.get_server_info()
            steps = step_breakdown(before, info, dt)
            print(format_breakdown(steps))
            out_toks = sum(len(o["output_ids"]) for o in outs)
            exact = all(len(o["output_ids"]) == n for o, (_, n) in zip(outs, reqs))
            max_bs = info["max_running_requests"]  # the engine's resolved value
            lb = roofline_seconds(reqs, weight_bytes, kv_tok, bw, max_bs, n_params, flops)
            result["plait"] = {
                "seconds": dt,
                "output_tok_s": out_toks / dt,
                "total_tok_s": (out_toks + result["input_tokens"]) / dt,
                "exact_lengths": exact,
                "max_total_tokens": info.get("max_total_tokens"),
                "retractions": info.get("num_retractions"),
                "steps": steps,
                "max_running_requests": max_bs,
                "engine_args": engine_args,
                "kernel_compiles": info.get("kernel_compiles_after_startup", 0)
                - before.get("kernel_compiles_after_startup", 0),
            }
            result["roofline"] = {"seconds": lb, "output_tok_s": out_toks / lb, "plait_fraction": lb / dt}
            print(
                f"plait {workload}: {out_toks / dt:.0f} out tok/s, {(out_toks + result['input_tokens']) / dt:.0f} "
                f"total tok/s ({dt:.2f} s); roofline {out_toks / lb:.0f} out tok/s; exact lengths: {exact}; "
                f"kernels compiled during the run: {result['plait']['kernel_compiles']}"
            )
            results.append(result)
    if not args.skip_transformers:
        hf = run_transformers_gpu(cfg, args)
        for r in results:
            r["transformers"] = hf
    return results


def run_transformers_gpu(cfg, args) -> dict:
    """transformers generate on a static batch (input 512, output 128) at the same shape."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    raw = {k: v for k, v in cfg.raw.items() if k != "architectures"}
    hf_cfg = LlamaConfig(**raw)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(hf_cfg, torch_dtype=torch.bfloat16).eval()
    bs, n_in, n_out = args.hf_batch_size, 512, 128
    ids = torch.randint(100, 30000, (bs, n_in), device="cuda")
    with torch.no_grad():
        model.generate(ids[:, :16], max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n_out,
            min_new_tokens=n_out,
            do_sample=False,
            pad_token_id=0,
        )
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
    res = {"batch_size": bs, "input_len": n_in, "output_len": n_out, "seconds": dt, "output_tok_s": bs * n_out / dt}
    print(f"transformers generate bs={bs} in {n_in} out {n_out}: {bs * n_out / dt:.0f} out tok/s")
    del model
    torch.cuda.empty_cache()
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="built-in dummy shape (GPU); default: the embedded model on CPU")
    p.add_argument(
        "--workload",
        nargs="+",
        default=["offline"],
        choices=["offline", "batch64", "single"],
        help="GPU: one or more of the shared workloads, run in turn on one engine",
    )
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-running-requests", type=int, default=None, help="default: the engine's choice")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other ServerArgs field for the Engine (GPU), e.g. --engine-arg chunked_prefill_size=4096",
    )
    p.add_argument(
        "--quantization",
        choices=["fp8"],
        default=None,
        help="GPU: the Engine's weights (fp8: FP8 weights quantized at load; default: bf16); transformers stays bf16",
    )
    p.add_argument("--hf-batch-size", type=int, default=64)
    p.add_argument(
        "--precision",
        action="append",
        choices=sorted(PRECISIONS),
        help="CPU: the Engine's weight precision, repeatable (each measured; the first one is `plait`)",
    )
    p.add_argument("--rounds", type=int, default=1, help="CPU: rounds over the precisions, interleaved")
    p.add_argument(
        "--llamacpp-python",
        default=None,
        help="CPU: a Python with llama-cpp-python: llama.cpp on the default model's GGUF too (engine/llamacpp_peer.py)",
    )
    args = p.parse_args()
    if args.model is None:
        res = run_cpu(args)
        save("bench_offline_cpu", res)
    else:
        for res in run_gpu(args):
            suffix = f"_{args.quantization}" if args.quantization else ""
            save(f"bench_offline_{args.model}_{res['bench'].removeprefix('offline-gpu-')}{suffix}", res)


if __name__ == "__main__":
    main()
