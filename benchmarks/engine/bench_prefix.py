"""RadixAttention benchmark: prefix reuse on vs off on the default model, in one run.

Workloads (greedy, token-id prompts so both engines see identical inputs):
  few-shot   dozens of questions behind one long shared few-shot prefix, submitted as one batch;
  multi-turn several chat conversations, each turn resending the whole history (one batch per turn).

Both engines live side by side and the workloads alternate between them, so drifting machine load
biases neither side. Prints throughput, cache hit rate and the on/off ratio; saves JSON.

    .venv/bin/python benchmarks/engine/bench_prefix.py            # a few minutes on a small CPU
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time

from plait.runtime import Engine


def few_shot_prompts(tokenizer, num_shots: int, num_questions: int, seed: int = 0):
    rng = random.Random(seed)

    def qa():
        a, b = rng.randrange(10, 99), rng.randrange(10, 99)
        return f"Q: What is {a} plus {b}?\nA:", f" {a + b}\n"

    prefix = "Answer with the number only.\n" + "".join(q + a for q, a in (qa() for _ in range(num_shots)))
    prefix_ids = tokenizer.encode(prefix)
    return prefix_ids, [prefix_ids + tokenizer.encode(qa()[0]) for _ in range(num_questions)]


def conversation_openers(tokenizer, num_convs: int, context_words: int, seed: int = 1):
    rng = random.Random(seed)
    topics = "garden bridge violin harbor orchard library comet glacier market lantern".split()
    words = "the a river stone old bright small quiet morning people walked built under across near".split()
    out = []
    for i in range(num_convs):
        notes = " ".join(rng.choice(words + topics) for _ in range(context_words))
        out.append(
            tokenizer.encode(f"<|im_start|>system\nNotes about the {topics[i % len(topics)]}: {notes}<|im_end|>\n")
        )
    return out


USER_TURNS = [
    "Summarize the notes in one sentence.",
    "What is the main topic?",
    "Give it a short title.",
    "Name one detail.",
    "Say something kind about it.",
]


def run_batch(engine: Engine, prompts: list[list[int]], params: dict) -> tuple[list[dict], float]:
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=[params] * len(prompts))
    return outs, time.perf_counter() - start


def summarize(outs: list[dict], seconds: float) -> dict:
    prompt = sum(o["meta_info"]["prompt_tokens"] for o in outs)
    cached = sum(o["meta_info"]["cached_tokens"] for o in outs)
    completion = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {
        "requests": len(outs),
        "seconds": round(seconds, 3),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "completion_tokens": completion,
        "cache_hit_rate": round(cached / max(1, prompt), 4),
        "requests_per_s": round(len(outs) / seconds, 4),
        "tokens_per_s": round((prompt + completion) / seconds, 2),
    }


def bench_few_shot(engines: dict, tokenizer, args) -> dict:
    prefix, prompts = few_shot_prompts(tokenizer, args.shots, args.questions)
    params = {"max_new_tokens": args.few_shot_new_tokens, "temperature": 0}
    result, outputs = {"prefix_tokens": len(prefix)}, {}
    for name, eng in engines.items():
        outs, seconds = run_batch(eng, prompts, params)
        result[name] = summarize(outs, seconds)
        outputs[name] = [o["output_ids"] for o in outs]
    return finish(result, outputs)


def bench_multi_turn(engines: dict, tokenizer, args) -> dict:
    openers = conversation_openers(tokenizer, args.conversations, args.context_words)
    params = {"max_new_tokens": args.chat_new_tokens, "temperature": 0}
    result, outputs = {}, {}
    for name, eng in engines.items():
        histories = [list(o) for o in openers]
        all_outs, seconds = [], 0.0
        for turn in range(args.turns):
            user = tokenizer.encode(
                f"<|im_start|>user\n{USER_TURNS[turn % len(USER_TURNS)]}<|im_end|>\n<|im_start|>assistant\n"
            )
            for h in histories:
                h += user
            outs, dt = run_batch(eng, histories, params)
            seconds += dt
            for h, o in zip(histories, outs):
                h += o["output_ids"]
            all_outs += outs
        result[name] = summarize(all_outs, seconds)
        outputs[name] = [o["output_ids"] for o in all_outs]
    return finish(result, outputs)


def finish(result: dict, outputs: dict) -> dict:
    result["speedup_on_vs_off"] = round(result["on"]["requests_per_s"] / result["off"]["requests_per_s"], 3)
    same = sum(a == b for a, b in zip(outputs["on"], outputs["off"]))
    result["identical_outputs"] = f"{same}/{len(outputs['on'])}"
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--shots", type=int, default=24, help="few-shot examples in the shared prefix")
    p.add_argument("--questions", type=int, default=24)
    p.add_argument("--few-shot-new-tokens", type=int, default=6)
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--context-words", type=int, default=120, help="per-conversation notes in turn 1")
    p.add_argument("--chat-new-tokens", type=int, default=12)
    p.add_argument("--max-total-tokens", type=int, default=16384)
    p.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=512,
        help="CPU prefill throughput saturates well below the GPU default of 8192",
    )
    p.add_argument("--num-threads", type=int, default=1, help="torch threads in each scheduler process")
    p.add_argument(
        "--out",
        default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "out", "bench_prefix.json"),
    )
    args = p.parse_args()

    common = dict(
        model_path=args.model_path,
        num_threads=args.num_threads,
        max_total_tokens=args.max_total_tokens,
        chunked_prefill_size=args.chunked_prefill_size,
    )
    load_before = os.getloadavg()
    started = time.perf_counter()
    with Engine(disable_radix_cache=True, **common) as off, Engine(**common) as on:
        engines = {"off": off, "on": on}
        for eng in engines.values():  # warm-up: first-call costs stay out of the numbers
            eng.generate(input_ids=[1, 2, 3, 4], sampling_params={"max_new_tokens": 2})
        tokenizer = on.tokenizer
        workloads = {
            "few_shot": bench_few_shot(engines, tokenizer, args),
            "multi_turn": bench_multi_turn(engines, tokenizer, args),
        }
        for eng in engines.values():
            if not eng.check_integrity():
                raise SystemExit(f"KV integrity check failed: {eng.get_stats()['last_integrity_error']}")
        model = on.model_path

    report = {
        "bench": "bench_prefix",
        "model": model,
        "device": "cpu",
        "config": vars(args),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        },
        "wall_seconds": round(time.perf_counter() - started, 1),
        "workloads": workloads,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)

    print(f"{'workload':<11} {'cache':<5} {'reqs':>5} {'secs':>8} {'req/s':>8} {'tok/s':>9} {'hit rate':>9}")
    for wname, w in workloads.items():
        for side in ("off", "on"):
            r = w[side]
            print(
                f"{wname:<11} {side:<5} {r['requests']:>5} {r['seconds']:>8.2f} {r['requests_per_s']:>8.3f} "
                f"{r['tokens_per_s']:>9.1f} {r['cache_hit_rate']:>9.1%}"
            )
        print(
            f"{'':<11} on/off throughput ratio {w['speedup_on_vs_off']:.2f}x, identical greedy outputs "
            f"{w['identical_outputs']}"
        )
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
