"""OpenAI tool calling on /v1/chat/completions: tools into the prompt, tool_choice into a constraint,
the model's output back into `tool_calls`.

- Prompt. A chat template that reads the `tools` variable (Qwen2.5, Hermes, Llama-3.1, ...) gets the
  tools, and the history's `tool_calls` / `tool` messages, in OpenAI's shape (arguments as objects, as
  those templates expect). Any other template (the embedded SmolLM2's) gets the generic rendering: a
  system message listing the tools and asking for `{"name": ..., "arguments": {...}}` (or a list of
  them); earlier calls rendered as that JSON in the assistant turn; tool results as user turns.
- tool_choice "required" / named: the output is constrained by a JSON schema built from the tools'
  parameter schemas (`call_schema`), so the arguments always parse and match. "auto": the output is
  parsed; anything that is not a whole call stays text. "none": no tools offered, nothing parsed.
- Parsing accepts the generic JSON (one call, a list, or calls one after another), Llama-3.1's
  `{"name", "parameters"}` (after an optional `<|python_tag|>`), Mistral's `[TOOL_CALLS]` prefix, a
  ```json fence, and Hermes/Qwen `<tool_call>{...}</tool_call>` blocks after some text.
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from ..constrained import validate_constraint
from .errors import APIError
from .protocol import ChatCompletionRequest, ChatMessage
from .protocol_tools import NamedToolChoice, Tool

GENERIC_TOOLS_INTRO = "You can call these tools (functions), given as JSON with their parameters' JSON schema:"
GENERIC_TOOLS_HOWTO = (
    'To call a tool, answer with only a JSON object {"name": <tool name>, "arguments": <an object '
    "matching its parameters>}, or a JSON list of such objects to call several tools. Otherwise answer "
    "in plain text.")
HERMES_OPEN = "<tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)
_CALL_PREFIXES = ("<|python_tag|>", "[TOOL_CALLS]")
_FENCE = re.compile(r"```(?:json)?\s*(.*?)\s*```", re.S)
# How an auto-mode output that is a call begins; a stream holds such text back until it can tell.
_CALL_OPENERS = ("{", "[", "```", HERMES_OPEN, *_CALL_PREFIXES)


# ---------------------------------------------------------------- prompt rendering

def template_reads_tools(tokenizer: Any) -> bool:
    """Whether the chat template uses the `tools` variable (then it knows how to show tools and calls)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: transformers picks "tool_use" when tools are given
        template = template.get("tool_use") or template.get("default")
    return isinstance(template, str) and _reads_tools(template)


@functools.lru_cache(maxsize=8)
def _reads_tools(template: str) -> bool:
    # NOTE: cached: every chat request asks, and parsing a long template (Llama-3.1's) costs milliseconds.
    try:
        from jinja2 import Environment, meta

        env = Environment(extensions=["jinja2.ext.loopcontrols"])
        return "tools" in meta.find_undeclared_variables(env.parse(template))
    except Exception:  # a tag only transformers' environment knows ({% generation %}): read the text
        return re.search(r"\btools\b", template) is not None


def render_messages(req: ChatCompletionRequest, tokenizer: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages for `apply_chat_template`, and its extra keyword arguments (`tools=`)."""
    native = template_reads_tools(tokenizer)
    offered = req.tools if req.tools and req.effective_tool_choice != "none" else None
    if native:
        messages = [_native_message(m) for m in req.messages]
        return messages, ({"tools": [t.model_dump(exclude_none=True) for t in offered]} if offered else {})
    messages = _generic_messages(req.messages)
    if offered:
        prompt = generic_tools_prompt(offered, req.effective_tool_choice)
        if messages and messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": messages[0]["content"] + "\n\n" + prompt}
        else:
            messages.insert(0, {"role": "system", "content": prompt})
    return messages, {}


def generic_tools_prompt(tools: list[Tool], choice: Any) -> str:
    lines = [GENERIC_TOOLS_INTRO]
    lines += [json.dumps(t.function.model_dump(exclude={"strict"}, exclude_none=True), ensure_ascii=False)
              for t in tools]
    lines.append(GENERIC_TOOLS_HOWTO)
    if choice == "required":
        lines.append("You must call at least one tool now.")
    elif isinstance(choice, NamedToolChoice):
        lines.append(f'You must call the tool "{choice.function.name}" now.')
    return "\n".join(lines)


def _role(message: ChatMessage) -> str:
    return "system" if message.role == "developer" else message.role


def _arguments_value(arguments: str) -> Any:
    """Arguments as an object for rendering (templates and the generic JSON); text when not JSON."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _native_message(message: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": _role(message), "content": message.text()}
    if message.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.function.name, "arguments": _arguments_value(c.function.arguments)}}
            for c in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out


