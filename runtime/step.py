"""One step as plain data: what the scheduler hands a step runner (`StepInput`) and what it gets back
(`StepOutput`), and the per-request sampling inputs a step reads (`SamplingRow`).

The seam between deciding what runs and running it. The scheduler builds a `StepInput` from its batch;
a runner (the model runner on one device, a fake runner in tests, a draft-and-verify runner, a
tensor-parallel worker group) executes it and never sees the scheduler's request objects. Host arrays
are numpy int64; nothing here holds device state.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from .sampling_params import SamplingParams


class ForwardMode(enum.Enum):
    EXTEND = 1  # prefill of new tokens on top of an (optionally) cached prefix
    DECODE = 2  # one new token per request
    # Speculative decoding: each request's draft tree (its last token and the drafts after it) scored in
    # one step, over its cached prefix; a token sees the prefix and its own ancestors in the tree.
    VERIFY = 3

    def is_extend(self) -> bool:
        return self is ForwardMode.EXTEND

    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE

    def is_verify(self) -> bool:
        return self is ForwardMode.VERIFY


class SamplingRow:
    """What sampling one request's next token reads: its parameters, its tokens so far (for penalties
    and min_new_tokens), its stop ids, its seeded generator and its grammar matcher. Made once per
    request; `output_ids` is the request's own list (read here, appended by the scheduler)."""

    __slots__ = (
        "params",
        "prompt_ids",
        "output_ids",
        "stop_token_ids",
        "generator",
        "grammar",
        "return_logprob",
        "top_logprobs_num",
        "penalized",
    )

    def __init__(
        self,
        params: SamplingParams,
        prompt_ids: list[int],
        output_ids: list[int],
        stop_token_ids: set[int],
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
    ):
        self.params = params
        self.prompt_ids = prompt_ids
        self.output_ids = output_ids
        self.stop_token_ids = stop_token_ids
        self.generator: Any = None  # torch.Generator of a seeded request
        self.grammar: Any = None  # the request's grammar matcher (constrained decoding), or None
        self.return_logprob = return_logprob
        self.top_logprobs_num = top_logprobs_num
        self.penalized = (
            params.frequency_penalty != 0 or params.presence_penalty != 0 or params.repetition_penalty != 1.0
        )

    def min_tokens_pending(self) -> bool:
        """Stop tokens are still banned (fewer than min_new_tokens generated)."""
        return len(self.output_ids) < self.params.min_new_tokens

    def needs_host_sampling(self) -> bool:
        """Sampling this row's next token needs something only the host has after the previous step: its
        logprobs are read back, its grammar advances, its penalties count its tokens, or its stop tokens
        are banned until min_new_tokens. Such a step cannot be launched before the previous one is read."""
        return self.return_logprob or self.grammar is not None or self.penalized or self.min_tokens_pending()

    def plain_greedy(self) -> bool:
        """The argmax of the raw logits: greedy, and nothing adjusts the logits."""
        return (
            self.params.is_greedy
            and self.grammar is None
            and not self.params.logit_bias
            and not self.penalized
            and not self.min_tokens_pending()
        )


@dataclass
class LogprobRow:
    """A row of the step's hidden states whose logprobs were asked for: request `req` (index in the
    step), hidden row `row`, predicting prompt position `pos` (token `target`); `pos` equal to the prompt's
    length is the next token's distribution of a prefill-only request (no token, top logprobs only)."""

    req: int
    row: int
    pos: int
    target: int
    top_k: int
    next_token: bool = False


@dataclass
class DraftRows:
    """VERIFY: each request's draft tree. Request b's nodes are its `extend_lens[b]` rows of the step,
    node 0 its last committed token (the root), the others draft tokens, each after its parent."""

    parents: np.ndarray  # (T,) int64: each node's parent, as an index among its request's nodes (-1: the root)
    # (B,): the runner's drafter writes the request's nodes (tokens, parents, positions) before verifying;
    # the scheduler only sized them (speculative_num_draft_tokens).
    model_draft: list[bool]
    # (sum n_b * n_b,) bool, row-major per request: node e sees node c (c an ancestor of e, or e). None:
    # every tree is a chain.
    tree_mask: Optional[np.ndarray] = None

    @property
    def has_model_drafts(self) -> bool:
        return any(self.model_draft)


@dataclass
class VerifiedTokens:
    """What a VERIFY step accepted for one request."""

    tokens: list[int]  # the accepted drafts, then the target's own next token (never empty)
    nodes: list[int]  # the node of each accepted draft (len(tokens) - 1), in order down the tree
    logprobs: Optional[list] = None  # per token (logprob, top list or None), when asked
    proposed: int = 0  # draft tokens the request had this step


@dataclass
class LoraRows:
    """A step's LoRA adapters (runtime/lora/): per request in step order (B,), its adapter's slot in the
    runner's device pool (0: the base model alone); and the adapters the runner copies from host memory
    into slots before this step's forward, (slot, adapter) (the scheduler chose the slots)."""

    slots: list[int]
    loads: list[tuple[int, Any]] = field(default_factory=list)


@dataclass
class ImageRows:
    """EXTEND: rows [row, row + count) of the step's tokens are image tokens `start ..` of one image (a
    vision model's input embeddings there are the image's features, not the tokens'). `pixels` is the
    image preprocessed, (C, S, S) float32; `key` its hash (the same image in one step runs once)."""

    row: int
    start: int
    count: int
    pixels: np.ndarray
    key: int


