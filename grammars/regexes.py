"""Named regexes for constrained generation: `gen(regex=REGEXES["email"])` or `regex("email")`.

Every pattern uses only what both grammar backends (xgrammar and outlines-core) and Python's `re`
understand: no lookaround, backreferences, named groups, inline flags or `\\b`; matching is always
a full match, so there are no anchors. Digit runs are bounded (a model cannot run on forever);
free-text parts use `+`/`*`, because large counted repetitions blow up outlines' DFA index.
"""

from __future__ import annotations

_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"

REGEXES: dict[str, str] = {
    # Optional minus, no leading zeros.
    "integer": r"-?(0|[1-9][0-9]{0,17})",
    # Decimal with optional fraction and exponent (a JSON number).
    "float": r"-?(0|[1-9][0-9]{0,17})(\.[0-9]{1,17})?([eE][+-]?[0-9]{1,3})?",
    "boolean": r"(true|false)",
    # Calendar date YYYY-MM-DD (day 01-31; month-specific lengths are not checked).
    "iso_date": r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    # Practical email: local part, @, dotted domain with a 2-24 letter TLD.
    "email": r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}",
    "ipv4": rf"{_OCTET}\.{_OCTET}\.{_OCTET}\.{_OCTET}",
    # A double-quoted string with JSON escapes.
    "string": r'"([^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"',
}


def regex(name: str) -> str:
    """The named regex; ValueError lists the known names for an unknown one."""
    try:
        return REGEXES[name]
    except KeyError:
        raise ValueError(f"unknown regex name {name!r}; known: {', '.join(sorted(REGEXES))}") from None
