"""Where the parts of a tool call are in JSON text that may still be growing (a stream) or cut short
(max_tokens): the call objects, each one's `name` and the span of its `arguments` value.

A scanner, not a parser: it reads as far as the text goes and reports what is complete, so a stream can
send a call's name as soon as it is known and its arguments piece by piece as they are written. Whether
the whole text is valid is json.loads' call, made when the output ends (tools/parser.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

_WS = " \t\r\n"
ARGUMENT_KEYS = ("arguments", "parameters")  # OpenAI's / the generic prompt's, Llama-3.1's


@dataclass
class CallSpan:
    """One call object in the text. Positions are indexes into the scanned text; None: not there yet."""

    start: int
    name: Optional[str] = None  # once its string is complete
    args_start: Optional[int] = None  # where the arguments value begins
    args_end: Optional[int] = None  # just past it, once complete
    end: Optional[int] = None  # just past the object's '}', once complete

    def arguments_text(self, text: str) -> Optional[str]:
        """The raw text of an object-valued `arguments` so far (all of it once complete), else None."""
        if self.args_start is None or text[self.args_start] != "{":
            return None
        return text[self.args_start : self.args_end if self.args_end is not None else len(text)]


def skip_ws(text: str, i: int, also: str = "") -> int:
    while i < len(text) and (text[i] in _WS or text[i] in also):
        i += 1
    return i


def string_end(text: str, i: int) -> Optional[int]:
    """`text[i]` is '"': the index past the closing quote, None while the string is open."""
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
        elif text[j] == '"':
            return j + 1
        else:
            j += 1
    return None


def value_end(text: str, i: int) -> Optional[int]:
    """The index past the JSON value that begins at `text[i]`, None while it is incomplete."""
    if text[i] == '"':
        return string_end(text, i)
    if text[i] in "{[":
        depth, j = 0, i
        while j < len(text):
            c = text[j]
            if c == '"':
                end = string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i  # a number, true, false or null: ends at a delimiter (the text's end may still extend it)
    while j < len(text) and text[j] not in ",}] \t\r\n":
        j += 1
    return j if j < len(text) else None


def scan_call(text: str, i: int) -> CallSpan:
    """The call object that begins at `text[i]` ('{'), read as far as it goes."""
    span = CallSpan(start=i)
    j = i + 1
    while True:
        j = skip_ws(text, j, also=",")
        if j >= len(text):
            return span
        if text[j] == "}":
            span.end = j + 1
            return span
        key_end = string_end(text, j) if text[j] == '"' else None
        if key_end is None:
            return span
        key = _string_value(text[j:key_end])
        j = skip_ws(text, key_end)
        if j >= len(text) or text[j] != ":":
            return span
        j = skip_ws(text, j + 1)
        if j >= len(text):
            return span
        end = value_end(text, j)
        if key == "name" and text[j] == '"' and end is not None:
            span.name = _string_value(text[j:end])
        elif key in ARGUMENT_KEYS and span.args_start is None:
            span.args_start, span.args_end = j, end
        if end is None:
            return span
        j = end


def scan_calls(text: str, i: int) -> list[CallSpan]:
    """The call objects of the value at `text[i]`: one object, or the objects of a list, as far as the text
    goes (a list element that is not an object ends the scan)."""
    if text[i] == "{":
        return [scan_call(text, i)]
    spans: list[CallSpan] = []
    j = i + 1
    while True:
        j = skip_ws(text, j, also=",")
        if j >= len(text) or text[j] != "{":
            return spans
        spans.append(scan_call(text, j))
        if spans[-1].end is None:
            return spans
        j = spans[-1].end


def _string_value(literal: str) -> Optional[str]:
    try:
        value = json.loads(literal)
    except ValueError:  # a bad escape: not a name
        return None
    return value if isinstance(value, str) else None
