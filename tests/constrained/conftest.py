"""Fixtures of the structured-output tests: both grammar backends on the real SmolLM2 tokenizer, and the
token tables of the xgrammar one."""

from __future__ import annotations

import pytest
from plait.runtime.constrained import create_grammar_backend
from plait.runtime.constrained.token_tables import TokenTables


@pytest.fixture(scope="module")
def backends(default_tokenizer):
    made = {name: create_grammar_backend(name, default_tokenizer) for name in ("xgrammar", "outlines")}
    yield made
    for backend in made.values():
        backend.shutdown()


@pytest.fixture(scope="module")
def tables(backends):
    return TokenTables(backends["xgrammar"].vocab)
