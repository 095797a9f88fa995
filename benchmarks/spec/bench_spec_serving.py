"""Speculation under a stream of arrivals, on the scheduler in-process (no HTTP): requests arrive at a fixed
rate in wall-clock time, each streams its tokens, and each request's TPOT (seconds from its first token to
its last over the tokens after the first) is taken on the scheduler's own loop, with NGRAM off and on,
back to back on one model runner. Datasets: `random` (random prompts: no draft pays) and `copy` (a
random passage quoted 4 times, as bench_serving's copy dataset; the outputs of a real model quote it on).

    python benchmarks/spec/bench_spec_serving.py --model llama-3.1-8b --load-format dummy \\
        --datasets random copy --num-prompts 200 --rate 16 --input-len 512 --output-len 128

On the CPU (the embedded default model when --model is left out) the same at a few requests a second.
Prints one JSON object per (dataset, mode, repeat) and a summary of TPOT on / off.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch


def _prompts(dataset: str, n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    hi = min(vocab, 30000)
    if dataset == "copy":
        return [[rng.randrange(100, hi) for _ in range(max(1, length // 4))] * 4 for _ in range(n)]
    return [[rng.randrange(100, hi) for _ in range(length)] for _ in range(n)]


def serve(runner, args, prompts: list[list[int]], speculative: bool) -> dict:
    """One stream of `prompts` through a fresh scheduler over `runner`; TPOT per request (seconds)."""
    from plait.runtime.io_struct import FlushCacheReq, TokenizedGenerateReq
    from plait.runtime.request_options import RequestOptions
    from plait.runtime.sampling_params import SamplingParams
    from plait.runtime.scheduler.scheduler import Scheduler

    s = Scheduler(_server_args(args, speculative), runner, None)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    count: dict[str, int] = {}
    start = time.perf_counter()
    arrived = 0
    while True:
        now = time.perf_counter()
        while arrived < len(prompts) and start + arrived / args.rate <= now:
            sp = SamplingParams(temperature=0, ignore_eos=True, max_new_tokens=args.output_len)
            opts = RequestOptions(rid=str(arrived), stream=True)
            s.handle_message(TokenizedGenerateReq(list(prompts[arrived]), sp, opts))
            arrived += 1
        if s.is_idle():
            if arrived == len(prompts):
                break
            time.sleep(max(0.0, start + arrived / args.rate - time.perf_counter()))
            continue
        s.step()
        t = time.perf_counter()
        for o in s.collect_outputs():
            if o.new_ids:
                first.setdefault(o.rid, t)
                last[o.rid] = t
                count[o.rid] = count.get(o.rid, 0) + len(o.new_ids)
    wall = time.perf_counter() - start
    assert s.handle_message(FlushCacheReq(0)).result is True
    tpot = sorted((last[r] - first[r]) / (count[r] - 1) for r in count if count[r] > 1)
    st = s.get_stats()
    return {
        "tpot_ms_median": 1e3 * statistics.median(tpot),
        "tpot_ms_mean": 1e3 * statistics.fmean(tpot),
        "out_tok_s": sum(count.values()) / wall,
        "wall_s": wall,
        "spec_verify_batches": st.get("spec_verify_batches", 0),
        "spec_draft_tokens": st.get("spec_draft_tokens", 0),
        "spec_accepted_tokens": st.get("spec_accepted_tokens", 0),
        "steps": {k: v["steps"] for k, v in st["steps"].items() if isinstance(v, dict) and "steps" in v},
    }


def _server_args(args, speculative: bool):
    from plait.runtime.server_args import ServerArgs

    return ServerArgs(
        model_path=args.model,
        load_format=args.load_format,
        device=args.device,
        max_running_requests=args.max_running_requests,
        speculative_algorithm="NGRAM" if speculative else None,
        num_threads=args.threads,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a model folder or built-in shape (default: the embedded model)")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--datasets", nargs="+", default=["random", "copy"], choices=("random", "copy"))
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--rate", type=float, default=16.0, help="requests per second")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.model is None:
        from plait.runtime.models.default_model import default_model_path

        args.model = default_model_path()
    from plait.runtime.executor.spec_runner import create_step_runner

    torch.manual_seed(args.seed)
    # One runner for both modes: NGRAM's settings capture its verify graphs, which plain decoding ignores.
    runner = create_step_runner(_server_args(args, True), args.model)
    rows = []
    for dataset in args.datasets:
        prompts = _prompts(dataset, args.num_prompts, args.input_len, runner.info.vocab_size, args.seed)
        serve(runner, args, prompts[: max(4, len(prompts) // 10)], False)  # warm-up (compiles, caches)
        for rep in range(args.repeats):
            for spec in (False, True):
                row = {"dataset": dataset, "mode": "ngram" if spec else "off", "repeat": rep}
                row.update(serve(runner, args, prompts, spec))
                print(json.dumps(row), flush=True)
                rows.append(row)
    for dataset in args.datasets:
        off = [r["tpot_ms_median"] for r in rows if r["dataset"] == dataset and r["mode"] == "off"]
        on = [r["tpot_ms_median"] for r in rows if r["dataset"] == dataset and r["mode"] == "ngram"]
        print(
            f"{dataset}: TPOT median off {statistics.median(off):.2f} ms, NGRAM {statistics.median(on):.2f} ms "
            f"({statistics.median(on) / statistics.median(off):.3f}x)"
        )


if __name__ == "__main__":
    main()
