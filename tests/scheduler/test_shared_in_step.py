"""Prefixes shared inside one prefill batch (scheduler/admission.py, `SharedInStep`): a waiting request that
shares a long enough uncached prefix with one admitted before it in the same batch reads that part from it in
the same forward, so the prefix is computed once and nobody waits a step for it. In-process on a tiny random
model: exact batch shapes and table rows, the slot accounting after every step, and every greedy output equal
to the same prompt run alone (which computes its whole prompt itself)."""

from __future__ import annotations

import pytest
from plait.runtime.io_struct import TokenizedGenerateReq
from plait.runtime.request_options import RequestOptions
from plait.runtime.sampling_params import SamplingParams
from test_scheduler_state import make_scheduler, run_until_idle, submit

GREEDY = dict(temperature=0, ignore_eos=True)


def alone(path, prompts: dict, max_new_tokens: int, **kw) -> dict:
    """Each prompt's greedy tokens from a scheduler of its own (nothing cached, nothing shared)."""
    out = {}
    for rid, ids in prompts.items():
        s = make_scheduler(path, max_total_tokens=1024, **kw)
        submit(s, rid, ids, max_new_tokens=max_new_tokens, **GREEDY)
        out[rid] = run_until_idle(s)[rid].new_ids
    return out


def row(s, rid: str, n: int) -> list[int]:
    r = s.queues.by_rid[rid]
    return s.kv.req_to_token.host[r.req_pool_idx, :n].tolist()


def test_a_shared_uncached_prefix_is_computed_once_in_the_same_step(random_models):
    path = random_models["llama"]
    s = make_scheduler(path, max_total_tokens=1024)
    shared = list(range(2, 66))  # 64 tokens, longer than the sharing threshold
    prompts = {f"q{i}": shared + [100 + i, 120 + i] for i in range(4)}
    for rid, ids in prompts.items():
        submit(s, rid, ids, max_new_tokens=3, **GREEDY)
    first = s.step()
    # One step for all four: q0 computes the 64 shared tokens, the others their own two.
    assert [r.rid for r in first.reqs] == ["q0", "q1", "q2", "q3"]
    assert first.prefix_lens == [0, 64, 64, 64] and first.extend_lens == [66, 2, 2, 2]
    assert [(x.req.rid, x.source.rid, x.start, x.end) for x in first.shared] == [
        ("q1", "q0", 0, 64),
        ("q2", "q0", 0, 64),
        ("q3", "q0", 0, 64),
    ]
    assert row(s, "q1", 64) == row(s, "q2", 64) == row(s, "q3", 64) == row(s, "q0", 64)
    assert s.kv.cache.peek_prefix_len(shared) == 64  # q0's insert; the others found their slots in the tree
    finals = run_until_idle(s)
    assert {rid: o.new_ids for rid, o in finals.items()} == alone(path, prompts, 3)
    assert [finals[f"q{i}"].cached_tokens for i in range(4)] == [0, 64, 64, 64]
    assert s.stats["cached_tokens"] == 3 * 64


def test_a_chat_templates_system_prompt_is_prefilled_once(random_models):
    # SmolLM2's template puts ~20 tokens of system prompt before every user turn: requests batched together
    # share that much, and all of them are prefilled in the first step.
    s = make_scheduler(random_models["llama"], max_total_tokens=1024)
    system = list(range(2, 22))  # 20 tokens
    for i in range(3):
        submit(s, f"q{i}", system + [100 + i] * 8, max_new_tokens=1, temperature=0)
    first = s.step()
    assert [r.rid for r in first.reqs] == ["q0", "q1", "q2"]
    assert first.prefix_lens == [0, 20, 20] and first.extend_lens == [28, 8, 8]
    run_until_idle(s)


def test_short_shared_prefix_is_computed_by_each(random_models):
    s = make_scheduler(random_models["llama"], max_total_tokens=1024)
    for i in range(3):
        submit(s, f"q{i}", [5, 6, 7, 8] + [100 + i], max_new_tokens=1, temperature=0)
    first = s.step()
    assert len(first.reqs) == 3 and first.prefix_lens == [0, 0, 0] and not first.shared
    run_until_idle(s)


