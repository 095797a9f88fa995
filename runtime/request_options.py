"""RequestOptions: what one request asks for besides its prompt and its sampling, and its samples.

The options (logprobs, streaming, the request id, the scheduling group) are built once from what the
caller passed (`Engine.generate`'s keyword arguments, a /generate body, an OpenAI route, a DSL `gen`) by
`RequestOptions.of`, checked when built (a ValueError naming the field), and carried whole from there to
the scheduler: the tokenizer manager puts them into the scheduler's message (`TokenizedGenerateReq`) and
the scheduler builds its `Req` from them.

`expand_samples` is the one place an n > 1 request becomes its n samples, for the Engine, the HTTP
server and the DSL alike: sample k is request `{rid}-{k}` with n = 1 and seed + k. `new_rid` is the one
maker of request ids. `cache_key_prompt` is a prompt as the prefix cache keys it, in its (LoRA adapter,
cache salt) namespace: here, torch-free, so the data-parallel controller routes by the same keys.
"""

from __future__ import annotations

import dataclasses
import hashlib
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from .sampling_params import SamplingParams


class RequestOptionError(ValueError):
    """A request option is invalid; `field` names it (the HTTP server reports it as the bad param)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, slots=True)
class RequestOptions:
    rid: Optional[str] = None  # None: the tokenizer manager's caller picks a fresh one before expansion
    return_logprob: bool = False
    logprob_start_len: int = -1  # first prompt position with a logprob; -1: none of the prompt's
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    group: Optional[str] = None  # program / fork group: a scheduling and caching hint
    # vLLM's: a waiting request of a lower value is admitted first; equal values keep the schedule policy's order.
    priority: int = 0
    # SGLang's: the LoRA adapter (its name) this request runs with; None: the base model.
    lora_path: Optional[str] = None
    # vLLM's: requests of different salts never share cached prefixes (tenants kept apart).
    cache_salt: Optional[str] = None

    def __post_init__(self) -> None:
        # NOTE: checked here, not in `of`, so every RequestOptions that exists is valid, however built.
        if self.rid is not None and not isinstance(self.rid, str):
            raise RequestOptionError("rid", "rid must be a string (or a list of strings for a batch)")
        start = self.logprob_start_len
        if not isinstance(start, int) or start < -1:
            raise RequestOptionError("logprob_start_len", f"logprob_start_len must be an int >= -1, got {start!r}")
        top = self.top_logprobs_num
        if not isinstance(top, int) or top < 0:
            raise RequestOptionError("top_logprobs_num", f"top_logprobs_num must be an int >= 0, got {top!r}")
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise RequestOptionError("priority", f"priority must be an int, got {self.priority!r}")
        for name in ("lora_path", "cache_salt"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise RequestOptionError(name, f"{name} must be a non-empty string (or null), got {value!r}")

    @classmethod
    def of(
        cls,
        rid: Optional[str] = None,
        return_logprob: Any = False,
        logprob_start_len: Optional[int] = None,
        top_logprobs_num: Optional[int] = None,
        return_text_in_logprobs: Any = False,
        stream: bool = False,
        group: Optional[str] = None,
        priority: Optional[int] = None,
        lora_path: Optional[str] = None,
        cache_salt: Optional[str] = None,
    ) -> "RequestOptions":
        """From SGLang's `generate` arguments, where None means the default and flags are truthy values."""
        return cls(
            rid=rid,
            return_logprob=bool(return_logprob),
            logprob_start_len=-1 if logprob_start_len is None else logprob_start_len,
            top_logprobs_num=top_logprobs_num or 0,
            return_text_in_logprobs=bool(return_text_in_logprobs),
            stream=stream,
            group=group,
            priority=0 if priority is None else priority,
            lora_path=lora_path,
            cache_salt=cache_salt,
        )

    def __reduce__(self):
        # NOTE: every request's options cross ZMQ to the scheduler: pickled as the constructor's arguments,
        # they are smaller and quicker to load than through the slots dataclass's own state methods.
        return (
            RequestOptions,
            (
                self.rid,
                self.return_logprob,
                self.logprob_start_len,
                self.top_logprobs_num,
                self.return_text_in_logprobs,
                self.stream,
                self.group,
                self.priority,
                self.lora_path,
                self.cache_salt,
            ),
        )

    def check_prompt(self, num_prompt_tokens: int) -> None:
        """The checks that need the prompt's length."""
        if self.return_logprob and self.logprob_start_len >= num_prompt_tokens:
            # (SGLang refuses it too: the prompt logprobs asked for would silently be an empty list)
            raise RequestOptionError(
                "logprob_start_len",
                f"logprob_start_len ({self.logprob_start_len}) must be "
                f"less than the prompt's {num_prompt_tokens} tokens",
            )

    def with_rid(self, rid: str) -> "RequestOptions":
        return dataclasses.replace(self, rid=rid)


def expand_samples(sp: SamplingParams, options: RequestOptions) -> list[tuple[SamplingParams, RequestOptions]]:
    """The requests of one prompt: the request itself when n == 1; else its n samples, request
    `{rid}-{k}` for k = 0 .. n-1, each with n = 1 and seed + k (so the samples differ, yet each is
    reproducible), grouped under `rid` unless the caller named a group."""
    if options.rid is None:
        raise ValueError("expand_samples needs the request's rid")
    if sp.n == 1:
        return [(sp, options)]
    group = options.group or options.rid
    return [
        (sp.for_sample(k), dataclasses.replace(options, rid=sample_rid(options.rid, k), group=group))
        for k in range(sp.n)
    ]


def new_rid() -> str:
    """A fresh request id (for a request whose caller named none)."""
    return uuid.uuid4().hex


def sample_rid(rid: str, k: int) -> str:
    """The request id of sample k of request `rid` (what aborting `rid` also aborts)."""
    return f"{rid}-{k}"


def is_sample_of(sample: str, rid: str) -> bool:
    """Whether request `sample` was expanded from request `rid` (its samples, or an OpenAI route's prompts
    `{rid}-p{i}` and their samples)."""
    return sample.startswith(rid + "-")


# A namespace marks up to this many of a prompt's first tokens with 31 bits of its hash each.
NAMESPACE_MARKED_TOKENS = 2


def cache_key_prompt(input_ids: list[int], lora_path: Optional[str], cache_salt: Optional[str]) -> list[int]:
    """The prompt as the prefix cache keys it: `input_ids` itself for the base model and no salt; else a
    copy whose first tokens carry the (adapter, salt) namespace's hash above bit 32. The radix tree is a
    trie, so a different first token is a different subtree: nothing is shared across namespaces, and
    within one everything is as before. (Keys stay int64, as KV events pack them; two namespaces collide
    only if 62 bits of their hashes do, 31 for a one-token prompt.)"""
    if lora_path is None and cache_salt is None:
        return input_ids
    digest = hashlib.blake2b(repr((lora_path, cache_salt)).encode(), digest_size=8).digest()
    marks = int.from_bytes(digest, "little")
    ids = list(input_ids)
    for i in range(min(NAMESPACE_MARKED_TOKENS, len(ids))):
        ids[i] += ((marks >> (31 * i)) & 0x7FFFFFFF | 1) << 32  # never 0: a marked id is never a plain one
    return ids
