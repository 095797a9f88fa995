"""Scheduler logic with exact-state assertions, in-process, on a tiny random model (the KV-memory
primitives it stands on: test_kv_memory.py).

No subprocess: the Scheduler is driven message by message and step by step, and its pools are
inspected directly.
"""

from __future__ import annotations

import pytest
from plait.runtime.io_struct import (
    AbortReq,
    FlushCacheReq,
    GetStatsReq,
    PinPrefixReq,
    TokenizedGenerateReq,
    UnpinPrefixReq,
)
from plait.runtime.request_options import RequestOptions
from plait.runtime.sampling_params import SamplingParams
from plait.runtime.scheduler.scheduler import Scheduler, create_scheduler
from plait.runtime.server_args import ServerArgs


def make_scheduler(path, **kw) -> Scheduler:
    args = ServerArgs(model_path=path, device="cpu", **kw)
    return create_scheduler(args, path)


def submit(s: Scheduler, rid: str, ids: list[int], **sp) -> None:
    s.handle_message(TokenizedGenerateReq(ids, SamplingParams(**sp), RequestOptions(rid=rid)))


def assert_host_table_matches(s: Scheduler) -> None:
    """The scheduler reads KV slots from its host copy of req_to_token: it must equal the real one."""
    live = s.queues.running + s.queues.jump_tails + ([s.queues.chunked] if s.queues.chunked else [])
    for r in live:
        if r.req_pool_idx is not None:
            host = s.kv.req_to_token.host[r.req_pool_idx, : r.kv_len].tolist()
            assert host == s.kv.req_to_token.req_to_token[r.req_pool_idx, : r.kv_len].tolist(), r.rid


def run_until_idle(s: Scheduler, max_steps: int = 1000) -> dict:
    finals = {}
    for _ in range(max_steps):
        s.step()
        assert_host_table_matches(s)
        s.check_integrity()  # the KV slot accounting holds after every step, a step in flight or not
        assert s.last_integrity_error is None, s.last_integrity_error
        for o in s.collect_outputs():
            if o.finished_reason is not None:
                finals[o.rid] = o
        if s.is_idle():
            return finals
    raise AssertionError("scheduler did not go idle")


def test_prefill_then_decode_exact_state(random_models):
    s = make_scheduler(random_models["llama"], disable_radix_cache=True, max_total_tokens=64, max_running_requests=4)
    submit(s, "a", [5, 6, 7, 8, 9], max_new_tokens=3, temperature=0, ignore_eos=True)
    submit(s, "b", [10, 11, 12], max_new_tokens=3, temperature=0, ignore_eos=True)
    batch = s.step()  # one prefill step for both
    assert batch.mode.is_extend() and batch.extend_lens == [5, 3] and batch.prefix_lens == [0, 0]
    a, b = s.queues.running
    assert (a.kv_len, b.kv_len) == (5, 3) and len(a.output_ids) == len(b.output_ids) == 1
    assert s.kv.allocator.available() == 64 - 8
    rows = s.kv.req_to_token.req_to_token
    assert sorted(rows[a.req_pool_idx, :5].tolist() + rows[b.req_pool_idx, :3].tolist()) == list(range(1, 9))
    batch = s.step()  # decode: one new slot each
    assert batch.mode.is_decode() and s.kv.allocator.available() == 64 - 10
    assert (a.kv_len, b.kv_len) == (6, 4)
    finals = run_until_idle(s)
    assert set(finals) == {"a", "b"}
    assert all(f.finished_reason == {"type": "length", "length": 3} for f in finals.values())
    assert s.kv.allocator.available() == 64
    s.kv.cache.check_integrity()
    assert s.kv.req_to_token.available() == s.kv.req_to_token.size


