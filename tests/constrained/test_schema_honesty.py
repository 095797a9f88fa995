"""Honest schemas and strict refusals (issue 22): oneOf branches enforced exactly or reported, formats checked
by shape only reported, strict mode naming the keyword it refuses and where, and the JSON layouts of both
backends."""

from __future__ import annotations

import json
import re

import pytest
from plait.runtime.constrained import StrictSchemaError, validate_constraint
from plait.runtime.constrained.one_of import branches_exclusive
from plait.runtime.sampling_params import SamplingParams


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
