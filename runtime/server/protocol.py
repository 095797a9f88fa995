"""Request bodies of the HTTP APIs: SGLang's native `/generate` and the OpenAI routes.

Models are strict (`"5"` is not an int) and forbid unknown fields, so a typo or a wrong type becomes a
400 that names the field instead of being silently ignored. Responses are plain dicts built in
`native_api.py` / `openai_responses.py`: their shapes are fixed by SGLang and OpenAI, and plain dicts
keep the streaming hot path free of model construction.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

_STRICT = ConfigDict(strict=True, extra="forbid")


# ---------------------------------------------------------------- SGLang native

# Fields SGLang's clients send that plait does not implement (multimodal, LoRA, disaggregation, ...).
# They are accepted only with their "unset" value, so SGLang's bench/clients work unchanged while a
# request that really needs one of them gets a clear 400 instead of a silent wrong answer.
SGLANG_UNSUPPORTED_FIELDS = (
    "image_data", "video_data", "audio_data", "modalities", "lora_path", "lora_id",
    "return_hidden_states", "custom_logit_processor", "session_params", "bootstrap_host",
    "bootstrap_port", "bootstrap_room", "data_parallel_rank", "input_embeds", "token_ids_logprob",
)


class GenerateRequest(BaseModel):
    """POST /generate. Exactly one of `text` / `input_ids`; a list makes it a batch."""

    model_config = ConfigDict(strict=True, extra="allow")

    text: Optional[Union[str, list[str]]] = None
    input_ids: Optional[Union[list[int], list[list[int]]]] = None
    sampling_params: Optional[Union[dict[str, Any], list[dict[str, Any]]]] = None
    rid: Optional[Union[str, list[str]]] = None
    return_logprob: Optional[Union[bool, list[bool]]] = None
    logprob_start_len: Optional[Union[int, list[int]]] = None
    top_logprobs_num: Optional[Union[int, list[int]]] = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    log_metrics: bool = True
    # plait's program hint: requests of one program (and its forks) share a group id, which the
    # `dfs-weight` schedule policy keeps together. SGLang servers ignore the field.
    group: Optional[str] = None

    @model_validator(mode="after")
    def _check_extras(self) -> "GenerateRequest":
        for name, value in (self.model_extra or {}).items():
            if name not in SGLANG_UNSUPPORTED_FIELDS:
                raise ValueError(f"unknown field '{name}'")
            if value not in (None, False, [], {}, ""):
                raise ValueError(f"field '{name}' is not supported by plait")
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("exactly one of 'text' or 'input_ids' must be given")
        return self

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)

    @property
    def batch_size(self) -> int:
        if not self.is_batch:
            return 1
        return len(self.text if self.text is not None else self.input_ids)


class PinPrefixRequest(BaseModel):
    """POST /pin_prefix (plait only): keep the cached part of a prefix from eviction until unpinned."""

    model_config = _STRICT
    text: Optional[str] = None
    input_ids: Optional[list[int]] = None

    @model_validator(mode="after")
    def _one_prefix(self) -> "PinPrefixRequest":
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("exactly one of 'text' or 'input_ids' must be given")
        if not (self.text if self.text is not None else self.input_ids):
            raise ValueError("the prefix to pin must not be empty")
        return self


class UnpinPrefixRequest(BaseModel):
    model_config = _STRICT
    pin_id: int


class AbortRequest(BaseModel):
    model_config = _STRICT
    rid: Optional[str] = None
    abort_all: bool = False


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


class _SamplingExtensions(BaseModel):
    """SGLang's extra sampling fields on the OpenAI routes (sent through `extra_body`)."""

    model_config = _STRICT

    model: Optional[str] = None
    n: int = Field(default=1, ge=1, le=64)
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

    @model_validator(mode="after")
    def _stop_list(self) -> "_SamplingExtensions":
        if isinstance(self.stop, list) and len(self.stop) > 16:
            raise ValueError("stop accepts at most 16 sequences")
        return self


class CompletionRequest(_SamplingExtensions):
    """POST /v1/completions."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = Field(default=16, ge=0)
    logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    @model_validator(mode="after")
    def _unsupported(self) -> "CompletionRequest":
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of must equal n (server-side best-of ranking is not supported)")
        if isinstance(self.prompt, list) and len(self.prompt) == 0:
            raise ValueError("prompt must not be empty")
        return self


class TextContentPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[TextContentPart]]] = None
    name: Optional[str] = None
    tool_call_id: Optional[str] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingExtensions):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(default=None, ge=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    # Tools are not implemented; accepted only when empty so that clients that always send them work.
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    # SGLang extension: continue the last assistant message instead of opening a new one.
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None

    @model_validator(mode="after")
    def _unsupported(self) -> "ChatCompletionRequest":
        if self.tools:
            raise ValueError("tools are not supported")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs the last message to be from the assistant")
        return self

    @property
    def max_new_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
