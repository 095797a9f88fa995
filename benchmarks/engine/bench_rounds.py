"""Prefix-sharing request streams (issue 7 / ANCHORS): the radix cache on vs off, in one run.

The streams are `make_rounds` of shared/bench/workload.py: `fewshot` (one 2,000-token prefix shared
by 256 questions), `multiturn` (64 conversations x 4 rounds, each round resending the whole history)
and `tree` (32 roots x 4 forks x 4 forks). Rounds run one after another and each round's inputs carry
the previous round's generated tokens (`run_rounds`). Token ids only; greedy; exact output lengths.

One Engine with the radix cache on runs every stream, then one with it off (`disable_radix_cache`);
each engine is warmed up first and the cache is flushed before every stream, so each starts cold.
Reported per stream: seconds, cached-token ratio (from meta_info `cached_tokens`) next to the ideal
ratio (every token a perfect prefix cache could reuse), the on/off speedup and, on the full 8B
streams, vLLM's time divided by plait's (ANCHORS: the target is >= 1.2 with the cache on).

GPU (dummy weights at a real shape):
    python benchmarks/engine/bench_rounds.py --model llama-3.1-8b
CPU (default without a GPU): a tiny random Llama and the streams scaled down (`--scale`), which only
checks that the benchmark works end to end:
    python benchmarks/engine/bench_rounds.py --scale 0.1
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: bench_common

from bench_common import (  # noqa: E402
    format_breakdown,
    git_commit,
    load_workload_module,
    parse_engine_args,
    save,
    step_breakdown,
)

HERE = os.path.dirname(os.path.abspath(__file__))
STREAMS = ("fewshot", "multiturn", "tree")
# ANCHORS.md: vLLM 0.26.0 on one H200, Llama-3.1-8B shape, dummy bf16 weights (seconds per stream).
VLLM_8B_SECONDS = {
    "on": {"fewshot": 0.97, "multiturn": 4.62, "tree": 4.46},
    "off": {"fewshot": 13.1, "multiturn": 7.40, "tree": 20.3},
}
TARGET_VS_VLLM = 1.2
# A tiny Llama for CPU runs: big enough to exercise every code path, small enough to run in seconds.
# The vocabulary covers the workload's ids (all < workload.VOCAB_HI = 30000).
TINY_CONFIG = dict(
    architectures=["LlamaForCausalLM"],
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=30016,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)


# ------------------------------------------------------------------------------------- the streams
def scale_rounds(rounds, scale: float, turn_type):
    """A smaller stream of the same structure: the first `scale` of the parentless turns of each round
    (with every descendant of a kept turn), every `1/scale`-th token of each turn's new ids and `scale`
    of each output length. Striding keeps a shared prefix shared and a unique tail unique."""
    if scale >= 1.0:
        return rounds
    stride = max(1, round(1 / scale))
    kept: set[str] = set()
    out = []
    for rnd in rounds:
        roots = [t for t in rnd if t.parent is None]
        roots = set(t.key for t in roots[: max(1, math.ceil(len(roots) * scale))])
        small = [
            turn_type(t.key, t.parent, t.new_ids[::stride], max(1, round(t.output_len * scale)))
            for t in rnd
            if t.key in roots or t.parent in kept
        ]
        kept.update(t.key for t in small)
        out.append(small)
    return out


def distinct_prefixes(seqs: list[list[int]]) -> int:
    """How many distinct non-empty prefixes the sequences have (the nodes of their trie): the total
    length minus the longest common prefixes of neighbours in sorted order."""
    seqs = sorted(seqs)
    shared = 0
    for a, b in zip(seqs, seqs[1:]):
        n, i = min(len(a), len(b)), 0
        while i < n and a[i] == b[i]:
            i += 1
        shared += i
    return sum(map(len, seqs)) - shared


def ideal_cached_tokens(inputs: list[list[int]], outputs: list[list[int]]) -> int:
    """Input tokens a perfect (unbounded) prefix cache could serve. Every request's KV covers its input
    and all but its last generated token; each distinct prefix of those sequences must be computed once,
    the generated ones by decode, the rest by prefill. Whatever input is left over came from the cache."""
    computed = [i + o[:-1] for i, o in zip(inputs, outputs)]
    by_decode = sum(max(0, len(o) - 1) for o in outputs)
    min_prefill = distinct_prefixes(computed) - by_decode
    return sum(map(len, inputs)) - min_prefill


def run_stream(eng, workload, rounds) -> dict:
    """Runs one stream through `eng` from a cold cache; timing covers every round."""
    if not eng.flush_cache():
        raise RuntimeError("flush_cache refused: the engine is not idle")
    cached: list[int] = []
    inputs: list[list[int]] = []
    outputs: list[list[int]] = []
    per_round_cached: list[float] = []

    def generate(reqs):
        outs = eng.generate(
            input_ids=[list(i) for i, _ in reqs],
            sampling_params=[{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for _, n in reqs],
        )
        outs = outs if isinstance(outs, list) else [outs]
        hits = [o["meta_info"]["cached_tokens"] for o in outs]
        cached.extend(hits)
        per_round_cached.append(sum(hits) / max(1, sum(len(i) for i, _ in reqs)))
        inputs.extend(list(i) for i, _ in reqs)
        outputs.extend(list(o["output_ids"]) for o in outs)
        return [o["output_ids"] for o in outs]

    res = workload.run_rounds(rounds, generate)
    ideal = ideal_cached_tokens(inputs, outputs)
    res.update(
        cached_tokens=sum(cached),
        cached_ratio=sum(cached) / max(1, res["input_tokens"]),
        ideal_cached_tokens=ideal,
        ideal_cached_ratio=ideal / max(1, res["input_tokens"]),
        per_round_cached_ratio=per_round_cached,
        output_tok_s=res["generated_tokens"] / res["seconds"],
        total_tok_s=(res["generated_tokens"] + res["input_tokens"]) / res["seconds"],
    )
    return res


def run_engine(args, engine_kwargs: dict, workload, streams: dict, radix: bool) -> dict:
    from plait.runtime import Engine

    label = "on" if radix else "off"
    t = time.perf_counter()
    with Engine(**engine_kwargs, disable_radix_cache=not radix) as eng:
        startup = time.perf_counter() - t
        # Warm-up: every stream at 1/32 scale from another seed, so that prefill, cached prefill and decode
        # at a variety of lengths have all run (and compiled) before anything is timed.
        for name in streams:
            warm = scale_rounds(workload.make_rounds(name, seed=1), 1 / 32, workload.Turn)
            workload.run_rounds(
                warm,
                lambda reqs: [
                    o["output_ids"]
                    for o in eng.generate(
                        input_ids=[i for i, _ in reqs],
                        sampling_params=[{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for _, n in reqs],
                    )
                ],
            )
        warmup = time.perf_counter() - t - startup
        print(f"cache {label:3s} engine up in {startup:.1f} s, warm-up {warmup:.1f} s", flush=True)
        results = {"startup_s": startup, "warmup_s": warmup}
        # With --repeat, each stream runs again (cold cache each time) after all ran once: the first pass
        # is what a fresh engine gives, a later one shows what first use (kernel compiles) cost it.
        for rep in range(args.repeat):
            for name, rounds in streams.items():
                before = eng.get_stats()
                res = run_stream(eng, workload, rounds)
                after = eng.get_stats()
                res["retractions"] = after["num_retractions"] - before["num_retractions"]
                res["kernel_compiles"] = after.get("kernel_compiles_after_startup", 0) - before.get(
                    "kernel_compiles_after_startup", 0
                )
                res["steps"] = step_breakdown(before, after, res["seconds"])
                res["integrity_ok"] = eng.check_integrity()
                if rep == 0:
                    results[name] = res
                else:
                    results[name].setdefault("repeats", []).append(res)
                print(
                    f"cache {label:3s} {name:9s}{'' if rep == 0 else f' (pass {rep + 1})'} {res['seconds']:7.2f} s  "
                    f"rounds {' '.join(f'{s:.2f}' for s in res['per_round_s'])}  cached {res['cached_ratio']:.1%} "
                    f"(ideal {res['ideal_cached_ratio']:.1%})  {res['output_tok_s']:.0f} out tok/s  "
                    f"exact {res['exact_lengths']}  retractions {res['retractions']}  "
                    f"kernel compiles {res['kernel_compiles']}",
                    flush=True,
                )
                print(f"cache {label:3s} {name:9s} {format_breakdown(res['steps'])}", flush=True)
        results["kernels_compiled_after_startup"] = eng.get_stats().get("kernels_compiled_after_startup", [])
        if results["kernels_compiled_after_startup"]:
            print(
                f"cache {label:3s} kernels compiled after start-up: "
                f"{', '.join(results['kernels_compiled_after_startup'])}",
                flush=True,
            )
        info = eng.get_server_info()
        results["max_total_tokens"] = info.get("max_total_tokens")
    return results


# ---------------------------------------------------------------------------------------- the run
def engine_kwargs_for(args, tmp: str) -> tuple[dict, str]:
    from plait.runtime.models.config import BUILTIN_SHAPES

    if args.model == "tiny":
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(TINY_CONFIG, f)
        path, label, load_format = tmp, "tiny", "dummy"
    elif args.model in BUILTIN_SHAPES:
        path, label, load_format = args.model, args.model, "dummy"
    elif os.path.isdir(args.model):
        path, label, load_format = args.model, os.path.basename(os.path.normpath(args.model)), args.load_format
    else:
        raise ValueError(
            f"--model {args.model!r} is neither 'tiny', a built-in shape "
            f"({', '.join(sorted(BUILTIN_SHAPES))}) nor a model folder"
        )
    kwargs = dict(
        model_path=path,
        load_format=load_format,
        max_running_requests=args.max_running_requests,
        attention_backend=args.attention_backend,
        disable_cuda_graph=args.disable_cuda_graph,
        enable_step_timing=True,
    )
    if args.num_threads:
        kwargs["num_threads"] = args.num_threads
    kwargs.update(parse_engine_args(args.engine_arg))
    return kwargs, label


def ratio(a, b):
    return a / b if a and b else None


def main() -> None:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model",
        default="llama-3.1-8b" if cuda else "tiny",
        help="built-in dummy shape (llama-3.1-8b, llama-3.2-1b, ...), 'tiny' (a random 2-layer "
        "Llama for CPU checks) or a model folder; default: llama-3.1-8b on a GPU, else tiny",
    )
    p.add_argument("--load-format", default="dummy", choices=["dummy", "auto"], help="for a model folder")
    p.add_argument(
        "--scale",
        type=float,
        default=1.0 if cuda else 0.1,
        help="shrink the streams: this fraction of conversations/requests, tokens and output "
        "lengths (default 1 on a GPU, 0.1 on the CPU)",
    )
    p.add_argument("--streams", nargs="+", default=list(STREAMS), choices=STREAMS)
    p.add_argument("--max-running-requests", type=int, default=None, help="default: the engine's choice")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--num-threads", type=int, default=None if cuda else 1, help="CPU threads of the scheduler")
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other ServerArgs field, e.g. --engine-arg chunked_prefill_size=16384",
    )
    p.add_argument("--skip-off", action="store_true", help="only run with the radix cache on")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run the streams this many times on each engine (the first pass is the one reported)",
    )
    args = p.parse_args()
    if not 0.0 < args.scale <= 1.0:
        p.error(f"--scale must be in (0, 1], got {args.scale}")

    workload = load_workload_module()
    streams = {s: scale_rounds(workload.make_rounds(s), args.scale, workload.Turn) for s in args.streams}
    with tempfile.TemporaryDirectory(prefix="bench_rounds_") as tmp:
        engine_kwargs, label = engine_kwargs_for(args, tmp)
        result = {
            "bench": "rounds",
            "model": label,
            "scale": args.scale,
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "date": time.strftime("%Y-%m-%d"),
            "commit": git_commit(),
            "engine_args": {k: v for k, v in engine_kwargs.items() if k != "model_path"},
            "streams": {
                s: dict(zip(("requests", "input_tokens", "output_tokens"), workload.rounds_totals(r)), rounds=len(r))
                for s, r in streams.items()
            },
        }
        print(json.dumps({k: result[k] for k in ("model", "scale", "device", "streams")}), flush=True)
        result["on"] = run_engine(args, engine_kwargs, workload, streams, radix=True)
        if not args.skip_off:
            result["off"] = run_engine(args, engine_kwargs, workload, streams, radix=False)
    compare_to_vllm = label == "llama-3.1-8b" and args.scale == 1.0
    result["summary"] = summarize(result, args.streams, compare_to_vllm)
    save(f"bench_rounds_{label}" + ("" if args.scale == 1.0 else f"_scale{args.scale:g}"), result)
    print_table(result["summary"], compare_to_vllm)


def summarize(result: dict, streams, compare_to_vllm: bool) -> dict:
    out = {}
    for s in streams:
        on, off = result["on"][s], result.get("off", {}).get(s)
        row = {
            "on_s": on["seconds"],
            "off_s": off["seconds"] if off else None,
            "cached_ratio_on": on["cached_ratio"],
            "ideal_cached_ratio": on["ideal_cached_ratio"],
            "off_over_on": ratio(off and off["seconds"], on["seconds"]),
            "exact_lengths": on["exact_lengths"] and (off is None or off["exact_lengths"]),
        }
        if compare_to_vllm:
            row["vllm_on_s"], row["vllm_off_s"] = VLLM_8B_SECONDS["on"][s], VLLM_8B_SECONDS["off"][s]
            row["vllm_over_plait_on"] = ratio(row["vllm_on_s"], row["on_s"])
            row["vllm_over_plait_off"] = ratio(row["vllm_off_s"], row["off_s"])
            row["meets_target_on"] = row["vllm_over_plait_on"] >= TARGET_VS_VLLM
        out[s] = row
    return out


def print_table(summary: dict, compare_to_vllm: bool) -> None:
    def fmt(value, spec: str) -> str:
        width = int(spec.split(".")[0])
        return f"{'-':>{width}s}" if value is None else format(value, spec)

    head = f"{'stream':10s}{'on s':>8s}{'off s':>8s}{'off/on':>8s}{'cached':>8s}{'ideal':>8s}"
    if compare_to_vllm:
        head += f"{'vLLM on':>9s}{'vLLM/on':>9s}{'vLLM off':>9s}{'vLLM/off':>9s}"
    print(head)
    for s, r in summary.items():
        line = (
            f"{s:10s}{fmt(r['on_s'], '8.2f')}{fmt(r['off_s'], '8.2f')}{fmt(r['off_over_on'], '8.2f')}"
            f"{r['cached_ratio_on']:8.1%}{r['ideal_cached_ratio']:8.1%}"
        )
        if compare_to_vllm:
            line += (
                f"{r['vllm_on_s']:9.2f}{fmt(r['vllm_over_plait_on'], '9.2f')}"
                f"{r['vllm_off_s']:9.2f}{fmt(r['vllm_over_plait_off'], '9.2f')}"
            )
        print(line + ("" if r["exact_lengths"] else "  (output lengths NOT exact)"))
    if compare_to_vllm:
        print(f"target: vLLM/on >= {TARGET_VS_VLLM} (plait {TARGET_VS_VLLM}x faster than vLLM with its prefix cache)")


if __name__ == "__main__":
    main()
