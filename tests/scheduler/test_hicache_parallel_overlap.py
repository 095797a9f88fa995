"""The hierarchical cache under overlap scheduling over a tensor-parallel group (issue 33): rank 0's host-tier
copies are made while a step is in flight (demotions and load-backs while the next step is planned, write
backs while results are processed) and reach rank 1 in the next step's plan, where it replays them on its own
pool and host shard at the same place among its steps (kvcache/host_copies.py).

This test process is rank 0 (the scheduler, in-process, as in test_parallel_overlap.py); rank 1 is a real
process. A multi-turn workload several times the tiny device pool must give the one-device scheduler's
tokens with the tier off, load prefixes back from the host, and check out (both tiers) after every step.
"""

from __future__ import annotations

import random

import pytest
from test_prefill_pipeline import GREEDY, drive, scheduler
from test_scheduler_state import submit

pytestmark = pytest.mark.timeout(600)

POOL = 160


def multi_turn(s, conversations: int = 6, turns: int = 4) -> dict:
    """Conversations whose histories grow each turn (the last answer and a new message): rid -> tokens."""
    rng = random.Random(5)
    history = {c: [rng.randrange(2, 256) for _ in range(28)] for c in range(conversations)}
    outputs = {}
    for turn in range(turns):
        for c in history:
            submit(s, f"c{c}-{turn}", history[c], max_new_tokens=6, **GREEDY)
        finals, _ = drive(s)
        for c in history:
            outputs[f"c{c}-{turn}"] = (ids := finals[f"c{c}-{turn}"].new_ids)
            history[c] = history[c] + ids + [rng.randrange(2, 256) for _ in range(12)]
    assert sum(len(h) for h in history.values()) > 3 * POOL
    return outputs


def test_write_back_under_overlap_at_tp2_gives_one_devices_outputs(random_models):
    path = random_models["llama"]
    want = multi_turn(scheduler(path, "off", max_total_tokens=POOL, num_threads=1))
    tier = dict(enable_hierarchical_cache=True, hicache_ratio=6.0, hicache_write_policy="write_back")
    s = scheduler(path, "on", max_total_tokens=POOL, num_threads=1, tp_size=2, **tier)
    try:
        got = multi_turn(s)
        stats = s.get_stats()
        assert s.check_integrity(full=True), s.last_integrity_error
    finally:
        s.runner.close()
    assert got == want
    assert stats["hicache_num_loads"] > 0 and stats["hicache_saved_tokens"] > 0
