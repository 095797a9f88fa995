"""Agent scaffolds and extraction pipelines as users write them, on the real default model.

Each test pins a behaviour a trial of agent-style programs found broken: programs calling programs
(`s += header(doc)`), a fork inside a loop, a tool raising inside a run_batch program, and a
constrained gen cut short by max_tokens. One Runtime serves the module; gens are a few tokens.
"""

import json
import logging
import re

import plait as sgl
import pytest
from conftest import default_backend_runtime


@pytest.fixture(scope="module", autouse=True)
def runtime():
    with default_backend_runtime(num_threads=1) as rt:
        yield rt


# ---------------------------------------------------------------- programs calling programs


@sgl.function
def header(s, doc):
    s += "Extract facts from the document.\nDocument: " + doc + "\n"


@sgl.function
def extract_field(s, field, pattern):
    s += field + ": " + sgl.gen(field, max_tokens=4, regex=pattern) + "\n"


@sgl.function
def extract(s, doc):
    s += header(doc)
    s += extract_field("age", r"[0-9]{1,3}")
    forks = s.fork(2)
    forks += [extract_field("city", r"[A-Z][a-z]+"), extract_field("name", r"[A-Z][a-z]+")]
    forks.join()
    s += sgl.user("Answer: " + extract_field("year", r"(19|20)[0-9]{2}"))


def test_nested_program_calls_run_on_the_callers_state():
    doc = "Alice is 31 years old and lives in Paris."
    state = extract.run(doc=doc, temperature=0)
    assert state.error() is None
    text = state.text()
    assert text.startswith("Extract facts from the document.\nDocument: " + doc + "\nage: ")
    assert re.fullmatch(r"[0-9]{1,3}", state["age"])
    assert len(state["city"]) == 1 and re.fullmatch(r"[A-Z][a-z]+", state["city"][0])
    assert len(state["name"]) == 1 and re.fullmatch(r"[A-Z][a-z]+", state["name"][0])
    assert re.fullmatch(r"(19|20)[0-9]{2}", state["year"])
    assert state.messages()[-1] == {"role": "user", "content": f"Answer: year: {state['year']}\n"}
    # The callee's text follows the caller's prefix, so the runtime reuses it.
    assert state.get_meta_info("year")["cached_tokens"] > 0
    # Tracing follows the call too: the constant prefix run_batch pre-caches includes the header.
    traced = extract.trace(doc=doc).text()
    assert traced.startswith("Extract facts from the document.\nDocument: " + doc + "\nage: {age}\n")


def test_a_program_call_used_as_a_value_is_a_separate_run():
    @sgl.function
    def caller(s, doc):
        sub = header(doc)  # not appended: reading it runs header on its own
        s += "Header was: " + sub.text()

    state = caller.run(doc="x")
    assert state.text() == "Header was: Extract facts from the document.\nDocument: x\n"


def test_a_bad_program_call_fails_where_it_is_written():
    @sgl.function
    def missing_argument(s):
        s += extract_field("age")

    with pytest.raises(TypeError, match="extract_field\\(\\).*pattern"):
        missing_argument.run()

    @sgl.function
    def sampling_in_call(s):
        s += header("doc", temperature=0)

    with pytest.raises(TypeError, match="sampling settings"):
        sampling_in_call.run()


# ---------------------------------------------------------------- fork in a loop


@sgl.function
def vote_rounds(s, rounds):
    s += "Pick a letter.\n"
    for options in rounds:
        forks = s.fork(2)
        forks += sgl.select("pick", choices=options)
        forks.join()
        s += "Round picks: " + ",".join(s["pick"]) + "\n"


def test_fork_in_a_loop_gathers_every_rounds_variables():
    state = vote_rounds.run(rounds=[["a", "b"], ["x", "y"]])
    assert state.error() is None
    picks = re.findall(r"Round picks: (.*)\n", state.text())
    assert len(picks) == 2
    assert all(p in ("a", "b") for p in picks[0].split(","))
    # Before the fix the second join kept the first round's ['a', 'a'] ('pick' existed already).
    assert all(p in ("x", "y") for p in picks[1].split(","))
    assert len(state["pick"]) == 2 and len(state.get_meta_info("pick")) == 2


# ---------------------------------------------------------------- failures inside programs


def flaky_tool(x):
    if x == 1:
        raise ValueError("tool failed on 1")
    return f"ok-{x}"


@sgl.function
def tool_step(s, x):
    s += f"Input {x}. First:" + sgl.gen("first", max_tokens=2, temperature=0) + "\n"
    s += "Tool: " + flaky_tool(x) + "\n"
    s += "Then:" + sgl.gen("second", max_tokens=2, temperature=0)


def test_tool_exception_in_run_batch_keeps_the_others_and_the_work_before_it():
    states = tool_step.run_batch([{"x": i} for i in range(3)], num_threads=3)
    assert [type(s.error()) for s in states] == [type(None), ValueError, type(None)]
    assert states[0]["second"] is not None and states[2]["second"] is not None
    failed = states[1]
    # What the body appended before the tool raised did run: the text shows how far it got.
    assert failed.text().startswith("Input 1. First:") and "first" in failed
    assert failed.text() == "Input 1. First:" + failed["first"] + "\n"
    with pytest.raises(RuntimeError, match="tool failed on 1"):
        failed["second"]


def test_constrained_gen_cut_by_max_tokens_says_so(caplog):
    @sgl.function
    def truncated(s):
        s += "JSON: " + sgl.gen(
            "j",
            max_tokens=3,
            json_schema={"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
        )

    with caplog.at_level(logging.WARNING, logger="plait.interpreter"):
        state = truncated.run(temperature=0)
        state.sync()
    assert state.get_meta_info("j")["finish_reason"]["type"] == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(state["j"])
    with pytest.raises(ValueError, match="stopped at max_tokens"):
        state.parsed("j")
    assert any("gen('j') stopped at max_tokens=3" in r.getMessage() for r in caplog.records)


def test_constrained_gen_complete_on_its_last_token_is_not_reported(caplog):
    @sgl.function
    def exact(s):
        s += "Two digits: " + sgl.gen("n", max_tokens=2, regex=r"[0-9]{2}")  # one token per digit

    with caplog.at_level(logging.WARNING, logger="plait.interpreter"):
        state = exact.run(temperature=0)
        state.sync()
    assert re.fullmatch(r"[0-9]{2}", state["n"])
    assert not any("stopped at max_tokens" in r.getMessage() for r in caplog.records)
