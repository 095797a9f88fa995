"""Online serving benchmark: an async HTTP client in the manner of SGLang's bench_serving.

    python benchmarks/serving/bench_serving.py --backend plait --port 30000 --dataset random \
        --num-prompts 32 --request-rate inf --random-input-len 128 --random-output-len 32

Backends: `plait` streams SGLang's native `POST /generate`; `openai` streams `POST /v1/completions`
(so it also measures other OpenAI-compatible servers). Prompts are token ids (both APIs take them),
so the client needs no tokenizer and the prompt length is exact; `ignore_eos` makes the output
length exact too. Arrivals are Poisson at `--request-rate` req/s (`inf`: all at once), optionally
capped by `--max-concurrency`. Prints request / token throughput and TTFT, ITL, TPOT and end-to-end
latency (median, p99) and saves the same numbers as JSON under benchmarks/out/.

Datasets: `random` (independent prompts), `shared-prefix` (`--num-groups` groups whose prompts
share a `--shared-prefix-len`-token prefix, as in few-shot or system-prompt workloads; this is where
the radix cache shows up as cached tokens and lower TTFT), `long-mix` (random prompts, a
`--long-fraction` of them `--long-input-len` tokens long: long prefills arriving among short requests)
and `copy` (each prompt a random `--copy-segment-len`-token passage quoted `--copy-repeats` times: a
model that continues the pattern copies its context, which prompt-lookup speculation can draft).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import aiohttp

_TIMEOUT = aiohttp.ClientTimeout(total=6 * 3600)
# Ids below this are special/control tokens in most vocabularies; random prompts avoid them.
_FIRST_ORDINARY_ID = 100


@dataclass
class BenchRequest:
    prompt_ids: list[int]
    output_len: int


@dataclass
class RequestResult:
    prompt_len: int
    output_len: int = 0
    cached_tokens: int = 0
    success: bool = False
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    chunks: int = 0  # stream events that brought tokens (fewer than tokens: the server coalesced some)


# ---------------------------------------------------------------- datasets


def random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(_FIRST_ORDINARY_ID, vocab) for _ in range(n)]


def sample_len(rng: random.Random, mean: int, range_ratio: float) -> int:
    """Uniform in [mean * range_ratio, mean] like SGLang's random dataset (range_ratio 1 = fixed)."""
    return max(1, rng.randint(int(mean * range_ratio), mean))


def build_dataset(args: argparse.Namespace, vocab: int) -> list[BenchRequest]:
    rng = random.Random(args.seed)
    if args.dataset == "random":
        return [
            BenchRequest(
                random_ids(rng, sample_len(rng, args.random_input_len, args.random_range_ratio), vocab),
                sample_len(rng, args.random_output_len, args.random_range_ratio),
            )
            for _ in range(args.num_prompts)
        ]
    if args.dataset == "long-mix":
        return [
            BenchRequest(
                random_ids(
                    rng,
                    args.long_input_len
                    if rng.random() < args.long_fraction
                    else sample_len(rng, args.random_input_len, args.random_range_ratio),
                    vocab,
                ),
                sample_len(rng, args.random_output_len, args.random_range_ratio),
            )
            for _ in range(args.num_prompts)
        ]
    if args.dataset == "copy":
        return [
            BenchRequest(
                random_ids(rng, args.copy_segment_len, vocab) * args.copy_repeats,
                sample_len(rng, args.random_output_len, args.random_range_ratio),
            )
            for _ in range(args.num_prompts)
        ]
    prefixes = [random_ids(rng, args.shared_prefix_len, vocab) for _ in range(args.num_groups)]
    requests = [
        BenchRequest(
            prefixes[i % args.num_groups] + random_ids(rng, args.question_len, vocab),
            sample_len(rng, args.random_output_len, args.random_range_ratio),
        )
        for i in range(args.num_prompts)
    ]
    rng.shuffle(requests)
    return requests


# ---------------------------------------------------------------- one streamed request


