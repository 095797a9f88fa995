"""A chat output back into OpenAI `tool_calls`: whole (`ToolPlan.message`) or streamed (`ToolCallStream`).

- Formats: the generic JSON (one call, a list, or calls one after another), Llama-3.1's `{"name",
  "parameters"}` (after an optional `<|python_tag|>`), Mistral's `[TOOL_CALLS]` prefix, a ```json fence, and
  Hermes/Qwen `<tool_call>{...}</tool_call>` blocks after some text.
- A whole output is all or nothing: calls only if every block parses as a call of an offered tool.
  A call's `arguments` is the model's own JSON text of the object (what a stream sends piece by piece).
- A stream sends text as content as soon as it cannot be the start of a call, and a call as OpenAI does:
  its id and name once the name is written, then its arguments as they grow, so clients that parse
  partial JSON (instructor's create_partial) see the object fill in.
- An output cut by max_tokens inside a forced call (tool_choice required / named) is still that call,
  with the arguments written so far, and finish_reason "length".
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from .json_scan import ARGUMENT_KEYS, CallSpan, scan_call, scan_calls, skip_ws

HERMES_OPEN = "<tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)
_CALL_PREFIXES = ("<|python_tag|>", "[TOOL_CALLS]")
_FENCE = re.compile(r"```(?:json)?\s*(.*?)\s*```", re.S)
_FENCE_OPEN = re.compile(r"```(?:json)?\s*")
# How an auto-mode output that is a call begins; a stream holds such text back until it can tell.
_CALL_OPENERS = ("{", "[", "```", HERMES_OPEN, *_CALL_PREFIXES)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def tool_call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def arguments_value(arguments: str) -> Any:
    """Arguments as an object (for rendering and checks); the text itself when it is not JSON."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


# ---------------------------------------------------------------- whole outputs


@dataclass(frozen=True)
class ParsedOutput:
    """`text[:content_end]` is the text before the calls (all of it when there are none)."""

    content_end: int
    calls: list[dict[str, Any]]  # OpenAI tool_calls entries (id, type, function{name, arguments})


def parse_tool_calls(text: str, names: set[str]) -> ParsedOutput:
    """The calls in a model's output; all or nothing: a block that does not parse leaves it all text."""
    start = text.find(HERMES_OPEN)
    if start >= 0:
        found = [_calls_in_json(body, names) for body in _HERMES_BLOCK.findall(text, start)]
        if found and all(found):
            return ParsedOutput(start, [c for calls in found for c in calls])
        return ParsedOutput(len(text), [])
    body = text.strip()
    for prefix in _CALL_PREFIXES:
        if body.startswith(prefix):
            body = body[len(prefix) :].strip()
    fenced = _FENCE.fullmatch(body)
    calls = _calls_in_json(fenced.group(1) if fenced else body, names)
    return ParsedOutput(0, calls) if calls else ParsedOutput(len(text), [])


def _calls_in_json(body: str, names: set[str]) -> list[dict[str, Any]]:
    """Calls from JSON text: an object, a list of objects, or objects one after another (separated by
    whitespace, ',' or ';'). Empty unless every value is a call of an offered tool."""
    decoder, calls, at = json.JSONDecoder(), [], 0
    while True:
        at = skip_ws(body, at, also=",;")
        if at == len(body):
            break
        try:
            value, end = decoder.raw_decode(body, at)
        except ValueError:
            return []
        items = value if isinstance(value, list) else [value]
        spans = scan_calls(body, at) if body[at] in "{[" else []
        if len(spans) != len(items):  # a list with something else than objects
            return []
        for item, span in zip(items, spans):
            if not isinstance(item, dict) or item.get("name") not in names:
                return []
            arguments = item.get("arguments", item.get("parameters", {}))
            if isinstance(arguments, str):  # some models send the arguments as JSON text, as OpenAI does
                arguments = arguments_value(arguments)
            if not isinstance(arguments, dict):
                return []
            raw = span.arguments_text(body)
            calls.append(
                tool_call(item["name"], raw.strip() if raw is not None else json.dumps(arguments, ensure_ascii=False))
            )
        at = end
    return calls


# ---------------------------------------------------------------- where calls are in growing text


def call_region(text: str) -> Optional[tuple[int, list[CallSpan]]]:
    """(where the calls begin, their spans so far) when `text` is, or begins to be, calls in one of the
    formats; None when it is not (yet) recognizable as calls."""
    marker = text.find(HERMES_OPEN)
    if marker >= 0:
        spans = []
        for block in re.finditer(re.escape(HERMES_OPEN), text):
            j = skip_ws(text, block.end())
            if j < len(text) and text[j] == "{":
                spans.append(scan_call(text, j))
        return marker, spans
    j = skip_ws(text, 0)
    for prefix in _CALL_PREFIXES:
        if text.startswith(prefix, j):
            j = skip_ws(text, j + len(prefix))
    fence = _FENCE_OPEN.match(text, j)
    if fence is not None:
        j = fence.end()
    if j >= len(text) or text[j] not in "{[":
        return None
    spans = scan_calls(text, j)
    while text[j] == "{" and spans[-1].end is not None:  # objects one after another
        j = skip_ws(text, spans[-1].end, also=",;")
        if j >= len(text) or text[j] != "{":
            break
        spans.append(scan_call(text, j))
    return 0, spans


def _calls_of_offered_tools(spans: list[CallSpan], names: frozenset[str]) -> list[CallSpan]:
    """The leading spans whose name is complete and offered (the rest may still turn out otherwise)."""
    out = []
    for span in spans:
        if span.name is None or span.name not in names:
            break
        out.append(span)
    return out


