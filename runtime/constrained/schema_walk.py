"""Reading a JSON schema: every object subschema with its JSON pointer (`walk_schema`), and the
patternProperties subschemas that admit a property name (`patterns_matching`)."""

from __future__ import annotations

import re
from typing import Any, Iterator

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


def patterns_matching(node: dict, name: str) -> list:
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


def _escape(name: str) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")
