"""A step is a token budget (scheduler/planner.py), driven by a fake runner with exact state: the running
requests' decode tokens first, then prefill chunks of the chunked request, jump tails and waiting requests
under what is left of `max_num_batched_tokens`, all in one mixed forward; steps planned one token past a
step in flight read their decode rows' inputs on the device; a decode step alone may verify drafts."""

from __future__ import annotations

from helpers.fake_runner import FakeRunner, drain, fake_scheduler, step, submit
from plait.runtime.io_struct import FlushCacheReq, TokenizedGenerateReq
from plait.runtime.request_options import RequestOptions
from plait.runtime.sampling_params import SamplingParams
from plait.runtime.scheduler.queues import ReqStatus


def layout(st) -> list[tuple[int, int]]:
    """A step as (cached prefix, new tokens) per request, in step order."""
    if st.mode.is_decode():
        return [(n - 1, 1) for n in st.seq_lens]
    return list(zip(st.prefix_lens, st.extend_lens))


def script(row) -> int:
    """The fake model's next token: 2 + (prompt + outputs) % 62 (never the EOS id 1)."""
    return 2 + (len(row.prompt_ids) + len(row.output_ids)) % 62


def test_decode_tokens_first_then_prefill_chunks_under_the_budget():
    runner = FakeRunner(max_total_tokens=256, max_running_requests=8)
    s = fake_scheduler(runner, max_num_batched_tokens=16, chunked_prefill_size=16, disable_radix_cache=True)
    submit(s, "a", list(range(2, 12)), max_new_tokens=6)  # 10 tokens
    assert step(s).mode.is_extend()
    submit(s, "b", list(range(20, 50)), max_new_tokens=3)  # 30 tokens: two chunks
    submit(s, "c", list(range(60, 65)), max_new_tokens=2)  # 5 tokens
    mixed = step(s)
    # a's token first, then what is left of 16 tokens for b's first chunk; c waits behind the chunk.
    assert mixed.mode.is_extend() and mixed.num_decode == 1
    assert [r.rid for r in mixed.reqs] == ["a", "b"] and layout(runner.steps[-1]) == [(10, 1), (0, 15)]
    assert runner.steps[-1].decode_rows == 1 and runner.steps[-1].sample_rows == [0]  # b's chunk samples nothing
    b = s.queues.by_rid["b"]
    assert b.status is ReqStatus.CHUNKED and s.queues.by_rid["c"].status is ReqStatus.WAITING
    step(s)  # a again, then b's last 15 tokens (the chunk continues before any waiting request)
    assert layout(runner.steps[-1]) == [(11, 1), (15, 15)] and runner.steps[-1].sample_rows == [0, 15]
    assert b.status is ReqStatus.RUNNING and b.output_ids == [2 + 30 % 62]
    step(s)  # a and b decode, c (5 tokens) fits in what is left
    assert layout(runner.steps[-1]) == [(12, 1), (30, 1), (0, 5)]
    assert runner.steps[-1].num_tokens == 7 <= 16
    step(s)  # nothing waits: a plain decode step of everyone
    assert runner.steps[-1].mode.is_decode() and layout(runner.steps[-1]) == [(13, 1), (31, 1), (5, 1)]
    finals = drain(s)
    # Each request's tokens are the script's, as if it ran alone.
    assert finals["a"].new_ids == [2 + (10 + k) % 62 for k in range(6)]
    assert finals["b"].new_ids == [2 + (30 + k) % 62 for k in range(3)]
    assert finals["c"].new_ids == [2 + (5 + k) % 62 for k in range(2)]
    assert s.handle_message(FlushCacheReq(0)).result is True and s.kv.available() == 256


def test_every_running_request_advances_each_step_while_others_prefill():
    # Six requests arriving one step apart: once running, none ever sits out a step (the phases before
    # mixed steps stopped every running request for each arriving prefill).
    runner = FakeRunner(max_total_tokens=512, max_running_requests=8)
    s = fake_scheduler(runner, max_num_batched_tokens=32, chunked_prefill_size=32)
    arrivals = {i: (f"r{i}", list(range(10 * i + 2, 10 * i + 22))) for i in range(6)}  # 20 tokens each
    seen_running: dict[str, int] = {}
    for t in range(40):
        if t in arrivals:
            rid, ids = arrivals[t]
            submit(s, rid, ids, max_new_tokens=8)
        before = {r.rid: len(r.output_ids) for r in s.queues.running}
        step(s)
        after = {rid: len(r.output_ids) for rid, r in s.queues.by_rid.items()}
        for rid, n in before.items():
            assert after.get(rid, n + 1) == n + 1, (t, rid)  # one token more (or finished)
            seen_running[rid] = seen_running.get(rid, 0) + 1
        s.collect_outputs()
        if s.is_idle():
            break
    assert s.is_idle() and len(seen_running) == 6
    assert sum(st.decode_rows > 0 for st in runner.steps) >= 5  # the arrivals' prefills were mixed


