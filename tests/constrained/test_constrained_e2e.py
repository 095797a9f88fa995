"""Constrained decoding end to end on the real default model (SmolLM2-135M-Instruct, greedy).

Two engines: xgrammar with jump-forward (grammar-forced drafts, the default that replaces it, off: they
are tested in test_spec_greedy.py) and outlines-core with jump-forward off.
Every output under a constraint must parse and validate; free requests in the same batch must be
unaffected; invalid constraints raise ValueError and the engine keeps serving.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from plait.grammars.regexes import regex
from plait.runtime import Engine

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "role"],
}
PEOPLE = ["Alice is a 30 year old admin.", "Bob, aged 250, is a guest.", "Carol (user) just turned 41."]


@pytest.fixture(scope="module")
def engines():
    with (
        Engine(num_threads=1, max_total_tokens=4096, speculative_grammar_drafts="off") as xg,
        Engine(num_threads=1, max_total_tokens=4096, grammar_backend="outlines", disable_jump_forward=True) as ol,
    ):
        yield {"xgrammar": xg, "outlines": ol}


def chat(eng, text: str) -> str:
    return eng.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


def greedy(max_new_tokens: int, **constraint) -> dict:
    return {"temperature": 0, "max_new_tokens": max_new_tokens, **constraint}


@pytest.mark.parametrize("name", ["xgrammar", "outlines"])
def test_json_schema_outputs_validate(engines, name):
    eng = engines[name]
    prompts = [chat(eng, f"Extract name, age and role as JSON: {p}") for p in PEOPLE]
    outs = eng.generate(prompts, greedy(48, json_schema=json.dumps(PERSON)))
    for out in outs:
        value = json.loads(out["text"])
        jsonschema.validate(value, PERSON)  # includes the enum and 0 <= age <= 120
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
        assert out["text"] == json.dumps(value, ensure_ascii=False)  # natural JSON (", ", ": ") by default


@pytest.mark.parametrize("name", ["xgrammar", "outlines"])
def test_regex_outputs_fullmatch(engines, name):
    eng = engines[name]
    cases = [
        ("What is the IP address of the local host?", regex("ipv4")),
        ("When did the Berlin wall fall? Answer with a date.", regex("iso_date")),
        ("Is water wet? Answer yes or no, then a number.", r"(yes|no), [0-9]{1,2}"),
    ]
    outs = eng.generate([chat(eng, q) for q, _ in cases], [greedy(24, regex=pattern) for _, pattern in cases])
    for out, (_, pattern) in zip(outs, cases):
        assert re.fullmatch(pattern, out["text"]), (pattern, out["text"])
        assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_ebnf_output_follows_grammar(engines):
    eng = engines["xgrammar"]
    grammar = 'root ::= answer ", because " reason\nanswer ::= "yes" | "no"\nreason ::= [a-z ]{1,40}'
    out = eng.generate(chat(eng, "Is the sky blue?"), greedy(32, ebnf=grammar))
    assert re.fullmatch(r"(yes|no), because [a-z ]{1,40}", out["text"]), out["text"]


def test_any_json_and_whitespace_option(engines):
    eng = engines["xgrammar"]
    outs = eng.generate(
        [chat(eng, "Describe a cat as JSON.")] * 2,
        [greedy(40, json_schema="$$ANY$$"), greedy(40, json_schema=json.dumps(PERSON), json_whitespace=True)],
    )
    if outs[0]["meta_info"]["finish_reason"]["type"] == "stop":
        json.loads(outs[0]["text"])
    jsonschema.validate(json.loads(outs[1]["text"]), PERSON)


@pytest.mark.parametrize("name", ["xgrammar", "outlines"])
def test_mixed_batch_leaves_free_requests_alone(engines, name):
    eng = engines[name]
    free_prompt = "The capital of France is"
    alone = eng.generate(free_prompt, greedy(10))
    outs = eng.generate(
        [chat(eng, f"JSON please: {PEOPLE[0]}"), free_prompt, chat(eng, "Yes or no?")],
        [greedy(48, json_schema=json.dumps(PERSON)), greedy(10), greedy(4, regex="(yes|no)")],
    )
    jsonschema.validate(json.loads(outs[0]["text"]), PERSON)
    assert outs[1]["output_ids"] == alone["output_ids"]
    assert outs[2]["text"] in ("yes", "no")


def test_length_inside_grammar_returns_partial_output(engines):
    eng = engines["xgrammar"]
    out = eng.generate(chat(eng, PEOPLE[0]), greedy(3, json_schema=json.dumps(PERSON)))
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert '{"name":"'.startswith(out["text"]) or out["text"].startswith('{"name":"')


def test_jump_forward_on_and_off_give_valid_json(engines):
    """xgrammar runs with jump-forward on; an outlines engine runs with it off (see fixture)."""
    eng = engines["xgrammar"]
    on = eng.generate(chat(eng, PEOPLE[2]), greedy(48, json_schema=json.dumps(PERSON)))
    jsonschema.validate(json.loads(on["text"]), PERSON)
    stats = eng.get_stats()
    if "jump_forward_tokens" not in stats:
        pytest.skip("the scheduler does not call GrammarManager.jump_forward yet")
    assert stats["jump_forward_tokens"] > 0
    assert engines["outlines"].get_stats().get("jump_forward_tokens", 0) == 0


def test_forced_stop_ends_without_its_step_and_changes_nothing(engines):
    """Where a grammar allows only the stop token (a fixed-length regex fully written), xgrammar's engine
    (jump-forward on) appends it without the step that would sample it; outlines' (jump-forward off) runs
    that step. Same outputs, token for token; with logprobs asked for, the step runs (its logprob)."""
    xg, ol = engines["xgrammar"], engines["outlines"]
    prompts = [chat(xg, f"Give a three-digit number about {w}.") for w in ("cats", "rain", "trains")]
    params = greedy(12, regex=r"[0-9]{3}")
    before = xg.get_stats().get("grammar_forced_stops", 0)
    on, off = xg.generate(prompts, params), ol.generate(prompts, params)
    assert xg.get_stats()["grammar_forced_stops"] == before + len(prompts)
    assert ol.get_stats().get("grammar_forced_stops", 0) == 0
    eos = xg.tokenizer.eos_token_id
    for a, b in zip(on, off):
        assert re.fullmatch(r"[0-9]{3}", a["text"]), a["text"]
        assert a["output_ids"] == b["output_ids"] and a["output_ids"][-1] == eos
        assert a["meta_info"]["finish_reason"] == b["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
        assert a["meta_info"]["completion_tokens"] == b["meta_info"]["completion_tokens"] == 4
    with_logprobs = xg.generate(prompts[0], params, return_logprob=True)
    assert xg.get_stats()["grammar_forced_stops"] == before + len(prompts)
    assert with_logprobs["output_ids"] == on[0]["output_ids"]
    assert len(with_logprobs["meta_info"]["output_token_logprobs"]) == 4


def test_stats_report_grammar_compile_time_and_device_memory(engines):
    # What /metrics (plait_grammar_compile_seconds) and /get_server_info's memory_usage read.
    eng = engines["outlines"]
    before = eng.get_stats().get("grammar_compile_seconds", 0.0)  # (no grammar manager before the first grammar)
    eng.generate("Pick a code:", greedy(6, regex=r"[A-F]{3}-[0-9]{2}"))  # a grammar no other test compiles
    stats = eng.get_stats()
    assert stats["grammar_compile_seconds"] > before
    # float32 SmolLM2-135M: ~135M parameters; KV: 30 layers x 3 heads x 64 dims x (K, V) x 4 bytes per slot.
    assert 4e8 < stats["weight_bytes"] < 7e8
    # (one slot more than max_total_tokens: slot 0, where padded rows write)
    assert stats["kv_cache_bytes"] == (stats["max_total_tokens"] + 1) * 30 * 3 * 64 * 2 * 4


INVALID = [
    ({"regex": "a(b"}, "regex 'a(b' is invalid"),
    ({"regex": "(?<=x)y"}, "lookahead/lookbehind"),
    ({"json_schema": "{not json"}, "json_schema is not valid JSON"),
    ({"json_schema": '{"type": "integr"}'}, "not a valid JSON schema"),
    ({"ebnf": "root ::= missing_rule"}, "missing_rule"),
    ({"regex": "a", "json_schema": "{}"}, "mutually exclusive"),
]


@pytest.mark.parametrize("params,message", INVALID)
def test_invalid_constraints_raise_and_engine_keeps_serving(engines, params, message):
    eng = engines["xgrammar"]
    with pytest.raises(ValueError, match=re.escape(message)):
        eng.generate("Hi", {"max_new_tokens": 4, **params})
    assert eng.generate("Hi", greedy(2))["meta_info"]["completion_tokens"] == 2


def test_outlines_rejects_ebnf_clearly(engines):
    with pytest.raises(ValueError, match="does not support EBNF"):
        engines["outlines"].generate("Hi", {"max_new_tokens": 4, "ebnf": 'root ::= "a"'})
    assert engines["outlines"].generate("Hi", greedy(2))["meta_info"]["completion_tokens"] == 2


def test_unenforced_schema_features_are_reported_in_meta_info(engines):
    eng = engines["xgrammar"]
    schema = {
        "type": "object",
        "required": ["tags"],
        "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
    }
    out = eng.generate(chat(eng, "List two tags."), greedy(24, json_schema=json.dumps(schema)))
    assert any("uniqueItems" in w for w in out["meta_info"]["grammar_warnings"])
    plain = eng.generate(chat(eng, "Hi"), greedy(2))
    assert "grammar_warnings" not in plain["meta_info"]
