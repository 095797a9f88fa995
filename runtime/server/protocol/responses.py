"""The request body of OpenAI's Responses API (POST /v1/responses), strict like protocol/openai.py's models.

Input items are parsed one by one (`input_items`) so that an error names the item (`input[2]`): messages (a
string or text parts), earlier function calls and their outputs. Image, file and audio parts, and item types
of OpenAI's hosted tools, are a 400 that says so.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .compat import RESPONSES, compat_model
from .openai import REASONING_EFFORTS

_STRICT = ConfigDict(strict=True, extra="forbid")
_ITEM = ConfigDict(strict=True, extra="ignore")  # items echoed back from a response carry ids, status, ...


class TextPart(BaseModel):
    model_config = _ITEM
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(BaseModel):
    """An easy input message, an input message, or an output message sent back as input."""

    model_config = _ITEM
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[TextPart]]

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content: Any) -> Any:
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("input_image", "input_file", "input_audio"):
                raise ValueError(
                    f"content parts of type '{kind}' are not supported on /v1/responses (images: send them to "
                    "/v1/chat/completions as image_url parts)"
                )
            if kind == "refusal":
                part["type"], part["text"] = "output_text", part.get("refusal", "")
        return content

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(BaseModel):
    model_config = _ITEM
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(BaseModel):
    model_config = _ITEM
    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, list[TextPart]]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


InputItem = Union[MessageItem, FunctionCallItem, FunctionCallOutputItem]
_ITEM_TYPES: dict[str, type[BaseModel]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
}


def input_items(value: Union[str, list[Any]]) -> list[InputItem]:
    """The request's `input` as items; ValueError naming the item that is not one plait can take."""
    if isinstance(value, str):
        return [MessageItem(role="user", content=value)]
    items: list[InputItem] = []
    for i, raw in enumerate(value):
        kind = raw.get("type", "message") if isinstance(raw, dict) else None
        model = _ITEM_TYPES.get(kind) if isinstance(kind, str) else None
        if model is None:
            what = f"of type '{kind}'" if isinstance(kind, str) else "that is not an object"
            raise ValueError(
                f"input[{i}]: an item {what} is not supported (plait takes messages, function_call "
                "and function_call_output items)"
            )
        items.append(_validated(model, raw, f"input[{i}]"))  # type: ignore[arg-type]
    return items


def _validated(model: type[BaseModel], raw: Any, where: str) -> Any:
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        inside = ".".join(str(p) for p in first["loc"])
        message = str(first["msg"]).removeprefix("Value error, ")
        raise ValueError(f"{where}{'.' + inside if inside else ''}: {message}") from None


class FunctionTool(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class NamedFunction(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = None
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class TextConfig(BaseModel):
    model_config = _STRICT
    format: Optional[TextFormat] = None
    verbosity: Optional[Literal["low", "medium", "high"]] = None


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    effort: Optional[Literal[REASONING_EFFORTS]] = None  # type: ignore[valid-type]
    summary: Optional[str] = None


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_obfuscation: Optional[bool] = None


class ResponsesRequest(compat_model(RESPONSES)):  # type: ignore[misc]
    """POST /v1/responses."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: Optional[str] = None
    input: Union[str, list[Any]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    text: Optional[TextConfig] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedFunction]] = None
    parallel_tool_calls: Optional[bool] = None
    previous_response_id: Optional[str] = None
    store: Optional[bool] = None
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    reasoning: Optional[ReasoningConfig] = None
    # "message.output_text.logprobs" asks for the output's token logprobs (with top_logprobs alternatives
    # each); the other values name outputs plait never makes (file search, images, encrypted reasoning).
    include: Optional[list[str]] = None
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)

    @property
    def wants_logprobs(self) -> bool:
        return "message.output_text.logprobs" in (self.include or ()) or bool(self.top_logprobs)

    @field_validator("input")
    @classmethod
    def _items(cls, value: Union[str, list[Any]]) -> Union[str, list[Any]]:
        items = input_items(value)  # (parsed again by the route; here for the error's `param`)
        if not items:
            raise ValueError("input must not be empty")
        return value

    @field_validator("tools")
    @classmethod
    def _function_tools(cls, tools: Optional[list[dict[str, Any]]]) -> Optional[list[dict[str, Any]]]:
        for i, tool in enumerate(tools or []):
            kind = tool.get("type")
            if kind != "function":
                raise ValueError(
                    f"tools[{i}]: tools of type '{kind}' are not supported (plait runs no hosted "
                    "tools): send function tools"
                )
            _validated(FunctionTool, tool, f"tools[{i}]")
        return tools

    @property
    def function_tools(self) -> list[FunctionTool]:
        return [FunctionTool.model_validate(t) for t in self.tools or []]
