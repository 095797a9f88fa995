"""Stepping an in-process `Scheduler` to the end: the loop several rooms' tests share."""

from __future__ import annotations


def run_until_idle(s, max_steps: int = 4000) -> dict:
    """Step `s` until it is idle, checking its integrity after every step: each request's new token ids by rid.
    AssertionError when it does not go idle within `max_steps`."""
    out: dict = {}
    for _ in range(max_steps):
        s.step()
        assert s.check_integrity(), s.last_integrity_error
        for o in s.collect_outputs():
            out.setdefault(o.rid, []).extend(o.new_ids)
        if s.is_idle():
            return out
    raise AssertionError("the scheduler did not go idle")