def _final_arguments(span: CallSpan, text: str) -> Optional[str]:
    """The arguments of a complete span given as a JSON string (decoded); None for an object."""
    if span.args_start is None or span.args_end is None or text[span.args_start] != '"':
        return None
    value = json.loads(text[span.args_start : span.args_end])
    return value if isinstance(value, str) else None


# ---------------------------------------------------------------- one request's plan


@dataclass(frozen=True)
class ToolPlan:
    """How a request's outputs are read: None from `tools.calls.plan_for` means plain text."""

    names: frozenset[str]
    forced: bool
    parallel: bool
    forced_name: Optional[str] = None  # the one tool a forced output can call (named, or the only tool)

    def parse(self, text: str) -> ParsedOutput:
        parsed = parse_tool_calls(text, set(self.names))
        if not self.parallel and len(parsed.calls) > 1:  # parallel_tool_calls=false: at most one call
            return ParsedOutput(parsed.content_end, parsed.calls[:1])
        return parsed

    def message(self, text: str, cut: bool = False) -> tuple[dict[str, Any], bool]:
        """The response's `message` for a whole output, and whether it holds calls. `cut`: the output
        ended at max_tokens, so a forced call may be incomplete (it is returned as written so far)."""
        parsed = self.parse(text)
        calls = parsed.calls or (self.cut_calls(text) if cut and self.forced else [])
        if not calls:
            return {"role": "assistant", "content": text}, False
        content = (text[: parsed.content_end].strip() or None) if parsed.calls else None
        return {"role": "assistant", "content": content, "tool_calls": calls}, True

    def cut_calls(self, text: str) -> list[dict[str, Any]]:
        """The calls of a forced output cut short, each with the arguments written so far."""
        region = call_region(text)
        spans = region[1] if region else []
        calls = []
        for span in spans[: None if self.parallel else 1]:
            name = span.name if span.name in self.names else self.forced_name
            if name is None:
                break
            calls.append(tool_call(name, span.arguments_text(text) or ""))
        if not calls and self.forced_name is not None:  # cut before the name: the one tool it can be
            calls.append(tool_call(self.forced_name, ""))
        return calls

    def new_stream(self) -> "ToolCallStream":
        return ToolCallStream(self)


@dataclass
class _StreamedCall:
    id: str
    arguments_sent: int = 0  # characters of its arguments text already sent


@dataclass
class ToolCallStream:
    """One streamed choice of a request with tools (see the module docstring)."""

    plan: ToolPlan
    sent: int = 0  # characters of content sent
    calls: list[_StreamedCall] = field(default_factory=list)

    def update(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """`text` is the choice's cumulative output: the content to send now, and tool_calls delta entries."""
        region = call_region(text)
        spans = _calls_of_offered_tools(region[1], self.plan.names) if region else []
        if not spans:
            return self._content_delta(text), []
        start = region[0]  # type: ignore[index]
        content = text[self.sent : start] if start > self.sent else ""
        self.sent = max(self.sent, start)
        return content, self._deltas(text, spans)

    def finish(self, text: str, cut: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """At the end: the content not sent yet, and the last tool_calls delta entries."""
        if self.calls:  # the calls were streamed: send what is left of them
            region = call_region(text)
            spans = _calls_of_offered_tools(region[1], self.plan.names) if region else []
            deltas = self._deltas(text, spans, final=True)
            return "", deltas
        parsed = self.plan.parse(text)
        calls = parsed.calls or (self.plan.cut_calls(text) if cut and self.plan.forced else [])
        rest = text[self.sent : parsed.content_end] if parsed.calls or not calls else ""
        self.sent = len(text)
        for call in calls:
            self.calls.append(_StreamedCall(call["id"], len(call["function"]["arguments"])))
        return rest, [{"index": k, **call} for k, call in enumerate(calls)]

    @property
    def sent_calls(self) -> bool:
        return bool(self.calls)

    def _deltas(self, text: str, spans: list[CallSpan], final: bool = False) -> list[dict[str, Any]]:
        if not self.plan.parallel:
            spans = spans[:1]
        deltas = []
        for k, span in enumerate(spans):
            arguments = span.arguments_text(text)
            if arguments is None:
                arguments = _final_arguments(span, text) or ""  # given as a JSON string: sent once whole
            if k == len(self.calls):
                self.calls.append(_StreamedCall(new_call_id()))
                head = {
                    "index": k,
                    "id": self.calls[k].id,
                    "type": "function",
                    "function": {"name": span.name, "arguments": arguments},
                }
                self.calls[k].arguments_sent = len(arguments)
                deltas.append(head)
                continue
            piece = arguments[self.calls[k].arguments_sent :]
            if piece:
                self.calls[k].arguments_sent = len(arguments)
                deltas.append({"index": k, "function": {"arguments": piece}})
        return deltas

    def _content_delta(self, text: str) -> str:
        hold = self._hold_from(text)
        delta = text[self.sent : hold] if hold > self.sent else ""
        self.sent = max(self.sent, hold)
        return delta

    def _hold_from(self, text: str) -> int:
        if self.plan.forced:
            return 0
        head = text.lstrip()
        if any(o.startswith(head) or head.startswith(o) for o in _CALL_OPENERS):
            return 0
        marker = text.find(HERMES_OPEN)
        if marker >= 0:
            return marker
        for k in range(min(len(HERMES_OPEN) - 1, len(text)), 0, -1):  # a marker cut by the chunk's end
            if text.endswith(HERMES_OPEN[:k]):
                return len(text) - k
        return len(text)


__all__ = [
    "ARGUMENT_KEYS",
    "HERMES_OPEN",
    "ParsedOutput",
    "ToolCallStream",
    "ToolPlan",
    "arguments_value",
    "parse_tool_calls",
]
