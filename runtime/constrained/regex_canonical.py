"""A user's Python regex, rewritten into the plain dialect both grammar backends read the same way.

Users write regexes for Python's `re` (and check outputs with `re.fullmatch`), but xgrammar and
outlines-core each parse their own dialect: xgrammar rejects named groups, inline flags and `{,n}`,
and lets `.` match a newline, which Python's `.` never does. Rather than passing the text through
and hoping, `canonical_regex` parses the pattern with Python's own parser and writes the tree
back out using only constructs both backends agree on:

- `.` becomes `[^\\n]` (or any character under the `s` flag);
- groups of every kind become plain `(...)`; lazy quantifiers become greedy (a full match
  accepts the same strings either way); `{,n}` becomes `{0,n}`;
- the `i` flag (global or scoped) spells out each letter's cases (`[yY][eE][sS]`);
- a leading `^` / `\\A` and a trailing `$` / `\\Z` are dropped (a constraint is always a full match).

`json_string_pattern` does the same for a JSON schema's string `pattern`, which the backends
match against the string's JSON text: '"', '\\' and control characters are written escaped.

Every string the rewritten pattern matches is matched by the user's pattern (`re.fullmatch`).
Constructs no finite automaton can enforce (lookaround, backreferences, conditionals, anchors
inside the pattern, atomic groups, possessive quantifiers) raise ValueError naming them.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

try:  # Python >= 3.11 keeps the parser here; it is the only way to see a regex's structure.
    import re._parser as _sre_parse  # type: ignore[import-not-found]
    from re import _constants as _sre_const  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as _sre_const  # type: ignore[no-redef]
    import sre_parse as _sre_parse  # type: ignore[no-redef]

_UNSUPPORTED = {
    "ASSERT": "a lookahead/lookbehind assertion",
    "ASSERT_NOT": "a negative lookahead/lookbehind assertion",
    "GROUPREF": "a backreference",
    "GROUPREF_EXISTS": "a conditional group",
    "ATOMIC_GROUP": "an atomic group",
    "POSSESSIVE_REPEAT": "a possessive quantifier",
}
_LEADING_ANCHORS = ("AT_BEGINNING", "AT_BEGINNING_STRING")
_TRAILING_ANCHORS = ("AT_END", "AT_END_STRING")
_CATEGORIES = {
    "CATEGORY_DIGIT": r"\d",
    "CATEGORY_NOT_DIGIT": r"\D",
    "CATEGORY_SPACE": r"\s",
    "CATEGORY_NOT_SPACE": r"\S",
    "CATEGORY_WORD": r"\w",
    "CATEGORY_NOT_WORD": r"\W",
}
_META = set(r".^$*+?{}[]\|()")
_CLASS_META = set(r"\]^-[")
_NAMED_ESCAPES = {"\n": r"\n", "\t": r"\t", "\r": r"\r", "\f": r"\f", "\v": r"\v"}
# JSON-body mode: characters a JSON string never holds raw, as set text and as code ranges.
_JSON_RAW_UNSAFE = '"\\\\\\x00-\\x1f'
_JSON_UNSAFE_RANGES = ((0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C))
_NEGATIVE = {
    "CATEGORY_NOT_DIGIT": "CATEGORY_DIGIT",
    "CATEGORY_NOT_SPACE": "CATEGORY_SPACE",
    "CATEGORY_NOT_WORD": "CATEGORY_WORD",
}
# Nodes written as one atom (a quantifier may follow them directly).
_ATOMS = ("LITERAL", "NOT_LITERAL", "ANY", "IN", "BRANCH", "SUBPATTERN")
_IGNORECASE = _sre_const.SRE_FLAG_IGNORECASE
_DOTALL = _sre_const.SRE_FLAG_DOTALL


def canonical_regex(pattern: str) -> str:
    """The backend-neutral full-match form of a Python regex (see the module docstring).

    Raises ValueError for syntax errors and for constructs constrained decoding cannot enforce."""
    items, flags = _parse(pattern)
    return _Writer(pattern).sequence(items, flags)


def _parse(pattern: str) -> tuple[list, int]:
    """Python's parse of `pattern` without its leading / trailing anchors, and its global flags."""
    with warnings.catch_warnings():
        # NOTE: Python parses "[[:alpha:]]" as the set "[[:alph]" then a literal "]" and only
        # warns; both backends read it differently again. Refuse it instead of guessing.
        warnings.simplefilter("error", FutureWarning)
        try:
            parsed = _sre_parse.parse(pattern)
        except re.error as e:
            raise ValueError(f"regex {_short(pattern)} is invalid: {e}") from None
        except FutureWarning as w:
            raise ValueError(
                f"regex {_short(pattern)} is ambiguous ({w}); POSIX classes such as "
                "[[:alpha:]] are not supported: escape a literal '[' inside a set "
                "as '\\['"
            ) from None
    items = list(parsed)
    if items and _is_anchor(items[0], _LEADING_ANCHORS):
        items = items[1:]
    if items and _is_anchor(items[-1], _TRAILING_ANCHORS):
        items = items[:-1]
    return items, parsed.state.flags