def _payload(args: argparse.Namespace, req: BenchRequest) -> tuple[str, dict[str, Any]]:
    if args.backend == "plait":
        return "/generate", {
            "input_ids": req.prompt_ids,
            "stream": True,
            "sampling_params": {"max_new_tokens": req.output_len, "temperature": 0.0, "ignore_eos": True},
        }
    return "/v1/completions", {
        "model": args.model,
        "prompt": req.prompt_ids,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def run_one(session: aiohttp.ClientSession, args: argparse.Namespace, req: BenchRequest) -> RequestResult:
    path, payload = _payload(args, req)
    result = RequestResult(prompt_len=len(req.prompt_ids))
    start = last = time.perf_counter()
    tokens = 0
    try:
        async with session.post(args.base_url + path, json=payload, headers=args.headers) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return result
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = chunk["error"].get("message", str(chunk["error"]))
                    return result
                now = time.perf_counter()
                new_tokens = _count_tokens(args.backend, chunk, tokens, result)
                if new_tokens > tokens:
                    result.chunks += 1
                    if tokens == 0:
                        result.ttft = now - start
                    else:
                        # A chunk carrying k tokens counts as k equal gaps (stream_interval > 1).
                        result.itl.extend([(now - last) / (new_tokens - tokens)] * (new_tokens - tokens))
                    tokens, last = new_tokens, now
        result.e2e = time.perf_counter() - start
        result.output_len = tokens
        result.success = tokens > 0
        if not result.success:
            result.error = "no tokens received"
    except Exception as e:  # network errors count as failures, the run goes on
        result.error = f"{type(e).__name__}: {e}"
    return result


def _count_tokens(backend: str, chunk: dict[str, Any], so_far: int, result: RequestResult) -> int:
    """Completion tokens received so far, from one SSE chunk."""
    if backend == "plait":
        meta = chunk.get("meta_info") or {}
        result.cached_tokens = int(meta.get("cached_tokens") or 0)
        return int(meta.get("completion_tokens") or so_far)
    usage = chunk.get("usage")
    if usage:  # final usage chunk (include_usage): the exact count
        details = usage.get("prompt_tokens_details") or {}
        result.cached_tokens = int(details.get("cached_tokens") or 0)
        return max(so_far, int(usage.get("completion_tokens") or 0))
    choices = chunk.get("choices") or []
    if choices and (choices[0].get("text") or "") != "":
        return so_far + 1  # OpenAI streams one chunk per token (stream_interval 1)
    return so_far


# ---------------------------------------------------------------- the run


async def arrivals(requests: list[BenchRequest], rate: float, rng: random.Random):
    for i, req in enumerate(requests):
        yield req
        if rate != float("inf") and i + 1 < len(requests):
            await asyncio.sleep(rng.expovariate(rate))


async def benchmark(args: argparse.Namespace, requests: list[BenchRequest]) -> tuple[list[RequestResult], float]:
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=_TIMEOUT, connector=connector) as session:
        for req in requests[: args.warmup_requests]:
            warm = await run_one(session, args, BenchRequest(req.prompt_ids, min(req.output_len, 4)))
            if not warm.success:
                sys.exit(f"warmup request failed: {warm.error}")
        if args.flush_cache:
            await flush_cache(session, args)

        async def limited(req: BenchRequest) -> RequestResult:
            if limit is None:
                return await run_one(session, args, req)
            async with limit:
                return await run_one(session, args, req)

        start = time.perf_counter()
        tasks = [
            asyncio.create_task(limited(req))
            async for req in arrivals(requests, args.request_rate, random.Random(args.seed + 1))
        ]
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


async def flush_cache(session: aiohttp.ClientSession, args: argparse.Namespace) -> None:
    """Empty the server's prefix cache; it refuses while the warmup request is still being released."""
    for _ in range(50):
        async with session.post(args.base_url + "/flush_cache", headers=args.headers) as r:
            if r.status == 200:
                return
        await asyncio.sleep(0.2)
    print("warning: /flush_cache kept failing; the run starts with a warm cache")


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * p / 100.0
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    ms = 1000.0
    ttft = [r.ttft * ms for r in ok]
    e2e = [r.e2e * ms for r in ok]
    itl = [x * ms for r in ok for x in r.itl]
    tpot = [(r.e2e - r.ttft) / (r.output_len - 1) * ms for r in ok if r.output_len > 1]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_len for r in ok)
    summary: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "total_chunks": sum(r.chunks for r in ok),
        "cached_input_tokens": sum(r.cached_tokens for r in ok),
        "request_throughput": len(ok) / duration,
        "input_token_throughput": input_tokens / duration,
        "output_token_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
    }
    for name, values in (("ttft_ms", ttft), ("itl_ms", itl), ("tpot_ms", tpot), ("e2e_latency_ms", e2e)):
        summary[f"mean_{name}"] = statistics.fmean(values) if values else float("nan")
        summary[f"median_{name}"] = percentile(values, 50)
        summary[f"p99_{name}"] = percentile(values, 99)
    errors = sorted({r.error for r in results if not r.success})
    if errors:
        summary["errors"] = errors[:5]
    return summary