def test_with_mixing_off_a_step_is_one_phase():
    runner = FakeRunner(max_total_tokens=256, max_running_requests=8)
    s = fake_scheduler(runner, disable_mixed_chunk=True)
    submit(s, "a", list(range(2, 12)), max_new_tokens=4)
    step(s)
    submit(s, "b", list(range(20, 30)), max_new_tokens=4)
    second = step(s)
    assert second.mode.is_extend() and [r.rid for r in second.reqs] == ["b"] and second.num_decode == 0
    assert all(st.decode_rows == 0 for st in runner.steps)
    finals = drain(s)
    assert finals["a"].new_ids == [2 + (10 + k) % 62 for k in range(4)]


def test_a_step_planned_past_the_one_in_flight_reads_its_decode_inputs_on_the_device():
    # Overlap (the GPU's path, synchronous here): each step is launched before the previous one is read
    # back; a request whose token that step samples takes it by index (prev_src), the others from the host.
    runner = FakeRunner(max_total_tokens=256, max_running_requests=8)
    s = fake_scheduler(runner, max_num_batched_tokens=24, chunked_prefill_size=24)
    s.pipeline.overlap = True
    submit(s, "a", list(range(2, 12)), max_new_tokens=5)
    step(s)  # a's prefill in flight
    assert s.pipeline.pending is not None and runner.steps[-1].prev_src is None
    submit(s, "b", list(range(20, 40)), max_new_tokens=3)  # 20 tokens
    step(s)  # a's first token (in flight) decodes beside b's prefill; then a's prefill is read back
    st = runner.steps[-1]
    assert st.decode_rows == 1 and layout(st) == [(10, 1), (0, 20)]
    assert st.prev_src.tolist() == [0] + [-1] * 20  # a's input: the prefill's sample 0
    assert st.token_rows[0, 0] == 0 and st.token_rows[0, 1:].tolist() == list(range(20, 40))
    assert s.queues.by_rid["a"].output_ids == [2 + 10 % 62]  # read back after the next step's launch
    step(s)  # a decode step of a and b, both inputs from the mixed step in flight (samples 0 and 1)
    st = runner.steps[-1]
    assert st.mode.is_decode() and st.prev_src.tolist() == [0, 1] and st.seq_lens == [12, 21]
    finals = drain(s)
    assert finals["a"].new_ids == [2 + (10 + k) % 62 for k in range(5)]
    assert finals["b"].new_ids == [2 + (20 + k) % 62 for k in range(3)]
    assert not s.pipeline.in_flight() and s.handle_message(FlushCacheReq(0)).result is True
    assert s.kv.available() == 256


def test_a_prefill_only_request_in_flight_gets_no_decode_row():
    # max_new_tokens=0: the prefill samples nothing, so the step planned past it has no token to feed it.
    runner = FakeRunner(max_total_tokens=128)
    s = fake_scheduler(runner)
    s.pipeline.overlap = True
    submit(s, "p", list(range(2, 12)), max_new_tokens=0)
    submit(s, "q", list(range(30, 40)), max_new_tokens=3)
    step(s)
    step(s)
    assert layout(runner.steps[-1]) == [(10, 1)] and runner.steps[-1].prev_src.tolist() == [
        0
    ]  # q only (p sampled none)
    finals = drain(s)
    assert finals["p"].new_ids == [] and finals["q"].new_ids == [2 + (10 + k) % 62 for k in range(3)]
    assert s.handle_message(FlushCacheReq(0)).result is True and s.kv.available() == 128


def test_a_decode_step_alone_verifies_drafts_and_a_mixed_step_does_not():
    # NGRAM drafts (the copy script: every output repeats the prompt): a decode step with drafts becomes a
    # VERIFY step of k+1 tokens per request; a step that also prefills decodes one token per request.
    def copy(row):
        seq = row.prompt_ids + row.output_ids
        return seq[len(seq) % len(row.prompt_ids)]

    runner = FakeRunner(max_total_tokens=1024, script=copy)
    s = fake_scheduler(runner, speculative_algorithm="NGRAM", speculative_num_draft_tokens=4)
    prompt = [5, 6, 7, 8] * 6
    submit(s, "a", prompt, max_new_tokens=20)
    step(s)
    step(s)
    step(s)
    submit(s, "b", list(range(30, 50)), max_new_tokens=4)
    mixed = step(s)
    assert mixed.mode.is_extend() and mixed.num_decode == 1 and runner.steps[-1].decode_rows == 1
    finals = drain(s)
    modes = [st.mode.name for st in runner.steps]
    assert "VERIFY" in modes
    seq = prompt + finals["a"].new_ids
    assert finals["a"].new_ids == [seq[i % len(prompt)] for i in range(len(prompt), len(prompt) + 20)]
    assert s.handle_message(FlushCacheReq(0)).result is True and s.kv.available() == 1024


