"""The hierarchical cache (issue 33) under the scheduler, on a fake runner whose K/V a test can follow.

The fake runner (helpers/fake_runner.py, `kv_pool=True`) writes each new token's id and position into its
K/V pool and asserts, for every request that samples, that the pool holds the request's whole sequence at
its table's slots: a prefix loaded back from the host tier must be there before the step that reads it.
Each workload runs with the tier off and on: the same outputs, and the tier on serves prefixes from the
host; every step ends with the full integrity check (both tiers).
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from helpers.fake_runner import FakeRunner, drain, fake_scheduler, step, submit
from plait.runtime.io_struct import AbortReq, FlushCacheReq
from plait.runtime.kvcache.host_tier import HostTier
from plait.runtime.server_args import ServerArgs


def script(row) -> int:
    """A next token that depends on the tokens, not only their count (never the EOS id 1)."""
    return 2 + (7 * sum(row.prompt_ids) + 3 * sum(row.output_ids) + len(row.output_ids)) % 62


def scheduler(hicache: bool, policy: str = "write_through", pool: int = 160, fake_model=script, **args):
    runner = FakeRunner(max_total_tokens=pool, max_running_requests=4, context_len=600, script=fake_model, kv_pool=True)
    tier = dict(enable_hierarchical_cache=True, hicache_ratio=6.0, hicache_write_policy=policy) if hicache else {}
    return fake_scheduler(runner, **tier, **args)


def multi_turn(s, conversations=12, turns=4, seed=0) -> dict:
    """Conversations whose histories grow each turn (the last answer and a new user message); the working
    set is several times the device pool."""
    rng = random.Random(seed)
    history = {c: [rng.randrange(2, 64) for _ in range(24)] for c in range(conversations)}
    outputs = {}
    for turn in range(turns):
        for c in history:
            submit(s, f"c{c}-{turn}", history[c], max_new_tokens=8)
        finals = drain(s)
        assert s.check_integrity(full=True), s.last_integrity_error
        for c in history:
            ids = finals[f"c{c}-{turn}"].new_ids
            outputs[f"c{c}-{turn}"] = ids
            history[c] = history[c] + ids + [rng.randrange(2, 64) for _ in range(12)]
    assert sum(len(h) for h in history.values()) > 4 * s.kv.total
    return outputs


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_multi_turn_outputs_equal_with_the_tier_off_and_hits_come_from_the_host(policy):
    off = scheduler(False)
    on = scheduler(True, policy)
    assert multi_turn(on) == multi_turn(off)
    stats, base = on.get_stats(), off.get_stats()
    assert stats["hicache_num_loads"] > 0 and stats["hicache_loaded_tokens"] > 0
    assert stats["hicache_bytes_to_device"] == stats["hicache_loaded_tokens"] * on.kv.cache.host.bytes_per_token
    assert stats["cached_tokens"] > 2 * base["cached_tokens"], (stats["cached_tokens"], base["cached_tokens"])
    assert 0 < stats["hicache_host_used_tokens"] <= stats["hicache_host_tokens"]
    assert stats["hicache_write_policy"] == policy


def test_each_request_says_how_many_of_its_cached_tokens_came_from_the_host():
    s = scheduler(True, "write_back", pool=64)
    submit(s, "a", list(range(2, 42)), max_new_tokens=2)
    drain(s)
    submit(s, "b", list(range(42, 62)) * 2, max_new_tokens=2)  # pushes "a"'s prompt to the host
    drain(s)
    submit(s, "c", list(range(2, 42)) + [9], max_new_tokens=2)
    finals = drain(s)
    assert finals["c"].cached_tokens == 40 and finals["c"].cached_tokens_host == 40
    submit(s, "d", list(range(2, 42)) + [10], max_new_tokens=2)
    finals = drain(s)
    assert finals["d"].cached_tokens == 40 and finals["d"].cached_tokens_host == 0


def test_with_a_small_host_tier_it_evicts_there_too_and_outputs_stay_equal():
    off = scheduler(False)
    on = fake_scheduler(
        FakeRunner(max_total_tokens=160, max_running_requests=4, context_len=600, script=script, kv_pool=True),
        enable_hierarchical_cache=True,
        hicache_ratio=1.5,
    )
    assert multi_turn(on) == multi_turn(off)
    stats = on.get_stats()
    assert stats["hicache_host_evicted_tokens"] > 0 and stats["hicache_num_loads"] > 0


def test_chunked_prefill_and_page_size_two():
    off = scheduler(False, chunked_prefill_size=16, page_size=2)
    on = scheduler(True, chunked_prefill_size=16, page_size=2)
    assert multi_turn(on, conversations=8, turns=3) == multi_turn(off, conversations=8, turns=3)
    assert on.get_stats()["hicache_num_loads"] > 0


def test_ngram_speculation_keeps_the_tokens_and_the_kv_it_verified():
    def copying(row) -> int:  # repeats the prompt: prompt lookup drafts what the fake model then says
        return row.prompt_ids[(len(row.output_ids) + 3) % len(row.prompt_ids)]

    off = scheduler(False, fake_model=copying)
    on = scheduler(True, fake_model=copying, speculative_algorithm="NGRAM")
    assert multi_turn(on, conversations=8) == multi_turn(off, conversations=8)
    stats = on.get_stats()
    assert stats["spec_verify_steps"] > 0 and stats["spec_accepted_tokens"] > 0
    assert stats["hicache_num_loads"] > 0


def test_overlap_scheduling_steps_planned_past_the_one_in_flight():
    off = scheduler(False)
    runner = FakeRunner(max_total_tokens=160, max_running_requests=4, context_len=600, script=script, kv_pool=True)
    runner.info = replace(runner.info, supports_overlap=True)
    on = fake_scheduler(runner, enable_hierarchical_cache=True, hicache_ratio=6.0)
    assert on.pipeline.overlap
    assert multi_turn(on) == multi_turn(off)
    assert any(st.prev_src is not None for st in on.runner.steps)  # (steps were planned ahead)
    assert on.get_stats()["hicache_num_loads"] > 0


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_retraction_demotes_and_loads_back(policy):
    def run(hicache):
        s = scheduler(hicache, policy, pool=96, schedule_conservativeness=0.2)
        for i in range(6):
            submit(s, f"r{i}", [2 + (i * 5 + j) % 60 for j in range(20)], max_new_tokens=30)
        return {rid: o.new_ids for rid, o in drain(s, 2000).items()}, s

    want, base = run(False)
    got, s = run(True)
    assert got == want
    assert s.stats["num_retractions"] > 0
    assert s.get_stats()["hicache_num_loads"] > 0


def test_aborts_release_into_both_tiers_and_flush_empties_them():
    s = scheduler(True, "write_back", pool=96)
    for i in range(6):
        submit(s, f"a{i}", [2 + (i * 3 + j) % 60 for j in range(30)], max_new_tokens=20)
    for _ in range(4):
        step(s)
    s.handle_message(AbortReq("a0"))  # running
    s.handle_message(AbortReq("a5"))  # still waiting
    finals = drain(s, 2000)
    assert finals["a0"].finished_reason["type"] == "abort" and finals["a5"].finished_reason["type"] == "abort"
    assert finals["a1"].finished_reason["type"] == "length"
    # A second round over the same prompts finds them in the host tier.
    for i in range(1, 5):
        submit(s, f"b{i}", [2 + (i * 3 + j) % 60 for j in range(30)], max_new_tokens=4)
    drain(s)
    assert s.get_stats()["hicache_num_loads"] > 0
    assert s.control.handle(FlushCacheReq(1)) is True
    stats = s.get_stats()
    assert stats["hicache_host_used_tokens"] == 0 and stats["evictable_tokens"] == 0
    assert s.check_integrity(full=True), s.last_integrity_error


def test_the_fake_runner_catches_a_load_that_never_arrives(monkeypatch):
    """The check the tests above rely on: a load-back that leaves the device slots as they were fails."""
    monkeypatch.setattr(HostTier, "_scatter", lambda self, slots, staging: None)
    with pytest.raises(AssertionError, match="K/V"):
        multi_turn(scheduler(True, "write_back"))


@pytest.mark.parametrize(
    "args, message",
    [
        (dict(disable_radix_cache=True), "needs the radix cache"),
        (dict(pp_size=2, hicache_size=1.0), "pp_size 2"),
        (dict(speculative_algorithm="EAGLE", speculative_draft_model_path="x"), "EAGLE"),
        (dict(hicache_write_policy="write_through_selective"), "hicache_write_policy"),
        (dict(hicache_ratio=-1.0), "hicache_ratio"),
        (dict(hicache_ratio=0, hicache_size=0), "needs room"),
    ],
)
def test_settings_it_cannot_serve_are_refused_by_name(args, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(enable_hierarchical_cache=True, **args)
