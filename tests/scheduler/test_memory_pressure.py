"""A KV pool smaller than the load needs: admission, retraction and refusal under memory pressure.

The scheduler-level tests drive a tiny random model in-process (exact state, every step's slot
accounting checked); the end-to-end test runs the embedded model through the Engine with a small pool
and compares every greedy output with the same request alone on a big pool, token for token.
"""

from __future__ import annotations

import random

from plait.runtime.io_struct import FlushCacheReq, PinPrefixReq, TokenizedGenerateReq, UnpinPrefixReq
from plait.runtime.request_options import RequestOptions
from plait.runtime.sampling_params import SamplingParams
from plait.runtime.scheduler.scheduler import Scheduler, create_scheduler
from plait.runtime.server_args import ServerArgs


def make_scheduler(path, **kw) -> Scheduler:
    return create_scheduler(ServerArgs(model_path=path, device="cpu", **kw), path)


def submit(s: Scheduler, rid: str, ids: list[int], **sp) -> None:
    s.handle_message(TokenizedGenerateReq(list(ids), SamplingParams(**sp), RequestOptions(rid=rid)))


def run_until_idle(s: Scheduler, max_steps: int = 400) -> dict[str, tuple[list[int], dict]]:
    """rid -> (output ids, finish reason); the slot accounting is checked after every step, and a
    scheduler that stops making progress fails here instead of hanging."""
    ids: dict[str, list[int]] = {}
    finals: dict[str, tuple[list[int], dict]] = {}
    for _ in range(max_steps):
        s.step()
        s.check_integrity()
        assert s.last_integrity_error is None, s.last_integrity_error
        for o in s.collect_outputs():
            ids.setdefault(o.rid, []).extend(o.new_ids)
            if o.finished_reason is not None:
                finals[o.rid] = (ids[o.rid], o.finished_reason)
        if s.is_idle():
            return finals
    raise AssertionError(
        f"no progress: {len(s.queues.running)} running, {len(s.queues.waiting)} waiting, "
        f"{s.stats['num_retractions']} retractions"
    )


def assert_all_memory_back(s: Scheduler, total: int) -> None:
    assert s.kv.cache.protected_size() == 0
    assert s.handle_message(FlushCacheReq(0)).result is True
    assert s.kv.allocator.available() == total and s.kv.req_to_token.available() == s.kv.req_to_token.size


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
    assert s.kv.cache.evictable_size() == 40 and s.kv.allocator.available() == 10
    submit(s, "fresh", list(range(100, 108)), max_new_tokens=1, **GREEDY)
    submit(s, "hit", prefix + [200, 201, 202], max_new_tokens=1, **GREEDY)
    finals = run_until_idle(s, max_steps=50)
    assert finals["fresh"] == (
        alone(path, list(range(100, 108)), max_new_tokens=1, **GREEDY),
        {"type": "length", "length": 1},
    )
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
    assert out == alone(path, list(range(2, 42)), max_new_tokens=60, **GREEDY)[: len(out)] and len(out) >= 20
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
    assert finals["short"] == (alone(path, [3, 4, 5, 6], max_new_tokens=30, **GREEDY), {"type": "length", "length": 30})
    assert finals["long"] == (
        alone(path, list(range(10, 72)), max_new_tokens=1, **GREEDY),
        {"type": "length", "length": 1},
    )
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
    pin = s.handle_message(PinPrefixReq(1, token_ids=pinned)).result
    assert pin["pinned_tokens"] == 30
    submit(s, "big", list(range(2, 42)), max_new_tokens=2, **GREEDY)
    submit(s, "small", pinned + [7, 8], max_new_tokens=3, **GREEDY)
    finals = run_until_idle(s)
    out, reason = finals["big"]
    assert reason["type"] == "abort" and "30 of them held by pinned prefixes" in reason["message"]
    assert finals["small"] == (
        alone(path, pinned + [7, 8], max_new_tokens=3, **GREEDY),
        {"type": "length", "length": 3},
    )
    assert s.handle_message(UnpinPrefixReq(2, pin_id=pin["pin_id"])).result is True
    assert_all_memory_back(s, 64)


