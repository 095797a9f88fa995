"""Structured outputs users can rely on (issue 22), without a model: the JSON scanner, the shortest-completion
search, repeated keys masked exactly, loops noticed, the budget closing driven through the GrammarManager with
scripted logits, honest schemas (oneOf, formats) and strict refusals, and the JSON layouts of both backends.

Everything runs on the real SmolLM2 tokenizer and the real grammar backends."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import jsonschema
import pytest
import torch
from plait.runtime import ServerArgs
from plait.runtime.constrained import ANY_JSON, StrictSchemaError, create_grammar_backend, validate_constraint
from plait.runtime.constrained.bitmask import allocate_token_bitmask, unpack_bitmask
from plait.runtime.constrained.completion import CompletionSearch
from plait.runtime.constrained.integration import GrammarManager
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
from plait.runtime.constrained.one_of import branches_exclusive
from plait.runtime.constrained.repetition import MIN_SPAN, RepetitionWatch
from plait.runtime.constrained.token_tables import TokenTables
from plait.runtime.constrained.unique_keys import RepeatedKeyMask
from plait.runtime.detokenizer import IncrementalDetokenizer
from plait.runtime.sampling_params import SamplingParams

VOCAB = 49152
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 18, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "since": {"type": "string", "format": "date"},
    },
    "required": ["name", "age", "role", "since"],
}


@pytest.fixture(scope="module")
def backends(default_tokenizer):
    made = {name: create_grammar_backend(name, default_tokenizer) for name in ("xgrammar", "outlines")}
    yield made
    for backend in made.values():
        backend.shutdown()


@pytest.fixture(scope="module")
def tables(backends):
    return TokenTables(backends["xgrammar"].vocab)


def matcher_after(backend, kind: str, text: str, prefix: str, tokenizer):
    matcher = backend.compile_sync((kind, text)).new_matcher()
    for token in tokenizer.encode(prefix, add_special_tokens=False):
        assert matcher.accept_token(token), (prefix, tokenizer.decode([token]))
    return matcher


def scanned(prefix: str) -> JsonScanner:
    scanner = JsonScanner()
    scanner.feed(prefix.encode())
    return scanner


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


# ---------------------------------------------------------------- the closing, through the GrammarManager
def fake_request(manager, tokenizer, max_new_tokens: int, **params):
    sp = SamplingParams.from_dict({"max_new_tokens": max_new_tokens, **params})
    req = SimpleNamespace(
        sampling_params=sp,
        output_ids=[],
        finished_reason=None,
        max_new_tokens=max_new_tokens,
        detok=IncrementalDetokenizer(tokenizer),
        return_logprob=False,
    )
    req.remaining_new_tokens = lambda: max(0, req.max_new_tokens - len(req.output_ids))
    req.grammar = manager.request(sp).result()
    return req


def drive(manager, req, preferred: list[int], tokenizer, steps: int = 400) -> str:
    """Decode with scripted logits: the preferred tokens score highest, in order (where the grammar forces
    text, the first token of its encoding); jump-forward on."""
    scores = torch.zeros(VOCAB)
    for rank, token in enumerate(preferred):
        scores[token] = 100.0 - rank
    for _ in range(steps):
        if req.finished_reason is not None or req.grammar.is_terminated() or req.remaining_new_tokens() == 0:
            break
        logits = scores.clone().unsqueeze(0)  # (1, V)
        forced = req.grammar.inner.jump_forward_string()
        if forced:  # text the grammar fixes: written with the tokenizer's tokens, as a model would
            logits[0, tokenizer.encode(forced, add_special_tokens=False)[0]] = 200.0
        manager.fill_and_apply(logits, [req])
        token = int(torch.argmax(logits[0]))
        req.output_ids.append(token)
        assert manager.accept(req, token)
        if req.finished_reason is None and not req.grammar.is_terminated():
            manager.jump_forward(req)
    return tokenizer.decode(req.output_ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def manager(default_tokenizer):
    args = ServerArgs(grammar_backend="xgrammar", grammar_compile_timeout=60.0)
    made = GrammarManager(default_tokenizer, VOCAB, args)
    yield made
    made.backend.shutdown()


def test_a_model_that_rambles_is_closed_exactly_at_the_budget(manager, default_tokenizer):
    """The scripted model writes "ab" inside the name forever; the output still ends as a valid object, with
    its last token the budget's last one, and says why."""
    ab = default_tokenizer.encode("ab", add_special_tokens=False)[0]
    schema = {**PERSON, "properties": {**PERSON["properties"], "name": {"type": "string"}}}
    for budget, temperature in ((40, 0), (50, 0), (57, 0), (50, 1.0)):  # (past 32 "ab"s the loop watch acts first)
        # (temperature 1: the sampled path keeps every fitting token of the likeliest few; argmax picks here)
        req = fake_request(manager, default_tokenizer, budget, json_schema=json.dumps(schema), temperature=temperature)
        text = drive(manager, req, [ab], default_tokenizer)
        assert json.loads(text)["name"].startswith("abab")
        jsonschema.validate(json.loads(text), schema)
        assert req.finished_reason.type == "length" and len(req.output_ids) == budget
        assert req.grammar.closed_early == "budget"


