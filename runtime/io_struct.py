"""Typed messages between the tokenizer manager (caller's process) and the scheduler process.

They travel pickled over ZMQ; every message is a dataclass, never a bare dict or string.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from .request_options import RequestOptions
from .sampling_params import SamplingParams


@dataclass(frozen=True)
class ImageInput:
    """One image of a prompt as the scheduler carries it: its tokens are prompt positions [offset, offset +
    length) (each the model's image token), `pixels` its preprocessed (C, S, S) float32 array, `hash` a
    63-bit hash of its pixels (the prefix cache keys its tokens by it)."""

    offset: int
    length: int
    pixels: Any
    hash: int


@dataclass(slots=True)
class TokenizedGenerateReq:
    """One request as the scheduler receives it: its prompt's ids, its sampling and its options, whole (the
    scheduler's `Req.of` builds its request from them). `options.rid` is set: the request's id."""

    input_ids: list[int]
    sampling_params: SamplingParams
    options: RequestOptions
    images: tuple[ImageInput, ...] = ()  # a vision model's images, in prompt order

    @property
    def rid(self) -> str:
        return self.options.rid  # type: ignore[return-value]

    def __reduce__(self):
        # NOTE: one message per request crosses ZMQ: pickled as the constructor's arguments (see RequestOptions).
        return (TokenizedGenerateReq, (self.input_ids, self.sampling_params, self.options, self.images))


@dataclass
class AbortReq:
    rid: str


@dataclass
class ShutdownReq:
    """The engine is shutting down: the scheduler process stops serving and exits."""


@dataclass
class ControlReq:
    """A request that expects one `ControlReply` with the same `call_id` (one subclass per operation)."""

    call_id: int


@dataclass
class FlushCacheReq(ControlReq):
    """Drop every cached prefix and pin (refused, False, unless the scheduler is idle)."""


@dataclass
class GetStatsReq(ControlReq):
    """The scheduler's counters (`Scheduler.get_stats`)."""


@dataclass
class CheckIntegrityReq(ControlReq):
    """Run the full KV and queue integrity check; True when it holds."""


@dataclass
class PinPrefixReq(ControlReq):
    """Keep the cached part of `token_ids` cached until unpinned (or `ttl` seconds)."""

    token_ids: list[int] = field(default_factory=list)
    ttl: Optional[float] = None


@dataclass
class UnpinPrefixReq(ControlReq):
    pin_id: int = 0


@dataclass
class LoadLoraAdapterReq(ControlReq):
    """Load the PEFT folder `lora_path` as LoRA adapter `lora_name` (SGLang's /load_lora_adapter)."""

    lora_name: str = ""
    lora_path: str = ""


@dataclass
class UnloadLoraAdapterReq(ControlReq):
    """Forget LoRA adapter `lora_name` (refused while a live request asks for it)."""

    lora_name: str = ""


@dataclass
class ControlReply:
    call_id: int
    result: Any = None
    error: Optional[str] = None


@dataclass
class DeferredText:
    """The scheduler did not decode this request's text (nobody reads it before the end): the
    receiver decodes the first `num_ids` output ids incrementally, exactly as the scheduler would."""

    num_ids: int
    skip_special_tokens: bool


@dataclass
class ReqOutput:
    """What one request produced since the last message (deltas), plus its running totals."""

    rid: str
    new_ids: list[int]
    text_delta: str
    finished_reason: Optional[dict[str, Any]]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    # Deltas of (logprob, token_id, text|None) and of top lists [(logprob, token_id, text|None)]
    input_token_logprobs: list = field(default_factory=list)
    input_top_logprobs: list = field(default_factory=list)
    output_token_logprobs: list = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)
    # Final text replaces the accumulated one when stop trimming cut part of it.
    final_text: Optional[str] = None
    # Set on the final output of a request whose text is decoded by the receiver.
    deferred_text: Optional[DeferredText] = None
    # When the scheduler sampled the request's first token (time.monotonic(): one clock for every process
    # of the machine). A request that is not streamed sends its ids only at the end, so the receiver's own
    # clock would put its first token there.
    first_token_time: Optional[float] = None
    # Set on the final output of a constrained request that was steered to its shortest valid completion
    # ("budget": the tokens left could not finish it along the model's path; "repetition": a loop).
    closed_early: Optional[str] = None
    # Speculative decoding (totals, set while the server speculates): verify steps in which the request had
    # drafts (SGLang's `spec_verify_ct`), its drafts, and those accepted into its output.
    spec_verify_ct: Optional[int] = None
    spec_draft_tokens: Optional[int] = None
    spec_accepted_tokens: Optional[int] = None
    # Of `cached_tokens`, those loaded back from the host tier (set while the server runs one).
    cached_tokens_host: Optional[int] = None


@dataclass
class BatchOut:
    outputs: list[ReqOutput]


@dataclass
class SchedulerInfo:
    max_total_tokens: int
    context_len: int
    vocab_size: int
    max_running_requests: int
    device: str
    dtype: str
    attention_backend: str
    eos_token_ids: list[int]
    quantization: str = "none"  # the weights' quantization ("int8", "int4", "none")
    kv_cache_dtype: str = ""  # what the KV cache stores ("fp8_e4m3", "bfloat16", ...)
    cpu_features: list[str] = field(default_factory=list)  # the CPU's low-precision features, on the CPU
    # time.time() when each part of the scheduler process's start-up was done: "imported" (torch and the
    # scheduler's modules), "model" (built, weights in), "tokenizer" (loaded beside the model), "ready".
    startup_marks: dict[str, float] = field(default_factory=dict)
