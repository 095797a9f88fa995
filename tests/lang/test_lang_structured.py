"""Constrained generation from the DSL on the real default model: Pydantic models (parsed back),
dict schemas, named regexes, EBNF."""

from __future__ import annotations

import re

import plait as sgl
import pydantic
import pytest
from plait.grammars.regexes import REGEXES


class Person(pydantic.BaseModel):
    name: str
    age: int = pydantic.Field(ge=0, le=120)
    role: str


@pytest.fixture(scope="module")
def runtime():
    rt = sgl.Runtime()
    yield rt
    rt.shutdown()


@sgl.function
def extract(s, text):
    s += sgl.user("Extract the person as JSON: " + text)
    s += sgl.assistant(sgl.gen("person", max_tokens=48, json_schema=Person))


@sgl.function
def date_and_grammar(s):
    s += sgl.user("When did the first moon landing happen, and is water wet?")
    s += sgl.assistant(
        "Date: "
        + sgl.gen("date", max_tokens=16, regex="iso_date")
        + "\nAnswer: "
        + sgl.gen("yn", max_tokens=4, ebnf='root ::= "yes" | "no"')
    )


def test_pydantic_schema_parses_back_into_the_model(runtime):
    state = extract.run(text="Ada Lovelace, 36, mathematician.", temperature=0, backend=runtime)
    person = state.parsed("person")
    assert isinstance(person, Person) and 0 <= person.age <= 120


def test_named_regex_and_ebnf(runtime):
    state = date_and_grammar.run(temperature=0, backend=runtime)
    assert re.fullmatch(REGEXES["iso_date"], state["date"])
    assert state["yn"] in ("yes", "no")


def test_bad_schema_type_is_a_clear_error():
    with pytest.raises(TypeError, match="json_schema"):
        sgl.gen("x", json_schema=int)