def test_chunked_prefill_splits_long_prompt(random_models):
    s = make_scheduler(
        random_models["llama"],
        disable_radix_cache=True,
        max_total_tokens=128,
        chunked_prefill_size=8,
        max_prefill_tokens=8,
    )
    submit(s, "long", list(range(2, 22)), max_new_tokens=2, temperature=0, ignore_eos=True)  # 20 tokens
    sizes = []
    for _ in range(3):
        b = s.step()
        sizes.append((b.prefix_lens[0], b.extend_lens[0]))
    assert sizes == [(0, 8), (8, 8), (16, 4)]
    run_until_idle(s)
    assert s.kv.allocator.available() == 128


def test_retraction_when_kv_runs_out(random_models):
    # 20 slots: both requests are admitted (admission reserves only part of max_new_tokens), but
    # together they need 2 * (2 + 10) = 24 slots: one is retracted and resumed later.
    s = make_scheduler(random_models["llama"], disable_radix_cache=True, max_total_tokens=20)
    alone = make_scheduler(random_models["llama"], disable_radix_cache=True, max_total_tokens=64)
    for sched in (s, alone):
        submit(sched, "x", [2, 3], max_new_tokens=10, temperature=0, ignore_eos=True)
        submit(sched, "y", [20, 21], max_new_tokens=10, temperature=0, ignore_eos=True)
    finals, expected = run_until_idle(s), run_until_idle(alone)
    assert s.stats["num_retractions"] >= 1 and alone.stats["num_retractions"] == 0
    # Identical greedy output after resuming.
    assert {k: v.new_ids for k, v in finals.items()} == {k: v.new_ids for k, v in expected.items()}
    assert all(len(f.new_ids) == 10 for f in finals.values())
    assert s.kv.allocator.available() == 20
    s.kv.cache.check_integrity()


def test_request_that_can_never_fit_is_rejected(random_models):
    s = make_scheduler(random_models["llama"], disable_radix_cache=True, max_total_tokens=16)
    submit(s, "big", list(range(2, 40)), max_new_tokens=2)
    outs = s.collect_outputs()
    assert outs[0].rid == "big" and outs[0].finished_reason["type"] == "abort"
    assert "cannot fit" in outs[0].finished_reason["message"]
    assert s.is_idle()


def test_a_request_that_fails_to_be_added_is_aborted_and_the_scheduler_serves_on(random_models):
    s = make_scheduler(random_models["llama"], disable_radix_cache=True, max_total_tokens=64)
    # A seed past 64 bits, sent without the tokenizer manager's checks: the generator refuses it.
    submit(s, "bad", [3, 4, 5], max_new_tokens=2, temperature=1.0, seed=10**23)
    outs = s.collect_outputs()
    assert [o.rid for o in outs] == ["bad"] and outs[0].finished_reason["type"] == "abort"
    assert "refused the request" in outs[0].finished_reason["message"]
    assert "bad" not in s.queues.by_rid and not s.queues.waiting
    submit(s, "good", [3, 4, 5], max_new_tokens=2, temperature=0, ignore_eos=True)
    finals = run_until_idle(s)
    assert finals["good"].finished_reason == {"type": "length", "length": 2}
    assert s.kv.allocator.available() == 64


def test_abort_waiting_and_running(random_models):
    s = make_scheduler(random_models["llama"], disable_radix_cache=True, max_total_tokens=64)
    submit(s, "run", [3, 4, 5], max_new_tokens=50, temperature=0, ignore_eos=True)
    s.step()
    submit(s, "wait", [6, 7], max_new_tokens=5)
    s.handle_message(AbortReq("wait"))
    s.handle_message(AbortReq("run"))
    finals = run_until_idle(s)
    assert finals["wait"].finished_reason["type"] == "abort"
    assert finals["run"].finished_reason["type"] == "abort"
    assert s.kv.allocator.available() == 64


def test_flush_cache_refused_while_busy(random_models):
    s = make_scheduler(random_models["llama"], max_total_tokens=64)
    submit(s, "a", [3, 4, 5], max_new_tokens=4, temperature=0, ignore_eos=True)
    assert s.handle_message(FlushCacheReq(1)).result is False
    run_until_idle(s)
    assert s.kv.cache.evictable_size() > 0
    assert s.handle_message(FlushCacheReq(2)).result is True
    assert s.kv.cache.evictable_size() == 0 and s.kv.allocator.available() == 64