def _is_anchor(item: Any, names: tuple[str, ...]) -> bool:
    op, arg = item
    return str(op) == "AT" and str(arg) in names


class _Writer:
    """Writes a parsed pattern back as text; `flags` are the ones in force at each node."""

    def __init__(self, pattern: str, json_body: bool = False) -> None:
        self.pattern = pattern
        # True: the pattern is matched against a JSON string's text between its quotes, so '"',
        # '\\' and control characters appear escaped and never raw (see json_string_pattern).
        self.json_body = json_body

    def fail(self, what: str) -> ValueError:
        return ValueError(f"regex {_short(self.pattern)} uses {what}, which constrained decoding cannot enforce")

    def sequence(self, items: Any, flags: int) -> str:
        return "".join(self.node(op, arg, flags) for op, arg in items)

    def node(self, op: Any, arg: Any, flags: int) -> str:
        name = str(op)
        if name in _UNSUPPORTED:
            raise self.fail(_UNSUPPORTED[name])
        if name == "LITERAL":
            return self.literal(arg, flags)
        if name == "NOT_LITERAL":
            excluded = "".join(_class_char(c) for c in _cases(chr(arg), flags))
            return "[^" + excluded + (_JSON_RAW_UNSAFE if self.json_body else "") + "]"
        if name == "ANY":
            if self.json_body:  # any raw JSON string character (escapes left out: narrower)
                return "[^" + _JSON_RAW_UNSAFE + "]"
            return r"[\s\S]" if flags & _DOTALL else r"[^\n]"
        if name == "IN":
            return self.char_set(arg, flags)
        if name == "BRANCH":
            return "(" + "|".join(self.sequence(b, flags) for b in arg[1]) + ")"
        if name == "SUBPATTERN":
            _group, add_flags, del_flags, body = arg
            return self.group(body, (flags | add_flags) & ~del_flags)
        if name in ("MAX_REPEAT", "MIN_REPEAT"):  # lazy or greedy: the same full matches
            low, high, body = arg
            if high == 0:
                return ""
            return self.group(body, flags) + _quantifier(low, high)
        if name == "AT":
            raise ValueError(
                f"regex {_short(self.pattern)} uses an anchor or word boundary "
                f"({arg}) inside the pattern; only a leading ^ and a trailing $ "
                "are allowed"
            )
        raise self.fail(f"the construct {name}")

    def group(self, body: Any, flags: int) -> str:
        """`body` as one atom: parenthesized unless it already is a single atom."""
        text = self.sequence(body, flags)
        if (
            len(body) == 1
            and str(body[0][0]) in _ATOMS
            and (str(body[0][0]) != "LITERAL" or len(text) <= 2 or text.startswith("["))
        ):
            return text
        return "(" + text + ")"

    def literal(self, code: int, flags: int) -> str:
        variants = _cases(chr(code), flags)
        if self.json_body and any(_json_unsafe(ord(c)) for c in variants):
            return "(" + "|".join(_json_escaped(c) for c in variants) + ")"
        if len(variants) == 1:
            return _plain_char(variants[0])
        return "[" + "".join(_class_char(c) for c in variants) + "]"

    def char_set(self, members: Any, flags: int) -> str:
        negate = any(str(op) == "NEGATE" for op, _ in members)
        if self.json_body and not negate and len(members) == 1 and str(members[0][1]) in _NEGATIVE:
            # "\S" alone: a negated set of its complement, which can exclude the unsafe raws.
            negate, members = True, [(members[0][0], _NEGATIVE[str(members[0][1])])]
        parts: list[str] = []
        escaped: list[str] = []  # JSON-body mode: set members that only appear escaped
        for op, arg in members:
            name = str(op)
            if name == "NEGATE":
                continue
            if name == "LITERAL":
                for c in _cases(chr(arg), flags):
                    if self.json_body and not negate and _json_unsafe(ord(c)):
                        escaped.append(_json_escaped(c))
                    else:
                        parts.append(_class_char(c))
            elif name == "RANGE":
                for low, high in self.safe_ranges(arg[0], arg[1], negate):
                    parts.extend(self.range_parts(low, high, flags, negate))
                if self.json_body and not negate:  # '"' and '\\' stay reachable, escaped
                    escaped.extend(_json_escaped(c) for c in '"\\' if arg[0] <= ord(c) <= arg[1])
            elif name == "CATEGORY":
                parts.append(self.category(str(arg), negate))
            else:
                raise self.fail(f"the set member {name}")
        if negate:
            return "[^" + "".join(parts) + (_JSON_RAW_UNSAFE if self.json_body else "") + "]"
        alternatives = (["[" + "".join(parts) + "]"] if parts else []) + escaped
        return alternatives[0] if len(alternatives) == 1 else "(" + "|".join(alternatives) + ")"

    def safe_ranges(self, low: int, high: int, negated: bool) -> list[tuple[int, int]]:
        """The range minus the characters a JSON string never holds raw (positive sets only)."""
        if not self.json_body or negated:
            return [(low, high)]
        pieces = []
        for gap_low, gap_high in _JSON_UNSAFE_RANGES:
            if low < gap_low:
                pieces.append((low, min(high, gap_low - 1)))
            low = max(low, gap_high + 1)
        if low <= high:
            pieces.append((low, high))
        return [(a, b) for a, b in pieces if a <= b]

    def category(self, name: str, negated: bool) -> str:
        if self.json_body and not negated:
            if name in _NEGATIVE:
                raise self.fail(f"{_CATEGORIES[name]} mixed with other members of a set")
            if name == "CATEGORY_SPACE":
                return " "  # the raw whitespace a JSON string may hold (narrower than \\s)
        return _CATEGORIES[name]

    def range_parts(self, low: int, high: int, flags: int, negated: bool) -> list[str]:
        parts = [_class_char(chr(low)) + "-" + _class_char(chr(high))]
        if not flags & _IGNORECASE:
            return parts
        # The ASCII letters' other case is added; a negated set must also exclude the other case
        # of every non-ASCII letter, which this does not spell out, so it is refused.
        if negated and high > 0x7F:
            raise self.fail("a negated set with non-ASCII ranges under the ignore-case flag")
        for first, last, shift in ((0x61, 0x7A, -32), (0x41, 0x5A, 32)):
            lo, hi = max(low, first), min(high, last)
            if lo <= hi:
                parts.append(_class_char(chr(lo + shift)) + "-" + _class_char(chr(hi + shift)))
        return parts


