"""Request bodies of the OpenAI routes (SGLang's native ones are in protocol/native.py).

Models are strict (`"5"` is not an int), so a wrong type becomes a 400 that names the field. Nested objects
forbid unknown keys; a request body's unknown top-level fields are ignored with a warning and a response
header, and the fields other servers define are accepted as protocol/compat.py says. Responses are plain dicts built in
`native_api.py` / `openai/outputs.py`: their shapes are fixed by SGLang and OpenAI, and plain dicts
keep the streaming hot path free of model construction.
"""

from __future__ import annotations

from functools import cache
from typing import Any, Literal, Optional, Union, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from .compat import CHAT, COMPLETIONS, compat_model
from .tools import NamedToolChoice, Tool, ToolCall

_STRICT = ConfigDict(strict=True, extra="forbid")
# Top-level request bodies: a field no API defines is ignored (with a warning, protocol.compat.review);
# nested objects stay strict.
_TOP_LEVEL = ConfigDict(strict=True, extra="allow")
# Samples per prompt (OpenAI's limit for n). Each is its own Engine request, built up front.
MAX_N = 64


# ---------------------------------------------------------------- OpenAI


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    name: Optional[str] = None
    description: Optional[str] = None
    # `schema` shadows a BaseModel attribute, hence the alias.
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(BaseModel):
    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_present(self) -> "ResponseFormat":
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("response_format of type 'json_schema' needs json_schema.schema")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: one constraint (openai/structured_outputs.py maps it)."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    # `json` shadows a BaseModel attribute, hence the alias.
    json_: Optional[Union[str, dict[str, Any]]] = Field(default=None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = Field(default=None, min_length=1)
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    # Backend knobs of vLLM's; plait's backend has its own defaults.
    disable_fallback: Optional[bool] = None
    disable_any_whitespace: Optional[bool] = None
    disable_additional_properties: Optional[bool] = None
    whitespace_pattern: Optional[str] = None


class _SamplingExtensions(BaseModel):
    """SGLang's and vLLM's extra sampling fields on the OpenAI routes (sent through `extra_body`)."""

    model_config = _TOP_LEVEL

    model: Optional[str] = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    seed: Optional[int] = None
    presence_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    response_format: Optional[ResponseFormat] = None
    # SGLang extensions
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: Optional[int] = Field(default=None, ge=0)
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    rid: Optional[str] = None
    priority: Optional[int] = None  # vLLM's: lower first among waiting requests
    cache_salt: Optional[str] = None  # vLLM's: requests of different salts share no cached prefix
    stop_regex: Optional[Union[str, list[str]]] = None
    stream_interval: Optional[int] = Field(default=None, ge=1)
    custom_params: Optional[dict[str, Any]] = None
    # vLLM's names
    include_stop_str_in_output: bool = False  # = no_stop_trim
    spaces_between_special_tokens: bool = True
    structured_outputs: Optional[StructuredOutputs] = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """OpenAI declares n, stream, logprobs, echo, ... nullable, and clients that build a body from
        optional settings send `"n": null`: it means the default, as in vLLM. Fields typed Optional keep
        their null, which has a meaning there (max_tokens: the rest of the context)."""
        if not isinstance(data, dict):
            return data
        defaulted = _null_means_default(cls)
        return {k: v for k, v in data.items() if v is not None or k not in defaulted}

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, stop: Optional[Union[str, list[str]]]) -> Optional[Union[str, list[str]]]:
        if isinstance(stop, list) and len(stop) > 16:
            raise ValueError("stop accepts at most 16 sequences")
        return stop

    @field_validator("logit_bias")
    @classmethod
    def _bias_in_range(cls, bias: Optional[dict[str, float]]) -> Optional[dict[str, float]]:
        # OpenAI's range. NOTE: a bias of 1e308 is inf in float32 and made sampling return NaN garbage.
        bad = next(((k, v) for k, v in (bias or {}).items() if not -100.0 <= v <= 100.0), None)
        if bad is not None:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {bad[1]} for token {bad[0]}")
        return bias

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(
        cls, options: Optional[StreamOptions], info: ValidationInfo
    ) -> Optional[StreamOptions]:
        # OpenAI refuses them on a non-streaming request; ignoring them would hide a client bug.
        if options is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return options


