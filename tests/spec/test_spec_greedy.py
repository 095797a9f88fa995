"""Greedy outputs with speculation are token for token those without, on the default model (SmolLM2-135M),
in-process schedulers driven step by step (no subprocess): NGRAM prompt lookup and grammar-forced drafts,
alone and batched, with the radix cache on (a second round hits it), chunked prefill, a pool small
enough to retract, regex / JSON / EBNF constraints, stop strings and logprobs. The reference is plain
decoding (constrained: neither jump-forward nor drafts). The integrity check runs after every step.
"""

from __future__ import annotations

import json

import pytest
from plait.runtime.io_struct import TokenizedGenerateReq
from plait.runtime.request_options import RequestOptions
from plait.runtime.sampling_params import SamplingParams
from plait.runtime.scheduler.scheduler import create_scheduler
from plait.runtime.server_args import ServerArgs

PASSAGE = (
    "The old lighthouse on the northern cliff was built in 1871 by a shipwright named Elias Morrow, "
    "who carried every stone up the path himself. Its lamp burned whale oil until 1903, then kerosene, "
    "and finally electricity after the war."
)
SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "year": {"type": "integer"},
            "fuel": {"enum": ["whale oil", "kerosene", "electricity"]},
        },
        "required": ["name", "year", "fuel"],
    }
)
EBNF = 'root ::= "Answer: " ("yes" | "no") ", because " [a-z ]+ "."'