def test_reading_from_a_request_that_reads_from_another_and_computes_duplicates(random_models):
    """b computes 10 tokens a computes too (too few to share: b's copies are freed as duplicates when b is
    inserted), c reads 50 tokens from b (b's copies among them) and d is a's prompt again (all but its last
    token read from a). After the step every row holds only slots the tree owns, and the outputs are as alone."""
    path = random_models["llama"]
    s = make_scheduler(path, max_total_tokens=1024)
    p, q = list(range(2, 42)), list(range(200, 240))
    prompts = {"a": p + [50], "b": p[:10] + q, "c": p[:10] + q + [51, 52], "d": p + [50]}
    for rid, ids in prompts.items():
        submit(s, rid, ids, max_new_tokens=3, **GREEDY)
    first = s.step()
    assert [r.rid for r in first.reqs] == ["a", "b", "c", "d"]
    assert [(x.req.rid, x.source.rid, x.start, x.end) for x in first.shared] == [("c", "b", 0, 50), ("d", "a", 0, 40)]
    assert first.prefix_lens == [0, 0, 50, 40] and first.extend_lens == [41, 50, 2, 1]
    assert row(s, "b", 10) == row(s, "a", 10)  # b's duplicates swapped for a's at b's insert...
    assert row(s, "c", 50) == row(s, "b", 50)  # ...and c followed b: no row keeps a freed slot
    assert row(s, "d", 41) == row(s, "a", 41)  # (d's 41st token is its own: its slot is a duplicate of a's)
    finals = run_until_idle(s)  # (integrity and the host table checked after every step)
    assert {rid: o.new_ids for rid, o in finals.items()} == alone(path, prompts, 3)
    assert s.kv.allocator.available() + s.kv.cache.evictable_size() == s.kv.total


@pytest.mark.parametrize("page_size", [4])
def test_shared_parts_end_on_a_page_boundary(random_models, page_size):
    path = random_models["llama"]
    s = make_scheduler(path, max_total_tokens=1024, page_size=page_size)
    shared = list(range(2, 32))  # 30 tokens: 28 of them in whole pages
    prompts = {"a": shared + [60, 61], "b": shared + [70, 71, 72]}
    for rid, ids in prompts.items():
        submit(s, rid, ids, max_new_tokens=3, **GREEDY)
    first = s.step()
    assert [(x.req.rid, x.start, x.end) for x in first.shared] == [("b", 0, 28)]
    assert first.prefix_lens == [0, 28] and first.extend_lens == [32, 5]
    finals = run_until_idle(s)
    assert {rid: o.new_ids for rid, o in finals.items()} == alone(path, prompts, 3, page_size=page_size)


def test_a_request_asking_for_prompt_logprobs_computes_the_positions_it_asked_for(random_models):
    path = random_models["llama"]
    shared = list(range(2, 42))

    def lp_request(s):
        opts = RequestOptions(rid="lp", return_logprob=True, logprob_start_len=30)
        s.handle_message(TokenizedGenerateReq(shared + [80, 81], SamplingParams(max_new_tokens=2, **GREEDY), opts))

    together = make_scheduler(path, max_total_tokens=1024)
    submit(together, "a", shared + [70], max_new_tokens=2, **GREEDY)
    lp_request(together)
    first = together.step()
    # lp reads the positions before its first logprob's predecessor (29) from a and computes the rest
    assert [(x.req.rid, x.end) for x in first.shared] == [("lp", 29)] and first.extend_lens == [41, 13]
    lp_alone = make_scheduler(path, max_total_tokens=1024)
    lp_request(lp_alone)
    outs = [run_until_idle(s)["lp"] for s in (together, lp_alone)]
    assert outs[0].new_ids == outs[1].new_ids
    (got, want) = ([(lp, tok) for lp, tok, _ in o.input_token_logprobs] for o in outs)
    assert [tok for _, tok in got] == [tok for _, tok in want] == (shared + [80, 81])[30:]
    # (float32 over a different batch: the last bits differ)
    assert [lp for lp, _ in got] == pytest.approx([lp for lp, _ in want], abs=1e-4)