@pytest.mark.parametrize("disable_radix_cache", [True, False])
def test_chunked_prefill_under_memory_pressure_loses_nothing(random_models, disable_radix_cache):
    # Tiny chunks and a pool that cannot hold every request's decode: chunked requests must resume
    # (never be dropped) and every request must produce the same tokens as without pressure.
    prompts = [list(range(2, 2 + n)) for n in (5, 17, 4, 9, 22)]
    outs = {}
    for total in (64, 4096):
        s = make_scheduler(
            random_models["llama"],
            disable_radix_cache=disable_radix_cache,
            max_total_tokens=total,
            chunked_prefill_size=7,
            max_prefill_tokens=7,
        )
        for i, p in enumerate(prompts):
            submit(s, f"r{i}", p, max_new_tokens=12, temperature=0, ignore_eos=True)
        finals = run_until_idle(s)
        assert sorted(finals) == [f"r{i}" for i in range(5)]
        s.check_integrity()
        assert s.last_integrity_error is None
        outs[total] = {k: v.new_ids for k, v in finals.items()}
    assert outs[64] == outs[4096]


@pytest.mark.parametrize("max_running", [256, 2])
def test_overlap_schedule_gives_identical_outputs_and_frees_everything(random_models, max_running):
    # Overlap scheduling launches decode step i+1 before reading step i back; requests finishing at
    # step i get one discarded extra step. On the CPU the launch is synchronous, but the bookkeeping
    # (device-side input tokens, in-flight slots, late finishes, aborts) is the same as on a GPU.
    # With max_running 2 the pipeline keeps breaking for admissions (waiting requests, full batch).
    prompts = [list(range(2, 2 + n)) for n in (5, 17, 4, 9, 22, 3)]
    lengths = [3, 11, 7, 1, 12, 5]
    results = {}
    for overlap in (False, True):
        s = make_scheduler(random_models["llama"], max_total_tokens=512, max_running_requests=max_running)
        s.pipeline.overlap = overlap
        for i, (p, n) in enumerate(zip(prompts, lengths)):
            submit(s, f"r{i}", p, max_new_tokens=n, temperature=0, ignore_eos=True)
        submit(s, "stopper", [7, 8, 9], max_new_tokens=30, temperature=0, stop_token_ids=list(range(2, 256)))
        finals = run_until_idle(s)
        s.check_integrity()
        assert s.last_integrity_error is None
        assert s.kv.allocator.available() + s.kv.cache.evictable_size() == 512
        results[overlap] = {k: (v.new_ids, v.finished_reason) for k, v in finals.items()}
        if overlap:
            assert s.pipeline.pending is None
    assert results[True] == results[False]
    assert [len(results[True][f"r{i}"][0]) for i in range(6)] == lengths


def test_overlap_abort_mid_flight_frees_slots(random_models):
    s = make_scheduler(random_models["llama"], max_total_tokens=256, disable_radix_cache=True)
    s.pipeline.overlap = True
    submit(s, "a", [3, 4, 5], max_new_tokens=40, temperature=0, ignore_eos=True)
    submit(s, "b", [6, 7], max_new_tokens=40, temperature=0, ignore_eos=True)
    for _ in range(4):
        s.step()
    assert s.pipeline.pending is not None
    s.handle_message(AbortReq("a"))
    finals = run_until_idle(s)
    assert finals["a"].finished_reason["type"] == "abort"
    assert len(finals["b"].new_ids) == 40
    assert s.kv.allocator.available() == 256


