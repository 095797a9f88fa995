"""Cheap, tokenizer-free validation of constraints, for the request-intake path.

`validate_constraint(kind, text, backend_name, strict=False)` raises `ValueError` naming what is wrong
(bad regex, malformed JSON schema, bad EBNF, a feature the backend cannot handle at all) and returns a
list of warnings: schema keywords the backend accepts but does not enforce exactly. With `strict`, the
first such keyword is a `StrictSchemaError` (a ValueError; a 400 over HTTP) naming the keyword and its
JSON path instead. Nothing here touches the tokenizer, so it is fast enough to run before a request is
queued; the backend's compile repeats these checks (plus the tokenizer-specific work) and attaches the
same warnings to the result.
"""

from __future__ import annotations

from .base import BACKEND_NAMES, JSON_KINDS, check_key
from .outlines_backend import unenforced_for_outlines, validate_for_outlines
from .schema_support import Unenforced
from .xgrammar_backend import unenforced_for_xgrammar, validate_for_xgrammar


class StrictSchemaError(ValueError):
    """A strict request's schema uses a keyword the backend cannot enforce exactly."""

    def __init__(self, item: Unenforced, backend_name: str, more: int) -> None:
        others = f" (and {more} more)" if more else ""
        super().__init__(
            f"strict mode refuses keyword {item.keyword!r} at {item.path}: {item.reason} by {backend_name}, "
            f"so an output could violate it{others}; drop it from the schema, or turn strict off to generate "
            f"with it reported in meta_info.grammar_warnings"
        )
        self.keyword = item.keyword
        self.path = item.path


def validate_constraint(kind: str, text: str, backend_name: str = "xgrammar", strict: bool = False) -> list[str]:
    """Raise ValueError if the constraint is invalid for the backend; return its warnings.

    strict: a JSON schema keyword the backend does not enforce exactly raises StrictSchemaError."""
    kind, text = check_key((kind, text))
    if backend_name not in BACKEND_NAMES:
        raise ValueError(f"grammar_backend must be one of {list(BACKEND_NAMES)}, got {backend_name!r}")
    validate = validate_for_xgrammar if backend_name == "xgrammar" else validate_for_outlines
    if strict and kind in JSON_KINDS:
        unenforced = (unenforced_for_xgrammar if backend_name == "xgrammar" else unenforced_for_outlines)(text)
        if unenforced:
            raise StrictSchemaError(unenforced[0], backend_name, len(unenforced) - 1)
    return validate(kind, text)
