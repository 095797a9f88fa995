"""Regressions from the constraint trial: schemas, regexes and grammars a user brings (real model).

Each test pins a failure found by running user-style constraints through `Engine.generate` on the
default model (SmolLM2-135M-Instruct, greedy): outputs are checked the way a user checks them
(`re.fullmatch`, `jsonschema` Draft 2020-12), and bad input must raise a clear ValueError while
the engine keeps serving.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from plait.runtime import Engine


@pytest.fixture(scope="module")
def eng():
    with Engine(num_threads=1, max_total_tokens=4096) as engine:
        yield engine


def chat(eng, text: str) -> str:
    return eng.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


def greedy(max_new_tokens: int, **constraint) -> dict:
    return {"temperature": 0, "max_new_tokens": max_new_tokens, **constraint}


def still_serving(eng) -> bool:
    return eng.generate("Hi", greedy(2))["meta_info"]["completion_tokens"] == 2


# ---- regexes: Python semantics, whatever the backend's own dialect ----
def test_regex_dot_never_matches_a_newline(eng):
    """xgrammar's `.` matched "\\n"; the model wrote 'Answer: \\nA helpful...' (no re.fullmatch)."""
    pattern = r"Answer: .{1,20}"
    out = eng.generate(chat(eng, f"Answer in the format {pattern}: give an example."), greedy(32, regex=pattern))
    assert re.fullmatch(pattern, out["text"]), out["text"]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_regex_named_groups_inline_flags_and_open_lower_bound(eng):
    """xgrammar refused `(?P<name>...)`, `(?i:...)` and `{,n}` ('Group modifier flag is not supported')."""
    cases = [
        (r"(?P<answer>(?i:yes|no))", "Is the sky blue? Answer YES or NO."),
        (r"(?P<year>\d{4})-(?P<month>0[1-9]|1[0-2])", "Give a year and month like 2024-05."),
        (r"[0-9]{,3} apples", "How many apples? Answer like '12 apples'."),
    ]
    outs = eng.generate([chat(eng, q) for _, q in cases], [greedy(12, regex=p) for p, _ in cases])
    for out, (pattern, _) in zip(outs, cases):
        assert re.fullmatch(pattern, out["text"]), (pattern, out["text"])


def test_regex_posix_class_is_refused_clearly(eng):
    """Python reads "[[:alpha:]]" as a set then ']' (and only warns); the backends read it otherwise."""
    with pytest.raises(ValueError, match=re.escape("POSIX classes such as [[:alpha:]]")):
        eng.generate("Hi", greedy(4, regex="[[:alpha:]]+"))
    assert still_serving(eng)


# ---- grammars that compile but accept nothing ----
@pytest.mark.parametrize("ebnf", ["root ::= root", 'root ::= item\nitem ::= item "x"'])
def test_grammar_with_an_empty_language_is_a_clear_error(eng, ebnf):
    """Such a grammar compiled, then the request died at step one: "token 0 violates the grammar"."""
    out = eng.generate("Hi", greedy(8, ebnf=ebnf))
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "matches no text at all" in reason["message"], reason
    assert still_serving(eng)


# ---- JSON schemas composed with allOf / $ref siblings ----
PET_API = {
    "$defs": {
        "Pet": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"]},
        "Dog": {
            "allOf": [
                {"$ref": "#/$defs/Pet"},
                {"type": "object", "properties": {"good": {"type": "boolean"}}, "required": ["good"]},
            ]
        },
    },
    "$ref": "#/$defs/Dog",
}
MIXIN = {
    "allOf": [
        {"type": "object", "properties": {"a": {"type": "integer", "maximum": 9}}, "required": ["a"]},
        {"type": "object", "properties": {"b": {"type": "string", "maxLength": 4}}, "required": ["b"]},
    ]
}


def test_all_of_schemas_are_enforced(eng):
    """Neither backend enforces allOf: xgrammar generated any JSON, and the model wrote the schema
    itself back ('{"allOf":[{"type":"object",...'). The branches are now merged into one schema."""
    schemas = [PET_API, MIXIN]
    prompts = [chat(eng, f"Reply with one JSON value that fits this JSON schema: {json.dumps(s)}") for s in schemas]
    outs = eng.generate(prompts, [greedy(40, json_schema=json.dumps(s)) for s in schemas])
    for out, schema in zip(outs, schemas):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        jsonschema.Draft202012Validator(schema).validate(json.loads(out["text"]))
        assert "grammar_warnings" not in out["meta_info"], out["meta_info"]["grammar_warnings"]


def test_all_of_merge_refuses_what_it_cannot_merge_exactly():
    """Unsafe merges keep the allOf (and its 'not enforced' warning) instead of loosening it."""
    from plait.runtime.constrained.schema_merge import merge_all_of

    closed = {
        "allOf": [
            {"properties": {"a": {"type": "integer"}}, "additionalProperties": False},
            {"properties": {"b": {"type": "integer"}}},
        ]
    }
    patterns = {"allOf": [{"type": "string", "pattern": "^a"}, {"type": "string", "pattern": "b$"}]}
    cycle = {"$defs": {"N": {"allOf": [{"$ref": "#/$defs/N"}]}}, "$ref": "#/$defs/N"}
    for schema in (closed, patterns, cycle):
        assert merge_all_of(schema) == schema
    bounds = {
        "allOf": [
            {"type": "number", "minimum": 0, "maximum": 100},
            {"type": "integer", "minimum": 10, "exclusiveMaximum": 50},
        ]
    }
    assert merge_all_of(bounds) == {"type": "integer", "minimum": 10, "maximum": 100, "exclusiveMaximum": 50}


def test_outlines_accepts_boolean_true_subschemas():
    """outlines-core refused `true` ("Unsupported JSON Schema structure true"), at the root or nested."""
    from plait.runtime.constrained import validate_constraint

    for schema in (
        True,
        {"type": "object", "properties": {"a": True}, "required": ["a"]},
        {"type": "array", "items": True, "maxItems": 2},
    ):
        assert validate_constraint("json", json.dumps(schema), "outlines") == []


# ---- string patterns are matched against the string's JSON text ----
def test_pattern_with_a_literal_quote_yields_valid_json(eng):
    """Both backends put a pattern's '"' into the output raw: '{"quote":""Hi""}' (invalid JSON)."""
    schema = {
        "type": "object",
        "properties": {"quote": {"type": "string", "pattern": '^"[A-Za-z ]{1,12}"$'}},
        "required": ["quote"],
    }
    out = eng.generate(
        chat(eng, "Give a short quotation in double quotes, as JSON."), greedy(24, json_schema=json.dumps(schema))
    )
    jsonschema.Draft202012Validator(schema).validate(json.loads(out["text"]))


def test_outlines_pattern_dot_never_writes_a_raw_quote(eng):
    """outlines let '.' in a pattern match a raw '"', so '^x.$' accepted the text '"x""'."""
    from plait.runtime.constrained import create_grammar_backend

    backend = create_grammar_backend("outlines", eng.tokenizer)
    try:
        compiled = backend.compile_sync(("json", json.dumps({"type": "string", "pattern": "^x.$"})))
        for text, ok in (('"x""', False), ('"xa"', True)):
            matcher = compiled.new_matcher()
            ids = eng.tokenizer.encode(text, add_special_tokens=False)
            accepted = all(matcher.accept_token(t) for t in ids) and matcher.accept_token(
                eng.tokenizer.convert_tokens_to_ids("<|im_end|>")
            )
            assert accepted == ok, text
    finally:
        backend.shutdown()
