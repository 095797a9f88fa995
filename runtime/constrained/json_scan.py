"""Where a JSON text stands, byte by byte: open containers, strings, the keys each open object has.

The grammar matchers know whether a token is allowed, but not what it means structurally; the
closing search (completion.py), the repeated-key mask (unique_keys.py) and the loop watch need that:
"inside a key string of an object that already has 'name' and 'age'", "after a value in an array".
`JsonScanner.feed(data)` advances over a token's bytes (UTF-8 pieces included: every structural
character is ASCII); `snapshot()` / `restore()` make it rewindable, so rollbacks of the matcher and
the search's look-ahead can rewind it too.

The scanner trusts its input to be the prefix of a JSON text (the grammar guarantees it); bytes that
cannot be JSON there set `broken`, after which it only reports `broken`.

Property names are compared as written (raw bytes between the quotes): "a" and "\\u0061" count as two.
"""

from __future__ import annotations

from typing import Optional

# Where the scanner stands (`JsonScanner.context`):
VALUE = "value"  # a value must start here (after ':', after ',' in an array, at the top)
ARRAY_START = "array_start"  # after '[': a value or ']'
OBJECT_START = "object_start"  # after '{': a key or '}'
KEY = "key"  # after ',' in an object: a key must start
COLON = "colon"  # after a key: ':'
AFTER_IN_OBJECT = "after_in_object"  # after a value in an object: ',' or '}'
AFTER_IN_ARRAY = "after_in_array"  # after a value in an array: ',' or ']'
IN_STRING = "in_string"  # inside a value string
IN_KEY = "in_key"  # inside a key string
IN_LITERAL = "in_literal"  # inside a number, true, false or null
DONE = "done"  # the top-level value is complete
BROKEN = "broken"  # not JSON the scanner follows

_OBJECT, _ARRAY = 0, 1
_WHITESPACE = frozenset(b" \t\n\r")
_LITERAL_START = frozenset(b"-0123456789tfn")
_LITERAL_BODY = frozenset(b"0123456789+-.eEtruefalsn")
_DIGITS = frozenset(b"0123456789")
_QUOTE, _BACKSLASH = ord('"'), ord("\\")


