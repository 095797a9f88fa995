"""Per-request state (`Req`) and how a request ended (`FinishReason`): the ground floor every wing of
the scheduler side shares.

A request's tokens are `fill_ids = origin_input_ids + output_ids`. `kv_len` of them have K/V in the
pool: `req_to_token[req_pool_idx, :kv_len]`. Of those, the first `cache_len` belong to the prefix cache
(locked through `last_node`); the rest are the request's private slots. The prefix cache keys them as
`cache_prompt + output_ids`: the same ids, but for a request with a LoRA adapter or a cache salt, whose
first tokens are marked with it (`cache_key_prompt`), so that its prefixes are its namespace's alone, and
with images, whose tokens are marked with their image's hash (`mark_images`): the same image is a prefix
hit, another image never is.
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .detokenizer import IncrementalDetokenizer
from .io_struct import ImageInput, TokenizedGenerateReq
from .request_options import RequestOptions, cache_key_prompt
from .sampling_params import SamplingParams
from .step import SamplingRow

NO_OPTIONS = RequestOptions()  # a request that asks for nothing besides its tokens


@dataclass
class FinishReason:
    type: str  # "stop" | "length" | "abort"
    matched: Any = None  # stop string or token id (type "stop")
    length: int = 0  # type "length"
    message: str = ""  # type "abort"

    def to_json(self) -> dict[str, Any]:
        if self.type == "stop":
            return {"type": "stop", "matched": self.matched}
        if self.type == "length":
            return {"type": "length", "length": self.length}
        return {"type": "abort", "message": self.message}


class Req:
    """One request in the scheduler. `options` are the request's options as its caller built them (logprobs,
    streaming, group; `options.rid`, when set, is `rid`); the fields read every step are copied out of them."""

    def __init__(
        self,
        rid: str,
        input_ids: list[int],
        sampling_params: SamplingParams,
        options: RequestOptions = NO_OPTIONS,
        *,
        tokenizer=None,
        eos_token_ids: tuple[int, ...] = (),
        defer_text: bool = False,
        take_ids: bool = False,
    ):
        self.rid = rid
        # NOTE: with `take_ids` the caller hands its list over (the scheduler's freshly unpickled
        # message): no copy of a long prompt. Nothing here changes it in place.
        self.origin_input_ids = input_ids if take_ids and type(input_ids) is list else list(input_ids)
        self.sampling_params = sampling_params
        self.options = options
        self.return_logprob = return_logprob = options.return_logprob
        # Prompt logprobs are wanted from this prompt position on (-1: none, only output logprobs).
        start = options.logprob_start_len
        self.logprob_start_len = min(start, len(input_ids)) if return_logprob and start >= 0 else len(input_ids)
        self.top_logprobs_num = options.top_logprobs_num
        self.return_text_in_logprobs = options.return_text_in_logprobs
        self.stream = stream = options.stream
        self.group = options.group  # program / fork group id (scheduling hint)
        self.priority = options.priority  # lower first among the waiting (vLLM's convention)
        self.lora_path = options.lora_path  # the LoRA adapter's name, or None (the base model)
        self.images: tuple[ImageInput, ...] = ()  # a vision model's images (their tokens are in the prompt)
        self.cache_prompt = cache_key_prompt(self.origin_input_ids, options.lora_path, options.cache_salt)
        # NOTE: never rebound (append, extend, del in place): the sampling row shares this list.
        self.output_ids: list[int] = []
        self.finished_reason: Optional[FinishReason] = None
        self.stop_token_ids = set(sampling_params.stop_token_ids or [])
        if not sampling_params.ignore_eos:
            self.stop_token_ids |= set(eos_token_ids)
        self.eos_token_ids = set(eos_token_ids)
        self.stop_regexes = [re.compile(p) for p in sampling_params.stop_regexes]
        # Per-token stop checks read these, not sampling_params (set once: the params do not change).
        self.checks_text = bool(sampling_params.stop_strs or self.stop_regexes)
        max_new = sampling_params.max_new_tokens
        self.max_new_tokens = sys.maxsize if max_new is None else max_new
        # With `defer_text`, text nobody reads while the request runs (not streamed, no stop strings or
        # regexes, no grammar) is decoded by the receiver of the final output instead: the detokenizer
        # here only collects the ids it would have decoded (see io_struct.DeferredText).
        self.defer_text = (
            defer_text
            and tokenizer is not None
            and not stream
            and not self.checks_text
            and sampling_params.grammar_key is None
        )
        self.detok = IncrementalDetokenizer(None if self.defer_text else tokenizer, sampling_params.skip_special_tokens)
        self.sent_text_len = 0  # characters of detok.text already sent to the caller
        self.sent_ids = 0
        self.final_text: Optional[str] = None  # text after stop trimming, once finished

        # Memory
        self.req_pool_idx: Optional[int] = None
        self.kv_len = 0
        self.cache_len = 0
        self.last_node: Any = None
        # lpm: the prefix cache's last lookup of the waiting request's ids, reused while still current.
        self.rank_peek: Any = None
        self.prefix_len_this_step = 0
        self.extend_len_this_step = 0
        self.is_chunked = False  # mid-way through a chunked prefill
        self.cached_tokens = 0  # prompt tokens served from the prefix cache (reported)
        self.cached_tokens_host: Optional[int] = None  # of those, loaded back from a host tier (None: no tier)
        self.host_tokens_loading = 0  # loaded back for it while it waited for the copy (a held load)
        self.num_retractions = 0
        self.inflight_slot: Optional[int] = None  # overlap: kv slot of a launched, unprocessed step

        # Logprobs, accumulated as (logprob, token_id) pairs; top lists as [(logprob, token_id)]
        self.input_token_logprobs: list = []
        self.input_top_logprobs: list = []
        self.output_token_logprobs: list = []
        self.output_top_logprobs: list = []
        self.sent_input_logprobs = 0
        # Next prompt position whose logprob is still to compute (survives retraction).
        self.input_logprob_next = self.logprob_start_len
        self.sent_output_logprobs = 0

        # What sampling reads (the step runner's view of this request): the parameters, the token lists
        # (the same list objects), the stop ids, the generator and the grammar matcher.
        self.sampling = SamplingRow(
            sampling_params,
            self.origin_input_ids,
            self.output_ids,
            self.stop_token_ids,
            return_logprob,
            self.top_logprobs_num,
        )
        self.grammar: Any = None  # per-request grammar matcher (constrained decoding), or None: set_grammar
        self.grammar_future: Any = None  # the matcher's compile, while it runs
        self.spec: Any = None  # speculative decoding's state of the request (scheduler/speculation.py), or None
        self.status: Any = None  # the scheduler's ReqStatus (scheduler/queues.py) while it holds the request
        self.created = time.monotonic()
        self.first_token_time: Optional[float] = None

    @classmethod
    def of(cls, message: TokenizedGenerateReq, tokenizer: Any, eos_token_ids: tuple[int, ...]) -> "Req":
        """The scheduler's request for a message from the tokenizer manager: its ids taken over (the message is
        dropped after this), its text left to the receiver when nobody reads it before the end."""
        req = cls(
            message.options.rid,  # type: ignore[arg-type]
            message.input_ids,
            message.sampling_params,
            message.options,
            tokenizer=tokenizer,
            eos_token_ids=eos_token_ids,
            defer_text=True,
            take_ids=True,
        )
        if message.images:
            req.images = message.images
            req.cache_prompt = mark_images(req.cache_prompt, message.images)
        return req

    def set_grammar(self, matcher: Any) -> None:
        """The request's grammar matcher, for the scheduler and for sampling."""
        self.grammar = self.sampling.grammar = matcher

    def set_generator(self, gen: Optional[torch.Generator]) -> None:
        """A seeded request's own generator (its samples reproduce exactly): sampling draws from it."""
        self.sampling.generator = gen

    # ---- token views ----
    @property
    def fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def cache_fill_ids(self) -> list[int]:
        """`fill_ids` as the prefix cache keys them (see the module's docstring)."""
        return self.cache_prompt + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def prefill_only(self) -> bool:
        return self.sampling_params.max_new_tokens == 0

    def remaining_new_tokens(self) -> int:
        return max(0, self.max_new_tokens - len(self.output_ids))

    def needs_input_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len < len(self.origin_input_ids)

    def reset_for_retract(self) -> None:
        self.req_pool_idx = None
        self.kv_len = 0
        self.cache_len = 0
        self.last_node = None
        self.is_chunked = False
        self.num_retractions += 1


def mark_images(cache_ids: list[int], images: tuple[ImageInput, ...]) -> list[int]:
    """`cache_ids` with each image's tokens carrying 31 bits of its hash above bit 32 (xor'ed with a
    namespace's mark, if any, so both stay in the key): every image token is the same placeholder id, so
    without its image in the key two different images would share a cached prefix."""
    ids = list(cache_ids)
    for image in images:
        mark = ((image.hash & 0x7FFFFFFF) | 1) << 32
        for i in range(image.offset, image.offset + image.length):
            ids[i] ^= mark
    return ids
