"""LiteLLM: programs on any provider LiteLLM reaches (`litellm.completion`, OpenAI's chat format).

`plait.LiteLLM("provider/model", api_key=..., base_url=...)`: the client settings go with every request.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping, Optional

from ..chat_template import ChatTemplate, get_chat_template_by_model_path
from ..gen_params import ResolvedGen
from .base import BaseBackend
from .chat_api import conversation, import_sdk, refuse_unsupported, stop_list, top_k


class LiteLLM(BaseBackend):
    is_chat_model = True

    def __init__(
        self,
        model_name: str,
        chat_template: Optional[ChatTemplate] = None,
        api_key: Optional[str] = None,
        organization: Optional[str] = None,
        base_url: Optional[str] = None,
        timeout: Optional[float] = 600,
        max_retries: Optional[int] = None,
        default_headers: Optional[Mapping[str, str]] = None,
    ) -> None:
        self.litellm = import_sdk("litellm", "LiteLLM", "litellm")
        super().__init__(chat_template or get_chat_template_by_model_path(model_name))
        self.model_name = model_name
        settings = {
            "api_key": api_key,
            "organization": organization,
            "base_url": base_url,
            "timeout": timeout,
            "max_retries": max_retries,
            "default_headers": default_headers,
        }
        self.client_settings = {k: v for k, v in settings.items() if v is not None}

    def get_model_name(self) -> str:
        return self.model_name

    def _request(self, s: Any, params: ResolvedGen) -> dict:
        refuse_unsupported("LiteLLM", params)
        system, messages = conversation(s)
        if system:
            messages.insert(0, {"role": "system", "content": system})
        sp = params.sampling
        request: dict[str, Any] = {
            "model": self.model_name,
            "messages": messages,
            "max_tokens": sp.max_new_tokens,
            "temperature": sp.temperature,
            "top_p": sp.top_p,
            **self.client_settings,
        }
        for name in ("frequency_penalty", "presence_penalty", "seed"):
            if getattr(sp, name):
                request[name] = getattr(sp, name)
        if top_k(params) is not None:
            request["top_k"] = top_k(params)
        if stop_list(params):
            request["stop"] = stop_list(params)
        return request

    def generate(self, s: Any, params: ResolvedGen) -> tuple[str, dict]:
        ret = self.litellm.completion(**self._request(s, params))
        choice = ret.choices[0]
        usage = getattr(ret, "usage", None)
        return choice.message.content or "", {
            "id": ret.id,
            "finish_reason": choice.finish_reason,
            "prompt_tokens": getattr(usage, "prompt_tokens", None),
            "completion_tokens": getattr(usage, "completion_tokens", None),
        }

    def generate_stream(self, s: Any, params: ResolvedGen) -> Iterator[tuple[str, dict]]:
        for chunk in self.litellm.completion(**self._request(s, params), stream=True):
            piece = chunk.choices[0].delta.content if chunk.choices else None
            if piece:
                yield piece, {}