def _pressure_workload() -> list[tuple[str, str, dict]]:
    rng = random.Random(0)
    words = "alpha beta gamma delta river mountain cloud engine paper stone light orange window garden".split()

    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    system = "You are a careful assistant. " + text(60)
    items = []
    for i in range(18):
        prompt = system + f" Question {i}: " + text(rng.randrange(3, 12)) if i % 2 else text(rng.randrange(15, 50))
        sp = {"max_new_tokens": rng.randrange(16, 40), "temperature": 0, "ignore_eos": True}
        if i % 6 == 1:
            sp.update(temperature=0.8, seed=i, n=2)  # seeded samples: reproducible under pressure too
        if i % 6 == 3:
            sp.update(regex=r"(yes|no) [0-9]{2,3}", ignore_eos=False)
        items.append((f"r{i}", prompt, sp))
    items.append(("huge", text(220), {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}))
    return items


def _run_workload(pool: int, items, abort: str = "") -> tuple[dict, dict]:
    import asyncio

    from plait.runtime import Engine

    async def main(eng):
        # NOTE: one batch, so that every request reaches the scheduler together: requests sent one by one
        # arrive spread over its first steps, and then how many it admits at once (whether the pool
        # overflows and it must retract) depends on the machine's timing.
        rids, prompts, params = (list(col) for col in zip(*items))
        batch = asyncio.create_task(
            asyncio.wait_for(eng.async_generate(prompt=prompts, sampling_params=params, rid=rids), 300)
        )
        if abort:
            await asyncio.sleep(1.0)
            eng.abort(abort)
        flat, results = list(await batch), {}  # a batch's n samples come back one after another
        for rid, sp in zip(rids, params):
            n = sp.get("n", 1)
            results[rid] = flat[:n] if n > 1 else flat[0]
            del flat[:n]
        return results

    # NOTE: one torch thread: with one per core, a core taken by anything else makes the threads wait on
    # each other and the run many times slower (docs/server_args.md), past the per-request timeout.
    # A reserve at a third of the default (schedule_conservativeness) admits more than the pool can finish:
    # requests are retracted whatever the machine's timing (the admission would otherwise mostly avoid it).
    with Engine(
        max_total_tokens=pool,
        chunked_prefill_size=128,
        max_prefill_tokens=256,
        num_threads=1,
        schedule_conservativeness=0.3,
    ) as eng:
        results = asyncio.run(main(eng))
        stats = eng.get_stats()
        assert eng.check_integrity() is True
        assert eng.flush_cache() is True
        after = eng.get_stats()
    assert after["free_tokens"] == pool and after["integrity_errors"] == 0 and after["protected_tokens"] == 0
    return results, stats


def test_embedded_model_under_pressure_matches_a_big_pool_and_frees_everything():
    # ~19 requests needing ~6x the 320-slot pool: shared prefixes, n=2 seeded samples, regex, one that
    # outgrows the pool, one aborted mid-way. Every other request's tokens equal the big pool's run.
    items = _pressure_workload()
    small, stats = _run_workload(320, items, abort="r4")
    big, big_stats = _run_workload(8192, items)
    assert stats["num_retractions"] >= 1 and big_stats["num_retractions"] == 0, (stats, big_stats)
    assert stats["integrity_errors"] == 0

    def ids(res):
        return [x["output_ids"] for x in res] if isinstance(res, list) else res["output_ids"]

    huge = small["huge"]["meta_info"]["finish_reason"]
    assert huge["type"] == "abort" and "the pool holds 320" in huge["message"]
    assert big["huge"]["meta_info"]["finish_reason"] == {"type": "length", "length": 200}
    differ, aborted = [], []
    for rid, _, sp in items:
        if rid in ("huge", "r4"):
            continue
        if ids(small[rid]) != ids(big[rid]):
            differ.append((rid, sp, ids(small[rid]), ids(big[rid])))
        outs = small[rid] if sp.get("n") else [small[rid]]
        reasons = [o["meta_info"]["finish_reason"] for o in outs]
        aborted += [(rid, reason) for reason in reasons if reason["type"] == "abort"]
    assert not differ and not aborted, (differ, aborted, stats["num_retractions"])