def test_a_request_passed_over_for_cache_hits_goes_first_once_it_waited_long_enough():
    # lpm ranks cache hits first; "cold" (sharing nothing) would wait behind every hit that keeps coming.
    # Once it has waited MAX_REORDERED_WAIT_S it is admitted first, whatever its prefix.
    runner = FakeRunner(max_total_tokens=512, max_running_requests=2)
    s = fake_scheduler(runner, schedule_policy="lpm", max_num_batched_tokens=64, chunked_prefill_size=64)
    shared = list(range(2, 42))
    submit(s, "warm", shared + [50], max_new_tokens=1)
    drain(s)  # the shared prefix is cached
    submit(s, "cold", list(range(100, 140)), max_new_tokens=1)
    submit(s, "hit-1", shared + [51], max_new_tokens=1)
    submit(s, "hit-2", shared + [52], max_new_tokens=1)
    first = step(s)  # two may run: the hits, ranked by their cached prefix
    assert sorted(r.rid for r in first.reqs) == ["hit-1", "hit-2"]
    assert s.queues.by_rid["cold"].status is ReqStatus.WAITING
    drain(s)
    submit(s, "cold-2", list(range(150, 190)), max_new_tokens=1)
    submit(s, "hit-3", shared + [53], max_new_tokens=1)
    submit(s, "hit-4", shared + [54], max_new_tokens=1)
    s.queues.by_rid["cold-2"].created -= 5.0  # it has waited 5 s
    first = step(s)
    assert [r.rid for r in first.reqs][0] == "cold-2"  # then one hit (two may run)
    drain(s)


def test_waiting_requests_of_a_lower_priority_value_are_admitted_first():
    # vLLM's convention: lower first; equal priorities keep the policy's order (fcfs here: arrival).
    runner = FakeRunner(max_total_tokens=512, max_running_requests=2)
    s = fake_scheduler(runner, schedule_policy="fcfs")
    for rid, priority in (("late-0", 0), ("urgent", -5), ("late-1", 0), ("batch", 3), ("urgent-2", -5)):
        s.handle_message(
            TokenizedGenerateReq(
                list(range(10, 20)),
                SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True),
                RequestOptions(rid=rid, priority=priority),
            )
        )
    first = step(s)
    assert [r.rid for r in first.reqs] == ["urgent", "urgent-2"]
    order = []
    for _ in range(20):
        batch = step(s)
        if batch is not None:
            order += [r.rid for r in batch.prefill_part()[0]] if batch.mode.is_extend() else []
        s.collect_outputs()
        if s.is_idle():
            break
    assert order == ["late-0", "late-1", "batch"]


def test_a_priority_that_is_not_an_int_is_refused_naming_it():
    import pytest
    from plait.runtime.request_options import RequestOptionError

    with pytest.raises(RequestOptionError, match="priority must be an int") as e:
        RequestOptions(rid="x", priority="high")  # type: ignore[arg-type]
    assert e.value.field == "priority"


def test_a_long_prompt_prefills_at_most_the_threshold_a_step_beside_the_short_ones():
    # long_prefill_token_threshold (vLLM's name): a prompt takes at most 8 of the step's 32 tokens, the short
    # prompts behind it take what is left in the same step, and a second long prompt waits until the first
    # is whole (one chunked request at a time; the ones behind it wait with it: none passes another).
    runner = FakeRunner(max_total_tokens=256, max_running_requests=8)
    s = fake_scheduler(
        runner,
        max_num_batched_tokens=32,
        chunked_prefill_size=32,
        long_prefill_token_threshold=8,
        disable_radix_cache=True,
    )
    submit(s, "a", list(range(2, 8)), max_new_tokens=8)  # 6 tokens: under the threshold, whole
    assert layout(step(s) and runner.steps[-1]) == [(0, 6)]
    for rid, ids in (("b", range(20, 40)), ("c", range(60, 65)), ("d", range(70, 90)), ("e", range(100, 103))):
        submit(s, rid, list(ids), max_new_tokens=2)  # b and d: 20 tokens, c: 5, e: 3
    want = [
        [(6, 1), (0, 8), (0, 5)],  # a decodes; b's first 8; c whole; d (long, not first) waits, e with it
        [(7, 1), (5, 1), (8, 8)],  # b's next 8 before anyone waiting; d still waits
        [(8, 1), (16, 4)],  # b's last 4 (c finished)
        [(9, 1), (20, 1), (0, 8), (0, 3)],  # d first now: its first 8, and e beside it
        [(10, 1), (3, 1), (8, 8)],
        [(11, 1), (16, 4)],
    ]
    for k, layout_k in enumerate(want):
        step(s)
        assert layout(runner.steps[-1]) == layout_k, k
        assert runner.steps[-1].num_tokens <= 32
    assert s.queues.chunked is None and s.queues.by_rid["d"].status is ReqStatus.RUNNING
    finals = drain(s)
    for rid, n in (("b", 20), ("c", 5), ("d", 20), ("e", 3)):
        assert finals[rid].new_ids == [2 + (n + k) % 62 for k in range(2)], rid  # as if each ran alone
    assert finals["a"].new_ids == [2 + (6 + k) % 62 for k in range(8)]
    assert s.handle_message(FlushCacheReq(0)).result is True and s.kv.available() == 256
