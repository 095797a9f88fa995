"""Anthropic: programs on Claude models through the official `anthropic` SDK (Messages API).

`plait.Anthropic("claude-...", api_key=..., base_url=...)`; keyword arguments go to `anthropic.Anthropic`.
A gen opens or continues an assistant turn; the system turn becomes the request's `system`.
"""

from __future__ import annotations

from typing import Any, Iterator

from ..chat_template import get_chat_template
from ..gen_params import ResolvedGen
from .base import BaseBackend
from .chat_api import conversation, import_sdk, refuse_unsupported, stop_list, top_k


class Anthropic(BaseBackend):
    is_chat_model = True

    def __init__(self, model_name: str, *args: Any, **client_kwargs: Any) -> None:
        anthropic = import_sdk("anthropic", "Anthropic", "anthropic")
        super().__init__(get_chat_template("claude"))
        self.model_name = model_name
        self.client = anthropic.Anthropic(*args, **client_kwargs)

    def get_model_name(self) -> str:
        return self.model_name

    def _request(self, s: Any, params: ResolvedGen) -> dict:
        refuse_unsupported("Anthropic", params)
        system, messages = conversation(s)
        sp = params.sampling
        # NOTE: the sampling fields go as extra_body: recent SDKs no longer list them as arguments (some models
        # refuse them), while the API still reads them from the request's JSON, where this puts them.
        sampling: dict[str, Any] = {"temperature": sp.temperature}
        if sp.top_p < 1.0:
            sampling["top_p"] = sp.top_p
        if top_k(params) is not None:
            sampling["top_k"] = top_k(params)
        request: dict[str, Any] = {
            "model": self.model_name,
            "messages": messages,
            "max_tokens": sp.max_new_tokens,
            "extra_body": sampling,
        }
        if system:
            request["system"] = system
        if stop_list(params):
            request["stop_sequences"] = stop_list(params)
        return request

    def generate(self, s: Any, params: ResolvedGen) -> tuple[str, dict]:
        ret = self.client.messages.create(**self._request(s, params))
        text = "".join(block.text for block in ret.content if block.type == "text")
        return text, {
            "id": ret.id,
            "finish_reason": ret.stop_reason,
            "prompt_tokens": ret.usage.input_tokens,
            "completion_tokens": ret.usage.output_tokens,
        }

    def generate_stream(self, s: Any, params: ResolvedGen) -> Iterator[tuple[str, dict]]:
        with self.client.messages.stream(**self._request(s, params)) as stream:
            for piece in stream.text_stream:
                yield piece, {}
