"""RuntimeEndpoint: programs talk to a plait or SGLang server over its native HTTP API
(`/generate`, `/get_model_info`, `/flush_cache`, `/get_server_info`)."""

from __future__ import annotations

import json
import logging
from typing import Any, Iterator, Optional, Union

from ..chat_template import ChatTemplate, chat_template_from_tokenizer, get_chat_template
from ..pins import PrefixPin
from .http_client import EndpointHTTP
from .native import NativeBackend

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
    ) -> None:
        self.http = EndpointHTTP(base_url, api_key, verify, timeout)
        self.base_url = self.http.base_url
        self.model_info = self.http.get("/get_model_info")
        template = get_chat_template(chat_template_name) if chat_template_name else self._template_from_server()
        super().__init__(template)
        self.program_hints = program_hints
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

    def _send(self, payload: dict):
        return self.http.post("/generate", payload).json()

    def _send_stream(self, payload: dict) -> Iterator[dict]:
        for line in self.http.stream_lines("/generate", payload):
            if not line.startswith("data:"):
                continue
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk and "text" not in chunk:
                raise RuntimeError(f"{self.base_url}/generate stream failed: {chunk['error']}")
            yield chunk

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


def _json_or_none(res: Any, key: str) -> Any:
    try:
        body = res.json()
    except ValueError:
        return None
    return body.get(key) if isinstance(body, dict) else None