def test_a_failed_prefill_step_aborts_its_requests_too(random_models):
    # The requests of a prefill batch that raises are neither waiting nor running yet: fail_all must
    # still give them a final output, or their callers wait forever.
    s = make_scheduler(random_models["llama"], max_total_tokens=256)
    submit(s, "a", [3, 4, 5], max_new_tokens=4, temperature=0)
    submit(s, "b", [6, 7], max_new_tokens=4, temperature=0)

    def broken_forward(*args, **kwargs):
        raise RuntimeError("device lost")

    s.runner.model.forward = broken_forward
    with pytest.raises(RuntimeError):
        s.step()
    s.fail_all("RuntimeError: device lost")
    finals = {o.rid: o for o in s.collect_outputs()}
    assert set(finals) == {"a", "b"}
    assert all(
        o.finished_reason == {"type": "abort", "message": "internal error: RuntimeError: device lost"}
        for o in finals.values()
    )
    assert s.is_idle()


def test_pins_with_a_ttl_expire(random_models):
    import time as _time

    s = make_scheduler(random_models["llama"], max_total_tokens=256)
    submit(s, "a", list(range(2, 40)), max_new_tokens=0)
    run_until_idle(s)
    pinned = s.handle_message(PinPrefixReq(1, token_ids=list(range(2, 40)), ttl=0.05)).result
    kept = s.handle_message(PinPrefixReq(2, token_ids=list(range(2, 40)))).result
    assert pinned["pinned_tokens"] == 38 and s.kv.cache.protected_size() == 38
    _time.sleep(0.1)
    stats = s.handle_message(GetStatsReq(3)).result
    assert pinned["pin_id"] not in s.kv.pins and kept["pin_id"] in s.kv.pins
    assert stats["protected_tokens"] == 38  # the pin without a ttl still holds the prefix
    assert s.handle_message(UnpinPrefixReq(4, pin_id=kept["pin_id"])).result is True
    assert s.kv.cache.protected_size() == 0
    s.check_integrity()
    assert s.last_integrity_error is None


def test_prefill_warm_up_runs_and_gives_every_slot_back(random_models):
    from plait.runtime.executor.warmup import WARMUP_PROMPT_TOKENS, warm_up_prefill

    s = make_scheduler(random_models["llama"], max_total_tokens=512, max_running_requests=4)
    slots, rows = s.kv.allocator.available(), s.kv.req_to_token.available()
    calls = []
    run = s.runner.run
    s.runner.run = lambda batch: calls.append((batch.prefix_lens, batch.extend_lens)) or run(batch)
    warm_up_prefill(s.runner.run, s.runner.allocator, s.runner.req_to_token_pool, s.runner.info.vocab_size)
    # Both prompts whole, then the second over a cached prefix of half its length.
    half = WARMUP_PROMPT_TOKENS[1] // 2
    assert calls == [([0, 0], list(WARMUP_PROMPT_TOKENS)), ([half], [WARMUP_PROMPT_TOKENS[1] - half])]
    assert (s.kv.allocator.available(), s.kv.req_to_token.available()) == (slots, rows)
    # A pool too small for it (a test setup) is left alone.
    small = make_scheduler(random_models["llama"], max_total_tokens=64, max_running_requests=4)
    small.runner.run = lambda batch: pytest.fail("warm-up ran on a 64-slot pool")
    warm_up_prefill(small.runner.run, small.runner.allocator, small.runner.req_to_token_pool, 512)


def test_in_flight_prefixes_agree_with_comparing_every_pair():
    import random

    from plait.runtime.scheduler import admission
    from plait.runtime.scheduler.admission import InFlightPrefixes

    rng = random.Random(0)
    base = [rng.randrange(3) for _ in range(40)]
    for max_indexed in (8, 1):  # indexed windows, and the linear scan past the index limit
        admission.MAX_INDEXED_WINDOWS, saved = max_indexed, admission.MAX_INDEXED_WINDOWS
        try:
            flight, seqs = InFlightPrefixes(4), []
            for _ in range(200):
                ids = base[: rng.randrange(0, 40)] + [rng.randrange(3) for _ in range(rng.randrange(1, 12))]
                need = rng.randrange(4, 12) if rng.random() < 0.5 else rng.choice((8, 20))
                if len(ids) >= need:
                    expect = any(length >= need and other[:need] == ids[:need] for other, length in seqs)
                    assert flight.shares(ids, need) == expect, (ids, need)
                length = rng.randrange(1, len(ids) + 1)
                flight.add(ids, length)
                seqs.append((ids, length))
        finally:
            admission.MAX_INDEXED_WINDOWS = saved