def test_a_loop_is_closed_long_before_the_budget(manager, default_tokenizer):
    digits = [default_tokenizer.encode(d, add_special_tokens=False)[0] for d in "1234567890"]
    schema = {"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"]}
    req = fake_request(manager, default_tokenizer, 384, json_schema=json.dumps(schema))
    scores = torch.zeros(VOCAB)
    text_ids = []
    for _ in range(384):  # the model's favourite next digit is always the one after the last
        if req.grammar.is_terminated() or req.finished_reason is not None:
            break
        last = default_tokenizer.decode(req.output_ids[-1:]) if req.output_ids else ""
        nxt = digits[(int(last) % 10)] if last.isdigit() else digits[0]
        scores.zero_()
        scores[nxt] = 50
        logits = scores.clone().unsqueeze(0)
        manager.fill_and_apply(logits, [req])
        token = int(torch.argmax(logits[0]))
        req.output_ids.append(token)
        text_ids.append(token)
        assert manager.accept(req, token)
        if not req.grammar.is_terminated():
            manager.jump_forward(req)
    text = default_tokenizer.decode(req.output_ids, skip_special_tokens=True)
    assert json.loads(text)["id"].startswith("1234567890")
    assert req.grammar.closed_early == "repetition" and req.grammar.is_terminated()
    assert len(req.output_ids) < 80


def test_closing_off_leaves_the_model_alone(manager, default_tokenizer):
    ab = default_tokenizer.encode("ab", add_special_tokens=False)[0]
    req = fake_request(manager, default_tokenizer, 40, json_schema=json.dumps(PERSON), close_within_budget=False)
    text = drive(manager, req, [ab], default_tokenizer)
    assert text.startswith('{"name": "abab') and req.grammar.closed_early is None
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_an_impossible_budget_is_left_to_the_model(manager, default_tokenizer):
    """No valid object fits in 4 tokens: nothing is forced (and the counter says so)."""
    before = manager.counters["grammar_close_overshoots"]
    req = fake_request(manager, default_tokenizer, 4, json_schema=json.dumps(PERSON))
    drive(manager, req, [default_tokenizer.encode("ab", add_special_tokens=False)[0]], default_tokenizer)
    assert req.grammar.closed_early is None and manager.counters["grammar_close_overshoots"] == before + 1


def test_regex_output_is_closed_within_the_budget(manager, default_tokenizer):
    pattern = r"(yes|no), because [a-z ]{1,60}\."
    a = default_tokenizer.encode(" a", add_special_tokens=False)[0]
    yes = default_tokenizer.encode("yes", add_special_tokens=False)[0]
    req = fake_request(manager, default_tokenizer, 16, regex=pattern)
    text = drive(manager, req, [yes, a], default_tokenizer)
    assert re.fullmatch(pattern, text), text
    assert req.finished_reason.type == "length" and req.grammar.closed_early == "budget"


