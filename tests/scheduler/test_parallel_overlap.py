"""Overlap scheduling over a tensor-parallel group: decode steps launched from the previous step's tokens
on the device (rank 0 sends them to the other ranks) and prefills launched behind each other, with
the prefix cache's table writes shipped in the plans. On the CPU a launch runs synchronously, but the
scheduler's bookkeeping and the group's messages are the GPU's.

This test process is rank 0 (the scheduler, in-process, as in tests/scheduler/test_prefill_pipeline.py); rank 1
is a real process. The workload must give the one-device scheduler's tokens and cached-token counts.
"""

from __future__ import annotations

import random

import pytest
from test_prefill_pipeline import assert_all_freed, drive, fewshot_requests, scheduler, summary
from test_scheduler_state import submit

pytestmark = pytest.mark.timeout(600)


def workload(s) -> tuple[dict, int]:
    rng = random.Random(3)
    finals = {}
    for rid, ids, sp in fewshot_requests(rng, 14):
        submit(s, rid, ids, **sp)
    finals.update(drive(s)[0])
    # A second round over the first round's outputs (their prefixes are cached now) and decodes long
    # enough for steps launched ahead to follow each other.
    for rid, out in sorted(finals.items()):
        submit(s, rid + "+", list(range(2, 50)) + out.new_ids, max_new_tokens=9, temperature=0, ignore_eos=True)
    got, back_to_back = drive(s)
    finals.update(got)
    return summary(finals), s.stats["cached_tokens"]


def test_overlap_scheduling_at_tp2_gives_one_devices_outputs(random_models):
    path = random_models["llama"]
    want = workload(scheduler(path, "off", max_total_tokens=2048, num_threads=1))
    s = scheduler(path, "on", max_total_tokens=2048, num_threads=1, tp_size=2)
    launched = []  # per launched step: whether its input ids were the previous step's, on the device
    launch = s.runner.launch
    s.runner.launch = lambda step, prev=None: (
        launched.append((step.mode.is_decode(), step.ids_from_prev)) or launch(step, prev)
    )
    try:
        got = workload(s)
        assert_all_freed(s, 2048)
    finally:
        s.runner.close()
    assert got == want
    assert (True, True) in launched and (False, False) in launched  # decodes from the device, pipelined prefills
