"""The scheduler's parts driven by a fake step runner (no model): admission, chunking, retraction,
jump-forward tails, pins and aborts, with exact state after each step (the statuses of requests, the
queues, the slots, and the steps the runner was handed). The tiny-model tests above them
(test_scheduler_state.py, test_scheduler_adversarial.py) are the integration layer."""

from __future__ import annotations

import pytest
from helpers.fake_runner import FakeRunner, drain, fake_scheduler, step, submit
from plait.runtime.io_struct import (
    AbortReq,
    CheckIntegrityReq,
    FlushCacheReq,
    GetStatsReq,
    PinPrefixReq,
    UnpinPrefixReq,
)
from plait.runtime.scheduler.queues import ReqStatus


def all_memory_back(s, total: int) -> bool:
    """Every slot free once the cache is flushed (only an idle scheduler flushes)."""
    return s.handle_message(FlushCacheReq(0)).result is True and s.kv.available() == total


def statuses(s) -> dict:
    return {rid: r.status for rid, r in s.queues.by_rid.items()}


def test_one_prefill_batch_then_decode_with_exact_steps():
    runner = FakeRunner(max_total_tokens=64)
    s = fake_scheduler(runner, disable_radix_cache=True)
    submit(s, "a", [5, 6, 7, 8, 9], max_new_tokens=3)
    submit(s, "b", [10, 11, 12], max_new_tokens=3)
    assert statuses(s) == {"a": ReqStatus.WAITING, "b": ReqStatus.WAITING}
    batch = step(s)
    assert batch.mode.is_extend() and batch.prefix_lens == [0, 0] and batch.extend_lens == [5, 3]
    assert statuses(s) == {"a": ReqStatus.RUNNING, "b": ReqStatus.RUNNING}
    first = runner.steps[0]
    assert first.token_rows[0].tolist() == [5, 6, 7, 8, 9, 10, 11, 12]  # input ids
    assert first.token_rows[1].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]  # positions
    assert first.sample_rows == [4, 7] and first.sampling_reqs == [0, 1]
    a, b = s.queues.running
    # The script: 2 + (prompt + outputs) % 62.
    assert a.output_ids == [7] and b.output_ids == [5]
    assert s.kv.available() == 64 - 8
    batch = step(s)
    assert batch.mode.is_decode() and [r.rid for r in batch.reqs] == ["a", "b"]
    assert runner.steps[1].token_rows[0].tolist() == [7, 5] and runner.steps[1].seq_lens == [6, 4]
    assert (a.kv_len, b.kv_len) == (6, 4) and s.kv.available() == 64 - 10
    finals = drain(s)
    assert {rid: o.new_ids for rid, o in finals.items()} == {"a": [7, 8, 9], "b": [5, 6, 7]} or {
        rid: o.completion_tokens for rid, o in finals.items()
    } == {"a": 3, "b": 3}
    assert s.kv.available() == 64 and not s.queues.by_rid


def test_a_long_prompt_is_chunked_and_stays_the_one_chunked_request():
    runner = FakeRunner(max_total_tokens=128)
    s = fake_scheduler(runner, chunked_prefill_size=8, max_prefill_tokens=8)
    submit(s, "long", list(range(2, 22)), max_new_tokens=2)  # 20 tokens
    submit(s, "short", [30, 31], max_new_tokens=2)
    step(s)
    long = s.queues.by_rid["long"]
    assert long.status is ReqStatus.CHUNKED and s.queues.chunked is long and long.kv_len == 8
    assert s.queues.by_rid["short"].status is ReqStatus.WAITING
    step(s)
    assert long.status is ReqStatus.CHUNKED and long.kv_len == 16
    step(s)  # the last 4 tokens, and "short" joins the batch (4 + 2 <= 8)
    assert [(st.prefix_lens, st.extend_lens) for st in runner.steps] == [([0], [8]), ([8], [8]), ([16, 0], [4, 2])]
    assert long.status is ReqStatus.RUNNING and s.queues.chunked is None
    assert runner.steps[0].sample_rows == [] and runner.steps[2].sample_rows == [3, 5]
    finals = drain(s)
    assert set(finals) == {"long", "short"} and all_memory_back(s, 128)


def test_a_shared_prefix_is_matched_exactly_once_cached():
    runner = FakeRunner(max_total_tokens=128)
    s = fake_scheduler(runner)
    prefix = list(range(2, 42))  # 40 tokens
    submit(s, "first", prefix + [50, 51], max_new_tokens=1)
    drain(s)
    submit(s, "second", prefix + [60], max_new_tokens=1)
    step(s)
    assert runner.steps[-1].prefix_lens == [40] and runner.steps[-1].extend_lens == [1]
    finals = drain(s)
    assert finals["second"].cached_tokens == 40
    assert s.get_stats()["cached_tokens"] == 40