def test_requests_of_one_constraint_search_once_and_write_what_each_writes_alone(manager, default_tokenizer):
    """A batch of date answers under one regex: the first request's search from the opening state is kept
    (CompletionSearch's memo) and the others take its text instead of searching again; after the model's own
    digits the old completion less as many bytes still completes (the fixed-width hint), so no request searches
    again. Each output is what the same request writes alone on a fresh manager."""
    pattern = r"(1[0-9]|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
    digits = [default_tokenizer.encode(d, add_special_tokens=False)[0] for d in "4719"]
    stats = manager.search.stats
    before = dict(stats)
    texts = []
    for i in range(4):
        req = fake_request(manager, default_tokenizer, 16, regex=pattern)
        texts.append(drive(manager, req, digits[i:] + digits[:i], default_tokenizer))
        assert re.fullmatch(pattern, texts[-1]), texts[-1]
    assert stats["completion_searches"] - before["completion_searches"] == 1
    assert stats["completion_memo"] - before["completion_memo"] == 3
    alone = GrammarManager(
        default_tokenizer, VOCAB, ServerArgs(grammar_backend="xgrammar", grammar_compile_timeout=60.0)
    )
    try:
        req = fake_request(alone, default_tokenizer, 16, regex=pattern)
        assert drive(alone, req, digits[3:] + digits[:3], default_tokenizer) == texts[3]
        assert alone.search.stats["completion_searches"] == 1 and alone.search.stats["completion_memo"] == 0
    finally:
        alone.backend.shutdown()


# ---------------------------------------------------------------- the closing under grammar drafts
def scripted_logits(grammar, scores: torch.Tensor, tokenizer) -> torch.Tensor:
    """(V,) the scripted model of `drive` at the grammar's state: `scores`, and where text is forced its
    tokenizer encoding's first token above everything."""
    logits = scores.clone()
    forced = grammar.inner.jump_forward_string()
    if forced:
        logits[tokenizer.encode(forced, add_special_tokens=False)[0]] = 200.0
    return logits


def finished(req) -> bool:
    return req.finished_reason is not None or req.grammar.is_terminated() or req.remaining_new_tokens() == 0


def plain_greedy(manager, req, scores: torch.Tensor, tokenizer) -> list[int]:
    """Plain constrained decoding of the scripted model (no jump-forward, no drafts)."""
    while not finished(req):
        logits = scripted_logits(req.grammar, scores, tokenizer).unsqueeze(0)  # (1, V)
        manager.fill_and_apply(logits, [req])
        token = int(torch.argmax(logits[0]))
        req.output_ids.append(token)
        assert manager.accept(req, token)
    return req.output_ids


def drafted_greedy(manager, req, scores: torch.Tensor, tokenizer, guess: int, max_drafts: int = 8):
    """The same model in verify steps as the scheduler runs grammar drafts (speculation.py, verify.py,
    results.py): the forced text and then `guess` (the model's favourite, a perfect lookup) as drafts within
    draft_room, every node scored under its plain mask (the root's refined), the longest match taken and
    committed through keeps_verified. Returns the output, the steps with drafts while the closer chose, and
    the commits keeps_verified cut short."""
    from plait.runtime.constrained.bitmask import apply_token_bitmask_inplace
    from plait.runtime.speculative.acceptance import accept_greedy
    from plait.runtime.speculative.grammar_drafts import GrammarDrafts, fill_tree_bitmask
    from plait.runtime.speculative.tree import DraftTree

    drafter = GrammarDrafts(tokenizer, tokenizer.all_special_ids)
    choosing_steps = cuts = 0
    plain_greedy_step(manager, req, scores, tokenizer)  # the prefill's token
    while not finished(req):
        g = req.grammar
        n = g.draft_room(min(max_drafts, req.remaining_new_tokens() - 1), free=False)
        drafts, _ = drafter.propose(g, req.output_ids, n, extend=lambda ctx, k, extra, longer: [guess] * k)
        choosing_steps += bool(drafts) and g.closer.choosing
        tree = DraftTree.chain(req.output_ids[-1], drafts)
        bitmask = allocate_token_bitmask(tree.size, VOCAB)
        fill_tree_bitmask(g, tree, bitmask, 0)
        logits = torch.stack(
            [scripted_logits(g, scores, tokenizer)]
            + [_scripted_after(g, drafts[:i], scores, tokenizer) for i in range(1, tree.size)]
        )  # (T, V)
        g.refine_bitmask(logits[0], bitmask[0])
        apply_token_bitmask_inplace(logits, bitmask, list(range(tree.size)))
        tokens, _ = accept_greedy(tree, torch.argmax(logits, dim=1).tolist())
        for j, token in enumerate(tokens):
            if j and not g.keeps_verified(token):
                cuts += 1
                break
            req.output_ids.append(token)
            assert manager.accept(req, token)
            if finished(req):
                break
    return req.output_ids, choosing_steps, cuts


