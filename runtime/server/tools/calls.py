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
- The output is read back into `tool_calls` by tools/parser.py (whole, or streamed as OpenAI does).
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any, Optional

from ..errors import APIError
from ..protocol.openai import ChatCompletionRequest, ChatMessage
from ..protocol.tools import NamedToolChoice, Tool
from .parser import ToolPlan, arguments_value

GENERIC_TOOLS_INTRO = "You can call these tools (functions), given as JSON with their parameters' JSON schema:"
GENERIC_TOOLS_HOWTO = (
    'To call a tool, answer with only a JSON object {"name": <tool name>, "arguments": <an object '
    "matching its parameters>}, or a JSON list of such objects to call several tools. Otherwise answer "
    "in plain text."
)


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
        prompt = generic_tools_prompt(offered)
        if messages and messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": messages[0]["content"] + "\n\n" + prompt}
        else:
            messages.insert(0, {"role": "system", "content": prompt})
        _ask_for_the_call(messages, req.effective_tool_choice)
    return messages, {}


def _ask_for_the_call(messages: list[dict[str, Any]], choice: Any) -> None:
    """A forcing tool_choice, said in the last user turn.
    NOTE: not in the system message, which every turn of a conversation shares: there it made the prompt of an
    agent's next (unforced) turn differ from the first token on, so nothing of the conversation was reused
    from the prefix cache."""
    if choice == "required":
        ask = "You must call at least one tool now."
    elif isinstance(choice, NamedToolChoice):
        ask = f'You must call the tool "{choice.function.name}" now.'
    else:
        return
    last_user = next((m for m in reversed(messages) if m["role"] == "user"), messages[0])
    last_user["content"] = f"{last_user['content']}\n\n{ask}"


def generic_tools_prompt(tools: list[Tool]) -> str:
    lines = [GENERIC_TOOLS_INTRO]
    lines += [
        json.dumps(t.function.model_dump(exclude={"strict"}, exclude_none=True), ensure_ascii=False) for t in tools
    ]
    lines.append(GENERIC_TOOLS_HOWTO)
    return "\n".join(lines)


def _role(message: ChatMessage) -> str:
    return "system" if message.role == "developer" else message.role


def _native_message(message: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": _role(message), "content": message.text()}
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.function.name, "arguments": arguments_value(c.function.arguments)},
            }
            for c in message.tool_calls
        ]
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
            calls = [
                {"name": c.function.name, "arguments": arguments_value(c.function.arguments)} for c in m.tool_calls
            ]
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
            raise APIError(
                400, f"{where} must describe a JSON object (type 'object'): arguments are an object", param="tools"
            )
        from ...constrained.validation import validate_constraint  # (not at import: server_context.warm_validators)

        try:
            warnings = validate_constraint("json", json.dumps(fn.parameters), backend)
        except ValueError as e:
            message = str(e).replace("json_schema", "the schema", 1)  # the backend's words for response_format
            raise APIError(400, f"{where}: {message}", param="tools") from None
        if warnings and fn.strict:
            raise APIError(
                400,
                f"{where} has strict=true, but " + "; ".join(warnings) + " (set strict=false for best effort)",
                param="tools",
            )
    # NOTE: response_format is not refused: it shapes the final answer, and agent frameworks send it on
    # every turn, forced ones included (as OpenAI and vLLM accept it); a forced turn's output is calls.
    if forcing(req) and (req.regex is not None or req.ebnf is not None):
        raise APIError(
            400,
            "tool_choice 'required' or a named function constrains the output to tool calls; "
            "it cannot be combined with regex or ebnf",
            param="tool_choice",
        )


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
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": tools[i].function.name}, "arguments": {"$ref": f"#/$defs/tool_{i}"}},
            "required": ["name", "arguments"],
        }
        for i in indices
    ]
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
    if set(parameters) <= _NO_ARGUMENT_KEYS and not parameters.get("properties") and not parameters.get("required"):
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


def plan_for(req: ChatCompletionRequest) -> Optional[ToolPlan]:
    """How the outputs are read back (tools/parser.py); None: plain text (no tools, or "none")."""
    if not req.tools or req.effective_tool_choice == "none":
        return None
    names = [t.function.name for t in req.tools]
    choice = req.effective_tool_choice
    forced_name = (
        choice.function.name
        if isinstance(choice, NamedToolChoice)
        else names[0]
        if choice == "required" and len(names) == 1
        else None
    )
    return ToolPlan(frozenset(names), forcing(req), req.parallel_tool_calls is not False, forced_name)
