"""Many LoRA adapters on one base model (issue 36): output tok/s of a batch whose requests use 1, 8 or 64
distinct adapters (rank 16 on every projection: q, k, v, o, gate, up, down), against the base model alone
(an engine without LoRA), batch by batch, one engine after the other on one machine. Each cell runs twice: the
first run copies the batch's adapters into their device slots (the "first run" column: what an adapter's first
requests pay), the second is the figure.

Adapters are written as PEFT folders (random A and B) for the model's shape (lora_folders.py, which vLLM's side
of the comparison, vllm_lora_peer.py, writes its adapters with too); the model has dummy weights at a built-in
shape. GPU: the 8B shape; CPU: the 135M shape at small batches.

    python benchmarks/engine/bench_lora.py                                   # CPU: smollm2-135m, small
    python benchmarks/engine/bench_lora.py --model llama-3.1-8b --batches 1 32 128 --adapters 1 8 64
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: bench_common

from bench_common import save  # noqa: E402
from lora_folders import write_adapters  # noqa: E402
from plait.runtime import Engine  # noqa: E402
from plait.runtime.models.config import BUILTIN_SHAPES  # noqa: E402


def step_delta(before: dict, after: dict) -> dict:
    """The steps by kind (count, rows, tokens, device ms) between two `get_stats()["steps"]`."""
    out = {}
    for kind, t in (after or {}).items():
        if isinstance(t, dict) and "steps" in t and t["steps"] > before[kind]["steps"]:
            d = {k: t[k] - before[kind][k] for k in ("steps", "rows", "tokens", "device_s", "wall_s")}
            d["device_ms"], d["wall_ms"] = round(d.pop("device_s") * 1e3, 2), round(d.pop("wall_s") * 1e3, 2)
            out[kind] = d
    return out


def throughput(
    eng: Engine, batch: int, prompt_len: int, new_tokens: int, adapters: list, steps: Optional[list] = None
) -> tuple[float, float]:
    """Output tok/s of one batch (`adapters[i % len]` for request i; [None]: the base model): the first run,
    in which the batch's adapters are first copied into their device slots (cold), and a second (warm).
    `steps`: where the warm run's steps by kind are appended (device time under enable_step_timing)."""
    prompts = [[(7 * i + j) % 1000 + 10 for j in range(prompt_len)] for i in range(batch)]  # distinct prompts
    sp = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    lora = [adapters[i % len(adapters)] for i in range(batch)]
    eng.generate(input_ids=prompts[:1], sampling_params=dict(sp, max_new_tokens=2), lora_path=lora[:1])  # warm
    rates = []
    for _ in range(2):
        eng.flush_cache()
        before = eng.get_stats().get("steps") if steps is not None else None
        start = time.perf_counter()
        outs = eng.generate(input_ids=prompts, sampling_params=sp, lora_path=lora)
        rates.append(sum(len(o["output_ids"]) for o in outs) / (time.perf_counter() - start))
    if steps is not None:
        steps.append(step_delta(before, eng.get_stats().get("steps")))
    return rates[0], rates[1]


def main() -> None:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.1-8b" if cuda else "smollm2-135m", choices=sorted(BUILTIN_SHAPES))
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128] if cuda else [1, 8])
    p.add_argument("--adapters", type=int, nargs="+", default=[1, 8, 64] if cuda else [1, 8])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=256 if cuda else 32)
    p.add_argument("--new-tokens", type=int, default=128 if cuda else 16)
    p.add_argument("--step-timing", action="store_true", help="each warm run's steps by kind, with device time")
    args = p.parse_args()
    shape = BUILTIN_SHAPES[args.model]
    common = dict(model_path=args.model, load_format="dummy", max_running_requests=max(args.batches))
    if args.step_timing:
        common["enable_step_timing"] = True
    rows = []
    base_steps: dict[int, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        with Engine(**common) as eng:
            base = {}
            for b in args.batches:
                steps: Optional[list] = [] if args.step_timing else None
                base[b] = throughput(eng, b, args.prompt_len, args.new_tokens, [None], steps)[1]
                if steps:
                    base_steps[b] = steps[0]
        paths = write_adapters(tmp, shape, args.rank, max(args.adapters))
        lora_args = dict(
            lora_paths=[f"a{i}={path}" for i, path in enumerate(paths)],
            max_lora_rank=args.rank,
            max_loras_per_batch=max(args.adapters),
        )
        with Engine(**common, **lora_args) as eng:
            for b in args.batches:
                for n in sorted({min(n, b) for n in args.adapters}):  # no more adapters than requests
                    steps = [] if args.step_timing else None
                    names = [f"a{i}" for i in range(n)]
                    cold, tps = throughput(eng, b, args.prompt_len, args.new_tokens, names, steps)
                    rows.append({"batch": b, "adapters": n, "tok_s": tps, "cold_tok_s": cold, "base_tok_s": base[b]})
                    if steps:
                        rows[-1].update(steps=steps[0], base_steps=base_steps.get(b))
    print(f"{args.model} dummy weights, rank {args.rank} on all projections, {args.new_tokens} new tokens")
    print(f"{'batch':>6} {'adapters':>9} {'base tok/s':>11} {'LoRA tok/s':>11} {'x base':>7} {'first run':>10}")
    for r in rows:
        ratio = r["tok_s"] / r["base_tok_s"]
        print(
            f"{r['batch']:>6} {r['adapters']:>9} {r['base_tok_s']:>11.1f} {r['tok_s']:>11.1f} {ratio:>7.3f} "
            f"{r['cold_tok_s'] / r['base_tok_s']:>10.2f}"
        )
        for label, steps in (("LoRA", r.get("steps")), ("base", r.get("base_steps"))):
            for kind, t in (steps or {}).items():
                print(f"{'':>17} {label} {kind:>7}: {t['steps']} steps, {t['tokens']} tokens, "
                      f"{t['device_ms']:.1f} ms device, {t['wall_ms']:.1f} ms wall")  # fmt: skip
    save("bench_lora", {"model": args.model, "rank": args.rank, "device": "cuda" if cuda else "cpu", "rows": rows})


if __name__ == "__main__":
    main()
