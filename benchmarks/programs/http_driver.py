"""The HTTP driver of paper_programs.py: the same programs through plait's OpenAI backend as a completion model
(one call per gen, one per select), against `plait serve` or `vllm serve`, counting what the requests used;
and the servers' model name and cache flush.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from plait.backend.openai_backend import OpenAI


class CountingUsage:
    """What an OpenAI backend's requests used: prompt, cached (where reported) and completion tokens.
    A select's one-token completions are not output (in-process, select generates nothing)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.selecting = threading.local()
        self.reset()

    def reset(self) -> None:
        self.prompt_tokens = self.completion_tokens = self.cached_tokens = self.requests = 0
        self.cached_reported = False

    def add(self, usage: Any) -> None:
        if usage is None:
            return
        details = getattr(usage, "prompt_tokens_details", None)
        cached = getattr(details, "cached_tokens", None) if details is not None else None
        with self._lock:  # run_batch's programs report from their own threads
            self.requests += 1
            self.prompt_tokens += usage.prompt_tokens or 0
            if not getattr(self.selecting, "on", False):
                self.completion_tokens += usage.completion_tokens or 0
            if cached is not None:
                self.cached_reported = True
                self.cached_tokens += cached


class CompletionDriver(OpenAI):
    """plait's OpenAI backend as a completion model, counting usage; `regex_key="structured_outputs"`
    sends regex fields as vLLM (>= 0.12) reads them."""

    def __init__(self, base_url: str, regex_key: str = "regex") -> None:
        super().__init__("m", is_chat_model=False, base_url=base_url, timeout=600, max_retries=0)
        self.regex_key = regex_key
        self.token_usage = CountingUsage()

    def _request_kwargs(self, params: Any) -> dict:
        kwargs = super()._request_kwargs(params)
        extra = kwargs.get("extra_body") or {}
        if self.regex_key != "regex" and "regex" in extra:
            extra[self.regex_key] = {"regex": extra.pop("regex")}
        return kwargs

    def select(self, s: Any, choices: Any, temperature: float, choices_method: Any) -> Any:
        self.token_usage.selecting.on = True
        try:
            return super().select(s, choices, temperature, choices_method)
        finally:
            self.token_usage.selecting.on = False


def served_model_name(base_url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(base_url.rstrip("/") + "/models", timeout=30) as r:
        return json.load(r)["data"][0]["id"]


def flush_server(base_url: str, plait_server: bool) -> None:
    """Empty the server's prefix cache so each run starts cold: plait's /flush_cache, vLLM's
    /reset_prefix_cache (served with VLLM_SERVER_DEV_MODE=1). Best effort: a server without it says so once."""
    import urllib.error
    import urllib.request

    root = base_url.rstrip("/").removesuffix("/v1")
    path = "/flush_cache" if plait_server else "/reset_prefix_cache"
    for _ in range(100):  # plait refuses while requests are in flight
        try:
            with urllib.request.urlopen(urllib.request.Request(root + path, method="POST"), timeout=60) as r:
                if r.status == 200:
                    return
        except urllib.error.HTTPError as e:
            if e.code in (404, 405):
                print(f"  {root}{path}: {e.code}, runs do not start from an empty cache", flush=True)
                return
        time.sleep(0.1)
