"""The CPU smoke run of benchmarks/programs/paper_programs.py (issue 35): every workload of the SGLang paper's
programs at a tiny scale on the default model, through the DSL with hints on and off and through the HTTP
driver (plait's OpenAI backend, one completion call per gen / select) against the same Engine's HTTP API."""

import os
import sys

import pytest
from paths import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks", "programs"))
import paper_programs  # noqa: E402
import paper_workloads  # noqa: E402

DRIVERS = ["dsl-hints", "dsl-nohints", "http-plait"]


@pytest.fixture(scope="module")
def rows():
    args = paper_programs.build_parser().parse_args(
        ["--scale", "0.02", "--parallel", "8", "--max-total-tokens", "8192"]
    )
    return paper_programs.run_drivers(args, paper_programs.select_workloads(args), DRIVERS)


def test_every_workload_runs_on_every_driver_without_errors(rows):
    assert [(r.workload, r.driver) for r in rows] == [(w, d) for w in paper_workloads.NAMES for d in DRIVERS]
    for r in rows:
        assert r.errors == 0, r
        assert r.programs >= 2 and r.wall_s > 0 and r.latency_p99_s >= r.latency_mean_s > 0, r
        assert r.prompt_tokens > 0, r


def test_fixed_lengths_give_every_driver_the_same_output_tokens(rows):
    """Free gens ignore EOS and stops, so only regex fields (json, judge's score) may differ in length."""
    by = {(r.workload, r.driver): r for r in rows}
    for name in paper_workloads.NAMES:
        counts = {by[(name, d)].output_tokens for d in DRIVERS}
        if name in ("json", "judge"):
            assert all(c > 0 for c in counts), (name, counts)
        else:
            assert len(counts) == 1 and counts.pop() > 0, (name, counts)


def test_shared_prefixes_are_cached_and_answers_are_scored(rows):
    by = {(r.workload, r.driver): r for r in rows}
    for d in DRIVERS:  # the plait server reports cached tokens over HTTP as well
        assert by[("mmlu", d)].cached_share is not None and by[("mmlu", d)].cached_share > 0.3, by[("mmlu", d)]
    for name in ("mmlu", "hellaswag", "json"):
        assert all(0.0 <= by[(name, d)].accuracy <= 1.0 for d in DRIVERS)
    assert by[("tot", "dsl-hints")].accuracy is None
