"""A schema narrowed for generation (`tighten_schema`), before a backend compiles it: only outputs valid for
the original, with fewer ways for a small model to go wrong (invented keys, an unmerged allOf, a pattern
written for raw text, fractional integer bounds)."""

from __future__ import annotations

import math
import re
from typing import Any

from .regex_canonical import json_string_pattern
from .schema_merge import merge_all_of
from .schema_walk import patterns_matching, walk_schema

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
                elif len(patterns_matching(node, name)) == 1:
                    # NOTE: a backend enforces `required` among declared properties only: a closed
                    # object's required "_id" that only a pattern admits was left out ('{"m": 1}').
                    props[name] = patterns_matching(node, name)[0]
        if not isinstance(props, dict) or not props:
            continue
        if _ALLOF_BRANCH.search(path) or any(k in node for k in _OPEN_OBJECT_KEYS):
            continue
        min_props = node.get("minProperties", 0)
        if isinstance(min_props, (int, float)) and min_props > len(props):
            continue
        node["additionalProperties"] = False
    return schema


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