def json_string_pattern(pattern: str) -> str:
    """`canonical_regex` for a JSON schema `pattern`, matched against the string's JSON text.

    Both backends match a pattern against the characters between the quotes as written, so a
    raw '"' in the pattern produced invalid JSON ('"a"b"') and outlines let '.' write a raw '"'.
    Here '"', '\\' and control characters are written escaped; `.` and negated sets never
    produce them raw."""
    items, flags = _parse(pattern)
    return _Writer(pattern, json_body=True).sequence(items, flags)


def _json_unsafe(code: int) -> bool:
    return code < 0x20 or code in (0x22, 0x5C)


def _json_escaped(char: str) -> str:
    """A regex for the JSON escape of `char` (the text `\\"` for '"', `\\n` for a newline)."""
    short = {'"': '"', "\\": "\\\\", "\n": "n", "\t": "t", "\r": "r", "\b": "b", "\f": "f"}
    if char in short:
        return "\\\\" + short[char]
    if _json_unsafe(ord(char)):
        return f"\\\\u{ord(char):04x}"
    return _plain_char(char)


def _cases(char: str, flags: int) -> list[str]:
    """`char` and, under the ignore-case flag, its other cases that Python also matches."""
    if not flags & _IGNORECASE:
        return [char]
    found = [char]
    for other in (char.lower(), char.upper(), char.swapcase()):
        if len(other) == 1 and other not in found and re.fullmatch(re.escape(char), other, re.IGNORECASE):
            found.append(other)
    return found


def _quantifier(low: int, high: int) -> str:
    unbounded = high == _sre_const.MAXREPEAT
    if (low, unbounded) == (0, True):
        return "*"
    if (low, unbounded) == (1, True):
        return "+"
    if (low, high) == (0, 1):
        return "?"
    if unbounded:
        return f"{{{low},}}"
    return f"{{{low}}}" if low == high else f"{{{low},{high}}}"


def _plain_char(char: str) -> str:
    if char in _META:
        return "\\" + char
    return _escape_control(char)


def _class_char(char: str) -> str:
    if char in _CLASS_META:
        return "\\" + char
    return _escape_control(char)


def _escape_control(char: str) -> str:
    if char in _NAMED_ESCAPES:
        return _NAMED_ESCAPES[char]
    code = ord(char)
    if code < 0x20 or 0x7F <= code < 0xA0:
        return f"\\x{code:02x}"
    return char


def _short(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")
