"""Structured outputs without a model (issue 22): the JSON scanner, the shortest-completion search the budget
closer runs, repeated keys masked exactly, and loops noticed. On the real SmolLM2 tokenizer and both grammar
backends (conftest.py)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from helpers.constrained import PERSON, VOCAB, matcher_after, scanned
from plait.runtime.constrained import ANY_JSON
from plait.runtime.constrained.bitmask import allocate_token_bitmask, unpack_bitmask
from plait.runtime.constrained.completion import CompletionSearch
from plait.runtime.constrained.json_scan import (
    AFTER_IN_OBJECT,
    ARRAY_START,
    COLON,
    IN_KEY,
    IN_LITERAL,
    IN_STRING,
    KEY,
    JsonScanner,
)
from plait.runtime.constrained.repetition import MIN_SPAN, RepetitionWatch
from plait.runtime.constrained.unique_keys import RepeatedKeyMask


# ---------------------------------------------------------------- the scanner
@pytest.mark.parametrize(
    "prefix,context,closing",
    [
        ('{"name": "Al', IN_STRING, b'"}'),
        ('{"a": [1, 2', IN_LITERAL, b"]}"),
        ('{"a": [1, {"b": tr', IN_LITERAL, b"ue}]}"),
        ('{"a": -', IN_LITERAL, b"0}"),
        ('{"a": 1, ', KEY, None),
        ('{"a"', COLON, None),
        ('{"a": {"b": 1}, "c": ["x"]', AFTER_IN_OBJECT, b"}"),
        ("[", ARRAY_START, b"]"),
        ('{"x\\"y', IN_KEY, None),
        ('{"x": "\\u00', IN_STRING, None),  # inside an escape: no closing quote yet
    ],
)
def test_scanner_follows_the_structure(prefix, context, closing):
    scanner = scanned(prefix)
    assert scanner.context == context
    assert scanner.closing_text() == closing
    if closing is not None:
        json.loads(prefix + closing.decode())


def test_scanner_records_keys_per_object_and_rewinds():
    scanner = scanned('{"a": 1, "b": {"a": 2}, ')
    assert scanner.current_keys() == {b"a", b"b"}
    snap = scanner.snapshot()
    scanner.feed(b'"a"')
    assert scanner.repeated_key
    scanner.restore(snap)
    assert scanner.context == KEY and not scanner.repeated_key
    scanner.feed(b'"c": 3}')
    assert scanner.context == "done" and scanner.closing_text() == b""


# ---------------------------------------------------------------- the shortest completion
@pytest.mark.parametrize(
    "prefix",
    [
        '{"name": "Al',
        '{"name": "Al", "age": 1',
        '{"name": "Al", "age": 30, "role": "us',
        '{"name": "Al", "age": 30, "role": "user", "tags": ["x", "y',
        '{"name": "Al", "age": 30, "role": "user", "since": "2024-',
    ],
)
def test_search_completes_to_a_valid_value(backends, tables, default_tokenizer, prefix):
    search = CompletionSearch(tables)
    matcher = matcher_after(backends["xgrammar"], "json_natural", json.dumps(PERSON), prefix, default_tokenizer)
    found = search.find(matcher, scanned(prefix))
    value = json.loads(prefix + found.text.decode())
    jsonschema.Draft202012Validator(PERSON, format_checker=jsonschema.FormatChecker()).validate(value)
    assert "tags" not in value or prefix.endswith('"y')  # optional properties are not added
    # the matcher is left where it was: the completion's tokens are accepted from there
    assert all(matcher.accept_token(t) for t in found.token_ids) and matcher.is_completed()


def test_search_result_is_short(backends, tables, default_tokenizer):
    search = CompletionSearch(tables)
    matcher = matcher_after(backends["xgrammar"], "json_natural", json.dumps(PERSON), '{"name": "Al', default_tokenizer)
    found = search.find(matcher, scanned('{"name": "Al'))
    assert found.text == b'", "age": 18, "role": "admin", "since": "1111-11-11"}'
    nested = {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {"b": {"type": "array", "items": {"type": "integer"}, "minItems": 1}},
                "required": ["b"],
            }
        },
        "required": ["a"],
    }
    matcher = matcher_after(backends["xgrammar"], "json_natural", json.dumps(nested), "{", default_tokenizer)
    assert search.find(matcher, scanned("{")).text == b'"a": {"b": [0]}}'


def test_cheap_paths_come_first(backends, tables, default_tokenizer):
    """Closing containers needs no search; a previous completion still valid is taken as it is."""
    search = CompletionSearch(tables)
    prefix = '{"a": [1, {"b": "x'
    matcher = matcher_after(backends["xgrammar"], "json_natural", ANY_JSON, prefix, default_tokenizer)
    assert search.find(matcher, scanned(prefix)).how == "closers"
    matcher = matcher_after(backends["xgrammar"], "json_natural", json.dumps(PERSON), '{"name": "Al', default_tokenizer)
    hint = b'", "age": 18, "role": "admin", "since": "1111-11-11"}'
    assert search.find(matcher, scanned('{"name": "Al'), [hint]).how == "hint"


@pytest.mark.parametrize(
    "kind,text,prefix,check",
    [
        ("regex", r"(yes|no), because [a-z ]{1,30}\.", "yes, bec", r"(yes|no), because [a-z ]{1,30}\."),
        ("regex", r"[A-Z]{3}-[0-9]{4}", "AB", r"[A-Z]{3}-[0-9]{4}"),
        ("ebnf", 'root ::= "[" num ("," num)* "]"\nnum ::= [1-9] [0-9]*', "[12,3", r"\[[1-9][0-9]*(,[1-9][0-9]*)*\]"),
    ],
)
def test_search_completes_regexes_and_grammars(backends, tables, default_tokenizer, kind, text, prefix, check):
    for name, backend in backends.items():
        if kind == "ebnf" and name == "outlines":
            continue
        matcher = matcher_after(backend, kind, text, prefix, default_tokenizer)
        found = CompletionSearch(tables).find(matcher, None)
        assert re.fullmatch(check, prefix + found.text.decode()), (name, found.text)


# ---------------------------------------------------------------- repeated keys
def allowed_ids(matcher, vocab_size: int = VOCAB) -> list[int]:
    bitmask = allocate_token_bitmask(1, vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    return unpack_bitmask(bitmask, vocab_size)[0].nonzero().flatten().tolist()


OPEN_FLAT = json.dumps({"type": "object", "additionalProperties": {"type": ["integer", "string", "boolean"]}})
KEY_CASES = [
    ("xgrammar", ANY_JSON, '{"a": 1, "bb": [{"c": 2}], '),
    ("xgrammar", ANY_JSON, '{"a": 1, "bb": 2, "b'),
    ("xgrammar", ANY_JSON, '{"name": {"x": 1}, "na'),
    ("xgrammar", ANY_JSON, '{"a": "x", "b": true'),
    ("xgrammar", ANY_JSON, '{"a": {"b": 1, "c": [1]'),
    ("outlines", OPEN_FLAT, '{"a": 1, "bb": 2, "b'),
    ("outlines", OPEN_FLAT, '{"a": "x", "b": true'),
]


@pytest.mark.parametrize("name,schema,prefix", KEY_CASES)
def test_no_allowed_token_repeats_a_key(backends, tables, default_tokenizer, name, schema, prefix):
    """Exhaustive: from each state, every token the mask still allows is scanned; none closes a key its
    object already has, and every token the mask took away would have."""
    matcher = matcher_after(backends[name], "json_natural", schema, prefix, default_tokenizer)
    bitmask = allocate_token_bitmask(1, VOCAB)
    matcher.fill_bitmask(bitmask, 0)
    before = set(unpack_bitmask(bitmask, VOCAB)[0].nonzero().flatten().tolist())
    scanner = scanned(prefix)
    RepeatedKeyMask(tables).apply(scanner, bitmask[0], matcher)
    after = set(unpack_bitmask(bitmask, VOCAB)[0].nonzero().flatten().tolist())
    probe = JsonScanner()
    for token in before:
        probe.restore(scanner.snapshot())
        probe.feed(tables.vocab.decoded[token])
        assert probe.repeated_key == (token not in after), (prefix, tables.vocab.decoded[token])
    if prefix.endswith('"b'):  # "b" is a new key, and so may "bbc" be; "bb" is taken
        assert {tables.byte_token[ord('"')], tables.byte_token[ord("b")]} <= after


# ---------------------------------------------------------------- loops
def test_repetition_watch_sees_periodic_tails_and_digit_runs():
    watch = RepetitionWatch()
    unit = list(range(100, 110))  # "1234567890" as ten tokens
    for i in range(39):
        watch.feed(unit[i % 10], b"x")
    assert not watch.looping
    watch.feed(unit[39 % 10], b"x")
    assert watch.looping and "every 10" in watch.why
    watch.rollback(1)
    assert not watch.looping
    digits = RepetitionWatch()
    for i in range(11):
        digits.feed(1000 + i, b"123")  # all different tokens, 33 digits
    assert digits.looping and "digits" in digits.why
    varied = RepetitionWatch()
    for i in range(3 * MIN_SPAN):
        varied.feed(i * 7 % 101, b"ab")
    assert not varied.looping
    drifting = RepetitionWatch()  # "name" keys one "_name" longer each time: no period, few tokens
    key, value, sep = [1, 2], [3, 4, 5], [6, 7]
    stream = []
    for n in range(1, 12):
        stream += sep + key * n + [8] + value
    fed = 0
    while not drifting.looping and fed < len(stream):
        drifting.feed(stream[fed], b"x")
        fed += 1
    assert drifting.looping and "distinct" in drifting.why and fed < 100
