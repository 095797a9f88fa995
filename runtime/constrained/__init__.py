"""Constrained decoding: grammar backends (xgrammar, outlines-core), async compile cache,
token bitmasks and jump-forward. See base.py for the interface and integration.py for the
scheduler-facing helpers."""

from .base import (ANY_JSON, BACKEND_NAMES, GRAMMAR_KINDS, JSON_KINDS, CompiledGrammar, GrammarBackend,
                   GrammarCompileError, GrammarCompileTimeout, GrammarMatcher)
from .bitmask import allocate_token_bitmask, apply_token_bitmask_inplace
from .factory import create_grammar_backend
from .validation import StrictSchemaError, validate_constraint

__all__ = [
    "ANY_JSON", "BACKEND_NAMES", "GRAMMAR_KINDS", "JSON_KINDS", "CompiledGrammar", "GrammarBackend",
    "GrammarCompileError", "GrammarCompileTimeout", "GrammarMatcher", "StrictSchemaError",
    "create_grammar_backend", "allocate_token_bitmask", "apply_token_bitmask_inplace", "validate_constraint",
]
