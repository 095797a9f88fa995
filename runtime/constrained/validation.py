"""Cheap, tokenizer-free validation of constraints, for the request-intake path.

`validate_constraint(kind, text, backend_name)` raises `ValueError` naming what is wrong (bad regex,
malformed JSON schema, bad EBNF, a feature the backend cannot handle at all) and returns a list of
warnings: schema keywords the backend accepts but does not enforce. Nothing here touches the
tokenizer, so it is fast enough to run before a request is queued; the backend's compile repeats
these checks (plus the tokenizer-specific work) and attaches the same warnings to the result.
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

from .base import ANY_JSON, BACKEND_NAMES, check_key

try:  # Python >= 3.11 keeps the parser here; it is the only way to see a regex's structure.
    import re._parser as _sre_parse  # type: ignore[import-not-found]
    from re import _constants as _sre_const  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as _sre_const  # type: ignore[no-redef]
    import sre_parse as _sre_parse  # type: ignore[no-redef]


def validate_constraint(kind: str, text: str, backend_name: str = "xgrammar") -> list[str]:
    """Raise ValueError if the constraint is invalid for the backend; return its warnings."""
    kind, text = check_key((kind, text))
    if backend_name == "xgrammar":
        from .xgrammar_backend import validate_for_xgrammar

        return validate_for_xgrammar(kind, text)
    if backend_name == "outlines":
        from .outlines_backend import validate_for_outlines

        return validate_for_outlines(kind, text)
    raise ValueError(f"grammar_backend must be one of {list(BACKEND_NAMES)}, got {backend_name!r}")


# ---- JSON schema ----
def parse_json_schema(text: str) -> Optional[Any]:
    """Parse and sanity-check a JSON schema text; None means ANY_JSON (any JSON value)."""
    if text == ANY_JSON:
        return None
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"json_schema is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
                         ) from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"json_schema must be a JSON object (or boolean), got {type(schema).__name__}")
    if schema is False:
        raise ValueError("json_schema is `false`: no value can satisfy it")
    try:
        import jsonschema  # optional: gives precise messages for malformed schemas
    except ImportError:
        return schema
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator
                                            ).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise ValueError(f"json_schema is not a valid JSON schema at {where}: {e.message}") from None
    return schema


# ---- regex ----
_UNSUPPORTED_REGEX_NODES = {
    "ASSERT": "a lookahead/lookbehind assertion",
    "ASSERT_NOT": "a negative lookahead/lookbehind assertion",
    "GROUPREF": "a backreference",
    "GROUPREF_EXISTS": "a conditional group",
    "ATOMIC_GROUP": "an atomic group",
    "POSSESSIVE_REPEAT": "a possessive quantifier",
}


def normalize_regex(pattern: str) -> str:
    """Check a regex and return it without a leading `^` / trailing `$` (output is always a fullmatch).

    Raises ValueError for syntax errors and for constructs no finite-automaton backend can
    enforce (lookaround, backreferences, conditionals, anchors or word boundaries mid-pattern)."""
    try:
        parsed = _sre_parse.parse(pattern)
    except re.error as e:
        raise ValueError(f"regex {_short(pattern)} is invalid: {e}") from None
    items = list(parsed)
    start = 1 if items and _is_anchor(items[0], "AT_BEGINNING") else 0
    end = len(items) - 1 if len(items) > start and _is_anchor(items[-1], "AT_END") else len(items)
    _check_nodes(items[start:end], pattern)
    stripped = pattern
    if start:
        stripped = stripped[1:]
    if end < len(items):
        stripped = stripped[:-1]
    return stripped


def _is_anchor(item: Any, name: str) -> bool:
    op, arg = item
    return str(op) == "AT" and str(arg) == name


def _check_nodes(items: Any, pattern: str) -> None:
    for op, arg in items:
        op_name = str(op)
        if op_name in _UNSUPPORTED_REGEX_NODES:
            raise ValueError(f"regex {_short(pattern)} uses {_UNSUPPORTED_REGEX_NODES[op_name]}, "
                             "which constrained decoding cannot enforce")
        if op_name == "AT":
            raise ValueError(f"regex {_short(pattern)} uses an anchor or word boundary ({arg}) inside "
                             "the pattern; only a leading ^ and a trailing $ are allowed")
        for child in _children(op_name, arg):
            _check_nodes(child, pattern)


def _children(op_name: str, arg: Any) -> list:
    if op_name == "SUBPATTERN":
        return [arg[-1]]
    if op_name in ("MAX_REPEAT", "MIN_REPEAT"):
        return [arg[2]]
    if op_name == "BRANCH":
        return list(arg[1])
    return []


def _short(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[:limit - 3] + "...")


def clean_backend_error(exc: BaseException) -> str:
    """Strip C++ log prefixes ("[12:00:00] /project/cpp/x.cc:94: ") from a backend's message."""
    msg = str(exc).strip()
    msg = re.sub(r"^\[[0-9:]+\]\s+\S+:\d+:\s*", "", msg)
    msg = re.sub(r"^Check failed: \(.*?\) is false:\s*", "", msg)
    return msg.splitlines()[0] if msg else type(exc).__name__