def plain_greedy_step(manager, req, scores: torch.Tensor, tokenizer) -> None:
    logits = scripted_logits(req.grammar, scores, tokenizer).unsqueeze(0)
    manager.fill_and_apply(logits, [req])
    token = int(torch.argmax(logits[0]))
    req.output_ids.append(token)
    assert manager.accept(req, token)


def _scripted_after(grammar, drafts: list[int], scores: torch.Tensor, tokenizer) -> torch.Tensor:
    """The scripted model's logits at the state after `drafts` (the matcher walked there and back)."""
    with grammar.drafting():
        for token in drafts:
            assert grammar.accept_token(token)
        logits = scripted_logits(grammar, scores, tokenizer)
        grammar.rollback(len(drafts))
    return logits


def test_greedy_grammar_drafts_near_the_budget_write_plain_decodings_output(manager, default_tokenizer):
    """A greedy request drafts while the closer chooses (its forced text and the model's own string content):
    each verified token is kept only where plain decoding's decision at it writes it (keeps_verified), so
    the output is plain constrained decoding's to the token, closing included, for budgets that close it
    inside the name, at the forced text between fields, and at the values after it."""
    ab = default_tokenizer.encode("ab", add_special_tokens=False)[0]
    schema = json.dumps({**PERSON, "properties": {**PERSON["properties"], "name": {"type": "string"}}})
    scores = torch.zeros(VOCAB)
    scores[ab] = 100.0
    choosing = cuts = 0
    for budget in (40, 50):
        want = plain_greedy(
            manager,
            fake_request(manager, default_tokenizer, budget, json_schema=schema, temperature=0),
            scores,
            default_tokenizer,
        )
        req = fake_request(manager, default_tokenizer, budget, json_schema=schema, temperature=0)
        got, chose, cut = drafted_greedy(manager, req, scores, default_tokenizer, guess=ab)
        assert got == want, budget
        assert req.grammar.closed_early == "budget"
        choosing, cuts = choosing + chose, cuts + cut
    assert choosing > 0  # drafts were verified where the closer chose (not held back to decoding)
    assert cuts > 0  # and some verified tokens were not plain decoding's there: cut


# ---------------------------------------------------------------- honest schemas, strict
def test_one_of_with_disjoint_branches_is_enforced_exactly():
    obj = lambda **p: {"type": "object", "properties": p, "required": list(p)}  # noqa: E731
    tagged = [
        obj(kind={"const": "circle"}, r={"type": "integer"}),
        obj(kind={"const": "square"}, s={"type": "integer"}),
    ]
    assert branches_exclusive(tagged, {})
    assert branches_exclusive([{"type": "string"}, {"type": "object"}, {"type": "null"}], {})
    assert branches_exclusive([{"$ref": "#/$defs/a"}, {"enum": [1, 2]}], {"$defs": {"a": {"type": "string"}}})
    assert not branches_exclusive([{"type": "number"}, {"type": "integer"}], {})
    assert not branches_exclusive([{"enum": [1, 2]}, {"enum": [2.0, 3]}], {})
    assert not branches_exclusive([obj(a={"type": "string"}), obj(b={"type": "string"})], {})
    schema = {
        "type": "object",
        "properties": {"shape": {"oneOf": tagged}, "n": {"oneOf": [{"type": "number"}, {"type": "integer"}]}},
    }
    for backend in ("xgrammar", "outlines"):
        warnings = validate_constraint("json", json.dumps(schema), backend)
        assert [w for w in warnings if "oneOf" in w] == [w for w in warnings if "/properties/n" in w], warnings
        assert any("/properties/n" in w for w in warnings)


