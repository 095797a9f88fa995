"""When a `oneOf` is exactly an `anyOf`: branches that no JSON value can match twice.

Neither backend checks a oneOf's exclusivity (it is compiled as anyOf, so a value matching two
branches passes and fails validation). But most real oneOfs are exclusive by construction: a string
or an object, a tagged union whose `kind` is a different const in every branch. For those, anyOf
and oneOf accept the same values, and the keyword is enforced exactly. `branches_exclusive` proves
that conservatively: two branches are disjoint when
- the JSON types they admit do not meet (integer counts as a number), or
- both pin their values (`const` / `enum`) to sets that do not meet, or
- both require one property whose subschemas are disjoint by the two rules above (a discriminator).
Anything else (a `$ref` that does not resolve locally, branches that merely look different) is not
proven, and the oneOf stays reported.
"""

from __future__ import annotations

import json
from typing import Any, Optional

_ALL_TYPES = frozenset({"null", "boolean", "object", "array", "number", "string"})
_MAX_REF_HOPS = 8


def branches_exclusive(branches: list, root: Any) -> bool:
    """True if no JSON value is valid for two of `branches` (a oneOf's list), `$ref`s read in `root`."""
    resolved = [_resolve(b, root) for b in branches]
    if any(b is None for b in resolved):
        return False
    return all(
        _disjoint(resolved[i], resolved[j], root) for i in range(len(resolved)) for j in range(i + 1, len(resolved))
    )


def _disjoint(a: dict, b: dict, root: Any, depth: int = 0) -> bool:
    if not _json_types(a) & _json_types(b):
        return True
    values_a, values_b = _pinned_values(a), _pinned_values(b)
    if values_a is not None and values_b is not None and not values_a & values_b:
        return True
    if depth > 2:
        return False
    props_a, props_b = a.get("properties"), b.get("properties")
    if not (isinstance(props_a, dict) and isinstance(props_b, dict)):
        return False
    required = set(_strings(a.get("required"))) & set(_strings(b.get("required")))
    for name in required & set(props_a) & set(props_b):
        left, right = _resolve(props_a[name], root), _resolve(props_b[name], root)
        if left is not None and right is not None and _disjoint(left, right, root, depth + 1):
            return True
    return False


def _json_types(schema: dict) -> frozenset:
    """The JSON types a schema admits at most ("integer" folded into "number")."""
    values = _pinned_values(schema)
    if values is not None:
        return frozenset(_type_of(json.loads(v)) for v in values)
    declared = schema.get("type")
    if declared is None:
        return _ALL_TYPES
    names = [declared] if isinstance(declared, str) else declared
    if not isinstance(names, list):
        return _ALL_TYPES
    return frozenset("number" if t == "integer" else t for t in names if isinstance(t, str))


def _pinned_values(schema: dict) -> Optional[frozenset]:
    """The canonical JSON texts of the values `const` / `enum` allow, or None when neither is set."""
    if "const" in schema:
        return frozenset({_canonical(schema["const"])})
    if isinstance(schema.get("enum"), list):
        return frozenset(_canonical(v) for v in schema["enum"])
    return None


def _canonical(value: Any) -> str:
    # NOTE: 1 and 1.0 are the same JSON number for a validator; spelled alike, they meet.
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return json.dumps(value, sort_keys=True)


def _type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}[type(value)]


def _resolve(schema: Any, root: Any) -> Optional[dict]:
    """The subschema behind a chain of bare local `$ref`s; None for anything not a plain dict."""
    for _ in range(_MAX_REF_HOPS):
        if not isinstance(schema, dict):
            return None
        ref = schema.get("$ref")
        if ref is None:
            return schema
        if len(schema) > 1 or not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            return None  # siblings next to $ref, or another document: not reasoned about
        schema = _pointer(root, ref[1:])
    return None


def _pointer(root: Any, pointer: str) -> Any:
    node = root
    for part in pointer.split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _strings(values: Any) -> list:
    return [v for v in values if isinstance(v, str)] if isinstance(values, list) else []