def test_a_request_sharing_an_uncached_prefix_with_one_in_the_batch_waits_one_step():
    runner = FakeRunner(max_total_tokens=256)
    s = fake_scheduler(runner)
    shared = list(range(2, 42))
    submit(s, "a", shared + [50], max_new_tokens=1)
    submit(s, "b", shared + [51], max_new_tokens=1)
    step(s)
    assert runner.steps[0].extend_lens == [41] and s.queues.by_rid["b"].status is ReqStatus.WAITING
    step(s)  # "a" decodes nothing more (max 1): "b" now hits the cached prefix
    assert runner.steps[-1].prefix_lens == [40] and runner.steps[-1].extend_lens == [1]
    drain(s)


def test_short_of_kv_the_request_with_fewest_outputs_is_retracted_and_finishes_later():
    runner = FakeRunner(max_total_tokens=24)
    s = fake_scheduler(runner, disable_radix_cache=True)
    submit(s, "old", list(range(2, 10)), max_new_tokens=12)  # 8 + 12 = 20 tokens at the end
    for _ in range(3):
        step(s)
    # An admission reserve at its floor lets a second request in that the pool cannot finish with the first.
    s.shortage.new_token_ratio = 0.1
    submit(s, "new", list(range(20, 26)), max_new_tokens=12)
    step(s)
    new = s.queues.by_rid["new"]
    assert new.status is ReqStatus.RUNNING
    # Both decode until the pool runs out, then "new" (fewer outputs) starts over.
    for _ in range(20):
        if new.status is ReqStatus.WAITING and new.num_retractions:
            break
        step(s)
    assert new.num_retractions == 1 and new.status is ReqStatus.WAITING and new.kv_len == 0
    assert new.req_pool_idx is None and s.queues.waiting[0] is new
    # The reserve ratio jumped back to 0.7 at the retraction, then decayed once for the decode batch built.
    assert s.get_stats()["num_retractions"] == 1 and s.shortage.new_token_ratio == pytest.approx(0.7 - 0.001)
    finals = drain(s)
    assert {rid: o.completion_tokens for rid, o in finals.items()} == {"old": 12, "new": 12}
    assert s.kv.available() == 24


def test_a_request_that_outgrows_the_pool_alone_is_aborted_with_the_reason():
    runner = FakeRunner(max_total_tokens=12)
    s = fake_scheduler(runner, disable_radix_cache=True)
    submit(s, "big", list(range(2, 10)), max_new_tokens=20)
    finals = drain(s)
    reason = finals["big"].finished_reason
    assert reason["type"] == "abort" and "out of KV memory" in reason["message"]
    assert s.kv.available() == 12


def test_a_prompt_larger_than_the_pool_ends_at_intake():
    s = fake_scheduler(FakeRunner(max_total_tokens=8))
    submit(s, "huge", list(range(2, 20)), max_new_tokens=1)
    outs = s.collect_outputs()
    assert [o.rid for o in outs] == ["huge"] and "cannot fit in the KV cache" in outs[0].finished_reason["message"]
    assert s.is_idle() and not s.queues.by_rid


def test_aborts_of_waiting_and_running_requests():
    runner = FakeRunner(max_total_tokens=64, max_running_requests=1)
    s = fake_scheduler(runner, disable_radix_cache=True)
    submit(s, "run", [2, 3, 4], max_new_tokens=10)
    submit(s, "wait", [5, 6], max_new_tokens=10)
    step(s)
    assert statuses(s) == {"run": ReqStatus.RUNNING, "wait": ReqStatus.WAITING}
    s.handle_message(AbortReq("wait"))  # ends at once: it holds nothing
    assert [o.finished_reason["message"] for o in s.collect_outputs()] == ["aborted by the client"]
    assert "wait" not in s.queues.by_rid and s.queues.waiting == []
    s.handle_message(AbortReq("run"))  # holds KV: released by the next step's sweep
    assert s.queues.by_rid["run"].status is ReqStatus.RUNNING
    assert step(s) is None
    assert s.is_idle() and s.kv.available() == 64
    assert [o.finished_reason["type"] for o in s.collect_outputs()] == ["abort"]


