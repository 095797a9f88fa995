"""Speculation under a stream of arrivals (serving), on the fake step runner with a GPU's step costs: requests
arrive every few steps, so the running batch keeps changing and mixed steps (decode rows and a prefill
chunk) interrupt its decode steps. With NGRAM on, each request's decode rate (tokens per second from its
first token to its last) must stay within 5% of the rate without speculation where no draft pays (random
prompts with nothing to look up; drafts proposed and always rejected), and beat it where requests quote
their context. Outputs are the same token for token either way."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from helpers.fake_runner import FakeRunner, fake_scheduler, serve_stream

VOCAB = 1000


def gpu_seconds(step) -> float:
    """An 8B model's step on the GPU, shaped after bench_spec_gpu's verify and decode step costs (its table in
    benchmarks/RESULTS.md): a decode step's fixed cost and a little per row when launched ahead of its
    predecessor's read-back, more when decided after it (the host work no longer hidden); a verify step
    (always decided) ~1.3x a decode step at one request, ~1.7x at 32 with a few drafts each; a prefill
    chunk's cost by its tokens."""
    decided = 0.0 if step.ids_from_prev else 1.5e-3
    if step.mode.is_verify():
        return 6.5e-3 + 1e-4 * step.batch_size + 1.5e-5 * step.num_tokens + 1.5e-3
    if step.mode.is_decode():
        return 5e-3 + 4e-5 * step.batch_size + decided
    rows = step.decode_rows
    return 5e-3 + 4e-5 * rows + 5e-5 * (step.num_tokens - rows) + (decided if rows else 0.0)


def hashed_script(row) -> int:
    """Random-looking outputs: a hash of the prompt's head and the position (prompt lookup finds nothing)."""
    h = hash((tuple(row.prompt_ids[:4]), len(row.output_ids)))
    return 2 + (h * 2654435761 >> 7) % (VOCAB - 10)


def rejected_script(row) -> int:
    """a, b, x1, a, b, x2, ...: after each "a b" prompt lookup proposes the x that came last time, and the
    model writes a new one: drafts are proposed every third step, none is accepted."""
    i, k = len(row.output_ids), row.prompt_ids[0]
    if i % 3 < 2:
        return (3 + k % 5, 4 + k % 5)[i % 3]
    return 100 + (i // 3 + k) % 800


def quoting_script(row) -> int:
    """The model goes on quoting its prompt (a passage repeated): prompt lookup finds every continuation."""
    return row.prompt_ids[len(row.output_ids) % len(row.prompt_ids)]


def prompts(kind: str, n: int, length: int) -> list[list[int]]:
    rng = random.Random(0)
    if kind == "quote":  # a passage quoted 4 times, as bench_serving's copy dataset
        return [[rng.randrange(2, VOCAB) for _ in range(length // 4)] * 4 for _ in range(n)]
    return [[rng.randrange(2, VOCAB) for _ in range(length)] for _ in range(n)]


def serve(script, reqs: list[list[int]], every_s: float, out_len: int, **server_args) -> tuple[dict, float]:
    """Each request's outputs, and the mean of the requests' decode rates (tokens after the first over the
    seconds between the first and the last), request i arriving at i * every_s seconds of the runner's clock."""
    runner = FakeRunner(
        max_total_tokens=60000,
        max_running_requests=64,
        context_len=1024,
        vocab_size=VOCAB,
        script=script,
        step_seconds=gpu_seconds,
    )
    runner.info = replace(runner.info, supports_overlap=True)
    s = fake_scheduler(runner, speculative_disable_by_batch_size=32, **server_args)
    s.speculation.clock = runner.clock
    run = serve_stream(s, runner, reqs, every_s, out_len)
    rates = [(len(t) - 1) / (t[-1] - t[0]) for t in run["times"].values()]
    return run["ids"], sum(rates) / len(rates)


# 16 requests a second, 512-token prompts, 128 tokens out: ~25 running at once, a prefill every few steps.
STREAM = dict(every_s=1 / 16, out_len=128)


@pytest.mark.parametrize("script", [hashed_script, rejected_script], ids=["nothing-to-look-up", "rejected"])
def test_speculation_costs_at_most_5_percent_where_no_draft_pays(script):
    reqs = prompts("random", 150, 512)
    off, rate_off = serve(script, reqs, **STREAM)
    on, rate_on = serve(script, reqs, **STREAM, speculative_algorithm="NGRAM")
    assert on == off
    assert rate_on > 0.95 * rate_off, rate_on / rate_off


def test_speculation_pays_where_requests_quote_their_context():
    reqs = prompts("quote", 150, 512)
    off, rate_off = serve(quoting_script, reqs, **STREAM)
    on, rate_on = serve(quoting_script, reqs, **STREAM, speculative_algorithm="NGRAM")
    assert on == off
    assert rate_on > 2 * rate_off, rate_on / rate_off


def sweep(rates=(2, 4, 8, 16, 32), n: int = 150) -> None:
    """The table of benchmarks/RESULTS.md (issue 32): NGRAM over off, each script, at each rate.
    python -c "import sys; sys.path[:0] = ['tests', 'tests/spec']; import test_spec_serving as t; t.sweep()" """
    scripts = (("random", hashed_script), ("random", rejected_script), ("quote", quoting_script))
    for rate in rates:
        row = []
        for kind, script in scripts:
            reqs = prompts(kind, n, 512)
            off, rate_off = serve(script, reqs, 1 / rate, 128)
            on, rate_on = serve(script, reqs, 1 / rate, 128, speculative_algorithm="NGRAM")
            assert on == off
            row.append(f"{rate_on / rate_off:.3f}")
        print(rate, " | ".join(row), flush=True)
