"""A new user's constraints on both grammar backends: real-world JSON schemas, regexes and EBNF grammars
nobody wrote tests for, run on the default model (greedy and sampled) and checked the way a user checks
them (`jsonschema` with formats, `re.fullmatch`); plus regressions of what the trial found wrong."""

from __future__ import annotations

import enum
import json
import re
from typing import Annotated, Literal, Optional

import jsonschema
import pydantic
import pytest
from plait.runtime import Engine
from plait.runtime.constrained import create_grammar_backend, validate_constraint

BACKENDS = ("xgrammar", "outlines")
STOP = 2  # <|im_end|>
FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER


class Color(str, enum.Enum):
    RED = "red"
    GREEN = "green"


class Dims(pydantic.BaseModel):
    w: Annotated[int, pydantic.Field(ge=1, le=9)]
    h: Annotated[int, pydantic.Field(gt=0, lt=10)]


class Product(pydantic.BaseModel):
    sku: Annotated[str, pydantic.Field(pattern=r"^[A-Z]{3}[0-9]{2}$")]
    kind: Literal["book", "toy"]
    colors: list[Color] = pydantic.Field(max_length=2)
    dims: Dims
    note: Optional[Annotated[str, pydantic.Field(max_length=6)]] = None


def obj(required=None, **props) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required}


