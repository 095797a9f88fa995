"""Request bodies of OpenAI tool calling: the `tools` a chat request offers, a `tool_choice` naming one, and
the calls an earlier assistant turn made (sent back in the history). Strict like the rest of protocol/openai.py."""

from __future__ import annotations

import re
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, field_validator

_STRICT = ConfigDict(strict=True, extra="forbid")
_TOOL_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


class FunctionDefinition(BaseModel):
    model_config = _STRICT
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None  # a JSON schema; none = the function takes no arguments
    strict: Optional[bool] = None  # true: keywords the grammar backend cannot enforce are a 400

    @field_validator("name")
    @classmethod
    def _name_shape(cls, name: str) -> str:
        # OpenAI's rule (plus '.' and ':'): the name goes into prompts and into a JSON-schema `const`.
        if not _TOOL_NAME.fullmatch(name):
            raise ValueError(f"tool name {name!r} must be 1-64 characters of a-z, A-Z, 0-9, '_', '-', '.', ':'")
        return name


class Tool(BaseModel):
    """One entry of `tools`: OpenAI's only tool type is "function"."""

    model_config = _STRICT
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(BaseModel):
    model_config = _STRICT
    name: str


class NamedToolChoice(BaseModel):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`: that function must be called."""

    model_config = _STRICT
    type: Literal["function"]
    function: ToolChoiceFunction


class FunctionCall(BaseModel):
    model_config = _STRICT
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    """A call an earlier assistant turn made (`message.tool_calls` sent back in the history)."""

    model_config = _STRICT
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall
    index: Optional[int] = None  # left by clients that assembled the call from stream deltas; unused
