"""Request bodies of SGLang's native routes (`/generate`, `/abort_request`) and plait's own (`/pin_prefix`,
`/unpin_prefix`). Strict like the OpenAI ones in protocol/openai.py: a wrong type is a 400 naming the field.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, model_validator

from .compat import NATIVE, compat_model

_STRICT = ConfigDict(strict=True, extra="forbid")


class GenerateRequest(compat_model(NATIVE)):  # type: ignore[misc]
    """POST /generate. Exactly one of `text` / `input_ids`; a list makes it a batch. The other fields of
    SGLang's GenerateReqInput are accepted as protocol/compat.py says."""

    model_config = ConfigDict(strict=True, extra="allow")

    text: Optional[Union[str, list[str]]] = None
    input_ids: Optional[Union[list[int], list[list[int]]]] = None
    sampling_params: Optional[Union[dict[str, Any], list[dict[str, Any]]]] = None
    rid: Optional[Union[str, list[str]]] = None
    return_logprob: Optional[Union[bool, list[bool]]] = None
    logprob_start_len: Optional[Union[int, list[int]]] = None
    top_logprobs_num: Optional[Union[int, list[int]]] = None
    return_text_in_logprobs: bool = False
    priority: Optional[int] = None  # lower first among waiting requests (vLLM's convention)
    lora_path: Optional[Union[str, list[Optional[str]]]] = None  # a LoRA adapter's name (per prompt in a batch)
    cache_salt: Optional[str] = None  # vLLM's: requests of different salts share no cached prefix
    # A vision model's images (one prompt: an image or a list; a batch: that per prompt), each a file
    # path, a data: URL or base64 (URLs are refused: no network).
    image_data: Optional[Union[str, list[Any]]] = None
    stream: bool = False
    log_metrics: bool = True
    # plait's program hint: requests of one program (and its forks) share a group id, which the
    # `dfs-weight` schedule policy keeps together. SGLang servers ignore the field.
    group: Optional[str] = None

    @model_validator(mode="after")
    def _one_prompt(self) -> "GenerateRequest":
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