S = {"type": "string"}
# Short valid outputs: generated on both backends, greedy and sampled.
GENERATED = {
    "address": obj(
        ["name", "zip", "country"],
        name={**S, "minLength": 1, "maxLength": 12},
        zip={**S, "pattern": "^[0-9]{5}$"},
        country={"enum": ["US", "FR", "DE"]},
    ),
    "issue": {
        **obj(
            number={"type": "integer", "minimum": 1, "maximum": 999},
            title={**S, "maxLength": 16},
            state={"enum": ["open", "closed"]},
            assignee={"type": ["string", "null"], "maxLength": 8},
        ),
        "additionalProperties": False,
    },
    "invoice": obj(
        id={**S, "pattern": r"^INV-\d{4}$"},
        lines={
            "type": "array",
            "minItems": 1,
            "maxItems": 2,
            "items": obj(qty={"type": "integer", "minimum": 1, "maximum": 9}),
        },
    ),
    "event": obj(day={**S, "format": "date"}, at={**S, "format": "time"}, start={**S, "format": "date-time"}),
    "tree": {
        "$defs": {
            "n": obj(
                v={"type": "integer", "minimum": 0, "maximum": 9},
                kids={"type": "array", "items": {"$ref": "#/$defs/n"}, "maxItems": 1},
            )
        },
        "$ref": "#/$defs/n",
    },
    "shape": {
        "oneOf": [
            obj(kind={"const": "circle"}, r={"type": "integer", "minimum": 1, "maximum": 9}),
            obj(kind={"const": "square"}, side={"type": "integer", "minimum": 1, "maximum": 9}),
        ]
    },
    "nullable_age": obj(age={"type": ["integer", "null"], "minimum": 0, "maximum": 150}),
    "stars": obj(stars={"enum": [1, 2, 3, 4, 5]}, ratio={"enum": [0.5, 1.5]}),
    "exclusive": obj(
        n={"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 15},
        half={"type": "integer", "minimum": 0.5, "maximum": 3.5},
    ),
    "lengths": obj(code={**S, "minLength": 3, "maxLength": 3}, word={**S, "minLength": 2, "maxLength": 5}),
    "array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 2, "maxItems": 3},
    "tuple": {
        "type": "array",
        "prefixItems": [{**S, "maxLength": 4}, {"type": "boolean"}],
        "items": False,
        "minItems": 2,
    },
    "closed": {**obj(a={"type": "integer", "minimum": -5, "maximum": 5}), "additionalProperties": False},
    "deep": obj(a=obj(b=obj(c=obj(d={"type": "boolean"})))),
    "weird_names": obj(
        **{
            "first name": {**S, "maxLength": 5},
            "prénom": {"const": "Zoé"},
            'say "hi"': {"type": "boolean"},
            "back\\slash": {"enum": [0, 1]},
        }
    ),
    "multiple_of": obj(n={"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 30}),
    "any_of": {"anyOf": [{"type": "integer", "minimum": 100, "maximum": 199}, {**S, "maxLength": 3}]},
    "const": {"const": {"ok": True, "n": [1, 2]}},
    "pydantic": Product.model_json_schema(),
}
# Compiled (and reported on) without generating.
COMPILED_ONLY = {
    "empty": {},
    "true": True,
    "open_object": obj(["a"], a={"type": "integer"}) | {"additionalProperties": True},
    "map": {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 2},
    "pattern_props": {
        "type": "object",
        "patternProperties": {"^x_[a-z]+$": {"type": "integer"}},
        "additionalProperties": False,
    },
    "long_enum": obj(country={"enum": [f"Country {i:03d}" for i in range(400)]}),
    "comment_thread": obj(author={**S, "maxLength": 8}, replies={"type": "array", "items": {"$ref": "#"}}),
    "email": obj(email={**S, "format": "email"}, home={**S, "format": "uri"}, ip={**S, "format": "ipv4"}),
    "uuid": obj(id={**S, "format": "uuid"}),
    "big_object": obj(**{f"field_{i}": {"type": ["string", "integer", "null"]} for i in range(60)}),
}
UNENFORCED = {  # keywords neither backend enforces: named in the warnings, never silently dropped
    "uniqueItems": {"type": "array", "items": {"enum": ["a", "b"]}, "uniqueItems": True},
    "not": obj(s={**S, "not": {"const": "x"}}),
    "if": {"type": "object", "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}},
    "contains": {"type": "array", "contains": {"const": 7}},
    "dependentRequired": {"type": "object", "properties": {"a": S, "b": S}, "dependentRequired": {"a": ["b"]}},
}

REGEXES = [
    r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
    r"[a-z0-9._]{1,12}@[a-z]{2,8}\.(com|org|net)",
    r"((25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(25[0-5]|2[0-4]\d|1?\d?\d)",
    r"\+1 \(\d{3}\) \d{3}-\d{4}",
    r"(red|green|blue|yellow)",
    r"[A-Z]{2,5}",
    r"\$\d{1,3}\.\d{2}",
    r"\[(INFO|WARN)\] [a-z ]{1,20}",
    r"[\u00C0-\u00FF]{1,3}",
    r"(?i:yes|no)",
    r"v\d+\.\d+\.\d+",
    r"#[0-9a-fA-F]{6}",
    r"\w{1,8}=\w{1,8}(; \w{1,8}=\w{1,8}){0,2}",
    r"[^\s,]{1,6}(, [^\s,]{1,6}){1,3}",
    r"(a|b)*c{2,5}",
]
EBNF = [
    (
        'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= num (("*" | "/") num)*\nnum ::= [1-9] [0-9]?',
        r"[1-9][0-9]?([*/][1-9][0-9]?)*([+-][1-9][0-9]?([*/][1-9][0-9]?)*)*",
    ),
    (
        'root ::= "SELECT " cols " FROM " name (" WHERE " name " = " [0-9]+)?\ncols ::= "*" | name (", " name)*\n'
        "name ::= [a-z]+",
        r"SELECT (\*|[a-z]+(, [a-z]+)*) FROM [a-z]+( WHERE [a-z]+ = [0-9]+)?",
    ),
    (
        'root ::= line line?\nline ::= key "=" value "\\n"\nkey ::= [a-z_]+\nvalue ::= [a-zA-Z0-9]+',
        r"([a-z_]+=[a-zA-Z0-9]+\n){1,2}",
    ),
    ('root ::= "[" num ("," num){0,3} "]"\nnum ::= "-"? [0-9] ("." [0-9])?', r"\[-?\d(\.\d)?(,-?\d(\.\d)?){0,3}\]"),
    ('root ::= ("yes" | "no") ", because " [a-z ]{1,30}', r"(yes|no), because [a-z ]{1,30}"),
    ('root ::= "<" tag ">" [a-z ]* "</" tag ">"\ntag ::= "b" | "i"', r"<(b|i)>[a-z ]*</(b|i)>"),
    ('root ::= item ("\\n" item){0,2}\nitem ::= "- " [A-Za-z]+', r"- [A-Za-z]+(\n- [A-Za-z]+){0,2}"),
    ('root ::= "{\\"ok\\": " ("true" | "false") "}"', r'\{"ok": (true|false)\}'),
]


@pytest.fixture(scope="module")
def engines():
    with (
        Engine(num_threads=1, max_total_tokens=8192) as xg,
        Engine(num_threads=1, max_total_tokens=8192, grammar_backend="outlines") as ol,
    ):
        yield {"xgrammar": xg, "outlines": ol}


@pytest.fixture(scope="module")
def matchers(default_tokenizer):
    made = {name: create_grammar_backend(name, default_tokenizer) for name in BACKENDS}
    yield made
    for backend in made.values():
        backend.shutdown()


def chat(eng, text: str) -> str:
    return eng.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


def accepts(backend, tokenizer, schema: dict, text: str) -> bool:
    matcher = backend.compile_sync(("json", json.dumps(schema))).new_matcher()
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.accept_token(t) for t in ids) and matcher.accept_token(STOP)


# ---- generation: every output parses and validates, every bound holds ----
@pytest.mark.parametrize("backend", BACKENDS)
def test_real_world_schemas_generate_valid_json(engines, backend):
    eng = engines[backend]
    names = [n for n in GENERATED if not (backend == "outlines" and n == "tree")]  # see the xfail below
    prompts = [chat(eng, f"Reply with a JSON value for this schema: {json.dumps(GENERATED[n])}") for n in names]
    params = [
        {"temperature": t, "max_new_tokens": 96, "json_schema": json.dumps(GENERATED[n]), "seed": 7}
        for n in names
        for t in (0, 1.0)
    ]
    outs = eng.generate([p for p in prompts for _ in (0, 1)], params)
    for i, out in enumerate(outs):
        name, schema = names[i // 2], GENERATED[names[i // 2]]
        if out["meta_info"]["finish_reason"]["type"] == "length":
            continue  # a sampled run may ramble inside a string; the grammar still held every token
        assert out["meta_info"]["finish_reason"]["type"] == "stop", (name, out["meta_info"])
        value = json.loads(out["text"])
        jsonschema.Draft202012Validator(schema, format_checker=FORMATS).validate(value)
        if name == "pydantic":
            Product.model_validate(value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_regexes_generate_full_matches(engines, backend):
    eng = engines[backend]
    prompts = [chat(eng, f"Write one example of text matching {p}") for p in REGEXES]
    params = [{"temperature": t, "max_new_tokens": 40, "regex": p, "seed": 3} for p in REGEXES for t in (0, 1.0)]
    outs = eng.generate([p for p in prompts for _ in (0, 1)], params)
    for i, out in enumerate(outs):
        if out["meta_info"]["finish_reason"]["type"] == "length":
            continue
        assert re.fullmatch(REGEXES[i // 2], out["text"]), (REGEXES[i // 2], out["text"])


def test_ebnf_grammars_generate_matching_text(engines):
    eng = engines["xgrammar"]
    prompts = [chat(eng, "Write something short.") for _ in EBNF]
    outs = eng.generate(
        [p for p in prompts for _ in (0, 1)],
        [{"temperature": t, "max_new_tokens": 40, "ebnf": g, "seed": 5} for g, _ in EBNF for t in (0, 1.0)],
    )
    for i, out in enumerate(outs):
        if out["meta_info"]["finish_reason"]["type"] == "length":
            continue
        assert re.fullmatch(EBNF[i // 2][1], out["text"]), (EBNF[i // 2][0], out["text"])


# ---- compile-only: accepted with warnings naming the keyword, or refused clearly ----
@pytest.mark.parametrize("backend", BACKENDS)
def test_bigger_schemas_compile_and_unenforced_keywords_are_named(matchers, backend):
    for schema in COMPILED_ONLY.values():
        matchers[backend].compile_sync(("json", json.dumps(schema)))
    for keyword, schema in UNENFORCED.items():
        warnings = validate_constraint("json", json.dumps(schema), backend)
        assert any(repr(keyword) in w for w in warnings), (keyword, warnings)


# ---- regressions ----
def test_length_bounded_strings_are_json_strings(matchers, default_tokenizer):
    """xgrammar wrote a string with minLength/maxLength as `[^"\\\\\\r\\n]{m,n}`: raw control characters
    passed (a sampled '{"code":"][\\x19"}' is not JSON) and escapes did not."""
    schema = obj(code={**S, "minLength": 2, "maxLength": 3})
    for backend in matchers.values():
        for text, ok in (
            ('{"code":"a\x01"}', False),
            ('{"code":"a\tb"}', False),
            ('{"code":"a\\nb"}', True),
            ('{"code":"abcd"}', False),
            ('{"code":"ab"}', True),
        ):
            assert accepts(backend, default_tokenizer, schema, text) == ok, (backend.name, text)
            assert json.loads(text, strict=True) if ok else True
    assert accepts(matchers["xgrammar"], default_tokenizer, schema, '{"code":"\\u00e9t"}')


def test_integer_with_fractional_bounds_is_accepted_and_enforced(matchers, default_tokenizer):
    """xgrammar refused a valid schema: "Integer constraint must be a whole number"."""
    schema = {"type": "integer", "minimum": 1.5, "exclusiveMaximum": 4.5}
    for backend in matchers.values():
        assert validate_constraint("json", json.dumps(schema), backend.name) == []
        assert [n for n in range(7) if accepts(backend, default_tokenizer, schema, str(n))] == [2, 3, 4]


def test_length_next_to_a_format_is_reported(matchers, default_tokenizer):
    """xgrammar drops maxLength next to a format, said so only on its C++ log; outlines dropped the
    format itself (any text passed as an email) and its warning named the length instead."""
    schema = obj(email={**S, "format": "email", "maxLength": 12})
    for backend in matchers.values():
        warnings = validate_constraint("json", json.dumps(schema), backend.name)
        assert any("'maxLength' next to 'format'" in w for w in warnings), (backend.name, warnings)
        assert not accepts(backend, default_tokenizer, schema, '{"email":"not an email"}'), backend.name
        assert accepts(backend, default_tokenizer, schema, '{"email":"a@b.io"}'), backend.name
    pattern = obj(zip={**S, "pattern": "^[0-9]{5}$", "maxLength": 5})
    assert not accepts(matchers["outlines"], default_tokenizer, pattern, '{"zip":"abc"}')


def test_outlines_formats_write_valid_json(matchers, default_tokenizer):
    """outlines-core's own format regexes: "time" let a raw backslash in ('"09:31:52\\\\H1Z"' is not JSON),
    `\\d` took non-ASCII digits, and date-time/time had no offset (RFC 3339 needs one)."""
    backend = matchers["outlines"]
    cases = [
        ({**S, "format": "time"}, '"09:31:52\\\\H1Z"', '"09:31:52.5+02:00"'),
        ({**S, "format": "date"}, '"१९९९-01-01"', '"1999-01-01"'),
        ({**S, "format": "date-time"}, '"2024-05-01T10:00:00"', '"2024-05-01T10:00:00Z"'),
        ({**S, "format": "uri"}, '"http://a.io/\\"x"', '"https://a.io/p?q=1#f"'),
    ]
    for schema, bad, good in cases:
        assert not accepts(backend, default_tokenizer, schema, bad), (schema, bad)
        assert accepts(backend, default_tokenizer, schema, good), (schema, good)
        FORMATS.check(json.loads(good), schema["format"])


def test_outlines_bounds_nullable_integers_and_closed_empty_objects(matchers, default_tokenizer):
    """outlines let {"type": ["integer", "null"], "maximum": 150} write 6196593423209, a bounded integer's
    multipleOf went unapplied and unreported, and outlines refused
    {"type": "object", "additionalProperties": false} ("Unsupported JSON Schema structure false")."""
    backend = matchers["outlines"]
    age = {"type": ["integer", "null"], "minimum": 0, "maximum": 150}
    assert validate_constraint("json", json.dumps(age), "outlines") == []
    assert [t for t in ("null", "0", "150", "151", "-1") if accepts(backend, default_tokenizer, age, t)] == [
        "null",
        "0",
        "150",
    ]
    fives = {"type": "integer", "minimum": 0, "maximum": 30, "multipleOf": 5}  # greedy wrote 1
    assert [t for t in ("1", "5", "25", "35") if accepts(backend, default_tokenizer, fives, t)] == ["5", "25"]
    closed = {"type": "object", "additionalProperties": False}
    assert [t for t in ("{}", '{"a":1}') if accepts(backend, default_tokenizer, closed, t)] == ["{}"]


def test_outlines_alternatives_sharing_a_prefix_all_stay_reachable(matchers, default_tokenizer):
    """outlines-core's DFA matched leftmost-first: "(cat|cats)" never allowed "cats", and an integer
    0..150 (rewritten as an enum) never allowed "15" or "150": the model could only write 0-9."""
    backend = matchers["outlines"]
    regex = backend.compile_sync(("regex", "(cat|cats)( [0-9]+)?"))
    for text in ("cat", "cats", "cats 12"):
        matcher = regex.new_matcher()
        assert all(matcher.accept_token(t) for t in default_tokenizer.encode(text, add_special_tokens=False))
        assert matcher.accept_token(STOP), text
    age = {"type": "integer", "minimum": 0, "maximum": 150}
    assert [t for t in ("1", "15", "150", "1500") if accepts(backend, default_tokenizer, age, t)] == ["1", "15", "150"]


@pytest.mark.xfail(
    strict=True,
    reason="outlines-core unrolls a $defs recursion 3 levels deep and then drops "
    "the required property but keeps its comma; not fixed yet",
)
def test_outlines_recursion_past_its_depth_stays_json(matchers, default_tokenizer):
    """Greedy decoding of GENERATED["tree"] on outlines wrote '{"v":1,"kids":[{"v":1,"kids":[{"v":1,"kids":
    [{"v":1,}]}]}]}'."""
    cut = '{"v":1,"kids":[{"v":1,"kids":[{"v":1,"kids":[{"v":1,}]}]}]}'
    assert not accepts(matchers["outlines"], default_tokenizer, GENERATED["tree"], cut)


def test_outlines_escapes_property_names(matchers, default_tokenizer):
    """outlines wrote names as they are: '{"say "hi"":true,"back\\slash":1}' (greedy, GENERATED["weird_names"])."""
    schema = obj(**{'say "hi"': {"type": "boolean"}, "back\\slash": {"enum": [0, 1]}, "prénom": {"const": "Zoé"}})
    good = json.dumps({'say "hi"': True, "back\\slash": 1, "prénom": "Zoé"}, ensure_ascii=False, separators=(",", ":"))
    for backend in matchers.values():
        assert accepts(backend, default_tokenizer, schema, good), backend.name
        assert not accepts(backend, default_tokenizer, schema, '{"say "hi"":true,"back\\slash":1,"prénom":"Zoé"}')
