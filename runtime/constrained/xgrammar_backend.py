"""xgrammar backend (the default): JSON schema, regex, EBNF (GBNF dialect) and any-JSON.

JSON text is laid out by the kind (`JSON_LAYOUTS`): natural (", " and ": "), compact, two-space
indentation, or free whitespace ("json_ws"). Objects that declare
their properties admit only those, in declared order (see `schema_tighten.tighten_schema`), which
keeps small models on the rails and still yields schema-valid output.
"""

from __future__ import annotations

import json
import re
import time
from typing import Optional

import torch
import xgrammar as xgr

from .base import ANY_JSON, JSON_KINDS, CompiledGrammar, GrammarBackend, GrammarKey, GrammarMatcher
from .schema_merge import merge_all_of
from .schema_support import Unenforced, unenforced_keywords
from .schema_text import clean_backend_error, normalize_regex, parse_json_schema
from .schema_tighten import tighten_schema
from .vocab import TokenizerVocab

# from_json_schema's layout arguments per JSON kind. NOTE: "json_ws" lets the model put any whitespace
# anywhere, where small models loop on spaces; the other layouts fix every separator.
JSON_LAYOUTS = {
    "json_natural": {"any_whitespace": False, "separators": (", ", ": ")},
    "json": {"any_whitespace": False, "separators": (",", ":")},
    "json_indent": {"any_whitespace": False, "indent": 2, "separators": (",", ": ")},
    "json_ws": {"any_whitespace": True},
}
# NOTE: xgrammar spells the characters of a string with minLength/maxLength as `[^"\\\r\n]`: a raw
# control character passed (the output '"a\x01"' is not JSON) and an escape did not. Such rules are
# respelled as one JSON string character: a printable or non-ASCII one, or an escape (counted as one
# character, as JSON Schema counts it).
_LENGTH_BOUNDED_CHAR = re.compile(r'^(\w+_characters ::= )\(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.MULTILINE)
_JSON_STRING_CHAR = (
    r'(([^\0-\x1f\"\\]) | ("\\" ([\"\\/bfnrt] | ("u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] '
    r"[A-Fa-f0-9]))))"
)


def _to_grammar(kind: str, text: str) -> xgr.Grammar:
    """Tokenizer-free conversion of a constraint to an xgrammar Grammar (raises ValueError)."""
    if kind == "regex":
        text = normalize_regex(text)
    try:
        if kind in JSON_KINDS:
            schema = "{}" if text == ANY_JSON else json.dumps(tighten_schema(json.loads(text)))
            # NOTE: xgrammar's strict_mode drops required-but-undeclared keys and refuses
            # minItems without items; tighten_schema gives the same narrowing without that.
            grammar = xgr.Grammar.from_json_schema(schema, strict_mode=False, **JSON_LAYOUTS[kind])
            ebnf, count = _LENGTH_BOUNDED_CHAR.subn(lambda m: m.group(1) + _JSON_STRING_CHAR, str(grammar))
            return xgr.Grammar.from_ebnf(ebnf) if count else grammar
        if kind == "regex":
            return xgr.Grammar.from_regex(text)
        return xgr.Grammar.from_ebnf(text)
    except Exception as e:  # xgrammar raises RuntimeError or its own error types
        label = "json_schema" if kind in JSON_KINDS else kind
        raise ValueError(f"invalid {label}: {clean_backend_error(e)}") from None


def validate_for_xgrammar(kind: str, text: str) -> list[str]:
    """Raise ValueError if xgrammar cannot handle the constraint; return unenforced-feature warnings."""
    warnings = [str(item) for item in unenforced_for_xgrammar(text)] if kind in JSON_KINDS else []
    _to_grammar(kind, text)
    return warnings


def unenforced_for_xgrammar(schema_text: str) -> list[Unenforced]:
    """The keywords of a JSON schema xgrammar does not enforce exactly (ValueError if it is malformed)."""
    schema = parse_json_schema(schema_text)
    return [] if schema is None else unenforced_keywords(merge_all_of(schema), "xgrammar")


class XGrammarMatcher(GrammarMatcher):
    def __init__(self, compiled: xgr.CompiledGrammar, vocab: TokenizerVocab) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)
        self._special = vocab.special_token_ids
        self._vocab_size = vocab.vocab_size

    def accept_token(self, token_id: int) -> bool:
        # NOTE: xgrammar logs a warning for every rejected special token; reject those up front.
        if token_id in self._special or not 0 <= token_id < self._vocab_size:
            return False
        return self._matcher.accept_token(int(token_id))

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def is_completed(self) -> bool:
        return self._matcher.is_terminated() or self._matcher.is_completed()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    @property
    def max_rollback(self) -> int:
        return 1 << 30  # unlimited in xgrammar >= 0.1.20

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self._matcher.rollback(num_tokens)

    def jump_forward_string(self) -> Optional[str]:
        if self._matcher.is_terminated():
            return None
        return self._matcher.find_jump_forward_string() or None


class XGrammarCompiled(CompiledGrammar):
    def __init__(
        self, key: GrammarKey, warnings: list[str], seconds: float, compiled: xgr.CompiledGrammar, vocab: TokenizerVocab
    ) -> None:
        super().__init__(key, warnings, seconds)
        self._compiled = compiled
        self._vocab = vocab

    def new_matcher(self) -> GrammarMatcher:
        return XGrammarMatcher(self._compiled, self._vocab)


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, vocab: TokenizerVocab, num_threads: int = 1, compile_timeout: float = 60.0) -> None:
        super().__init__(vocab, num_threads=num_threads, compile_timeout=compile_timeout)
        vocab_type = {"byte_level": xgr.VocabType.BYTE_LEVEL, "byte_fallback": xgr.VocabType.BYTE_FALLBACK}.get(
            vocab.vocab_type, xgr.VocabType.RAW
        )
        # NOTE: special tokens carry "" in `encoded`, which xgrammar treats as never-allowed.
        self._info = xgr.TokenizerInfo(
            list(vocab.encoded),
            vocab_type,
            vocab_size=vocab.vocab_size,
            stop_token_ids=list(vocab.stop_token_ids),
            add_prefix_space=vocab.add_prefix_space,
        )
        # Our own cache (keyed by (kind, text)) sits in front; xgrammar's would duplicate it.
        self._compiler = xgr.GrammarCompiler(self._info, max_threads=num_threads, cache_enabled=False)

    def validate(self, kind: str, text: str) -> list[str]:
        return validate_for_xgrammar(kind, text)

    def _compile(self, kind: str, text: str, warnings: list[str]) -> CompiledGrammar:
        start = time.perf_counter()
        grammar = _to_grammar(kind, text)
        try:
            compiled = self._compiler.compile_grammar(grammar)
        except RuntimeError as e:
            raise ValueError(f"xgrammar could not compile the {kind} constraint: {clean_backend_error(e)}") from None
        return XGrammarCompiled((kind, text), warnings, time.perf_counter() - start, compiled, self.vocab)
