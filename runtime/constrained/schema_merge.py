"""`allOf` (and `$ref` with sibling keywords) folded into one schema the backends can enforce.

Neither grammar backend enforces `allOf`: xgrammar drops it (the node becomes "any JSON", and a
small model then writes `{"allOf": [...]}` back), outlines ignores it. Yet it is how real APIs
compose types (OpenAPI inheritance: `allOf: [{"$ref": "#/$defs/Base"}, {...}]`). `merge_all_of`
rewrites every such node into the single schema that both branches describe at once:
properties united (a name declared twice gets the merge of both), `required` united, `type` and
`enum` intersected, lower bounds raised and upper bounds lowered.

A merge is only done where it is exact or narrower (every instance of the merged schema is valid
for each branch). Anything it cannot combine safely (two different patterns or formats, an
`additionalProperties` that another branch's properties would break, a recursive `$ref` chain,
...) leaves the node as it was, so the existing "not enforced" warning still reports it.
"""

from __future__ import annotations

import copy
import json
from typing import Any, Optional

_LOWER_BOUNDS = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties", "minContains")
_UPPER_BOUNDS = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties", "maxContains")
_ANNOTATIONS = (
    "title",
    "description",
    "default",
    "examples",
    "$comment",
    "deprecated",
    "readOnly",
    "writeOnly",
    "$schema",
    "$id",
    "$anchor",
)
# Keywords that restrict which property names an object may have beyond its `properties`.
_CLOSING = ("additionalProperties", "patternProperties", "unevaluatedProperties")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
_SUBSCHEMAS = (
    "items",
    "additionalProperties",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "propertyNames",
    "unevaluatedItems",
    "unevaluatedProperties",
    "additionalItems",
)
_MAX_REF_DEPTH = 8


class _CannotMerge(Exception):
    """Raised inside a merge that would not be exact; the node is then left unchanged."""


def merge_all_of(schema: Any) -> Any:
    """A copy of `schema` with every mergeable `allOf` (and `$ref` + siblings) folded in place."""
    schema = copy.deepcopy(schema)
    if not isinstance(schema, dict):
        return schema
    return _Merger(schema).visit(schema, ())


class _Merger:
    def __init__(self, root: dict) -> None:
        self.root = root

    def visit(self, node: Any, refs: tuple[str, ...]) -> Any:
        """Merge bottom-up: children first, then this node's own allOf / $ref siblings."""
        if not isinstance(node, dict):
            return node
        for key in _SUBSCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                node[key] = {k: self.visit(v, refs) for k, v in node[key].items()}
        for key in _SUBSCHEMA_LISTS:
            if isinstance(node.get(key), list):
                node[key] = [self.visit(v, refs) for v in node[key]]
        for key in _SUBSCHEMAS:
            if isinstance(node.get(key), dict):
                node[key] = self.visit(node[key], refs)
        try:
            return self.fold(node, refs)
        except _CannotMerge:
            return node

    def fold(self, node: dict, refs: tuple[str, ...]) -> dict:
        branches = node.get("allOf")
        has_ref_siblings = isinstance(node.get("$ref"), str) and any(
            k not in ("$ref", "$defs", "definitions", *_ANNOTATIONS) for k in node
        )
        if not isinstance(branches, list) and not has_ref_siblings:
            return node
        own = {k: v for k, v in node.items() if k != "allOf"}
        # NOTE: references are JSON pointers from the root, so definitions can move aside.
        defs = {k: own.pop(k) for k in ("$defs", "definitions") if k in own}
        merged: dict = {}
        for part in [own, *(branches if isinstance(branches, list) else [])]:
            for piece in self.expand(part, refs):
                merged = merge_two(merged, piece)
        merged.update(defs)
        return merged

    def expand(self, part: Any, refs: tuple[str, ...]) -> list[Any]:
        """A branch as the schemas to intersect: itself, or its siblings and its $ref's target."""
        if not isinstance(part, dict) or not isinstance(part.get("$ref"), str):
            return [part]
        rest = {k: v for k, v in part.items() if k != "$ref"}
        return [rest, *self.expand(self.resolve(part["$ref"], refs), (*refs, part["$ref"]))]

    def resolve(self, ref: str, refs: tuple[str, ...]) -> Any:
        """The local definition a `$ref` points at, itself merged; a cycle is refused."""
        if not ref.startswith("#/") or ref in refs or len(refs) >= _MAX_REF_DEPTH:
            raise _CannotMerge()
        target: Any = self.root
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise _CannotMerge()
            target = target[part]
        # Refs inside the target stay refs (they still resolve from the root); only this level
        # is copied in, so a recursive definition is expanded once, not forever.
        return self.visit(copy.deepcopy(target), (*refs, ref))


def merge_two(a: Any, b: Any) -> dict:
    """The schema of instances valid under both `a` and `b` (raises _CannotMerge if not exact)."""
    if a is True or a == {}:
        a = {}
    if b is True or b == {}:
        return dict(a) if isinstance(a, dict) else {}
    if not isinstance(a, dict) or not isinstance(b, dict) or "allOf" in b or "$ref" in b:
        raise _CannotMerge()
    _check_closing(a, b)
    _check_closing(b, a)
    out = dict(a)
    for key, value in b.items():
        if key not in out:
            out[key] = value
        elif key in _ANNOTATIONS:
            continue
        elif key == "properties":
            out[key] = _merge_properties(out[key], value)
        elif key == "required":
            out[key] = list(dict.fromkeys([*out[key], *value]))
        elif key == "type":
            out[key] = _intersect_types(out[key], value)
        elif key == "enum":
            out[key] = [v for v in out[key] if _contains(value, v)]
            if not out[key]:
                raise _CannotMerge()
        elif key in _LOWER_BOUNDS:
            out[key] = max(out[key], value)
        elif key in _UPPER_BOUNDS:
            out[key] = min(out[key], value)
        elif key == "uniqueItems":
            out[key] = bool(out[key] or value)
        elif key == "items" and isinstance(value, dict) and isinstance(out[key], dict):
            out[key] = merge_two(out[key], value)
        elif _canonical(out[key]) != _canonical(value):
            raise _CannotMerge()
    return out


def _check_closing(a: dict, b: dict) -> None:
    """A branch that closes its object (`additionalProperties: false`, ...) stays exact only if
    the other branch declares no property it does not."""
    if not any(k in a and a[k] is not True for k in _CLOSING):
        return
    own = set(a.get("properties", {}))
    if any(name not in own for name in b.get("properties", {})):
        raise _CannotMerge()
    if any(k in b and b[k] is not True for k in _CLOSING) and any(
        _canonical(a.get(k)) != _canonical(b.get(k)) for k in _CLOSING
    ):
        raise _CannotMerge()


def _merge_properties(a: dict, b: dict) -> dict:
    out = dict(a)
    for name, schema in b.items():
        out[name] = merge_two(out[name], schema) if name in out else schema
    return out


def _intersect_types(a: Any, b: Any) -> Any:
    left = [a] if isinstance(a, str) else list(a)
    right = [b] if isinstance(b, str) else list(b)
    both = [t for t in left if t in right]
    # An integer is a number, so {"type": "number"} and {"type": "integer"} leave integers.
    if "integer" not in both and (
        ("integer" in left and "number" in right) or ("number" in left and "integer" in right)
    ):
        both.append("integer")
    if not both:
        raise _CannotMerge()
    return both[0] if len(both) == 1 else both


def _contains(values: list, item: Any) -> bool:
    return any(_canonical(v) == _canonical(item) for v in values)


def _canonical(value: Any) -> Optional[str]:
    return json.dumps(value, sort_keys=True)
