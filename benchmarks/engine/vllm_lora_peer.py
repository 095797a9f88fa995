"""vLLM's side of the LoRA benchmark (issue 36): bench_lora.py's workload through vLLM's offline `LLM`, on the GPU
machine where vLLM is staged (the lead's .shared/bench/vllm/README.md: `PYTHONPATH=$HOME/site python3 ...`),
run right after bench_lora.py on the same machine.

The same cells as bench_lora.py: the base model alone (an engine without LoRA), then batch 1 / 32 / 128 with
1 / 8 / 64 distinct rank-16 adapters on every projection (request i uses adapter i mod n), the 8B shape with
dummy weights, token-id prompts, greedy, exact output lengths. The adapters are the same random PEFT folders
(lora_folders.py: same seeds, same weights), written here on the GPU machine; each engine runs in a process of
its own (vLLM frees a GPU's memory when its process ends). vLLM's settings: its defaults except LoRA on with
`max_loras` = the most adapters in a cell (plait's max_loras_per_batch), `max_lora_rank` = the adapters' rank,
every adapter in its host cache (`max_cpu_loras`, as plait keeps every loaded adapter in host memory) and
used once before timing; dummy weights, bf16, no tokenizer, max_model_len 2048, gpu_memory_utilization 0.88.

    PYTHONPATH=$HOME/site python3 benchmarks/engine/vllm_lora_peer.py     # 8B, batches 1 32 128 x 1 8 64
    PYTHONPATH=$HOME/site python3 benchmarks/engine/vllm_lora_peer.py --batches 32 --adapters 8

Prints tok/s per cell beside the base model's and saves $OUT/vllm_lora_peer.json (bench_lora.json's rows).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: bench_common

from bench_common import save  # noqa: E402
from lora_folders import builtin_shape, write_adapters  # noqa: E402

RESULT = "RESULT "  # the line prefix a part's results come back to the parent under


def prompts_of(batch: int, prompt_len: int) -> list[list[int]]:
    """bench_lora.py's prompts: distinct token ids per request."""
    return [[(7 * i + j) % 1000 + 10 for j in range(prompt_len)] for i in range(batch)]


def write_model(folder: str, shape: dict) -> str:
    """A config.json of plait's built-in `shape` for vLLM's dummy weights."""
    config = dict(
        shape,
        model_type="llama",
        torch_dtype="bfloat16",
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
    )
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return folder


# ------------------------------------------------------------------ one engine (a child process)
def run_part(args) -> None:
    """One engine's cells: `--part base` (no LoRA) or `lora`; one RESULT line each (and the settings')."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    lora = args.part == "lora"
    most = max(args.adapters)
    extra = dict(enable_lora=True, max_loras=most, max_lora_rank=args.rank, max_cpu_loras=most) if lora else {}
    start = time.perf_counter()
    llm = LLM(
        model=os.path.join(args.work_dir, "model"),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        seed=0,
        tensor_parallel_size=args.tp,
        **extra,
    )
    settings = dict(vllm=vllm.__version__, startup_s=round(time.perf_counter() - start, 1), **extra)
    print(RESULT + json.dumps({"settings": settings}), flush=True)
    # LoRARequest ids start at 1 (vLLM's 0 is no adapter); one object per adapter, reused by every cell.
    adapters = [LoRARequest(f"a{i}", i + 1, os.path.join(args.work_dir, f"a{i}")) for i in range(most)] if lora else []

    def generate(prompts, new_tokens, requests):
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, detokenize=False)
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=requests, use_tqdm=False)
        return time.perf_counter() - t, sum(len(o.outputs[0].token_ids) for o in outs)

    if lora:  # every adapter read into vLLM's host cache once (plait's are in host memory from its start)
        generate(prompts_of(most, 16), 2, adapters)
    for batch in args.batches:
        counts = sorted({min(n, batch) for n in args.adapters}) if lora else [0]  # no more adapters than requests
        for n in counts:
            prompts = prompts_of(batch, args.prompt_len)
            requests = [adapters[i % n] for i in range(batch)] if n else None
            generate(prompts[:1], 2, requests[:1] if requests else None)  # warm, as bench_lora.py
            llm.reset_prefix_cache()
            seconds, tokens = generate(prompts, args.new_tokens, requests)
            exact = tokens == batch * args.new_tokens
            cell = dict(batch=batch, adapters=n, tok_s=tokens / seconds, seconds=round(seconds, 3), exact_lengths=exact)
            print(RESULT + json.dumps(cell), flush=True)


def run_child(args, part: str) -> list[dict]:
    """`part` in a process of its own (this script again): its RESULT lines, parsed."""
    argv = [sys.executable, os.path.abspath(__file__), "--part", part, "--work-dir", args.work_dir]
    for name in ("batches", "adapters"):
        argv += [f"--{name}", *map(str, getattr(args, name))]
    for name in ("model", "rank", "prompt_len", "new_tokens", "tp", "max_model_len", "gpu_memory_utilization"):
        argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    results = []
    with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) as proc:
        for line in proc.stdout:  # passed through as it comes (vLLM logs to stdout too)
            print(line, end="", flush=True)
            if line.startswith(RESULT):
                results.append(json.loads(line[len(RESULT) :]))
    if proc.returncode != 0:
        raise SystemExit(f"vLLM's {part} engine failed (exit {proc.returncode}): its output is above")
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.1-8b", help="one of plait's built-in shapes (models/config.py)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--adapters", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--tp", type=int, default=1, help="vLLM's tensor_parallel_size")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.88)
    p.add_argument("--part", choices=["base", "lora"], help=argparse.SUPPRESS)  # a child process's engine
    p.add_argument("--work-dir", help=argparse.SUPPRESS)  # the model config and adapters the parent wrote
    args = p.parse_args()
    if args.part is not None:
        run_part(args)
        return
    shape = builtin_shape(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        args.work_dir = tmp
        write_model(os.path.join(tmp, "model"), shape)
        start = time.perf_counter()
        write_adapters(tmp, shape, args.rank, max(args.adapters))
        print(f"wrote {max(args.adapters)} adapters in {time.perf_counter() - start:.0f} s", flush=True)
        base_results = run_child(args, "base")
        lora_results = run_child(args, "lora")
    settings = {
        part: r["settings"]
        for part, results in (("base", base_results), ("lora", lora_results))
        for r in results
        if "settings" in r
    }
    base = {r["batch"]: r["tok_s"] for r in base_results if "batch" in r}
    rows = [dict(r, base_tok_s=base[r["batch"]]) for r in lora_results if "batch" in r]
    what = f"{args.model} dummy weights, rank {args.rank} on all projections, {args.new_tokens} new tokens"
    print(f"vLLM {settings['lora']['vllm']}: {what}")
    print(f"{'batch':>6} {'adapters':>9} {'base tok/s':>11} {'LoRA tok/s':>11} {'x base':>7}")
    for r in rows:
        ratio = r["tok_s"] / r["base_tok_s"]
        print(f"{r['batch']:>6} {r['adapters']:>9} {r['base_tok_s']:>11.1f} {r['tok_s']:>11.1f} {ratio:>7.2f}")
    if not all(r["exact_lengths"] for r in base_results + lora_results if "batch" in r):
        print("WARNING: some requests did not generate exactly --new-tokens tokens")
    save(
        "vllm_lora_peer",
        {"model": args.model, "rank": args.rank, "engine": "vllm", "settings": settings, "base": base, "rows": rows},
    )


if __name__ == "__main__":
    main()
