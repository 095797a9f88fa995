"""Generation, streaming and select for the runtimes that take SGLang's native request: a prompt (text or
token ids, one or a batch), one `SamplingParams` and one `RequestOptions`.

The colocated Engine takes those objects as they are; an HTTP server (plait's or SGLang's) gets them
written into a /generate body. Both backends share this logic and differ only in how a request is sent
(`_send`, `_send_stream`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Optional, Sequence, Union

from plait.runtime.request_options import RequestOptions
from plait.runtime.sampling_params import SamplingParams

from ..choices import ChoicesDecision, ChoicesSamplingMethod
from ..gen_params import ResolvedGen
from ..graph_builder import observe_request
from .base import BaseBackend

# A prompt: a text or token ids, or a batch of either (a list of results comes back, in the same order).
Prompt = Union[str, list[int], list[str], list[list[int]]]
PREFILL_ONLY = SamplingParams(max_new_tokens=0)  # a prefix into the prefix cache, nothing generated
SCORE_ONLY = SamplingParams(max_new_tokens=0, temperature=0)  # select()'s prompt logprobs
NO_OPTIONS = RequestOptions()


class NativeBackend(BaseBackend):
    # The LoRA adapter (a name the runtime loaded) of every request whose gen and program name none.
    lora: Optional[str] = None

    # ---- transport, implemented by subclasses ----
    def _send(
        self, prompt: Prompt, sampling: SamplingParams, options: RequestOptions, image_data: Any = None
    ) -> Union[dict, list[dict]]:
        """One generate request: a result ({"text", "meta_info"}), or a list of them for a batch or for
        n > 1 (the runtime expands the samples: request_options.expand_samples). `image_data`: the
        prompt's images (a batch: a list per prompt), or None."""
        raise NotImplementedError

    def _send_stream(
        self, prompt: Union[str, list[int]], sampling: SamplingParams, options: RequestOptions, image_data: Any = None
    ) -> Iterator[tuple[str, dict]]:
        """One streamed request (n == 1): (the new text, meta_info so far) as it comes."""
        raise NotImplementedError

    def _request(
        self, prompt: Prompt, sampling: SamplingParams, options: RequestOptions, images: Sequence[Any] = ()
    ) -> Union[dict, list[dict]]:
        """Send, and turn an aborted request (the runtime refused or dropped it) into an exception.
        Each result's meta_info also goes to the program's request graph (plait.graph). `images`: the
        program's images (`image()`, `video()`), which every prompt of the request holds."""
        out = self._send(prompt, sampling, options, image_data_of(prompt, images))
        for item in out if isinstance(out, list) else [out]:
            raise_if_aborted(item.get("meta_info"))
            observe_request(item.get("meta_info"))
        return out

    def _options(self, s: Any, options: RequestOptions = NO_OPTIONS) -> RequestOptions:
        """`options` with the program a request belongs to as its group: the runtime schedules one
        program's requests (and its forks') together (SGLang servers ignore the field); and the LoRA
        adapter, where the gen names none: the program's (`run(lora=...)`), else this backend's."""
        program_id = getattr(s, "program_id", None)
        if program_id and self.program_hints:
            options = dataclasses.replace(options, group=program_id)
        if options.lora_path is None:
            defaults = getattr(s, "default_sampling_para", None)
            lora = getattr(defaults, "lora_path", None) or self.lora
            if lora is not None:
                options = dataclasses.replace(options, lora_path=lora)
        return options

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
        return self._request(prefix, PREFILL_ONLY, self._options(None))["meta_info"]

    def cache_prefixes(self, prefixes: Sequence[Union[str, list[int]]]) -> list[Optional[dict]]:
        prefixes = [p for p in prefixes if p]
        if len(prefixes) <= 1:
            return [self.cache_prefix(p) for p in prefixes]
        outs = self._request(list(prefixes), PREFILL_ONLY, self._options(None))
        return [o["meta_info"] for o in (outs if isinstance(outs, list) else [outs])]

    def commit_lazy_operations(self, s: Any) -> None:
        # NOTE: without a prefix cache, a prefill ahead of the forks would only be computed again.
        if s.text_ and self.prefix_cache_enabled():
            self._request(s.text_, PREFILL_ONLY, self._options(s), s.images_)

    def generate(self, s: Any, params: ResolvedGen):
        out = self._request(s.text_, params.sampling, self._options(s, params.options), s.images_)
        if params.sampling.n > 1:  # the runtime gives sample k seed + k, as for any caller
            return [o["text"] for o in out], [o["meta_info"] for o in out]
        if isinstance(out, list):  # a server that answers a single prompt with a one-item list
            out = out[0]
        return out["text"], out["meta_info"]

    def generate_stream(self, s: Any, params: ResolvedGen) -> Iterator[tuple[str, dict]]:
        if params.sampling.n > 1:
            raise ValueError("gen(n > 1) cannot stream; run the program with stream=False")
        meta = None
        options = self._options(s, params.options)
        for piece, meta in self._send_stream(s.text_, params.sampling, options, image_data_of(s.text_, s.images_)):
            raise_if_aborted(meta)
            yield piece, meta
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
        tagged = self._options(s)
        images = s.images_
        prefix_tokens = (
            self._request(prefix, PREFILL_ONLY, tagged, images)["meta_info"]["prompt_tokens"] if prefix else 0
        )
        # 2. Score every choice in one batched request. Logprobs start one token before the end of
        #    the prefix: the prefix's last token may merge with the choice's first ("A: " + "Paris"
        #    tokenizes as "A:" + " Paris"), and then it belongs to the choice (token healing).
        #    The prefix itself goes last: its last token's id tells a choice that merged with it from
        #    one that starts after it (a token's text cannot: a piece of a multi-byte character, as in
        #    "日" = two tokens, decodes to "\ufffd").
        outs = self._request(
            [prefix + c for c in choices] + ([prefix] if prefix else []),
            SCORE_ONLY,
            dataclasses.replace(
                tagged, return_logprob=True, return_text_in_logprobs=True, logprob_start_len=max(prefix_tokens - 2, 0)
            ),
            images,
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
                [[tok[1] for tok in lps] for lps in input_logprobs],
                PREFILL_ONLY,
                dataclasses.replace(tagged, return_logprob=True, logprob_start_len=0),
            )
            unconditional = [o["meta_info"]["input_token_logprobs"] for o in uncond]
        return choices_method(
            choices=list(choices),
            normalized_prompt_logprobs=normalized,
            input_token_logprobs=input_logprobs,
            output_token_logprobs=output_logprobs,
            unconditional_token_logprobs=unconditional,
        )


def image_data_of(prompt: Prompt, images: Sequence[Any]) -> Any:
    """A request's image_data: None without images; the images for one prompt; for a batch, the same
    images for each prompt (every prompt of a program's batch extends the same text)."""
    if not images:
        return None
    is_batch = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
    return [list(images) for _ in prompt] if is_batch else list(images)


def is_text(prompt: Prompt) -> bool:
    """Whether a prompt is text (a string, or a batch of them), not token ids."""
    return isinstance(prompt, str) or (isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str))


def raise_if_aborted(meta_info: Optional[dict]) -> None:
    reason = (meta_info or {}).get("finish_reason") or {}
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
