"""outlines-core backend: regex and JSON schema (no EBNF), via a token-level DFA index.

A JSON schema becomes a regex laid out by the kind (natural: ", " and ": "; compact: no whitespace;
"json_ws": `[ \\t\\n\\r]*` between tokens; no indentation), then an `Index` over the vocabulary. Compiling walks the
whole DFA against the
vocabulary, which is slow for large schemas (seconds) but makes per-token masks cheap.

Recursive structures are unrolled to a fixed depth (`MAX_RECURSION_DEPTH`); any-JSON is therefore
limited in nesting depth, which is reported as a warning.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any, Optional

import outlines_core as oc
import torch

from .base import CompiledGrammar, GrammarBackend, GrammarKey, GrammarMatcher
from .regex_canonical import json_string_pattern
from .schema_support import ASSERTION_KEYWORDS, Unenforced, unenforced_keywords
from .schema_text import normalize_regex, parse_json_schema
from .schema_tighten import tighten_schema
from .schema_walk import walk_schema
from .vocab import TokenizerVocab

MAX_RECURSION_DEPTH = 3
MAX_ENUM_RANGE = 1000
_SCALAR_TYPES = ("string", "number", "boolean", "null")
_WHITESPACE = r"[ \t\n\r]*"
# outlines-core puts one whitespace pattern between every two JSON tokens; the natural layout is built
# with this marker there, then each marker is spelled by where it stands (see `_natural_layout`).
_GAP = "\x00gap\x00"
# NOTE: the shortest-completion search (completion.py) walks ahead of the request by up to a few hundred
# bytes and rolls back; the Guide keeps this many states.
_MAX_ROLLBACK = 1024
# Where a subschema may be the boolean `true` (see `_true_as_empty`).
_SUBSCHEMA_KEYS = (
    "items",
    "contains",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
    "additionalItems",
    "unevaluatedItems",
)
_SUBSCHEMA_MAP_KEYS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LIST_KEYS = ("prefixItems", "allOf", "anyOf", "oneOf")
# Formats written as a string `pattern` (Python regex; ASCII digits, RFC 3339 times with their offset).
# NOTE: outlines-core's own regexes broke the JSON: "time" allowed a raw backslash before any character
# ('"12:00:00\\H"'), "uri" and "email" a raw '"'; its `\d` let in non-ASCII digits ('"१९९९-01-01"');
# "date-time" and "time" omitted the offset RFC 3339 requires.
_DATE = r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
_TIME = r"([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]{1,6})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_PATH = r"[A-Za-z0-9._~%!$&'()*+,;=:@/-]"
_QUERY = r"[A-Za-z0-9._~%!$&'()*+,;=:@/?-]"
_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
FORMAT_PATTERNS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": f"{_DATE}T{_TIME}",
    "uuid": r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
    "email": r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}",
    "uri": rf"(https?|ftp)://[A-Za-z0-9.-]+(:[0-9]{{1,5}})?(/{_PATH}*)?(\?{_QUERY}*)?(#{_QUERY}*)?",
    "ipv4": rf"{_OCTET}\.{_OCTET}\.{_OCTET}\.{_OCTET}",
}


def _to_regex(kind: str, text: str) -> tuple[str, list[str]]:
    """Tokenizer-free: the regex outlines will enforce, plus warnings (raises ValueError)."""
    if kind == "ebnf":
        raise ValueError("the outlines grammar backend does not support EBNF grammars; use grammar_backend='xgrammar'")
    if kind == "regex":
        return normalize_regex(text), []
    if kind == "json_indent":
        raise ValueError(
            "the outlines grammar backend cannot lay JSON out with indentation (json_style "
            "'indent'); use grammar_backend='xgrammar' or another json_style"
        )
    schema = parse_json_schema(text)
    if schema is None:
        schema = {}
        warnings = [f"any-JSON is limited to {MAX_RECURSION_DEPTH} levels of nesting by outlines"]
    else:
        schema = prepare_schema_for_outlines(schema)
        warnings = [str(item) for item in unenforced_keywords(schema, "outlines")]
        _formats_and_patterns_for_outlines(schema)
    gap = {"json": "", "json_ws": _WHITESPACE, "json_natural": _GAP}[kind]
    try:
        regex = oc.json_schema.build_regex_from_schema(json.dumps(schema), gap, MAX_RECURSION_DEPTH)
    except ValueError as e:
        msg = str(e).splitlines()[0].strip()
        raise ValueError(f"invalid json_schema for outlines: {msg}") from None
    return (_natural_layout(regex) if kind == "json_natural" else regex), warnings


def _natural_layout(regex: str) -> str:
    """A regex built with `_GAP` between JSON tokens, with ", " after commas, ": " after colons and
    nothing elsewhere (outlines writes an array's comma without a gap before it)."""
    regex = regex.replace(f"{_GAP}:{_GAP}", ": ").replace(f"{_GAP},{_GAP}", ", ").replace(f",{_GAP}", ", ")
    return regex.replace(_GAP, "")


def prepare_schema_for_outlines(schema: Any) -> Any:
    """Rewrite a schema into the subset outlines-core translates correctly (same valid outputs).

    - `tighten_schema` (declared properties only, required names declared).
    - An empty subschema `{}` (any value) becomes "any scalar": outlines' regex for `{}` lacks a
      group around its alternation, which breaks the enclosing object, and spelling out nested
      containers instead multiplies the DFA past memory. A narrowing: outputs stay valid.
    - An integer (or integer-or-null) with both bounds and at most `MAX_ENUM_RANGE` values becomes
      an enum: outlines ignores minimum/maximum.
    - A closed object (`additionalProperties: false`) without `properties` gets `properties: {}`.
    - Enum values are listed longest first; property names are spelled as their JSON text.
    """
    schema = tighten_schema(_true_as_empty(schema))
    for path, node in list(walk_schema(schema)):
        if path != "/" and not any(k in ASSERTION_KEYWORDS for k in node):
            node["type"] = list(_SCALAR_TYPES)
        if node.get("additionalProperties") is False and "properties" not in node:
            # NOTE: outlines refused the closed object with no declared properties (the "no
            # arguments" schema) as "Unsupported JSON Schema structure false".
            node["properties"] = {}
        values = _bounded_integer_values(node)
        if values is not None:
            for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"):
                node.pop(key, None)
            node["enum"] = values + [None] * ("null" in node["type"])
        if isinstance(node.get("properties"), dict):
            # NOTE: outlines writes a property name between quotes as it is: 'say "hi"' came out as
            # the invalid '"say "hi"":true'. Named by their JSON-escaped text, they come out escaped.
            node["properties"] = {_json_text(k): v for k, v in node["properties"].items()}
            if isinstance(node.get("required"), list):
                node["required"] = [_json_text(k) if isinstance(k, str) else k for k in node["required"]]
        if isinstance(node.get("enum"), list):
            # NOTE: outlines' DFA matches leftmost-first: in "(1|15|150)" the later values died once
            # "1" matched, so 0..150 only ever wrote 0-9. Longest first, no value is cut short.
            node["enum"] = sorted(node["enum"], key=lambda v: -len(json.dumps(v)))
    return schema


def _json_text(name: str) -> str:
    """A property name as written between the quotes of a JSON string."""
    return json.dumps(name, ensure_ascii=False)[1:-1]


def _formats_and_patterns_for_outlines(schema: Any) -> None:
    """In place, after the warnings are taken: a `format` of `FORMAT_PATTERNS` becomes that pattern, and
    minLength/maxLength next to a pattern are dropped.

    NOTE: outlines-core keeps the length and silently drops the pattern (or format): '{"type": "string",
    "format": "email", "maxLength": 30}' allowed any text. The length is the one reported unenforced, as
    xgrammar drops it."""
    for _, node in walk_schema(schema):
        if node.get("format") in FORMAT_PATTERNS and "pattern" not in node:
            node["pattern"] = json_string_pattern(FORMAT_PATTERNS[node.pop("format")])
        if "pattern" in node:
            node.pop("minLength", None)
            node.pop("maxLength", None)


def _true_as_empty(schema: Any) -> Any:
    """The boolean subschema `true` spelled `{}`: outlines refuses the boolean form.

    NOTE: `additionalProperties: true` is left alone; outlines reads it as "declared properties
    only", and `{}` there would invite arbitrary extra keys."""
    if schema is True:
        return {}
    for _, node in list(walk_schema(schema)):
        for key in _SUBSCHEMA_KEYS:
            if node.get(key) is True:
                node[key] = {}
        for key in _SUBSCHEMA_MAP_KEYS:
            if isinstance(node.get(key), dict):
                node[key] = {k: {} if v is True else v for k, v in node[key].items()}
        for key in _SUBSCHEMA_LIST_KEYS:
            if isinstance(node.get(key), list):
                node[key] = [{} if v is True else v for v in node[key]]
    return schema


def _bounded_integer_values(node: dict) -> Optional[list[int]]:
    if node.get("type") not in ("integer", ["integer", "null"], ["null", "integer"]) or (
        "enum" in node or "const" in node
    ):
        return None
    low, high = node.get("minimum"), node.get("maximum")
    if isinstance(node.get("exclusiveMinimum"), (int, float)) and not isinstance(node.get("exclusiveMinimum"), bool):
        low = (
            math.floor(node["exclusiveMinimum"]) + 1
            if low is None
            else max(low, math.floor(node["exclusiveMinimum"]) + 1)
        )
    if isinstance(node.get("exclusiveMaximum"), (int, float)) and not isinstance(node.get("exclusiveMaximum"), bool):
        high = (
            math.ceil(node["exclusiveMaximum"]) - 1
            if high is None
            else min(high, math.ceil(node["exclusiveMaximum"]) - 1)
        )
    if not isinstance(low, (int, float)) or not isinstance(high, (int, float)):
        return None
    low, high = math.ceil(low), math.floor(high)
    if high < low or high - low + 1 > MAX_ENUM_RANGE:
        return None
    step = node.get("multipleOf")
    # NOTE: an enum pins the values, so a multipleOf left next to it was neither applied nor reported.
    if step is not None and not (isinstance(step, int) and not isinstance(step, bool) and step > 0):
        return None
    return [v for v in range(low, high + 1) if step is None or v % step == 0]


def json_schema_regex(schema_text: str) -> str:
    """The regex outlines enforces for a JSON schema, whitespace allowed between tokens (what SGLang's
    `build_regex_from_object` gives programs; ValueError for a schema outlines cannot take)."""
    return _to_regex("json_ws", schema_text)[0]


def validate_for_outlines(kind: str, text: str) -> list[str]:
    """Raise ValueError if outlines cannot handle the constraint; return unenforced-feature warnings."""
    return _to_regex(kind, text)[1]


def unenforced_for_outlines(schema_text: str) -> list[Unenforced]:
    """The keywords of a JSON schema outlines does not enforce exactly (ValueError if it is malformed)."""
    schema = parse_json_schema(schema_text)
    return [] if schema is None else unenforced_keywords(prepare_schema_for_outlines(schema), "outlines")


class OutlinesMatcher(GrammarMatcher):
    """Wraps an outlines Guide; a stop token accepted in a final state terminates the match."""

    def __init__(self, index: oc.Index, vocab: TokenizerVocab) -> None:
        self._index = index
        self._guide = oc.Guide(index, max_rollback=_MAX_ROLLBACK)
        self._vocab = vocab
        self._stop = frozenset(vocab.stop_token_ids)
        self._terminated = False

    def accept_token(self, token_id: int) -> bool:
        if self._terminated:
            return False
        if token_id in self._stop:
            if self._guide.is_finished():
                self._terminated = True
                return True
            return False
        if not 0 <= token_id < self._vocab.vocab_size or not self._vocab.decoded[token_id]:
            return False
        try:
            self._guide.advance(int(token_id), return_tokens=False)
        except ValueError:  # no transition: the grammar forbids this token
            return False
        return True

    def is_terminated(self) -> bool:
        return self._terminated

    def is_completed(self) -> bool:
        return self._terminated or self._guide.is_finished()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        target = bitmask[row]
        if self._terminated:
            target.zero_()
            return
        self._guide.write_mask_into(target.data_ptr(), target.numel(), target.element_size())
        if self._guide.is_finished():
            # outlines knows one eos id; every configured stop token may end a finished match.
            for stop in self._stop:
                target[stop // 32] |= _bit(stop % 32)

    @property
    def max_rollback(self) -> int:
        return _MAX_ROLLBACK

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0 and self._terminated:
            self._terminated = False
            num_tokens -= 1
        if num_tokens > 0:
            self._guide.rollback_state(num_tokens)

    def jump_forward_string(self) -> Optional[str]:
        """Forced text read off the token DFA: the common prefix of every allowed token, repeated
        while a token spelling exactly that prefix exists to step the DFA past it."""
        if self._terminated:
            return None
        state = self._guide.get_state()
        decoded = self._vocab.decoded
        forced = b""
        for _ in range(256):  # bound the walk; forced runs are short in practice
            if self._index.is_final_state(state):
                break  # ending is allowed here, so nothing further is forced
            allowed = self._index.get_allowed_tokens(state)
            if not allowed:
                break
            prefix = decoded[allowed[0]]
            for tok in allowed[1:]:
                text = decoded[tok]
                n = 0
                limit = min(len(prefix), len(text))
                while n < limit and prefix[n] == text[n]:
                    n += 1
                prefix = prefix[:n]
                if not prefix:
                    break
            if not prefix:
                break
            step = next((t for t in allowed if decoded[t] == prefix), None)
            if step is None:
                break
            forced += prefix
            state = self._index.get_next_state(state, step)
            if state is None:
                break
        return _complete_utf8_prefix(forced) or None


def _complete_utf8_prefix(data: bytes) -> str:
    """The longest prefix of `data` made of whole UTF-8 characters ("" if it starts mid-character).

    A trailing partial character stays forced and is offered again on a later step."""
    for cut in range(len(data), max(len(data) - 4, 0) - 1, -1):
        try:
            return data[:cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return ""


def _bit(i: int) -> int:
    return (1 << i) - (1 << 32) if i == 31 else (1 << i)  # int32 two's complement for bit 31


class OutlinesCompiled(CompiledGrammar):
    def __init__(
        self, key: GrammarKey, warnings: list[str], seconds: float, index: oc.Index, vocab: TokenizerVocab
    ) -> None:
        super().__init__(key, warnings, seconds)
        self._index = index
        self._vocab = vocab

    def new_matcher(self) -> GrammarMatcher:
        return OutlinesMatcher(self._index, self._vocab)


class OutlinesBackend(GrammarBackend):
    name = "outlines"

    def __init__(self, vocab: TokenizerVocab, num_threads: int = 1, compile_timeout: float = 60.0) -> None:
        super().__init__(vocab, num_threads=num_threads, compile_timeout=compile_timeout)
        by_bytes: dict[bytes, list[int]] = {}
        for token_id, data in enumerate(vocab.decoded):
            if data:  # special tokens, stop tokens and padding ids are never part of a match
                by_bytes.setdefault(data, []).append(token_id)
        self._vocabulary = oc.Vocabulary(vocab.stop_token_ids[0], by_bytes)

    def validate(self, kind: str, text: str) -> list[str]:
        return validate_for_outlines(kind, text)

    def _compile(self, kind: str, text: str, warnings: list[str]) -> CompiledGrammar:
        start = time.perf_counter()
        regex, _ = _to_regex(kind, text)
        try:
            # NOTE: outlines-core's DFA matches leftmost-first: once an earlier alternative has matched,
            # the later ones die, so "(cat|cats)" never allowed "cats". Anchoring the end keeps every
            # alternative alive until the text ends. Not for schemas: it made any-JSON's compile far
            # slower; their enums are ordered instead (see prepare_schema_for_outlines).
            index = oc.Index(f"({regex})$" if kind == "regex" else regex, self._vocabulary)
        except ValueError as e:
            raise ValueError(f"outlines could not compile the {kind} constraint: {str(e).splitlines()[0]}") from None
        return OutlinesCompiled((kind, text), warnings, time.perf_counter() - start, index, self.vocab)