class JsonScanner:
    """The structural state of a JSON prefix. Mutable; `snapshot()` gives an immutable copy.

    State: a stack of open containers (kind, what comes next, the keys written so far for objects),
    the string being read (a key's bytes are collected), the escape being read, a literal in progress.
    """

    __slots__ = ("stack", "string", "key", "escape", "literal", "done", "broken", "repeated_key")

    def __init__(self) -> None:
        # Each frame: [kind, expect, keys]; expect is one of the context names above that can stand
        # between tokens of that container (OBJECT_START, KEY, COLON, VALUE, AFTER_IN_OBJECT, ...).
        self.stack: list[list] = []
        self.string: Optional[str] = None  # None, IN_STRING or IN_KEY
        self.key = b""  # bytes of the key being read
        self.escape = 0  # 0: none; 1: after a backslash; 2-5: hex digits of a \\u escape still to read, plus one
        self.literal = b""
        self.done = False
        self.broken = False
        self.repeated_key = False  # the last feed closed a key its object already had

    # ---- snapshots ----
    def snapshot(self) -> tuple:
        stack = tuple((f[0], f[1], f[2]) for f in self.stack)
        return (stack, self.string, self.key, self.escape, self.literal, self.done, self.broken)

    def restore(self, snap: tuple) -> None:
        stack, self.string, self.key, self.escape, self.literal, self.done, self.broken = snap
        self.stack = [list(f) for f in stack]
        self.repeated_key = False

    @classmethod
    def from_snapshot(cls, snap: tuple) -> "JsonScanner":
        scanner = cls()
        scanner.restore(snap)
        return scanner

    # ---- queries ----
    @property
    def context(self) -> str:
        if self.broken:
            return BROKEN
        if self.string is not None:
            return self.string
        if self.literal:
            return IN_LITERAL
        if not self.stack:
            return DONE if self.done else VALUE
        return self.stack[-1][1]

    @property
    def depth(self) -> int:
        return len(self.stack)

    def open_count(self) -> int:
        """A lower bound on the bytes still needed to end the text: one per open container and string."""
        return len(self.stack) + (self.string is not None)

    def current_keys(self) -> frozenset:
        """Keys already written in the innermost open object (empty outside objects)."""
        for frame in reversed(self.stack):
            if frame[0] == _OBJECT:
                return frame[2]
            break
        return frozenset()

    def has_keys_open(self) -> bool:
        """Whether any open object already has a key (only then can a key be repeated)."""
        return any(f[0] == _OBJECT and f[2] for f in self.stack)

    # ---- feeding ----
    def feed(self, data: bytes) -> None:
        """Advance over `data` (a token's bytes)."""
        self.repeated_key = False
        if self.broken:
            return
        if self.string is not None and not self.escape and _QUOTE not in data and _BACKSLASH not in data:
            if self.string == IN_KEY:  # NOTE: the common case, string content, without a byte loop
                self.key += data
            return
        for byte in data:
            self._byte(byte)
            if self.broken:
                return

    def _byte(self, c: int) -> None:
        if self.string is not None:
            self._string_byte(c)
            return
        if self.literal:
            if c in _LITERAL_BODY:
                self.literal += bytes((c,))
                return
            self.literal = b""
            self._value_done()
        if c in _WHITESPACE:
            return
        expect = self.context
        if c == ord("{") or c == ord("["):
            if expect not in (VALUE, ARRAY_START):
                self.broken = True
                return
            self.stack.append([_OBJECT, OBJECT_START, frozenset()] if c == ord("{") else [_ARRAY, ARRAY_START, None])
        elif c == _QUOTE:
            if expect in (OBJECT_START, KEY):
                self.string, self.key = IN_KEY, b""
            elif expect in (VALUE, ARRAY_START):
                self.string = IN_STRING
            else:
                self.broken = True
        elif c == ord(":"):
            if expect != COLON:
                self.broken = True
                return
            self.stack[-1][1] = VALUE
        elif c == ord(","):
            if expect == AFTER_IN_OBJECT:
                self.stack[-1][1] = KEY
            elif expect == AFTER_IN_ARRAY:
                self.stack[-1][1] = VALUE
            else:
                self.broken = True
        elif c == ord("}") or c == ord("]"):
            closes = (OBJECT_START, AFTER_IN_OBJECT) if c == ord("}") else (ARRAY_START, AFTER_IN_ARRAY)
            if expect not in closes:
                self.broken = True
                return
            self.stack.pop()
            self._value_done()
        elif c in _LITERAL_START and expect in (VALUE, ARRAY_START):
            self.literal = bytes((c,))
        else:
            self.broken = True

    def _string_byte(self, c: int) -> None:
        if self.escape == 1:
            self.escape = 5 if c == ord("u") else 0
        elif self.escape:
            self.escape = 0 if self.escape == 2 else self.escape - 1
        elif c == _BACKSLASH:
            self.escape = 1
        elif c == _QUOTE:
            if self.string == IN_KEY:
                frame = self.stack[-1]
                self.repeated_key = self.repeated_key or self.key in frame[2]
                frame[2] = frame[2] | {self.key}
                frame[1] = COLON
                self.string = None
                return
            self.string = None
            self._value_done()
            return
        if self.string == IN_KEY:
            self.key += bytes((c,))

    def _value_done(self) -> None:
        if not self.stack:
            self.done = True
        else:
            frame = self.stack[-1]
            frame[1] = AFTER_IN_OBJECT if frame[0] == _OBJECT else AFTER_IN_ARRAY

    # ---- the schema-free closing ----
    def closing_text(self) -> Optional[bytes]:
        """The bytes that end the text from here without adding content, or None where content is
        required (a key waits for its value, a value must follow ',' or ':'): close the string, finish
        the literal, close every container. The grammar decides whether that is valid for the schema."""
        if self.broken or self.string == IN_KEY or self.escape:
            return None
        out = b'"' if self.string == IN_STRING else b""
        if self.literal:
            end = _finish_literal(self.literal)
            if end is None:
                return None
            out += end
        elif self.string is None and self.context in (VALUE, KEY, COLON):
            return None
        # (the outer frames wait for the value being written: each closes once it is done)
        return out + bytes(ord("}") if f[0] == _OBJECT else ord("]") for f in reversed(self.stack))


def _finish_literal(literal: bytes) -> Optional[bytes]:
    """The bytes that complete a partial JSON literal ("tr" -> "ue", "1." -> "0"), or None."""
    for word in (b"true", b"false", b"null"):
        if word.startswith(literal):
            return word[len(literal) :]
    last = literal[-1:]
    if last in (b"-", b".", b"e", b"E", b"+"):
        return b"0"
    return b"" if last and last[0] in _DIGITS else None
