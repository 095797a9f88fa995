"""RuntimeEndpoint: programs talk to a plait or SGLang server over its native HTTP API
(`/generate`, `/get_model_info`, `/flush_cache`, `/get_server_info`)."""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Union

from ..chat_template import ChatTemplate, chat_template_from_tokenizer, get_chat_template
from ..pins import PrefixPin
from .native import NativeBackend

logger = logging.getLogger(__name__)


class RuntimeEndpoint(NativeBackend):
    def __init__(self, base_url: str, api_key: Optional[str] = None, verify: Any = None,
                 chat_template_name: Optional[str] = None, timeout: Optional[float] = None,
                 program_hints: bool = True) -> None:
        import requests

        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.verify = verify
        self.timeout = timeout
        self.session = requests.Session()
        self.model_info = self._get("/get_model_info")
        template = get_chat_template(chat_template_name) if chat_template_name else self._template_from_server()
        super().__init__(template)
        self.program_hints = program_hints
        self._server_pins = True  # until the server answers 404: SGLang has no pin routes

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
                logger.warning("could not load the tokenizer %r to derive role markup (%s); pass "
                               "chat_template_name=... to choose one", source, e)
        return get_chat_template("default")

    def get_model_name(self) -> str:
        return self.model_info.get("model_path", "")

    # ---- HTTP ----
    def _headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _check(self, res: Any, path: str) -> None:
        if res.status_code != 200:
            try:
                detail: Union[str, dict] = res.json()
            except ValueError:
                detail = res.text
            raise RuntimeError(f"{self.base_url}{path} answered HTTP {res.status_code}: {detail}")

    def _get(self, path: str) -> Any:
        with self._reaching(path):
            res = self.session.get(self.base_url + path, headers=self._headers(), verify=self.verify,
                                   timeout=self.timeout)
        self._check(res, path)
        return res.json()

    def _post(self, path: str, payload: Optional[dict] = None, stream: bool = False) -> Any:
        with self._reaching(path):
            res = self.session.post(self.base_url + path, json=payload or {}, headers=self._headers(),
                                    verify=self.verify, stream=stream, timeout=self.timeout)
        self._check(res, path)
        return res

    @contextmanager
    def _reaching(self, path: str) -> Iterator[None]:
        """Name the server and how to start one when nothing answers (requests' own message is a
        wall of urllib3 internals); the exception type stays requests' ConnectionError."""
        import requests

        try:
            yield
        except requests.exceptions.ConnectionError as e:
            raise requests.exceptions.ConnectionError(
                f"no server answered at {self.base_url}{path}: start one with `python -m plait.runtime.server "
                f"--port PORT` (or SGLang's launch_server), or check the URL") from e

    def _send(self, payload: dict):
        return self._post("/generate", payload).json()

    def _send_stream(self, payload: dict) -> Iterator[dict]:
        res = self._post("/generate", payload, stream=True)
        for line in res.iter_lines(decode_unicode=False):
            line = line.decode("utf-8") if isinstance(line, bytes) else line
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
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
        res = self.session.post(self.base_url + "/pin_prefix", json={key: prefix}, headers=self._headers(),
                                verify=self.verify, timeout=self.timeout)
        if res.status_code in (404, 405):
            self._server_pins = False
            logger.info("%s has no /pin_prefix route: program prefixes are not pinned", self.base_url)
            return None
        self._check(res, "/pin_prefix")
        body = res.json()
        if body.get("pin_id") is None:
            return None
        return PrefixPin(body["pin_id"], int(body.get("pinned_tokens") or 0))

    def unpin_prefix(self, pin: PrefixPin) -> None:
        if pin is not None:
            self._post("/unpin_prefix", {"pin_id": pin.pin_id})

    # ---- management ----
    def flush_cache(self) -> Any:
        res = self._post("/flush_cache")
        return res.text

    def get_server_info(self) -> dict:
        return self._get("/get_server_info")