@cache
def _null_means_default(model: type[BaseModel]) -> frozenset[str]:
    """The fields of `model` with a default that do not take None."""
    return frozenset(
        name
        for name, f in model.model_fields.items()
        if not f.is_required() and type(None) not in get_args(f.annotation)
    )


class CompletionRequest(_SamplingExtensions, compat_model(COMPLETIONS)):  # type: ignore[misc]
    """POST /v1/completions."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    json_schema: Optional[str] = None  # SGLang's extension (a schema as JSON text)
    max_tokens: Optional[int] = Field(default=16, ge=0)
    logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    # Field validators (not one model validator) so that the error's `param` names the field.
    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and len(prompt) == 0:
            raise ValueError("prompt must not be empty")
        return prompt

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: Optional[str]) -> Optional[str]:
        if suffix:
            raise ValueError("suffix (fill-in-the-middle) is not supported")
        return suffix

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, best_of: Optional[int], info: ValidationInfo) -> Optional[int]:
        if best_of is not None and best_of != info.data.get("n", 1):
            raise ValueError("best_of must equal n (server-side best-of ranking is not supported)")
        return best_of


class TextContentPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ImageUrl(BaseModel):
    model_config = _STRICT
    url: str  # a data: URL (base64); http(s) URLs are refused (the runtime has no network)
    detail: Optional[Literal["auto", "low", "high"]] = None  # accepted; a LLaVA image is one size


class ImageContentPart(BaseModel):
    model_config = _STRICT
    type: Literal["image_url"]
    image_url: ImageUrl


IMAGE_PLACEHOLDER = "<image>"  # an image part in a message's text (the engine expands it to the image's tokens)


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[Union[TextContentPart, ImageContentPart]]]] = None
    name: Optional[str] = None
    tool_call_id: Optional[str] = None
    # What the openai client's `message.model_dump()` puts into a history (assistant turns). The legacy
    # function_call and audio are accepted only empty: without their support they cannot be rendered.
    tool_calls: Optional[list[ToolCall]] = None
    function_call: Optional[dict[str, Any]] = None
    audio: Optional[dict[str, Any]] = None
    refusal: Optional[str] = None  # an assistant turn that refused: its text when there is no content
    annotations: Optional[list[Any]] = None  # citations of a turn; nothing to render
    # A reasoning model's thinking, sent back in the history; templates that read it (Qwen3's) get it.
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_and_image_parts(cls, content: Any) -> Any:
        """Name the problem with a content part instead of pydantic's union noise."""
        if content is None or isinstance(content, str):
            return content
        if not isinstance(content, list):
            raise ValueError("content must be a string or a list of content parts")
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind is None:
                raise ValueError("each content part must be an object with a 'type'")
            if kind not in ("text", "image_url"):
                raise ValueError(
                    f"content parts of type '{kind}' are not supported (plait's vision models take "
                    "images): send parts of type 'text' or 'image_url'"
                )
        return content

    @field_validator("function_call", "audio")
    @classmethod
    def _not_set(cls, value: Any, info: ValidationInfo) -> Any:
        if value:
            raise ValueError(
                "messages with audio are not supported"
                if info.field_name == "audio"
                else "messages with the legacy function_call are not supported: send tool_calls"
            )
        return value

    def text(self) -> str:
        if self.content is None:
            return self.refusal or ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text if isinstance(part, TextContentPart) else IMAGE_PLACEHOLDER for part in self.content)

    def image_urls(self) -> list[str]:
        """The message's images, in order (each where `text()` puts IMAGE_PLACEHOLDER)."""
        if not isinstance(self.content, list):
            return []
        return [part.image_url.url for part in self.content if isinstance(part, ImageContentPart)]