def test_an_aborted_chunked_request_gives_its_chunk_back():
    runner = FakeRunner(max_total_tokens=64)
    s = fake_scheduler(runner, chunked_prefill_size=4, max_prefill_tokens=4)
    submit(s, "long", list(range(2, 14)), max_new_tokens=2)
    step(s)
    assert s.queues.chunked.rid == "long" and s.kv.available() == 64 - 4
    s.handle_message(AbortReq("long"))
    step(s)
    assert s.is_idle() and s.kv.available() + s.kv.cache.evictable_size() == 64
    assert s.handle_message(FlushCacheReq(1)).result is True and s.kv.available() == 64


def test_pins_hold_a_prefix_until_unpinned_and_flush_waits_for_idle():
    runner = FakeRunner(max_total_tokens=64)
    s = fake_scheduler(runner)
    prefix = list(range(2, 22))
    submit(s, "p", prefix, max_new_tokens=1)
    drain(s)
    pin = s.handle_message(PinPrefixReq(1, token_ids=prefix)).result
    assert pin["pinned_tokens"] == 20  # the whole prompt's K/V was computed and cached at the end
    assert s.kv.cache.protected_size() == 20 and s.kv.pinned_tokens() == 20
    submit(s, "busy", [40, 41], max_new_tokens=3)
    step(s)
    assert s.handle_message(FlushCacheReq(2)).result is False  # not idle
    drain(s)
    assert s.handle_message(UnpinPrefixReq(3, pin_id=pin["pin_id"])).result is True
    assert (
        s.kv.cache.protected_size() == 0 and s.handle_message(UnpinPrefixReq(4, pin_id=pin["pin_id"])).result is False
    )
    assert s.handle_message(FlushCacheReq(5)).result is True and s.kv.available() == 64
    assert s.handle_message(CheckIntegrityReq(6)).result is True
    assert s.handle_message(GetStatsReq(7)).result["free_tokens"] == 64


def test_a_bad_pin_ttl_is_refused_before_anything_is_locked():
    s = fake_scheduler(FakeRunner())
    reply = s.handle_message(PinPrefixReq(1, token_ids=[2, 3, 4], ttl=-1))
    assert "ttl must be > 0" in reply.error and not s.kv.pins


def test_the_queues_check_names_a_request_in_two_places():
    s = fake_scheduler(FakeRunner())
    submit(s, "a", [2, 3], max_new_tokens=1)
    r = s.queues.by_rid["a"]
    s.queues.running.append(r)  # a bug: in the waiting queue and running at once
    with pytest.raises(AssertionError, match="request a is in waiting and in running"):
        s.queues.check()
    assert s.check_integrity() is False and "request a" in s.last_integrity_error


def test_jump_forward_tails_are_prefilled_with_exact_state(default_tokenizer):
    # A real grammar (xgrammar over the default model's tokenizer), no model: after the first sampled
    # token the grammar forces the rest of a key; the request waits as a JUMP_TAIL for its prefill.
    vocab = len(default_tokenizer)
    runner = FakeRunner(max_total_tokens=512, vocab_size=vocab, context_len=256)
    s = fake_scheduler(runner, tokenizer=default_tokenizer, speculative_grammar_drafts="off")  # drafts replace jumps
    schema = '{"type":"object","properties":{"answer_value":{"type":"integer"}},"required":["answer_value"]}'
    prompt = default_tokenizer.encode("Answer:")
    submit(s, "j", prompt, max_new_tokens=24, json_schema=schema)
    assert s.queues.by_rid["j"].status is ReqStatus.GRAMMAR_PENDING
    req = s.queues.by_rid["j"]
    req.grammar_future.result(timeout=120)
    saw_tail = False
    for _ in range(60):
        step(s)
        if req.status is ReqStatus.JUMP_TAIL:
            saw_tail = True
            tail = req.seq_len - req.kv_len
            assert tail >= 2 and req in s.queues.jump_tails and req not in s.queues.running
            step(s)
            assert runner.steps[-1].mode.is_extend() and runner.steps[-1].extend_lens == [tail]
            assert req.status in (ReqStatus.RUNNING, ReqStatus.JUMP_TAIL, ReqStatus.FINISHED)
        outs = [o for o in s.collect_outputs() if o.finished_reason is not None]
        if outs:
            break
    assert saw_tail
    text = default_tokenizer.decode([t for t in req.output_ids if t not in s.eos_token_ids])
    assert text.startswith('{"answer_value":')
    drain(s)
    assert s.handle_message(FlushCacheReq(9)).result is True and s.kv.available() == 512
