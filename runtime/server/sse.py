"""Server-sent events: the `data: <json>` events the streaming routes write, templates for the events a
stream writes over and over that differ in a few values only (the next text of a choice), and SGLang's
cumulative events of the native /generate stream, encoded as they grow.

NOTE: under hundreds of streams the server writes tens of thousands of events a second; json.dumps of each
event's whole body (the response id, the model, the choice's keys; for /generate, the whole output so far)
was a large part of its time per event. An `EventTemplate` encodes the fixed part once, and per event only
the values that change; `CumulativeEvents` encodes only each chunk's new text and ids.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from ..engine.streams import CumulativeOutput

SSE_DONE = "data: [DONE]\n\n"

_ENCODER = json.JSONEncoder(ensure_ascii=False)
_encode_str = json.encoder.encode_basestring  # (the C function json.dumps uses with ensure_ascii=False)


def sse_event(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class Slot:
    """A value left open in an `EventTemplate`'s body."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


class EventTemplate:
    """An event whose body is fixed but for its `Slot`s. `render(*values)` (in the order the slots come in
    the JSON) is the text `sse_event` writes for the body with the values in place, character for
    character."""

    def __init__(self, body: Any) -> None:
        names: list[str] = []

        def marker(obj: Any) -> str:
            if not isinstance(obj, Slot):
                raise TypeError(f"{type(obj).__name__} is not JSON serializable")
            names.append(obj.name)
            return f"\x00plait-slot-{len(names) - 1}\x00"

        text = sse_event_with(body, marker)
        self._parts: list[str] = []
        for i in range(len(names)):
            head, sep, text = text.partition(json.dumps(f"\x00plait-slot-{i}\x00"))
            if not sep:
                raise ValueError(f"slot {names[i]!r} is not in the encoded event")
            self._parts.append(head)
        self._parts.append(text)
        self.slots = tuple(names)

    def render(self, *values: Any) -> str:
        parts = self._parts
        if len(values) != len(parts) - 1:
            raise TypeError(f"the template takes {len(parts) - 1} values ({', '.join(self.slots)}), got {len(values)}")
        out = [parts[0]]
        for value, part in zip(values, parts[1:]):
            out.append(encode_value(value))
            out.append(part)
        return "".join(out)


def sse_event_with(obj: Any, default: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, default=default)}\n\n"


def encode_value(value: Any) -> str:
    """json.dumps(value, ensure_ascii=False), with the common scalars taken the short way."""
    kind = type(value)
    if kind is str:
        return _encode_str(value)
    if value is None:
        return "null"
    if kind is int:
        return int.__repr__(value)
    return _ENCODER.encode(value)


class CumulativeEvents:
    """One request's native /generate stream: SGLang's cumulative chunks (a `CumulativeOutput` folded from the
    Engine's deltas), each event the UTF-8 of what `sse_event(chunk)` writes, character for character, with the
    chunk's "index" when given one. The text and ids so far are kept encoded; a chunk encodes only what it adds."""

    def __init__(self, index: Optional[int] = None) -> None:
        self.output = CumulativeOutput()
        self._tail = b"}\n\n" if index is None else b', "index": %d}\n\n' % index
        self._text = b""  # the text so far, JSON-escaped (what goes between its quotes), UTF-8
        self._ids = b""  # the ids so far, as JSON writes them between the brackets

    def add(self, delta: dict[str, Any]) -> bytes:
        """Fold in the next delta chunk; its event."""
        output = self.output
        before = len(output.text)
        output.add(delta)
        new_text = delta.get("text") or ""
        if len(output.text) != before + len(new_text):  # the end was cut (a stop regex matched in it)
            self._text = _encode_str(output.text)[1:-1].encode()
        elif new_text:
            self._text += _encode_str(new_text)[1:-1].encode()  # (JSON escapes character by character)
        new_ids = delta.get("output_ids")
        if new_ids:
            more = ", ".join(map(int.__repr__, new_ids)).encode()
            self._ids = self._ids + b", " + more if self._ids else more
        meta = _ENCODER.encode(output.meta_info).encode()
        return b"".join(
            (b'data: {"text": "', self._text, b'", "output_ids": [', self._ids, b'], "meta_info": ', meta, self._tail)
        )
