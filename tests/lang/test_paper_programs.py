"""The CPU smoke run of benchmarks/programs/paper_programs.py (issue 35): every workload of the SGLang paper's
programs at a tiny scale on the default model, through the DSL (hints on) and through the HTTP
driver (plait's OpenAI backend, one completion call per gen / select) against the same Engine's HTTP API."""

import os
import sys

import pytest
from helpers.paths import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks", "programs"))
import paper_programs  # noqa: E402
import paper_workloads  # noqa: E402

# Hints off is the hints-on path less the hints (lang's own tests cover both); the smoke run keeps to the two
# ends: every workload on the DSL with hints, the HTTP driver on one workload of each kind of call (a select
# over HTTP scores whole prompts, so the agents' selects cost ~2 minutes on a loaded CPU).
DRIVERS = ["dsl-hints", "http-plait"]
HTTP_WORKLOADS = {"mmlu", "hellaswag", "json"}  # few-shot, select (echoed logprobs), regex


@pytest.fixture(scope="module")
def rows():
    args = paper_programs.build_parser().parse_args(
        ["--scale", "0.01", "--parallel", "8", "--max-total-tokens", "8192", "--warm", "0"]
    )
    return paper_programs.run_drivers(
        args, paper_programs.select_workloads(args), DRIVERS, {"http-plait": HTTP_WORKLOADS}
    )


def test_every_workload_runs_on_every_driver_without_errors(rows):
    expected = [(w, d) for w in paper_workloads.NAMES for d in DRIVERS if d != "http-plait" or w in HTTP_WORKLOADS]
    assert [(r.workload, r.driver) for r in rows] == expected
    for r in rows:
        assert r.errors == 0, r
        assert r.programs >= 2 and r.wall_s > 0 and r.latency_p99_s >= r.latency_mean_s > 0, r
        assert r.prompt_tokens > 0, r


def test_fixed_lengths_give_the_drivers_the_same_output_tokens(rows):
    """Free gens ignore EOS and stops; a select generates nothing; regex fields may end at other lengths; the
    DSL's run_batch prefills of shared segments generate a token each."""
    by = {(r.workload, r.driver): r.output_tokens for r in rows}
    assert by[("hellaswag", "dsl-hints")] == by[("hellaswag", "http-plait")] == 0
    assert by[("agents", "dsl-hints")] > 0 and by[("tot", "dsl-hints")] > 0
    assert by[("mmlu", "dsl-hints")] >= by[("mmlu", "http-plait")] == len(paper_workloads.all_workloads(0.01)[0].batch)
    assert by[("json", "http-plait")] > 0 and by[("json", "dsl-hints")] > 0


def test_shared_prefixes_are_cached_and_answers_are_scored(rows):
    by = {(r.workload, r.driver): r for r in rows}
    for d in DRIVERS:  # each run starts from an empty cache; the plait server reports cached tokens over HTTP
        assert by[("mmlu", d)].cached_share is not None and 0.3 < by[("mmlu", d)].cached_share < 1.0, by[("mmlu", d)]
    for name in ("mmlu", "hellaswag", "json"):
        assert all(0.0 <= by[(name, d)].accuracy <= 1.0 for d in DRIVERS)
    assert by[("tot", "dsl-hints")].accuracy is None
