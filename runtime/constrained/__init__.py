"""Constrained decoding: grammar backends (xgrammar, outlines-core), async compile cache,
token bitmasks and jump-forward. See base.py for the interface and integration.py for the
scheduler-facing helpers."""

# NOTE: the names below load on first use (PEP 562), not with the package: the executor reads only
# bitmask.py, and importing base.py brings xgrammar and with it transformers (a large share of a CPU start,
# which the scheduler process then spent before building the model rather than beside it).
_EXPORTS = {
    "ANY_JSON": "base",
    "BACKEND_NAMES": "base",
    "GRAMMAR_KINDS": "base",
    "JSON_KINDS": "base",
    "CompiledGrammar": "base",
    "GrammarBackend": "base",
    "GrammarCompileError": "base",
    "GrammarCompileTimeout": "base",
    "GrammarMatcher": "base",
    "allocate_token_bitmask": "bitmask",
    "apply_token_bitmask_inplace": "bitmask",
    "create_grammar_backend": "factory",
    "StrictSchemaError": "validation",
    "validate_constraint": "validation",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "ANY_JSON",
    "BACKEND_NAMES",
    "GRAMMAR_KINDS",
    "JSON_KINDS",
    "CompiledGrammar",
    "GrammarBackend",
    "GrammarCompileError",
    "GrammarCompileTimeout",
    "GrammarMatcher",
    "StrictSchemaError",
    "create_grammar_backend",
    "allocate_token_bitmask",
    "apply_token_bitmask_inplace",
    "validate_constraint",
]
