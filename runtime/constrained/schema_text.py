"""Constraint texts read before any backend sees them: a JSON schema parsed and checked, a user's regex
re-spelled for the backends, a backend's error message cleaned for the user.

Tokenizer-free and backend-free: both backends and the intake checks (validation.py) build on these.
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

from .base import ANY_JSON
from .regex_canonical import canonical_regex

try:  # optional: gives precise messages for malformed schemas
    import jsonschema
except ImportError:
    jsonschema = None


# ---- JSON schema ----
def parse_json_schema(text: str) -> Optional[Any]:
    """Parse and sanity-check a JSON schema text; None means ANY_JSON (any JSON value)."""
    if text == ANY_JSON:
        return None
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"json_schema is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"json_schema must be a JSON object (or boolean), got {type(schema).__name__}")
    if schema is False:
        raise ValueError("json_schema is `false`: no value can satisfy it")
    if jsonschema is None:
        return schema
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise ValueError(f"json_schema is not a valid JSON schema at {where}: {e.message}") from None
    check_references_resolve_locally(schema)
    return schema


def check_references_resolve_locally(schema: Any) -> None:
    """Raise ValueError for a `$ref` to another document (a URL or a file): nothing is fetched here, and
    an unresolved reference would silently allow any JSON at that place.

    A reference is local when it starts with '#' or names (before any '#') an `$id` declared inside this
    schema (a bundled schema)."""
    ids, refs = set(), []

    def scan(node: Any, path: str) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("$id"), str):
                ids.add(node["$id"].split("#")[0])
            if isinstance(node.get("$ref"), str):
                refs.append((node["$ref"], path or "/"))
            for key, child in node.items():
                if key not in ("enum", "const", "default", "examples"):  # values, not schemas
                    scan(child, f"{path}/{key}")
        elif isinstance(node, list):
            for i, child in enumerate(node):
                scan(child, f"{path}/{i}")

    scan(schema, "")
    for ref, path in refs:
        if not ref.startswith("#") and ref.split("#")[0] not in ids:
            raise ValueError(
                f"json_schema has a $ref to another document at {path}: {ref!r}. Only references "
                f"inside the schema ('#/$defs/...') are resolved; inline the referenced schema "
                f"under $defs"
            )


# ---- regex ----
def normalize_regex(pattern: str) -> str:
    """The regex a backend should enforce for a user's Python regex (always a full match).

    See regex_canonical.py: the pattern is re-spelled in a dialect both backends read as Python
    does; ValueError for syntax errors and constructs no finite automaton can enforce."""
    return canonical_regex(pattern)


def clean_backend_error(exc: BaseException) -> str:
    """Strip C++ log prefixes ("[12:00:00] /project/cpp/x.cc:94: ") from a backend's message."""
    msg = str(exc).strip()
    msg = re.sub(r"^\[[0-9:]+\]\s+\S+:\d+:\s*", "", msg)
    msg = re.sub(r"^Check failed: \(.*?\) is false:\s*", "", msg)
    return msg.splitlines()[0] if msg else type(exc).__name__
