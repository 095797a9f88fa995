"""RuntimeEndpoint: programs talk to a plait or SGLang server over its native HTTP API
(`/generate`, `/get_model_info`, `/flush_cache`, `/get_server_info`)."""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any, Iterator, Optional, Union

from plait.runtime.request_options import RequestOptions
from plait.runtime.sampling_params import SamplingParams

from ..chat_template import ChatTemplate, chat_template_from_tokenizer, get_chat_template
from ..media import image_base64
from ..pins import PrefixPin
from .http_client import EndpointHTTP
from .native import NativeBackend, Prompt, is_text

logger = logging.getLogger(__name__)


class RuntimeEndpoint(NativeBackend):
    def __init__(
        self,
        base_url: str,
        api_key: Optional[str] = None,
        verify: Any = None,
        chat_template_name: Optional[str] = None,
        timeout: Optional[float] = None,
        program_hints: bool = True,
        lora: Optional[str] = None,
    ) -> None:
        """`lora`: the server's LoRA adapter (its name) of the requests whose gen and program name none."""
        self.http = EndpointHTTP(base_url, api_key, verify, timeout)
        self.base_url = self.http.base_url
        self.model_info = self.http.get("/get_model_info")
        template = get_chat_template(chat_template_name) if chat_template_name else self._template_from_server()
        super().__init__(template)
        self.program_hints = program_hints
        self.lora = lora
        self._server_pins = True  # until the server answers 404: SGLang has no pin routes

    @property
    def api_key(self) -> Optional[str]:
        return self.http.api_key

    def _template_from_server(self) -> ChatTemplate:
        """Load the served model's tokenizer to derive role markup (works when its folder or hub id
        is reachable from here); otherwise fall back to 'default' with a warning."""
        source = self.model_info.get("tokenizer_path") or self.model_info.get("model_path")
        if source:
            try:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(source)
                return chat_template_from_tokenizer(tokenizer, self.get_model_name())
            except Exception as e:  # an unreachable folder or hub id is common for remote servers
                logger.warning(
                    "could not load the tokenizer %r to derive role markup (%s); pass "
                    "chat_template_name=... to choose one",
                    source,
                    e,
                )
        return get_chat_template("default")

    def get_model_name(self) -> str:
        return self.model_info.get("model_path", "")

    def _send(self, prompt: Prompt, sampling: SamplingParams, options: RequestOptions, image_data: Any = None):
        return self.http.post("/generate", generate_body(prompt, sampling, options, image_data)).json()

    def _send_stream(
        self, prompt: Union[str, list[int]], sampling: SamplingParams, options: RequestOptions, image_data: Any = None
    ) -> Iterator[tuple[str, dict]]:
        # NOTE: /generate streams SGLang's cumulative chunks: the new text is what extends the last one.
        seen = 0
        for line in self.http.stream_lines(
            "/generate", {**generate_body(prompt, sampling, options, image_data), "stream": True}
        ):
            if not line.startswith("data:"):
                continue
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk and "text" not in chunk:
                raise RuntimeError(f"{self.base_url}/generate stream failed: {chunk['error']}")
            text = chunk["text"]
            yield text[seen:], chunk["meta_info"]
            seen = max(seen, len(text))

    # ---- prefix pins (plait's /pin_prefix and /unpin_prefix; absent on SGLang servers) ----
    def pin_prefix(self, prefix: Union[str, list[int]]) -> Optional[PrefixPin]:
        if not prefix or not self._server_pins:
            return None
        key = "text" if isinstance(prefix, str) else "input_ids"
        res = self.http.request("POST", "/pin_prefix", {key: prefix})
        if res.status_code in (404, 405):
            self._server_pins = False
            logger.info("%s has no /pin_prefix route: program prefixes are not pinned", self.base_url)
            return None
        self.http.check(res, "/pin_prefix")
        body = res.json()
        if body.get("pin_id") is None:
            return None
        return PrefixPin(body["pin_id"], int(body.get("pinned_tokens") or 0))

    def unpin_prefix(self, pin: PrefixPin) -> None:
        if pin is not None:
            self.http.post("/unpin_prefix", {"pin_id": pin.pin_id})

    # ---- management ----
    def flush_cache(self) -> bool:
        """True when the cache was flushed; False when the server refused because requests are running
        or waiting (HTTP 400 with success false), as Engine.flush_cache answers."""
        res = self.http.request("POST", "/flush_cache")
        if res.status_code == 400 and _json_or_none(res, "success") is False:
            return False
        self.http.check(res, "/flush_cache")
        return True

    def get_server_info(self) -> dict:
        return self.http.get("/get_server_info")

    def kv_free_tokens(self) -> Optional[int]:
        return self.get_server_info().get("free_tokens")


def generate_body(
    prompt: Prompt, sampling: SamplingParams, options: RequestOptions, image_data: Any = None
) -> dict[str, Any]:
    """A /generate body: the prompt as "text" or "input_ids", the sampling parameters that differ from the
    defaults (so SGLang servers, which lack some of plait's fields, accept it), the options set, and the
    images (PIL images and bytes as base64 text)."""
    body: dict[str, Any] = {
        "text" if is_text(prompt) else "input_ids": prompt,
        "sampling_params": sampling_body(sampling),
    }
    for f in dataclasses.fields(RequestOptions):
        value = getattr(options, f.name)
        if value != f.default:
            body[f.name] = value
    if image_data is not None:
        body["image_data"] = [
            [image_base64(i) for i in item] if isinstance(item, list) else image_base64(item) for item in image_data
        ]
    return body


def sampling_body(sampling: SamplingParams) -> dict[str, Any]:
    """`sampling_params` of a /generate body: the fields that differ from SamplingParams' defaults, and
    max_new_tokens and temperature always (a server's own defaults may differ), but the temperature of a
    request that samples nothing (max_new_tokens=0)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(SamplingParams):
        value = getattr(sampling, f.name)
        if value != f.default or f.name == "max_new_tokens" or (f.name == "temperature" and sampling.max_new_tokens):
            out[f.name] = value
    return out


def _json_or_none(res: Any, key: str) -> Any:
    try:
        body = res.json()
    except ValueError:
        return None
    return body.get(key) if isinstance(body, dict) else None