# The "off" values of the legacy function-calling fields (refused otherwise: send tools).
_LEGACY_OFF_VALUES: dict[str, tuple[Any, ...]] = {"function_call": (None, "none", "auto")}
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


class ChatCompletionRequest(_SamplingExtensions, compat_model(CHAT)):  # type: ignore[misc]
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    # Passed to the chat template (as vLLM does); "none" also turns a template's enable_thinking off.
    reasoning_effort: Optional[Union[Literal[REASONING_EFFORTS], float]] = None  # type: ignore[valid-type]
    # vLLM's template controls
    add_generation_prompt: bool = True
    documents: Optional[list[dict[str, Any]]] = None
    add_special_tokens: bool = False
    functions: Optional[list[dict[str, Any]]] = None
    function_call: Optional[Union[str, dict[str, Any]]] = None
    max_tokens: Optional[int] = Field(default=None, ge=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    # Tool calling (runtime/server/tools/calls.py). tool_choice defaults to "auto" with tools, else "none".
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: Optional[bool] = None
    # SGLang extension: continue the last assistant message instead of opening a new one.
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None

    # Field validators (not one model validator) so that the error's `param` names the field.
    @field_validator(*_LEGACY_OFF_VALUES)
    @classmethod
    def _only_off(cls, value: Any, info: ValidationInfo) -> Any:
        if value not in _LEGACY_OFF_VALUES[info.field_name]:
            raise ValueError(
                f"'{info.field_name}' is not supported by plait (legacy): send tools and "
                'tool_choice={"type": "function", "function": {"name": ...}}'
            )
        return value

    @field_validator("functions")
    @classmethod
    def _no_legacy_functions(cls, functions: Optional[list[dict[str, Any]]]) -> Any:
        if functions:
            raise ValueError(
                "the legacy 'functions' field is not supported: send the same definitions as "
                'tools=[{"type": "function", "function": ...}]'
            )
        return functions

    @field_validator("tools")
    @classmethod
    def _distinct_tool_names(cls, tools: Optional[list[Tool]]) -> Optional[list[Tool]]:
        names = [t.function.name for t in tools or []]
        duplicate = next((n for n in names if names.count(n) > 1), None)
        if duplicate is not None:
            raise ValueError(f"two tools are named {duplicate!r}; tool names must be distinct")
        return tools

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_shape(cls, choice: Any) -> Any:
        """One message instead of pydantic's union noise."""
        if choice is None or choice in ("none", "auto", "required"):
            return choice
        try:
            return NamedToolChoice.model_validate(choice)
        except ValidationError:
            raise ValueError(
                'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
            ) from None

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_needs_tools(cls, choice: Any, info: ValidationInfo) -> Any:
        # "none"/"auto" without tools ask for nothing; "required" or a named function without a tool to
        # call would be a silent lie if ignored.
        names = [t.function.name for t in info.data.get("tools") or []]
        if choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(
                f"tool_choice names the function {choice.function.name!r}, which is not among "
                f"the tools ({', '.join(map(repr, names)) or 'none given'})"
            )
        return choice

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, top: Optional[int], info: ValidationInfo) -> Optional[int]:
        if top and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs=true")
        return top

    @field_validator("continue_final_message")
    @classmethod
    def _final_is_assistant(cls, flag: bool, info: ValidationInfo) -> bool:
        messages = info.data.get("messages")
        if flag and messages and messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs the last message to be from the assistant")
        return flag

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_request_template(cls, kwargs: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        # NOTE: the template renders on the event loop, and a sandboxed Jinja template still runs nested
        # loops (100,000 x 100,000 steps): one request's template stalled every client for hours. The
        # model's own template is trusted; a client's is refused, as vLLM does by default.
        if kwargs and "chat_template" in kwargs:
            raise ValueError("a chat template sent with the request is not accepted; the model's own is used")
        return kwargs

    @property
    def effective_tool_choice(self) -> Union[str, NamedToolChoice]:
        """OpenAI's default: "auto" when tools are given, "none" otherwise."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @property
    def max_new_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
