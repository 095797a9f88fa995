"""Limits that keep one user's constraint from holding up everyone else's: a cap on a constraint's size, and
several compile threads (a compile cannot be stopped, so one past its timeout still holds its thread)."""

from __future__ import annotations

import time

import pytest
from plait.runtime import ServerArgs
from plait.runtime.constrained import ANY_JSON, validate_constraint
from plait.runtime.constrained.base import MAX_CONSTRAINT_CHARS
from plait.runtime.constrained.integration import COMPILE_THREADS, GrammarManager


@pytest.mark.parametrize("kind", ["regex", "ebnf", "json"])
def test_a_constraint_over_the_size_cap_is_refused_with_its_size(kind):
    text = "a" * (MAX_CONSTRAINT_CHARS[kind] + 1)
    with pytest.raises(ValueError, match=rf"the {kind} constraint is [\d,]+ characters long, over the [\d,]+"):
        validate_constraint(kind, text)


def test_a_long_json_schema_under_the_cap_is_accepted():
    # 2,000 properties (~70 KB of schema): over the regex cap, well under the schema one.
    schema = (
        '{"type": "object", "properties": {'
        + ", ".join(f'"field_{i:04d}": {{"type": "integer"}}' for i in range(2000))
        + "}}"
    )
    assert MAX_CONSTRAINT_CHARS["regex"] < len(schema) < MAX_CONSTRAINT_CHARS["json"]
    validate_constraint("json", schema)


def test_a_slow_compile_does_not_hold_up_the_next_constraint(default_tokenizer):
    # outlines builds the any-JSON automaton in about a second; a one-rule regex takes milliseconds. With one
    # compile thread the regex waited for the whole slow compile (a runaway one: for minutes).
    assert COMPILE_THREADS >= 2
    args = ServerArgs(grammar_backend="outlines", grammar_compile_timeout=120.0)
    manager = GrammarManager(default_tokenizer, 49152, args)
    try:
        slow = manager.backend.get_or_compile(("json", ANY_JSON))
        t0 = time.monotonic()
        fast = manager.backend.get_or_compile(("regex", "[0-9]{3}"))
        assert fast.result(timeout=120) is not None
        fast_s = time.monotonic() - t0
        assert not slow.done(), f"the slow compile ended first ({fast_s:.2f} s): the test's premise failed"
        assert slow.result(timeout=120) is not None
    finally:
        manager.backend.shutdown()