@dataclass
class StepInput:
    """One forward step, as the runner needs it.

    DECODE: `token_rows` (5, B): input ids (0 where they come from the previous step on the device),
    positions, request rows of req_to_token, sequence lengths, kv slots of the new tokens.
    EXTEND: `token_rows` (4, T) per new token: input id, position, kv slot, request row; `req_rows`
    (5, B) per request: request row, sequence length, cached prefix, new tokens, first row in T. The first
    `decode_rows` requests of an EXTEND step bring one token each after their computed KV: running
    requests decoding in the same forward as the others' prefill chunks (a mixed step).
    VERIFY: as EXTEND, with a fifth row in `token_rows`: each node's position in req_to_token (its
    request's prefix + its index among the request's nodes), which differs from its position in the
    sequence (prefix + its depth) in a tree; `draft` holds the trees. Built by speculative/verify_step.py.
    """

    mode: ForwardMode
    batch_size: int
    token_rows: np.ndarray
    seq_lens: list[int]
    # (request rows, positions, kv slots) of the new tokens, each (T,) on the host: req_to_token's writes.
    kv_writes: tuple[np.ndarray, np.ndarray, np.ndarray]
    req_rows: Optional[np.ndarray] = None  # EXTEND
    prefix_lens: list[int] = field(default_factory=list)  # EXTEND
    extend_lens: list[int] = field(default_factory=list)  # EXTEND
    # Rows of the hidden states (T,) that sample, and the index in the step of each one's request.
    sample_rows: list[int] = field(default_factory=list)
    sampling_reqs: list[int] = field(default_factory=list)
    sampling: list[SamplingRow] = field(default_factory=list)  # per sampling request
    logprob_rows: list[LogprobRow] = field(default_factory=list)
    # A step launched before the previous one was read back: per new token (T,), the index among the
    # previous step's sampled tokens (on the device) that is its input id, or -1 where `token_rows[0]`
    # holds it. None: every input id is on the host.
    prev_src: Optional[np.ndarray] = None
    decode_rows: int = 0  # EXTEND: the leading requests that decode one token (a mixed step)
    draft: Optional[DraftRows] = None  # VERIFY
    # EXTEND: per request, the token after its new ones when the request has one already (a chunk's next
    # prompt token), else -1 (it is sampled). An EAGLE head's entries are one token ahead of the target's.
    following_ids: Optional[list[int]] = None
    lora: Optional[LoraRows] = None  # None: no request of the step has an adapter
    images: list[ImageRows] = field(default_factory=list)  # EXTEND: image tokens among the new ones

    @property
    def num_tokens(self) -> int:
        return int(self.token_rows.shape[1])

    @property
    def ids_from_prev(self) -> bool:
        """Some input ids are the previous step's samples, still on the device."""
        return self.prev_src is not None

    @property
    def all_ids_from_prev(self) -> bool:
        return self.prev_src is not None and bool((self.prev_src >= 0).all())

    @classmethod
    def extend(
        cls,
        req_slots: Sequence[int],
        prefix_lens: Sequence[int],
        extend_lens: Sequence[int],
        new_ids: Iterable[int],
        out_slots: np.ndarray,
    ) -> "StepInput":
        """An EXTEND step: request b has `prefix_lens[b]` tokens in the cache and `extend_lens[b]` new ones
        (`new_ids`, all requests' concatenated), whose K/V go to `out_slots` (T,). No request samples yet
        (the caller adds `sample_rows`, `sampling_reqs`, `sampling`)."""
        pre = np.asarray(prefix_lens, dtype=np.int64)  # (B,)
        ext = np.asarray(extend_lens, dtype=np.int64)  # (B,)
        pool = np.asarray(req_slots, dtype=np.int64)  # (B,)
        starts = np.cumsum(ext) - ext  # (B,)
        total = int(ext.sum())
        tokens = np.empty((4, total), dtype=np.int64)
        tokens[0] = np.fromiter(new_ids, np.int64, total)
        tokens[1] = np.arange(total, dtype=np.int64) + np.repeat(pre - starts, ext)  # pre + (row - start)
        tokens[2] = out_slots
        tokens[3] = np.repeat(pool, ext)
        req_rows = np.stack([pool, pre + ext, pre, ext, starts])  # (5, B)
        return cls(
            ForwardMode.EXTEND,
            len(pool),
            tokens,
            req_rows[1].tolist(),
            (tokens[3], tokens[1], tokens[2]),
            req_rows=req_rows,
            prefix_lens=list(prefix_lens),
            extend_lens=list(extend_lens),
        )


@dataclass
class StepOutput:
    # Per request in step order: the sampled token, or None (a chunk mid-way / prefill-only).
    next_token_ids: list[Optional[int]]
    # Per request: (logprob, top list or None) for the sampled token, when asked.
    output_logprobs: list = field(default_factory=list)
    # Per request: list of (prompt position, logprob, token id, top list or None) computed this step.
    input_logprobs: list = field(default_factory=list)
    # VERIFY: per request, what was accepted (`next_token_ids` then holds each request's last token).
    verified: list[VerifiedTokens] = field(default_factory=list)
