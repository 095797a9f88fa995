"""long_prefill_token_threshold under a stream of arrivals (issue 32's long-prompt mix: 10% of prompts 8,000
tokens, the rest 512, 16 a second), the scheduler on a fake runner whose clock a modeled 8B-on-H100 step advances.
The test asserts the schedule (no prompt prefills more than the threshold in a step; outputs identical with the
cap and without); `sweep()` prints the modeled TTFT, TPOT and inter-token gaps for a few thresholds (the table in
benchmarks/RESULTS.md; the GPU's own figures come from bench_serving):

    python -c "import sys; sys.path[:0] = ['tests', 'tests/scheduler']; import test_long_prefill_stream as t; t.sweep()"
"""

from __future__ import annotations

import random
from dataclasses import replace

from helpers.fake_runner import FakeRunner, fake_scheduler, serve_stream

POOL = 200_000


def h100_8b_seconds(step) -> float:
    """A step of the 8B shape on an H100, fitted to the eighth session's step timing (RESULTS, issue 32): ~6.5 ms
    of weights a step, 40 us a decode row, 22 us a prefill token (a 953-token mixed step: 28 ms)."""
    rows = step.decode_rows if not step.mode.is_decode() else step.batch_size
    return 6.5e-3 + 4e-5 * rows + 2.2e-5 * (step.num_tokens - rows)


def long_mix(n: int, seed: int = 16) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 1000) for _ in range(8000 if rng.random() < 0.1 else 512)] for _ in range(n)]


def serve(reqs: list[list[int]], every_s: float, out_len: int, **server_args) -> dict:
    """Each request's outputs and its tokens' times on the runner's clock, request i arriving at i * every_s."""
    runner = FakeRunner(
        max_total_tokens=POOL, max_running_requests=64, context_len=8800, vocab_size=1000, step_seconds=h100_8b_seconds
    )
    runner.info = replace(runner.info, supports_overlap=True)
    s = fake_scheduler(runner, chunked_prefill_size=8192, **server_args)
    return {**serve_stream(s, runner, reqs, every_s, out_len), "steps": runner.steps}


def figures(run: dict) -> dict:
    """Modeled TTFT, TPOT (per request) and inter-token gaps (all), in ms: median and p99."""

    def pct(xs, q):
        xs = sorted(xs)
        return round(1e3 * xs[min(len(xs) - 1, int(q * len(xs)))], 1)

    ttft = [t[0] - run["arrival"][rid] for rid, t in run["times"].items()]
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for t in run["times"].values()]
    gaps = [b - a for t in run["times"].values() for a, b in zip(t, t[1:])]
    return {name: (pct(xs, 0.5), pct(xs, 0.99)) for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", gaps))}


def test_a_long_prompt_is_cut_at_the_threshold_and_outputs_do_not_change():
    reqs = long_mix(24)
    assert sum(len(r) == 8000 for r in reqs) >= 2  # long prompts in the stream, among running requests
    off = serve(reqs, every_s=1 / 16, out_len=32)
    on = serve(reqs, every_s=1 / 16, out_len=32, long_prefill_token_threshold=2048)
    assert on["ids"] == off["ids"]
    assert max(max(st.extend_lens or [0]) for st in off["steps"] if not st.mode.is_decode()) == 8000
    assert max(max(st.extend_lens or [0]) for st in on["steps"] if not st.mode.is_decode()) == 2048
    # With the cap, the running requests' longest wait for a token is a ~2,048-token step, not an 8,000-token one.
    assert longest_gap(on) < 0.5 * longest_gap(off)


def longest_gap(run: dict) -> float:
    return max(b - a for t in run["times"].values() for a, b in zip(t, t[1:]))


def sweep(n: int = 400, thresholds=(0, 4096, 2048, 1024)) -> None:
    reqs = long_mix(n)
    for t in thresholds:
        print(f"long_prefill_token_threshold={t}:", figures(serve(reqs, 1 / 16, 128, long_prefill_token_threshold=t)))
    print("chunked_prefill_size=2048:", figures(serve(reqs, 1 / 16, 128, max_num_batched_tokens=2048)))