def chat(tok, text: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.fixture(scope="module")
def schedulers(default_model_path):
    made = {}

    def get(name: str, **kw):
        if name not in made:
            kw.setdefault("max_total_tokens", 4096)  # the CPU default (65,536) is 3 GB of KV for this model
            args = ServerArgs(model_path=default_model_path, device="cpu", num_threads=1, **kw)
            made[name] = create_scheduler(args, default_model_path)
        return made[name]

    yield get
    made.clear()


def plain(schedulers):
    return schedulers("plain", disable_jump_forward=True)


def speculating(schedulers):
    return schedulers("ngram", speculative_algorithm="NGRAM")


def run(s, reqs: list[tuple[str, list[int], dict]], **flags) -> dict:
    for rid, ids, sp in reqs:
        s.handle_message(TokenizedGenerateReq(list(ids), SamplingParams(**sp), RequestOptions(rid=rid, **flags)))
    out: dict = {}
    for _ in range(2000):
        s.step()
        assert s.check_integrity(), s.last_integrity_error
        for o in s.collect_outputs():
            ids, lps = out.setdefault(o.rid, ([], []))[:2]
            ids.extend(o.new_ids)
            lps.extend(o.output_token_logprobs)
            if o.finished_reason is not None:
                out[o.rid] = (ids, lps, o.finished_reason, o.final_text)
        if s.is_idle():
            assert s.check_integrity(), s.last_integrity_error
            return out
    raise AssertionError("the scheduler did not go idle")


def tokens(out: dict) -> dict:
    return {rid: (v[0], v[2], v[3]) for rid, v in out.items()}


def workload(tok) -> list[tuple[str, list[int], dict]]:
    """Greedy requests, one of each kind (kept short: the test runs on a shared 2-core CPU)."""
    reqs = [
        ("copy", chat(tok, f"Repeat this passage word for word: {PASSAGE}"), dict(max_new_tokens=24)),
        (
            "json",
            chat(tok, f"Extract the builder's name, the year and the first fuel as JSON. {PASSAGE}"),
            dict(max_new_tokens=36, json_schema=SCHEMA),
        ),
        (
            "regex",
            chat(tok, f"When was the lighthouse built? {PASSAGE}"),
            dict(max_new_tokens=20, regex=r"It was built in [0-9]{4} by [A-Z][a-z]+ [A-Z][a-z]+\."),
        ),
        ("ebnf", chat(tok, f"Was the lamp electric in 1900? {PASSAGE}"), dict(max_new_tokens=16, ebnf=EBNF)),
        ("free", chat(tok, "Write a short poem about the sea."), dict(max_new_tokens=12)),
        ("stop", chat(tok, f"Repeat this passage word for word: {PASSAGE}"), dict(max_new_tokens=32, stop=["whale"])),
    ]
    return greedy(reqs)


def greedy(reqs):
    return [(rid, ids, {**sp, "temperature": 0}) for rid, ids, sp in reqs]


@pytest.fixture(scope="module")
def reference(schedulers, default_tokenizer) -> dict:
    """Plain decoding's outputs, the requests in one batch (in float32 on the CPU a request's greedy output
    does not depend on its batch: test_correctness_vs_hf checks both against transformers)."""
    return tokens(run(plain(schedulers), workload(default_tokenizer)))


def test_each_request_alone_matches_plain_decoding(schedulers, default_tokenizer, reference):
    spec = speculating(schedulers)
    for req in workload(default_tokenizer):
        if req[0] in ("copy", "json"):  # the others alone: the grammar-drafts test; all of them batched
            assert tokens(run(spec, [req]))[req[0]] == reference[req[0]], req[0]
    st = spec.get_stats()
    assert st["spec_verify_steps"] > 0 and st["avg_spec_accept_length"] > 1.5
    assert st["spec_accepted_tokens"] <= st["spec_draft_tokens"]


def test_batched_with_the_cache_hit_on_a_second_round_matches(schedulers, default_tokenizer, reference):
    spec = speculating(schedulers)
    reqs = workload(default_tokenizer)
    want = reference
    assert tokens(run(spec, reqs)) == want
    before = spec.get_stats()["cached_tokens"]
    assert tokens(run(spec, [(f"{rid}2", ids, sp) for rid, ids, sp in reqs])) == {
        f"{rid}2": v for rid, v in want.items()
    }
    assert spec.get_stats()["cached_tokens"] > before


def test_logprobs_are_the_targets_for_every_accepted_token(schedulers, default_tokenizer):
    ref, spec = plain(schedulers), speculating(schedulers)
    reqs = [r for r in workload(default_tokenizer) if r[0] == "copy"]
    want = run(ref, reqs, return_logprob=True, top_logprobs_num=2)
    got = run(spec, reqs, return_logprob=True, top_logprobs_num=2)
    for rid in want:
        assert got[rid][0] == want[rid][0]
        # one logprob per token; a verify step's logits and a decode step's round differently (other shapes)
        assert [t for _, t, _ in got[rid][1]] == [t for _, t, _ in want[rid][1]] == got[rid][0]
        for (a, _, _), (b, _, _) in zip(got[rid][1], want[rid][1]):
            assert abs(a - b) < 1e-3


def test_chunked_prefill_and_a_small_pool(schedulers, default_tokenizer, reference):
    """Prompts of ~90 tokens in chunks of 64, in a pool that holds about half the batch at once (admission
    waits for room; retraction under speculation: test_spec_scheduler.py, test_spec_drafters.py)."""
    reqs = [r for r in workload(default_tokenizer) if r[0] in ("copy", "json", "stop")]
    tight = schedulers(
        "tight", speculative_algorithm="NGRAM", chunked_prefill_size=64, max_total_tokens=200, disable_radix_cache=True
    )
    assert tokens(run(tight, reqs)) == {r[0]: reference[r[0]] for r in reqs}
    assert tight.timer.report()["prefill"]["steps"] > len(reqs)  # the long prompts went in two chunks


def test_grammar_drafts_alone_match_plain_constrained_decoding_and_take_fewer_steps(
    schedulers, default_tokenizer, reference
):
    drafts_only = schedulers("grammar", speculative_grammar_drafts="on")
    for req in [r for r in workload(default_tokenizer) if r[0] in ("json", "regex")]:
        assert tokens(run(drafts_only, [req]))[req[0]] == reference[req[0]], req[0]
    rep = drafts_only.timer.report()
    # one decode step per token without drafts: the outputs' tokens, less the prefills' first ones
    plain_steps = sum(len(reference[rid][0]) - 1 for rid in ("json", "regex"))
    # (near the end of a budget, where the closer chooses, greedy drafts are verified too: keeps_verified)
    assert rep["decode"]["steps"] + rep["verify"]["steps"] < 0.6 * plain_steps
    assert drafts_only.get_stats()["jump_forward_events"] == 0


def test_sampled_requests_speculate_and_finish(schedulers, default_tokenizer):
    # (the cost model off: whether it verifies this one request depends on the step times the module's
    # earlier tests left it; here rejection sampling's path is under test)
    spec = schedulers("ngram, every draft", speculative_algorithm="NGRAM", disable_speculative_adaptive=True)
    reqs = [
        (
            f"s{i}",
            chat(default_tokenizer, f"Repeat this passage word for word: {PASSAGE}"),
            dict(max_new_tokens=16, temperature=0.7, top_p=0.9),
        )
        for i in range(1)
    ]
    before = spec.get_stats()["spec_verify_steps"]
    out = run(spec, reqs)
    assert all(len(v[0]) > 0 for v in out.values())
    assert spec.get_stats()["spec_verify_steps"] > before