def test_formats_checked_by_shape_only_are_reported():
    schema = {
        "type": "object",
        "properties": {"d": {"type": "string", "format": "date"}, "u": {"type": "string", "format": "uuid"}},
    }
    for backend in ("xgrammar", "outlines"):
        warnings = validate_constraint("json", json.dumps(schema), backend)
        assert len(warnings) == 1 and "format 'date' at /properties/d is checked by shape only" in warnings[0]


@pytest.mark.parametrize(
    "keyword,schema,path",
    [
        (
            "uniqueItems",
            {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}},
            "/properties/tags",
        ),
        ("not", {"type": "object", "properties": {"s": {"type": "string", "not": {"const": "x"}}}}, "/properties/s"),
        ("if", {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "/"),
        ("contains", {"type": "array", "items": {"type": "integer"}, "contains": {"const": 7}}, "/"),
        ("oneOf", {"oneOf": [{"type": "integer"}, {"type": "number"}]}, "/"),
        (
            "format",
            {"type": "object", "properties": {"day": {"type": "string", "format": "date-time"}}},
            "/properties/day",
        ),
    ],
)
def test_strict_refuses_naming_the_keyword_and_its_path(keyword, schema, path):
    for backend in ("xgrammar", "outlines"):
        text = json.dumps(schema)
        assert validate_constraint("json_natural", text, backend)  # without strict: warnings
        with pytest.raises(StrictSchemaError, match=f"keyword {keyword!r} at {re.escape(path)}:") as info:
            validate_constraint("json_natural", text, backend, strict=True)
        assert info.value.keyword == keyword and info.value.path == path
    assert (
        validate_constraint(
            "json_natural",
            json.dumps({"type": "object", "properties": {"a": {"type": "integer", "minimum": 0}}}),
            strict=True,
        )
        == []
    )


# ---------------------------------------------------------------- JSON layouts
@pytest.mark.parametrize("name", ["xgrammar", "outlines"])
def test_json_layouts_of_both_backends(backends, default_tokenizer, name):
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "integer"},
            "b": {"type": "array", "items": {"type": "string"}},
            "c": {"type": "object", "properties": {"d": {"type": "boolean"}}, "required": ["d"]},
        },
        "required": ["a", "b", "c"],
    }
    value = {"a": 1, "b": ["x", "y"], "c": {"d": True}}
    layouts = {
        "json_natural": json.dumps(value),
        "json": json.dumps(value, separators=(",", ":")),
        "json_indent": json.dumps(value, indent=2),
    }
    for kind in layouts:
        if name == "outlines" and kind == "json_indent":
            with pytest.raises(ValueError, match="cannot lay JSON out with indentation"):
                backends[name].compile_sync((kind, json.dumps(schema)))
            continue
        compiled = backends[name].compile_sync((kind, json.dumps(schema)))
        for other_kind, other in layouts.items():
            matcher = compiled.new_matcher()
            ok = all(matcher.accept_token(t) for t in default_tokenizer.encode(other, add_special_tokens=False))
            assert (ok and matcher.is_completed()) == (other_kind == kind), (name, kind, other_kind)


def test_json_style_setting():
    assert SamplingParams(json_schema="{}").grammar_key == ("json_natural", "{}")
    assert SamplingParams(json_schema="{}", json_style="compact").grammar_key == ("json", "{}")
    assert SamplingParams(json_schema="{}", json_style="indent").grammar_key == ("json_indent", "{}")
    assert SamplingParams(json_schema="{}", json_whitespace=True).grammar_key == ("json_ws", "{}")
    with pytest.raises(ValueError, match="cannot work together"):
        SamplingParams(json_schema="{}", json_whitespace=True, json_style="compact").verify()
    with pytest.raises(ValueError, match="json_style must be one of"):
        SamplingParams(json_schema="{}", json_style="pretty").verify()
    with pytest.raises(ValueError, match="close_within_budget must be bool"):
        SamplingParams(close_within_budget="no").verify()
