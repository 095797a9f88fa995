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

import math
import re
from dataclasses import dataclass
from typing import Any, Iterator

from .one_of import branches_exclusive
from .regex_canonical import json_string_pattern
from .schema_merge import merge_all_of

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

_SCHEMA_MAP_KEYS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LIST_KEYS = ("prefixItems", "allOf", "anyOf", "oneOf")
_SCHEMA_KEYS = (
    "additionalProperties",
    "propertyNames",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "unevaluatedItems",
    "unevaluatedProperties",
    "additionalItems",
    "items",
)

_ALLOF_BRANCH = re.compile(r"/allOf/\d+$")
_OPEN_OBJECT_KEYS = (
    "additionalProperties",
    "patternProperties",
    "unevaluatedProperties",
    "allOf",
    "anyOf",
    "oneOf",
    "$ref",
    "if",
    "dependentSchemas",
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


def walk_schema(schema: Any, path: str = "") -> Iterator[tuple[str, dict]]:
    """Yield (json-pointer, subschema) for every object subschema, depth first."""
    if not isinstance(schema, dict):
        return
    yield path or "/", schema
    for key in _SCHEMA_MAP_KEYS:
        sub = schema.get(key)
        if isinstance(sub, dict):
            for name, child in sub.items():
                yield from walk_schema(child, f"{path}/{key}/{_escape(name)}")
    for key in _SCHEMA_LIST_KEYS:
        sub = schema.get(key)
        if isinstance(sub, list):
            for i, child in enumerate(sub):
                yield from walk_schema(child, f"{path}/{key}/{i}")
    for key in _SCHEMA_KEYS:
        sub = schema.get(key)
        if isinstance(sub, dict):
            yield from walk_schema(sub, f"{path}/{key}")
        elif isinstance(sub, list):  # draft-7 tuple `items` / list-valued keywords
            for i, child in enumerate(sub):
                yield from walk_schema(child, f"{path}/{key}/{i}")
    deps = schema.get("dependencies")
    if isinstance(deps, dict):
        for name, child in deps.items():
            yield from walk_schema(child, f"{path}/dependencies/{_escape(name)}")


def tighten_schema(schema: Any) -> Any:
    """A copy of `schema` narrowed for generation; every output it admits is valid for `schema`.

    - An object that declares `properties` (and has no additionalProperties, patternProperties,
      unevaluatedProperties or sibling applicators) gets `additionalProperties: false`: small
      models otherwise invent keys. Skipped where `required` or `minProperties` would then be
      unsatisfiable, and for allOf branches, whose siblings may declare the other keys.
    - `allOf` (and `$ref` with siblings) is folded into one schema where that is exact
      (schema_merge.py): neither backend enforces allOf.
    - A string `pattern` is re-spelled for the string's JSON text (regex_canonical.py): a raw
      '"' in it produced invalid JSON, and outlines let `.` write a raw '"'.
    - A `required` name missing from `properties` is added there (with the additionalProperties
      schema, or `{}`; or, in a closed object, the schema of the one patternProperties pattern that
      matches it), so that backends which only emit declared properties still emit it.
    - An integer's fractional bounds are rounded to the whole bounds they mean (`minimum: 1.5` is
      `minimum: 2`): xgrammar refused them ("Integer constraint must be a whole number").
    """
    schema = merge_all_of(schema)
    for path, node in list(walk_schema(schema)):
        if node.get("type") == "integer":
            _whole_integer_bounds(node)
        if isinstance(node.get("pattern"), str):
            try:
                node["pattern"] = json_string_pattern(node["pattern"])
            except ValueError:  # e.g. an anchor mid-pattern: the backend reads it as before
                pass
        props = node.get("properties")
        required = node.get("required")
        if isinstance(required, list) and (isinstance(props, dict) or node.get("type") == "object"):
            props = node.setdefault("properties", {}) if not isinstance(props, dict) else props
            extra = node.get("additionalProperties", True)
            for name in required:
                if not isinstance(name, str) or name in props:
                    continue
                if extra is not False:
                    props[name] = extra if isinstance(extra, dict) else {}
                elif len(_patterns_matching(node, name)) == 1:
                    # NOTE: a backend enforces `required` among declared properties only: a closed
                    # object's required "_id" that only a pattern admits was left out ('{"m": 1}').
                    props[name] = _patterns_matching(node, name)[0]
        if not isinstance(props, dict) or not props:
            continue
        if _ALLOF_BRANCH.search(path) or any(k in node for k in _OPEN_OBJECT_KEYS):
            continue
        min_props = node.get("minProperties", 0)
        if isinstance(min_props, (int, float)) and min_props > len(props):
            continue
        node["additionalProperties"] = False
    return schema


def _patterns_matching(node: dict, name: str) -> list:
    """The patternProperties subschemas whose pattern matches the property name."""
    patterns = node.get("patternProperties")
    if not isinstance(patterns, dict):
        return []
    out = []
    for pattern, sub in patterns.items():
        try:
            if re.search(pattern, name):
                out.append(sub)
        except re.error:
            return []  # a pattern Python cannot read: do not guess
    return out


def _undeclared_required(node: dict) -> list[str]:
    """Required names of a closed object that neither `properties` nor exactly one pattern declares:
    no backend makes the output contain them."""
    required, props = node.get("required"), node.get("properties", {})
    if not isinstance(required, list) or node.get("additionalProperties", True) is not False:
        return []
    props = props if isinstance(props, dict) else {}
    return [n for n in required if isinstance(n, str) and n not in props and len(_patterns_matching(node, n)) != 1]


def _whole_integer_bounds(node: dict) -> None:
    """Replace an integer node's fractional bounds by the inclusive whole bounds they mean."""

    def fractional(key: str) -> bool:
        value = node.get(key)
        return isinstance(value, float) and math.isfinite(value) and not value.is_integer()

    def tighten(key: str, value: int, stricter: Any) -> None:
        old = node.get(key)
        node[key] = value if not isinstance(old, (int, float)) or isinstance(old, bool) else stricter(old, value)

    if fractional("minimum"):
        node["minimum"] = math.ceil(node["minimum"])
    if fractional("maximum"):
        node["maximum"] = math.floor(node["maximum"])
    if fractional("exclusiveMinimum"):
        tighten("minimum", math.floor(node.pop("exclusiveMinimum")) + 1, max)
    if fractional("exclusiveMaximum"):
        tighten("maximum", math.ceil(node.pop("exclusiveMaximum")) - 1, min)


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


def _escape(name: str) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")
