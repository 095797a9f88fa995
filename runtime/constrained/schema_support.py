"""Which JSON-schema keywords each backend enforces, and a walker that reports the rest.

A backend that accepts a schema but silently drops one of its assertions would produce outputs
that fail validation; `unenforced_keywords(schema, backend)` lists every such place (an `Unenforced`:
the keyword, its JSON path, why), and `unenforced_features` the same as warnings ("keyword
'uniqueItems' at /properties/tags is not enforced by xgrammar; ..."). A `oneOf` whose branches no
value can match twice (one_of.py) is enforced exactly by the backends' anyOf, so it is not reported;
a `format` a backend checks by shape only (a regex cannot see that 2024-02-30 is no date) is. The tables below were
established against the official JSON-Schema test suite (tests/constrained/test_constrained_unit.py keeps
them honest: an invalid instance that a backend accepts must be explained by a warning here).

Unknown keywords and annotations (title, description, default, ...) constrain nothing, so they
are not reported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .one_of import branches_exclusive
from .schema_walk import patterns_matching, walk_schema

# Keywords that assert something about an instance (JSON Schema 2020-12 plus older drafts' names).
ASSERTION_KEYWORDS = frozenset(
    {
        "type",
        "enum",
        "const",
        "multipleOf",
        "maximum",
        "exclusiveMaximum",
        "minimum",
        "exclusiveMinimum",
        "maxLength",
        "minLength",
        "pattern",
        "format",
        "maxItems",
        "minItems",
        "uniqueItems",
        "maxContains",
        "minContains",
        "contains",
        "maxProperties",
        "minProperties",
        "required",
        "dependentRequired",
        "dependentSchemas",
        "dependencies",
        "properties",
        "patternProperties",
        "additionalProperties",
        "propertyNames",
        "items",
        "prefixItems",
        "additionalItems",
        "unevaluatedItems",
        "unevaluatedProperties",
        "allOf",
        "anyOf",
        "oneOf",
        "not",
        "if",
        "then",
        "else",
        "$ref",
        "$dynamicRef",
        "$recursiveRef",
    }
)

# Keywords that only constrain values of one JSON type; without a declared `type` a backend may
# generate another type and skip them.
_TYPED_KEYWORDS = {
    "multipleOf": "number",
    "maximum": "number",
    "exclusiveMaximum": "number",
    "minimum": "number",
    "exclusiveMinimum": "number",
    "maxLength": "string",
    "minLength": "string",
    "pattern": "string",
    "format": "string",
    "maxItems": "array",
    "minItems": "array",
    "uniqueItems": "array",
    "contains": "array",
    "maxContains": "array",
    "minContains": "array",
    "prefixItems": "array",
    "items": "array",
    "additionalItems": "array",
    "maxProperties": "object",
    "minProperties": "object",
    "required": "object",
    "properties": "object",
    "patternProperties": "object",
    "additionalProperties": "object",
    "propertyNames": "object",
    "dependentRequired": "object",
}
# Keywords whose presence lets xgrammar infer the node's type.
_TYPE_IMPLYING = {"properties": "object", "items": "array", "prefixItems": "array"}
_VALUE_PINNING = ("enum", "const")
_BRANCHING = ("anyOf", "oneOf")


_CALENDAR = "no calendar check: an impossible date such as 2024-02-30 passes"


@dataclass(frozen=True)
class Unenforced:
    """One schema keyword a backend does not enforce exactly."""

    keyword: str  # the keyword, as strict mode names it
    path: str  # JSON pointer of the subschema that holds it ("/" for the root)
    what: str  # "keyword 'uniqueItems'", "format 'date'", "keywords ['a'] next to $ref", ...
    reason: str  # "is not enforced", "is checked by shape only (...)", ...
    backend: str

    def __str__(self) -> str:
        return f"{self.what} at {self.path} {self.reason} by {self.backend}; outputs may violate it"


@dataclass(frozen=True)
class BackendSupport:
    """What one backend enforces; `partial` maps a keyword to the caveat reported for it."""

    name: str
    enforced: frozenset
    partial: dict
    formats: frozenset
    shape_only_formats: dict  # format -> what its shape lets through (reported)
    integer_bounds: bool  # minimum/maximum on integers
    number_bounds: bool  # minimum/maximum on non-integer numbers
    multiple_of_number: bool
    length_with_pattern: bool  # minLength/maxLength still enforced next to a pattern or a known format


XGRAMMAR = BackendSupport(
    name="xgrammar",
    enforced=frozenset(
        {
            "type",
            "enum",
            "const",
            "maximum",
            "exclusiveMaximum",
            "minimum",
            "exclusiveMinimum",
            "maxLength",
            "minLength",
            "pattern",
            "format",
            "maxItems",
            "minItems",
            "required",
            "properties",
            "additionalProperties",
            "items",
            "prefixItems",
            "additionalItems",
            "anyOf",
            "$ref",
            "maxProperties",
            "minProperties",
            "patternProperties",
            "propertyNames",
            "multipleOf",
        }
    ),
    partial={"oneOf": "is enforced as anyOf (exclusivity is not checked)"},
    formats=frozenset(
        {
            "email",
            "date",
            "time",
            "date-time",
            "duration",
            "ipv4",
            "ipv6",
            "hostname",
            "uuid",
            "uri",
            "uri-reference",
            "uri-template",
            "json-pointer",
            "relative-json-pointer",
        }
    ),
    shape_only_formats={
        "date": _CALENDAR,
        "date-time": _CALENDAR,
        "ipv4": "octets with leading zeros such as 01.2.3.4 pass",
        "hostname": "labels longer than 63 characters pass",
    },
    integer_bounds=True,
    number_bounds=True,
    multiple_of_number=False,
    length_with_pattern=False,
)

OUTLINES = BackendSupport(
    name="outlines",
    enforced=frozenset(
        {
            "type",
            "enum",
            "const",
            "maxLength",
            "minLength",
            "pattern",
            "format",
            "maxItems",
            "minItems",
            "required",
            "properties",
            "additionalProperties",
            "items",
            "anyOf",
            "$ref",
            "minimum",
            "maximum",
            "exclusiveMinimum",
            "exclusiveMaximum",
        }
    ),
    partial={"oneOf": "is enforced as anyOf (exclusivity is not checked)"},
    formats=frozenset({"date-time", "date", "time", "uuid", "uri", "email", "ipv4"}),
    shape_only_formats={"date": _CALENDAR, "date-time": _CALENDAR},
    # NOTE: outlines emits no bounds at all; outlines_backend rewrites small integer ranges into
    # enums (see `bounded_integer_to_enum`), so only those count as enforced.
    integer_bounds=False,
    number_bounds=False,
    multiple_of_number=False,
    length_with_pattern=False,
)

BACKENDS = {"xgrammar": XGRAMMAR, "outlines": OUTLINES}
_BOUND_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _undeclared_required(node: dict) -> list[str]:
    """Required names of a closed object that neither `properties` nor exactly one pattern declares:
    no backend makes the output contain them."""
    required, props = node.get("required"), node.get("properties", {})
    if not isinstance(required, list) or node.get("additionalProperties", True) is not False:
        return []
    props = props if isinstance(props, dict) else {}
    return [n for n in required if isinstance(n, str) and n not in props and len(patterns_matching(node, n)) != 1]


def unenforced_features(schema: Any, backend: str) -> list[str]:
    """Warnings for every assertion in `schema` that `backend` does not (fully) enforce."""
    return [str(item) for item in unenforced_keywords(schema, backend)]


def unenforced_keywords(schema: Any, backend: str) -> list[Unenforced]:
    """Every assertion in `schema` that `backend` does not (fully) enforce, in schema order."""
    support = BACKENDS[backend]
    found: list[Unenforced] = []

    def warn(path: str, keyword: str, what: str, reason: str = "is not enforced") -> None:
        found.append(Unenforced(keyword, path, what, reason, backend))

    for path, node in walk_schema(schema):
        keywords = [k for k in node if k in ASSERTION_KEYWORDS]
        declared = node.get("type")
        inferred = {_TYPE_IMPLYING[k] for k in keywords if k in _TYPE_IMPLYING}
        for keyword in keywords:
            value = node[keyword]
            if keyword == "oneOf" and isinstance(value, list) and branches_exclusive(value, schema):
                continue  # no value matches two branches: anyOf enforces it exactly
            if keyword in support.partial:
                warn(path, keyword, f"keyword {keyword!r}", support.partial[keyword])
                continue
            if keyword not in support.enforced:
                warn(path, keyword, f"keyword {keyword!r}")
                if keyword == "allOf":
                    # NOTE: an allOf left unmerged takes its siblings with it: xgrammar wrote two
                    # properties next to {"allOf": [...], "maxProperties": 1}.
                    siblings = [k for k in keywords if k not in ("allOf", "type")]
                    if siblings:
                        warn(path, siblings[0], f"keywords {siblings} next to allOf")
                continue
            if keyword == "$ref":
                if not (isinstance(value, str) and (value == "#" or value.startswith("#/"))):
                    warn(path, keyword, f"non-local $ref {value!r}")
                siblings = [k for k in keywords if k not in ("$ref", "type")]
                if siblings:
                    warn(path, siblings[0], f"keywords {siblings} next to $ref")
                continue
            if keyword == "required" and _undeclared_required(node):
                warn(path, keyword, f"keyword 'required' ({_undeclared_required(node)} not declared in properties)")
                continue
            if keyword in _BRANCHING:
                siblings = [k for k in keywords if k not in (*_BRANCHING, "type", "required", "properties")]
                if siblings:
                    warn(path, siblings[0], f"keywords {siblings} next to {keyword}")
                continue
            if any(k in node for k in _VALUE_PINNING) or "$ref" in node:
                continue  # the pinned values / reference decide; reported above if relevant
            typed = _TYPED_KEYWORDS.get(keyword)
            if typed and declared is None and typed not in inferred:
                warn(path, keyword, f"keyword {keyword!r} without a declared 'type'")
                continue
            shaped_by = (
                "pattern" if "pattern" in node else ("format" if node.get("format") in support.formats else None)
            )
            if keyword in ("minLength", "maxLength") and shaped_by and not support.length_with_pattern:
                # NOTE: xgrammar drops the length next to a format ("format combined with
                # minLength/maxLength is not supported" on its log only), as next to a pattern.
                warn(path, keyword, f"keyword {keyword!r} next to {shaped_by!r}")
            elif keyword == "format" and isinstance(value, str) and value not in support.formats:
                warn(path, keyword, f"format {value!r}")
            elif keyword == "format" and value in support.shape_only_formats:
                warn(
                    path,
                    keyword,
                    f"format {value!r}",
                    f"is checked by shape only ({support.shape_only_formats[value]})",
                )
            elif keyword in _BOUND_KEYWORDS:
                is_int = declared == "integer"
                if (is_int and not support.integer_bounds) or (not is_int and not support.number_bounds):
                    warn(path, keyword, f"keyword {keyword!r}")
            elif keyword == "multipleOf":
                exact = declared == "integer" and isinstance(value, int)
                if not exact and not support.multiple_of_number:
                    warn(path, keyword, f"keyword 'multipleOf' ({value!r} on {declared or 'any'} values)")
    return found
