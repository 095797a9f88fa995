"""What the structured-output tests without a model share (their fixtures, both grammar backends and the token
tables, are in tests/conftest.py): the vocabulary size, a person schema, a matcher fed a prefix, and the JSON
scanner after a prefix."""

from __future__ import annotations

from plait.runtime.constrained.json_scan import JsonScanner

VOCAB = 49152

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 18, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "since": {"type": "string", "format": "date"},
    },
    "required": ["name", "age", "role", "since"],
}


def matcher_after(backend, kind: str, text: str, prefix: str, tokenizer):
    matcher = backend.compile_sync((kind, text)).new_matcher()
    for token in tokenizer.encode(prefix, add_special_tokens=False):
        assert matcher.accept_token(token), (prefix, tokenizer.decode([token]))
    return matcher


def scanned(prefix: str) -> JsonScanner:
    scanner = JsonScanner()
    scanner.feed(prefix.encode())
    return scanner
