"""Held loads from the host tier (`hicache_load_policy="hold"`, issue 33): a prefix loaded back stays locked
and marked loading until its copy's event says it landed; the request waits for it, the others' steps go on.

On the CPU a load is synchronous, so the tests stand in for the GPU's copy stream: a held load's K/V reach the
device slots only when its event is queried the `polls`-th time (`LandsLater`). The fake runner (kv_pool=True)
asserts that every request that samples finds its whole sequence in the pool: a request scheduled before its
load landed fails there.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from helpers.fake_runner import FakeRunner, drain, fake_scheduler, step, submit
from plait.runtime.kvcache.host_tier import HostTier
from plait.runtime.server_args import ServerArgs
from test_hicache import multi_turn, scheduler, script


class LandsLater:
    """A held load's event: the copy lands at its `polls`-th query (or at `synchronize`)."""

    def __init__(self, copy, polls: int):
        self.copy, self.polls, self.queries, self.landed = copy, polls, 0, False

    def query(self) -> bool:
        self.queries += 1
        if not self.landed and self.queries >= self.polls:
            self.synchronize()
        return self.landed

    def synchronize(self) -> None:
        if not self.landed:
            self.copy()
            self.landed = True


@pytest.fixture
def held(monkeypatch):
    """HostTier.load with hold=True deferred as on a GPU; the events made, in order."""
    events: list[LandsLater] = []
    load = HostTier.load

    def deferred(self, host_slots, device_slots, hold=False):
        if not hold:
            return load(self, host_slots, device_slots)
        data = self.buffer[host_slots].clone()  # (n, L, 2, H, D): what the copy stream will bring
        n = int(host_slots.numel())
        self.stats.loaded_tokens += n
        self.stats.bytes_to_device += n * self.bytes_per_token
        events.append(LandsLater(lambda: self._scatter(device_slots, data), polls=3))
        return events[-1]

    monkeypatch.setattr(HostTier, "load", deferred)
    return events


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_held_loads_give_the_tier_off_outputs_and_no_step_reads_a_load_before_it_lands(held, policy):
    want = multi_turn(scheduler(False))
    s = scheduler(True, policy, hicache_load_policy="hold")
    assert multi_turn(s) == want  # (the fake runner checked every sampling request's K/V, each step)
    assert held and all(e.landed for e in held)
    assert any(e.queries >= 3 for e in held)  # requests were left out of steps while their copy was landing
    stats = s.get_stats()
    assert stats["hicache_num_loads"] == len(held) and stats["protected_tokens"] == 0
    assert s.check_integrity(full=True), s.last_integrity_error


def test_held_loads_with_chunked_prefill_and_page_size_two(held):
    off = scheduler(False, chunked_prefill_size=16, page_size=2)
    on = scheduler(True, chunked_prefill_size=16, page_size=2, hicache_load_policy="hold")
    assert multi_turn(on, conversations=8, turns=3) == multi_turn(off, conversations=8, turns=3)
    assert held and all(e.landed for e in held)


def test_held_loads_under_overlap_scheduling(held):
    want = multi_turn(scheduler(False))
    runner = FakeRunner(max_total_tokens=160, max_running_requests=4, context_len=600, script=script, kv_pool=True)
    runner.info = replace(runner.info, supports_overlap=True)
    s = fake_scheduler(runner, enable_hierarchical_cache=True, hicache_ratio=6.0, hicache_load_policy="hold")
    assert s.pipeline.overlap
    assert multi_turn(s) == want
    assert any(st.prev_src is not None for st in s.runner.steps)  # (steps were planned ahead)
    assert held and all(e.landed for e in held)


def a_held_load(held):
    """A scheduler where "long" decodes and "c" waits for its prompt's prefix, held in landing from the host."""
    s = scheduler(True, "write_back", pool=64, hicache_load_policy="hold")
    submit(s, "a", list(range(2, 42)), max_new_tokens=2)
    drain(s)
    submit(s, "b", list(range(42, 62)) * 2, max_new_tokens=2)  # pushes "a"'s prompt to the host
    drain(s)
    submit(s, "long", [3, 4, 5], max_new_tokens=30)
    step(s)
    step(s)  # "long" decodes
    submit(s, "c", list(range(2, 42)) + [9], max_new_tokens=2)
    step(s)  # c's match loads "a"'s prompt back: held
    assert len(held) == 1 and not held[0].landed
    return s


def test_a_request_waits_for_its_load_while_the_others_decode(held):
    s = a_held_load(held)
    assert s.kv.cache.protected_size() >= 40  # the loaded prefix stays locked while it lands
    long = next(r for r in s.queues.running if r.rid == "long")
    decoded = len(long.output_ids)
    step(s)
    assert [r.rid for r in s.queues.waiting] == ["c"] and not held[0].landed  # c waits for its copy ...
    assert len(long.output_ids) > decoded  # ... and "long" decodes meanwhile
    finals = drain(s)
    assert held[0].landed and held[0].queries >= 3
    assert finals["c"].cached_tokens == 40 and finals["c"].cached_tokens_host == 40
    assert finals["long"].finished_reason["type"] == "length"
    assert s.get_stats()["protected_tokens"] == 0
    assert s.check_integrity(full=True), s.last_integrity_error


def test_a_load_whose_request_was_aborted_unlocks_when_it_lands(held):
    from plait.runtime.io_struct import AbortReq

    s = a_held_load(held)
    s.handle_message(AbortReq("c"))
    drain(s)  # not idle while the copy lands: the loop polls it, then the lock ends
    assert held[0].landed and not s.kv.cache.loads_pending()
    assert s.get_stats()["protected_tokens"] == 0
    assert s.check_integrity(full=True), s.last_integrity_error


@pytest.mark.parametrize(
    "args, message",
    [
        (dict(hicache_load_policy="eager"), "hicache_load_policy"),
        (dict(hicache_load_policy="hold", tp_size=2), "one device only"),
        (dict(hicache_load_policy="hold", pp_size=2), "one device only"),
    ],
)
def test_load_policies_it_cannot_serve_are_refused_by_name(args, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(enable_hierarchical_cache=True, **args)