def print_summary(args: argparse.Namespace, s: dict[str, Any]) -> None:
    rows = [
        ("Backend", args.backend),
        ("Dataset", args.dataset),
        ("Request rate (req/s)", args.request_rate),
        ("Max concurrency", args.max_concurrency or "none"),
        ("Successful requests", s["completed"]),
        ("Failed requests", s["failed"]),
        ("Duration (s)", f"{s['duration_s']:.2f}"),
        ("Input tokens", s["total_input_tokens"]),
        ("Cached input tokens", s["cached_input_tokens"]),
        ("Output tokens", s["total_output_tokens"]),
        ("Request throughput (req/s)", f"{s['request_throughput']:.3f}"),
        ("Input token throughput (tok/s)", f"{s['input_token_throughput']:.1f}"),
        ("Output token throughput (tok/s)", f"{s['output_token_throughput']:.1f}"),
        ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.1f}"),
    ]
    for name, label in (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("tpot_ms", "TPOT"), ("e2e_latency_ms", "E2E latency")):
        rows.append((f"{label} median / p99 (ms)", f"{s[f'median_{name}']:.1f} / {s[f'p99_{name}']:.1f}"))
    if s.get("accept_length"):
        rows.append(("Accept length (speculative)", f"{s['accept_length']:.2f}"))
    width = max(len(k) for k, _ in rows)
    print("=" * (width + 16))
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print("=" * (width + 16))
    for err in s.get("errors", []):
        print("error:", err)


def server_accept_length(args: argparse.Namespace) -> Optional[float]:
    """The server's average speculative accept length (tokens per request-step with drafts), as SGLang's
    bench_serving reads it from /get_server_info: under internal_states[0] or at the top level; None
    when the server does not speculate or does not say."""
    import requests

    try:
        info = requests.get(args.base_url + "/get_server_info", headers=args.headers, timeout=30).json()
    except Exception:
        return None
    states = info.get("internal_states") or [{}]
    value = states[0].get("avg_spec_accept_length", info.get("avg_spec_accept_length"))
    return float(value) if value else None


def server_vocab_size(args: argparse.Namespace) -> int:
    """The server's vocabulary size, so random ids are valid (plait and SGLang report it)."""
    if args.vocab_size:
        return args.vocab_size
    import requests

    try:
        info = requests.get(args.base_url + "/get_model_info", headers=args.headers, timeout=30).json()
        return int(info.get("vocab_size") or 32000)
    except Exception:
        return 32000


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("plait", "openai"), default="plait")
    p.add_argument("--base-url", default=None, help="default http://HOST:PORT")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--model", default="default", help="model name for the openai backend")
    p.add_argument("--api-key", default=None)
    p.add_argument("--dataset", choices=("random", "shared-prefix", "long-mix", "copy"), default="random")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=32)
    p.add_argument("--random-range-ratio", type=float, default=1.0)
    p.add_argument("--shared-prefix-len", type=int, default=256, help="shared-prefix: prefix tokens per group")
    p.add_argument("--question-len", type=int, default=32, help="shared-prefix: own tokens per prompt")
    p.add_argument("--num-groups", type=int, default=4, help="shared-prefix: distinct prefixes")
    p.add_argument("--long-fraction", type=float, default=0.1, help="long-mix: share of long prompts")
    p.add_argument("--long-input-len", type=int, default=8000, help="long-mix: tokens of a long prompt")
    p.add_argument("--copy-segment-len", type=int, default=64, help="copy: tokens of the quoted passage")
    p.add_argument("--copy-repeats", type=int, default=4, help="copy: times the passage is quoted")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="req/s, Poisson; inf = burst")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument(
        "--flush-cache",
        action="store_true",
        help="flush the server's prefix cache after warmup (SGLang/plait /flush_cache)",
    )
    p.add_argument("--vocab-size", type=int, default=None)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output-file", default=None, help="default benchmarks/out/bench_serving_<...>.json")
    p.add_argument("--tag", default="", help="free text stored in the JSON (machine, model, ...)")
    args = p.parse_args(argv)
    if args.num_prompts < 1 or (args.max_concurrency is not None and args.max_concurrency < 1):
        p.error("--num-prompts and --max-concurrency must be >= 1")
    if args.request_rate <= 0:
        p.error("--request-rate must be > 0 (inf for a burst)")
    args.base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    args.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    return args


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    args = parse_args(argv)
    requests_ = build_dataset(args, server_vocab_size(args))
    results, duration = asyncio.run(benchmark(args, requests_))
    summary = summarize(results, duration)
    if args.backend == "plait":
        summary["accept_length"] = server_accept_length(args)
    print_summary(args, summary)
    out = args.output_file or os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        "out",
        f"bench_serving_{args.backend}_{args.dataset}_{args.num_prompts}p_rate{args.request_rate}.json",
    )
    os.makedirs(os.path.dirname(out), exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k not in ("headers", "api_key")}
    config["request_rate"] = str(args.request_rate)  # JSON has no infinity
    summary = {k: (None if isinstance(v, float) and v != v else v) for k, v in summary.items()}
    with open(out, "w") as f:
        json.dump(
            {
                "config": config,
                "summary": summary,
                "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                "requests": [asdict(r) for r in results],
            },
            f,
            indent=1,
        )
    print(f"saved {out}")
    return summary


if __name__ == "__main__":
    main()