def test_token_prefix_is_fill_ids_prefix():
    from plait.runtime.request import Req
    from plait.runtime.scheduler.admission import token_prefix

    r = Req("a", [1, 2, 3], SamplingParams())
    r.output_ids[:] = [4, 5]
    assert [token_prefix(r, n) for n in (0, 2, 3, 4, 5)] == [r.fill_ids[:n] for n in (0, 2, 3, 4, 5)]


def test_lpm_ranked_admission_matches_exactly_what_a_fresh_match_finds(random_models):
    # The admission reuses the lpm ranking's walk of each whole sequence for its match of all but the
    # last token; where that walk went as far as the shorter prefix, the prefix is walked again.
    s = make_scheduler(random_models["llama"], max_total_tokens=1024, schedule_policy="lpm")
    prompt = list(range(10, 30))  # 20 tokens
    submit(s, "parent", prompt, max_new_tokens=3, temperature=0, ignore_eos=True)
    generated = []
    while not s.is_idle():
        s.step()
        generated += [t for o in s.collect_outputs() for t in o.new_ids]
    full = prompt + generated
    cached = len(prompt) + 2  # the last generated token's KV was never computed
    queried_before = s.kv.cache.hit_stats.queried_tokens
    submit(s, "fork", prompt[:10] + [50, 51, 52], max_new_tokens=1, temperature=0, ignore_eos=True)
    submit(s, "same", list(prompt), max_new_tokens=1, temperature=0, ignore_eos=True)
    submit(s, "child", full + [40, 41, 42], max_new_tokens=1, temperature=0, ignore_eos=True)
    batch = s.step()
    # lpm order (the longest cached prefix first) and exact cached prefixes.
    assert list(zip((r.rid for r in batch.reqs), batch.prefix_lens)) == [
        ("child", cached),
        ("same", len(prompt) - 1),
        ("fork", 10),
    ]
    assert s.kv.cache.hit_stats.queried_tokens - queried_before == (len(full) + 2) + (len(prompt) - 1) + 12
    run_until_idle(s)
    s.check_integrity()
    assert s.last_integrity_error is None


def test_lpm_ranks_a_waiting_request_again_once_its_prefix_was_cached(random_models):
    # The ranking keeps each waiting request's lookup between steps; once the first request's prefill
    # inserted the prefix that a waiting request shares, that request ranks ahead again.
    s = make_scheduler(
        random_models["llama"],
        max_total_tokens=1024,
        schedule_policy="lpm",
        max_prefill_tokens=45,
        chunked_prefill_size=45,
    )
    shared, other = list(range(10, 50)), list(range(50, 90))  # 40 tokens each
    submit(s, "a", shared + [1], max_new_tokens=4, temperature=0, ignore_eos=True)
    submit(s, "c", other + [3], max_new_tokens=4, temperature=0, ignore_eos=True)
    submit(s, "b", shared + [2], max_new_tokens=4, temperature=0, ignore_eos=True)
    first = s.step()
    assert [r.rid for r in first.reqs] == ["a"]  # nothing cached: arrival order, then the budget
    second = s.step()
    assert second.mode.is_extend()
    # ("a" decodes its second token first, in the same step)
    assert list(zip((r.rid for r in second.reqs), second.prefix_lens)) == [("a", 41), ("b", 40), ("c", 0)]
    run_until_idle(s)


def test_intake_takes_the_messages_id_list_over_and_never_changes_it(random_models):
    s = make_scheduler(random_models["llama"], max_total_tokens=1024)
    ids = list(range(10, 40))
    submit(s, "a", ids, max_new_tokens=3, temperature=0, ignore_eos=True)
    assert s.queues.waiting[0].origin_input_ids is ids  # no copy at intake
    run_until_idle(s)
    assert ids == list(range(10, 40))
