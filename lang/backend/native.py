"""Generation, streaming and select over SGLang's native `/generate` request shape.

The colocated Engine and an HTTP server (plait's or SGLang's) take the same request dict, so both
backends share this logic and differ only in how a dict is sent (`_send`, `_send_stream`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Optional, Sequence, Union

from ..choices import ChoicesDecision, ChoicesSamplingMethod
from ..gen_params import ResolvedGen
from ..global_config import global_config
from ..graph_builder import observe_request
from .base import BaseBackend

PREFILL_ONLY = {"max_new_tokens": 0}


class NativeBackend(BaseBackend):
    # ---- transport, implemented by subclasses ----
    def _send(self, payload: dict) -> Union[dict, list[dict]]:
        """One /generate request; a list of prompts gives a list of results in the same order."""
        raise NotImplementedError

    def _send_stream(self, payload: dict) -> Iterator[dict]:
        """A streaming /generate request: cumulative results ({"text": all so far, "meta_info"})."""
        raise NotImplementedError

    def _request(self, payload: dict) -> Union[dict, list[dict]]:
        """Send, and turn an aborted request (the runtime refused or dropped it) into an exception.
        Each result's meta_info also goes to the program's request graph (plait.graph)."""
        out = self._send(payload)
        for item in out if isinstance(out, list) else [out]:
            raise_if_aborted(item)
            observe_request(item.get("meta_info"))
        return out

    def _request_tags(self, s: Any) -> dict:
        """Extra request fields naming the program a request belongs to: the runtime schedules one
        program's requests (and its forks') together. SGLang servers ignore the field."""
        program_id = getattr(s, "program_id", None)
        return {"group": program_id} if program_id and self.program_hints else {}

    def prefix_cache_enabled(self) -> bool:
        return not bool(self._server_setting("disable_radix_cache", False))

    def kv_pool_tokens(self) -> Optional[int]:
        return self._server_setting("max_total_tokens", None)

    def _server_setting(self, name: str, default: Any) -> Any:
        """A runtime setting from get_server_info(), read once (None/defaults where it fails)."""
        info = getattr(self, "_server_info_cache", None)
        if info is None:
            try:
                info = self.get_server_info() or {}
            except Exception:  # a server without the route: assume the defaults
                info = {}
            self._server_info_cache = info
        value = info.get(name, default)
        return default if value is None else value

    # ---- the backend interface ----
    def cache_prefix(self, prefix: Union[str, list[int]]) -> Optional[dict]:
        if not prefix:
            return None
        key = "text" if isinstance(prefix, str) else "input_ids"
        return self._request({key: prefix, "sampling_params": dict(PREFILL_ONLY)})["meta_info"]

    def cache_prefixes(self, prefixes: Sequence[Union[str, list[int]]]) -> list[Optional[dict]]:
        prefixes = [p for p in prefixes if p]
        if len(prefixes) <= 1:
            return [self.cache_prefix(p) for p in prefixes]
        key = "text" if isinstance(prefixes[0], str) else "input_ids"
        outs = self._request({key: list(prefixes), "sampling_params": dict(PREFILL_ONLY)})
        return [o["meta_info"] for o in (outs if isinstance(outs, list) else [outs])]

    def commit_lazy_operations(self, s: Any) -> None:
        # NOTE: without a prefix cache, a prefill ahead of the forks would only be computed again.
        if s.text_ and self.prefix_cache_enabled():
            self._request({"text": s.text_, "sampling_params": dict(PREFILL_ONLY), **self._request_tags(s)})

    def generate(self, s: Any, params: ResolvedGen):
        n = params.sampling.n
        if n > 1:
            # n samples = n copies of the prompt in one batch: every runtime batches a list, and
            # the copies share the prompt's prefix in the cache.
            single = ResolvedGen(dataclasses.replace(params.sampling, n=1), params.logprob, params.dtype)
            outs = self._request(self._payload(s, [s.text_] * n, single))
            return [o["text"] for o in outs], [o["meta_info"] for o in outs]
        out = self._request(self._payload(s, s.text_, params))
        if isinstance(out, list):  # a server that answers a single prompt with a one-item list
            out = out[0]
        return out["text"], out["meta_info"]

    def generate_stream(self, s: Any, params: ResolvedGen) -> Iterator[tuple[str, dict]]:
        if params.sampling.n > 1:
            raise ValueError("gen(n > 1) cannot stream; run the program with stream=False")
        payload = self._payload(s, s.text_, params)
        payload["stream"] = True
        seen = 0
        meta = None
        for chunk in self._send_stream(payload):
            raise_if_aborted(chunk)
            text, meta = chunk["text"], chunk["meta_info"]
            yield text[seen:], meta
            seen = len(text)
        observe_request(meta)

    def select(
        self, s: Any, choices: Sequence[str], temperature: float, choices_method: ChoicesSamplingMethod
    ) -> ChoicesDecision:
        if temperature > 1e-5:
            raise ValueError(f"select() scores choices by likelihood and needs temperature=0, got {temperature}")
        if not choices:
            raise ValueError("select() needs a non-empty list of choices")
        prefix = s.text_
        # 1. Prefill the shared prefix once; the batch below then hits it in the prefix cache.
        tags = self._request_tags(s)
        prefix_tokens = (
            self._request({"text": prefix, "sampling_params": dict(PREFILL_ONLY), **tags})["meta_info"]["prompt_tokens"]
            if prefix
            else 0
        )
        # 2. Score every choice in one batched request. Logprobs start one token before the end of
        #    the prefix: the prefix's last token may merge with the choice's first ("A: " + "Paris"
        #    tokenizes as "A:" + " Paris"), and then it belongs to the choice (token healing).
        #    The prefix itself goes last: its last token's id tells a choice that merged with it from
        #    one that starts after it (a token's text cannot: a piece of a multi-byte character, as in
        #    "日" = two tokens, decodes to "\ufffd").
        outs = self._request(
            {
                "text": [prefix + c for c in choices] + ([prefix] if prefix else []),
                "sampling_params": {**PREFILL_ONLY, "temperature": 0},
                "return_logprob": True,
                "return_text_in_logprobs": True,
                "logprob_start_len": max(prefix_tokens - 2, 0),
                **tags,
            }
        )
        prefix_last_id = outs.pop()["meta_info"]["input_token_logprobs"][-1][1] if prefix else None
        input_logprobs = [choice_token_logprobs(o["meta_info"], prefix, prefix_tokens, prefix_last_id) for o in outs]
        for choice, entries in zip(choices, input_logprobs):
            if all(entry[0] is None for entry in entries):
                # NOTE: only without text before the select: the prompt's first token has no logprob, so
                # a one-token choice scored -inf and any longer choice won, whatever the model thought.
                raise ValueError(
                    f"select(): the model cannot score choice {choice!r}: with no text before "
                    f"select(), a choice's first token has nothing to be predicted from; put "
                    f"some text (a question, a role) before it"
                )
        output_logprobs = [o["meta_info"].get("output_token_logprobs", []) for o in outs]
        normalized = [mean_logprob(lps) for lps in input_logprobs]
        unconditional = None
        if choices_method.requires_unconditional_logprobs:
            uncond = self._request(
                {
                    "input_ids": [[tok[1] for tok in lps] for lps in input_logprobs],
                    "sampling_params": dict(PREFILL_ONLY),
                    "return_logprob": True,
                    "logprob_start_len": 0,
                    **tags,
                }
            )
            unconditional = [o["meta_info"]["input_token_logprobs"] for o in uncond]
        return choices_method(
            choices=list(choices),
            normalized_prompt_logprobs=normalized,
            input_token_logprobs=input_logprobs,
            output_token_logprobs=output_logprobs,
            unconditional_token_logprobs=unconditional,
        )

    # ---- helpers ----
    def _payload(self, s: Any, text: Union[str, list[str]], params: ResolvedGen) -> dict:
        sampling = params.request_sampling_dict()
        if not global_config.skip_special_tokens_in_output:
            sampling["skip_special_tokens"] = False
        if not global_config.spaces_between_special_tokens_in_out:
            sampling["spaces_between_special_tokens"] = False
        return {"text": text, "sampling_params": sampling, **params.logprob, **self._request_tags(s)}


def raise_if_aborted(result: dict) -> None:
    reason = (result.get("meta_info") or {}).get("finish_reason") or {}
    if isinstance(reason, dict) and reason.get("type") == "abort":
        raise RuntimeError(f"the runtime aborted the request: {reason.get('message', 'no reason given')}")


def choice_token_logprobs(
    meta_info: dict, prefix: str, prefix_tokens: int, prefix_last_id: Optional[int] = None
) -> list:
    """The (logprob, token_id, text) entries of one choice's tokens.

    The entries cover the last positions of prefix+choice, whatever logprob_start_len convention the
    runtime uses; the choice starts at the prefix's last token position (healing) unless that token
    is still the prefix's own last token (`prefix_last_id`; without it, judged by its text), in which
    case it is dropped.
    """
    entries = list(meta_info["input_token_logprobs"])
    total = meta_info["prompt_tokens"]
    start = max(prefix_tokens - 1, 0)
    keep = total - start
    if keep > len(entries):
        raise RuntimeError(
            f"the runtime returned {len(entries)} input logprobs for a {total}-token prompt; "
            f"select() needs the last {keep}"
        )
    entries = entries[len(entries) - keep :]
    if prefix_tokens > 0 and entries and len(entries) > 1:
        if prefix_last_id is not None:
            unmerged = entries[0][1] == prefix_last_id
        else:
            first_text = entries[0][2] if len(entries[0]) > 2 else None
            unmerged = first_text is not None and prefix.endswith(first_text)
        if unmerged:
            entries = entries[1:]
    return entries


def mean_logprob(entries: Sequence[Sequence[Any]]) -> float:
    values = [e[0] for e in entries if e[0] is not None]
    return sum(values) / len(values) if values else float("-inf")