def _generic_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Plain role/content turns any template renders: calls as the generic JSON in the assistant turn,
    a run of tool results as one user turn (templates that insist on alternating roles accept it)."""
    out: list[dict[str, Any]] = []
    call_names: dict[str, str] = {}
    previous_was_tool = False
    for m in messages:
        text = m.text()
        if m.role == "tool":
            name = m.name or call_names.get(m.tool_call_id or "", "a tool")
            result = f"Result of {name}" + (f" (call {m.tool_call_id})" if m.tool_call_id else "") + f":\n{text}"
            if previous_was_tool:
                out[-1]["content"] += "\n\n" + result
            else:
                out.append({"role": "user", "content": result})
            previous_was_tool = True
            continue
        previous_was_tool = False
        if m.tool_calls:
            calls = [{"name": c.function.name, "arguments": _arguments_value(c.function.arguments)}
                     for c in m.tool_calls]
            call_names.update((c.id, c.function.name) for c in m.tool_calls)
            as_json = json.dumps(calls[0] if len(calls) == 1 else calls, ensure_ascii=False)
            text = f"{text}\n{as_json}" if text else as_json
        out.append({"role": _role(m), "content": text})
    return out


# ---------------------------------------------------------------- checks and the forcing constraint

def check_tools(req: ChatCompletionRequest, backend: str) -> None:
    """400s the request model cannot give: a parameters schema the grammar backend cannot use (checked
    for every tool, as "auto" may still be forced later by a client), unenforceable keywords of a strict
    tool, and a forcing tool_choice combined with regex or ebnf."""
    for i, tool in enumerate(req.tools or []):
        fn = tool.function
        where = f"tools[{i}].function.parameters ('{fn.name}')"
        if fn.parameters is None:
            continue
        if fn.parameters.get("type", "object") != "object":
            raise APIError(400, f"{where} must describe a JSON object (type 'object'): arguments are an "
                                "object", param="tools")
        try:
            warnings = validate_constraint("json", json.dumps(fn.parameters), backend)
        except ValueError as e:
            message = str(e).replace("json_schema", "the schema", 1)  # the backend's words for response_format
            raise APIError(400, f"{where}: {message}", param="tools") from None
        if warnings and fn.strict:
            raise APIError(400, f"{where} has strict=true, but " + "; ".join(warnings)
                           + " (set strict=false for best effort)", param="tools")
    # NOTE: response_format is not refused: it shapes the final answer, and agent frameworks send it on
    # every turn, forced ones included (as OpenAI and vLLM accept it); a forced turn's output is calls.
    if forcing(req) and (req.regex is not None or req.ebnf is not None):
        raise APIError(400, "tool_choice 'required' or a named function constrains the output to tool calls; "
                            "it cannot be combined with regex or ebnf", param="tool_choice")


def forcing(req: ChatCompletionRequest) -> bool:
    choice = req.effective_tool_choice
    return choice == "required" or isinstance(choice, NamedToolChoice)


def call_schema(req: ChatCompletionRequest) -> Optional[dict[str, Any]]:
    """The JSON schema that forces tool calls, or None when tool_choice does not force one.

    Named function: one `{"name": <it>, "arguments": <its parameters>}`. "required": one call of any
    tool (`anyOf`), or with parallel_tool_calls (OpenAI's default) a non-empty list of them. Each tool's
    parameter schema moves whole under `$defs/tool_<i>` and its local `$ref`s are re-pointed there, so
    schemas with their own `$defs` keep working."""
    choice = req.effective_tool_choice
    if not forcing(req):
        return None
    tools = list(req.tools or [])
    indices = range(len(tools))
    if isinstance(choice, NamedToolChoice):
        indices = [next(i for i, t in enumerate(tools) if t.function.name == choice.function.name)]
    defs = {f"tool_{i}": _rebased(tools[i].function.parameters, f"#/$defs/tool_{i}") for i in indices}
    calls = [{"type": "object", "properties": {"name": {"const": tools[i].function.name},
                                                "arguments": {"$ref": f"#/$defs/tool_{i}"}},
              "required": ["name", "arguments"]} for i in indices]
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if choice == "required" and req.parallel_tool_calls is not False:
        return {"$defs": defs, "type": "array", "items": one, "minItems": 1}
    return {"$defs": defs, **one}


# Keys of a parameters schema that declares no arguments (`{}`, `{"type": "object", "properties": {}}`,
# MCP's empty input schemas); any other key (additionalProperties, patternProperties, ...) may open it.
_NO_ARGUMENT_KEYS = frozenset({"type", "properties", "required", "title", "description", "$schema"})
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


def _arguments_schema(parameters: Optional[dict[str, Any]]) -> dict[str, Any]:
    """The schema forced arguments follow. A function without declared parameters takes `{}` (OpenAI:
    no parameters = an empty parameter list).
    NOTE: an object schema without properties admits any object, and the grammar backend leaves it open,
    so forced calls wrote invented keys until max_tokens (the tiny model never closed the object)."""
    if parameters is None:
        return NO_ARGUMENTS
    if (set(parameters) <= _NO_ARGUMENT_KEYS and not parameters.get("properties")
            and not parameters.get("required")):
        return {**parameters, **NO_ARGUMENTS}
    return parameters


def _rebased(parameters: Optional[dict[str, Any]], base: str) -> Any:
    parameters = _arguments_schema(parameters)

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(x) for x in node]
        if not isinstance(node, dict):
            return node
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str) and value.startswith("#"):
                out[key] = base + value[1:]
            elif key in ("enum", "const", "default", "examples"):  # values, not schemas
                out[key] = value
            else:
                out[key] = walk(value)
        return out

    return walk(parameters)


# ---------------------------------------------------------------- parsing the output

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
            body = body[len(prefix):].strip()
    fenced = _FENCE.fullmatch(body)
    calls = _calls_in_json(fenced.group(1) if fenced else body, names)
    return ParsedOutput(0, calls) if calls else ParsedOutput(len(text), [])


def _calls_in_json(body: str, names: set[str]) -> list[dict[str, Any]]:
    """Calls from JSON text: an object, a list of objects, or objects one after another (separated by
    whitespace, ',' or ';'). Empty unless every value is a call of an offered tool."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(body) and body[at] in " \t\r\n,;":
            at += 1
        if at == len(body):
            break
        try:
            value, at = decoder.raw_decode(body, at)
        except ValueError:
            return []
        values.extend(value if isinstance(value, list) else [value])
    calls = []
    for value in values:
        if not isinstance(value, dict) or value.get("name") not in names:
            return []
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):  # some models send the arguments as JSON text, as OpenAI does
            arguments = _arguments_value(arguments)
        if not isinstance(arguments, dict):
            return []
        calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                      "function": {"name": value["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}})
    return calls


# ---------------------------------------------------------------- one request's plan

@dataclass(frozen=True)
class ToolPlan:
    """How a request's outputs are read: None from `plan_for` means plain text (no tools, or "none")."""

    names: frozenset[str]
    forced: bool
    parallel: bool

    def parse(self, text: str) -> ParsedOutput:
        parsed = parse_tool_calls(text, set(self.names))
        if not self.parallel and len(parsed.calls) > 1:  # parallel_tool_calls=false: at most one call
            return ParsedOutput(parsed.content_end, parsed.calls[:1])
        return parsed

    def message(self, text: str) -> tuple[dict[str, Any], bool]:
        """The response's `message` for a whole output, and whether it holds calls."""
        parsed = self.parse(text)
        if not parsed.calls:
            return {"role": "assistant", "content": text}, False
        content = text[:parsed.content_end].strip() or None
        return {"role": "assistant", "content": content, "tool_calls": parsed.calls}, True

    def new_stream(self) -> "ToolCallStream":
        return ToolCallStream(self)


def plan_for(req: ChatCompletionRequest) -> Optional[ToolPlan]:
    if not req.tools or req.effective_tool_choice == "none":
        return None
    return ToolPlan(frozenset(t.function.name for t in req.tools), forcing(req),
                    req.parallel_tool_calls is not False)


@dataclass
class ToolCallStream:
    """One streamed choice: text is sent as content as soon as it cannot be the start of a call; text
    that may be one is held until the output ends, then sent as whole calls (one delta) or as content."""

    plan: ToolPlan
    sent: int = 0

    def content_delta(self, text: str) -> str:
        """`text` is the choice's cumulative output; returns the content safe to send now."""
        hold = self._hold_from(text)
        delta = text[self.sent:hold] if hold > self.sent else ""
        self.sent = max(self.sent, hold)
        return delta

    def finish(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """At the end: the content not sent yet, and the tool_calls delta entries (with their index)."""
        parsed = self.plan.parse(text)
        rest = text[self.sent:parsed.content_end]
        self.sent = len(text)
        return rest, [{"index": k, **call} for k, call in enumerate(parsed.calls)]

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
