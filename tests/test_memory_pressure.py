"""A KV pool smaller than the load needs: admission, retraction and refusal under memory pressure.

The scheduler-level tests drive a tiny random model in-process (exact state, every step's slot
accounting checked); the end-to-end test runs the embedded model through the Engine with a small pool
and compares every greedy output with the same request alone on a big pool, token for token.
"""

from __future__ import annotations

import random

import pytest

from plait.runtime.io_struct import AbortReq, ControlReq, TokenizedGenerateReq
from plait.runtime.sampling_params import SamplingParams
from plait.runtime.scheduler import Scheduler
from plait.runtime.server_args import ServerArgs


def make_scheduler(path, **kw) -> Scheduler:
    return Scheduler(ServerArgs(model_path=path, device="cpu", **kw), path)


def submit(s: Scheduler, rid: str, ids: list[int], **sp) -> None:
    s.handle_message(TokenizedGenerateReq(rid=rid, input_ids=list(ids), sampling_params=SamplingParams(**sp)))


def run_until_idle(s: Scheduler, max_steps: int = 400) -> dict[str, tuple[list[int], dict]]:
    """rid -> (output ids, finish reason); the slot accounting is checked after every step, and a
    scheduler that stops making progress fails here instead of hanging."""
    ids: dict[str, list[int]] = {}
    finals: dict[str, tuple[list[int], dict]] = {}
    for _ in range(max_steps):
        s.step()
        s._check_integrity()
        assert s.last_integrity_error is None, s.last_integrity_error
        for o in s.collect_outputs():
            ids.setdefault(o.rid, []).extend(o.new_ids)
            if o.finished_reason is not None:
                finals[o.rid] = (ids[o.rid], o.finished_reason)
        if s.is_idle():
            return finals
    raise AssertionError(f"no progress: {len(s.running)} running, {len(s.waiting)} waiting, "
                         f"{s.stats['num_retractions']} retractions")


def assert_all_memory_back(s: Scheduler, total: int) -> None:
    assert s.cache.protected_size() == 0
    assert s.handle_message(ControlReq(0, "flush_cache")).result is True
    assert s.allocator.available() == total and s.req_to_token.available() == s.req_to_token.size


def alone(path, ids: list[int], **sp) -> list[int]:
    s = make_scheduler(path, max_total_tokens=1024)
    submit(s, "alone", ids, **sp)
    return run_until_idle(s)["alone"][0]


GREEDY = dict(temperature=0, ignore_eos=True)


def test_locking_cached_prefixes_counts_against_the_admission_budget(random_models):
    # 40 of 50 slots hold an evictable cached prefix. `fresh` (8 new tokens) is admitted first; `hit`
    # reuses the prefix, and locking it leaves nothing to evict for the batch's 11 new slots. Counted
    # after the fit check, the batch could not be allocated: undone, admitted again, forever.
    path = random_models["llama"]
    s = make_scheduler(path, max_total_tokens=50, schedule_policy="fcfs")
    prefix = list(range(2, 42))
    submit(s, "warm", prefix, max_new_tokens=0)
    run_until_idle(s)
    assert s.cache.evictable_size() == 40 and s.allocator.available() == 10
    submit(s, "fresh", list(range(100, 108)), max_new_tokens=1, **GREEDY)
    submit(s, "hit", prefix + [200, 201, 202], max_new_tokens=1, **GREEDY)
    finals = run_until_idle(s, max_steps=50)
    assert finals["fresh"] == (alone(path, list(range(100, 108)), max_new_tokens=1, **GREEDY),
                               {"type": "length", "length": 1})
    assert finals["hit"][0] == alone(path, prefix + [200, 201, 202], max_new_tokens=1, **GREEDY)
    assert_all_memory_back(s, 50)


def test_a_prompt_that_fits_runs_even_when_its_max_new_tokens_would_not(random_models):
    # Alone, nothing needs the admission reserve: held to it, the request waited forever. It runs
    # until the pool is full, then ends with an error that says why; the next request goes on.
    path = random_models["llama"]
    s = make_scheduler(path, max_total_tokens=64)
    submit(s, "long", list(range(2, 42)), max_new_tokens=60, **GREEDY)
    submit(s, "next", [5, 6, 7], max_new_tokens=4, **GREEDY)
    finals = run_until_idle(s)
    out, reason = finals["long"]
    assert reason["type"] == "abort" and "out of KV memory" in reason["message"]
    assert "the pool holds 64" in reason["message"]
    assert out == alone(path, list(range(2, 42)), max_new_tokens=60, **GREEDY)[:len(out)] and len(out) >= 20
    assert finals["next"] == (alone(path, [5, 6, 7], max_new_tokens=4, **GREEDY), {"type": "length", "length": 4})
    assert_all_memory_back(s, 64)


def test_decode_retracts_a_chunked_prefill_instead_of_aborting_the_running_request(random_models):
    # `long` (62 of 64 slots) is prefilled 8 tokens at a time while `short` decodes; its chunks fill the pool. The
    # half-prefilled request gives its memory back (and resumes later); the running one was aborted.
    path = random_models["llama"]
    s = make_scheduler(path, max_total_tokens=64, chunked_prefill_size=8, max_prefill_tokens=8)
    submit(s, "short", [3, 4, 5, 6], max_new_tokens=30, **GREEDY)
    s.step()
    submit(s, "long", list(range(10, 72)), max_new_tokens=1, **GREEDY)
    finals = run_until_idle(s)
    assert finals["short"] == (alone(path, [3, 4, 5, 6], max_new_tokens=30, **GREEDY),
                               {"type": "length", "length": 30})
    assert finals["long"] == (alone(path, list(range(10, 72)), max_new_tokens=1, **GREEDY),
                              {"type": "length", "length": 1})
    assert s.stats["num_retractions"] >= 1
    assert_all_memory_back(s, 64)


def test_a_prompt_that_pins_leave_no_room_for_is_refused_and_others_go_on(random_models):
    # 30 of 64 slots are pinned; a 40-token prompt can never be prefilled (it was retracted and
    # admitted again forever). It ends with an error naming the pins; a small request still runs.
    path = random_models["llama"]
    s = make_scheduler(path, max_total_tokens=64, chunked_prefill_size=16)
    pinned = list(range(100, 130))
    submit(s, "warm", pinned, max_new_tokens=0)
    run_until_idle(s)
    pin = s.handle_message(ControlReq(1, "pin_prefix", {"token_ids": pinned})).result
    assert pin["pinned_tokens"] == 30
    submit(s, "big", list(range(2, 42)), max_new_tokens=2, **GREEDY)
    submit(s, "small", pinned + [7, 8], max_new_tokens=3, **GREEDY)
    finals = run_until_idle(s)
    out, reason = finals["big"]
    assert reason["type"] == "abort" and "30 of them held by pinned prefixes" in reason["message"]
    assert finals["small"] == (alone(path, pinned + [7, 8], max_new_tokens=3, **GREEDY),
                               {"type": "length", "length": 3})
    assert s.handle_message(ControlReq(2, "unpin_prefix", {"pin_id": pin["pin_id"]})).result is True
    assert_all_memory_back(s, 64)
