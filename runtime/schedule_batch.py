"""Per-request scheduler state (`Req`) and one step's batch (`ScheduleBatch`).

A request's tokens are `fill_ids = origin_input_ids + output_ids`. `kv_len` of them have K/V in the
pool: `req_to_token[req_pool_idx, :kv_len]`. Of those, the first `cache_len` belong to the prefix cache
(locked through `last_node`); the rest are the request's private slots.
"""

from __future__ import annotations

import itertools
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from .detokenizer import IncrementalDetokenizer
from .forward_batch import ForwardMode
from .sampling_params import SamplingParams


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
    def __init__(self, rid: str, input_ids: list[int], sampling_params: SamplingParams, *,
                 return_logprob: bool = False, logprob_start_len: int = -1, top_logprobs_num: int = 0,
                 return_text_in_logprobs: bool = False, stream: bool = False, tokenizer=None,
                 eos_token_ids: tuple[int, ...] = (), group: Optional[str] = None, defer_text: bool = False,
                 take_ids: bool = False):
        self.rid = rid
        # NOTE: with `take_ids` the caller hands its list over (the scheduler's freshly unpickled
        # message): no copy (~3 us per 1,000 ids). Nothing here changes it in place.
        self.origin_input_ids = input_ids if take_ids and type(input_ids) is list else list(input_ids)
        self.sampling_params = sampling_params
        self.return_logprob = return_logprob
        # Prompt logprobs are wanted from this prompt position on (-1: none, only output logprobs).
        if return_logprob and logprob_start_len is not None and logprob_start_len >= 0:
            self.logprob_start_len = min(logprob_start_len, len(input_ids))
        else:
            self.logprob_start_len = len(input_ids)
        self.top_logprobs_num = top_logprobs_num or 0
        self.return_text_in_logprobs = return_text_in_logprobs
        self.stream = stream
        self.group = group  # program / fork group id (scheduling hint)
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
        self.defer_text = (defer_text and tokenizer is not None and not stream and not self.checks_text
                           and sampling_params.grammar_key is None)
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

        self.generator: Optional[torch.Generator] = None
        self.grammar: Any = None  # per-request grammar matcher (constrained decoding), or None
        self.created = time.monotonic()
        self.first_token_time: Optional[float] = None

    # ---- token views ----
    @property
    def fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

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


@dataclass(eq=False)
class ScheduleBatch:
    """The requests of one forward step and how many new tokens each contributes."""

    mode: ForwardMode
    reqs: list[Req]
    prefix_lens: list[int] = field(default_factory=list)  # kv already in the pool (EXTEND)
    extend_lens: list[int] = field(default_factory=list)  # new tokens this step (EXTEND)
    out_cache_loc: Optional[torch.Tensor] = None  # (T,) kv slots allocated for the new tokens (host)
    # DECODE: (B,) int64 kv lengths including this step's token, and request rows; set when the step
    # is built, or derived from the previous step by `next_decode` (then not recomputed).
    seq_lens_host: Optional[np.ndarray] = None
    req_pool_host: Optional[np.ndarray] = None
    derived_rows: bool = False
    # A step derived by `next_decode` from a subset of the previous step's requests: (B,) int64 rows
    # of the previous step whose sampled tokens are this step's input ids (None: all, in order).
    prev_rows: Optional[np.ndarray] = None
    # Where this step's new tokens' kv slots go, once the step is built: (req slots, positions, kv
    # slots), each (T,) int64 on the host (the device table and its host copy get the same writes).
    kv_writes: Optional[tuple[np.ndarray, np.ndarray, np.ndarray]] = None

    @property
    def batch_size(self) -> int:
        return len(self.reqs)

    def decode_host_rows(self, ahead: int, with_input_ids: bool) -> np.ndarray:
        """(5, B) int64: input ids, positions, req_pool_indices, seq_lens, out_cache_loc of a decode step;
        (6, B) with `prev_rows` as the last row.

        `ahead`: the requests are that many tokens further along than their CPU state says (overlap).
        Without `with_input_ids` the ids row is 0 (the caller has them on the device).
        """
        reqs, n = self.reqs, len(self.reqs)
        if not self.derived_rows:  # from the requests' CPU state (again if a caller reuses the batch)
            self.seq_lens_host = np.fromiter((len(r.origin_input_ids) + len(r.output_ids) for r in reqs),
                                             np.int64, n) + ahead
            self.req_pool_host = np.fromiter((r.req_pool_idx for r in reqs), np.int64, n)
        rows = np.empty((5 if self.prev_rows is None else 6, n), dtype=np.int64)
        if with_input_ids:
            rows[0] = np.fromiter((r.output_ids[-1] if r.output_ids else r.origin_input_ids[-1] for r in reqs),
                                  np.int64, n)
        else:
            rows[0] = 0
        rows[1] = self.seq_lens_host - 1
        rows[2] = self.req_pool_host
        rows[3] = self.seq_lens_host
        rows[4] = self.out_cache_loc.cpu().numpy()
        if self.prev_rows is not None:
            rows[5] = self.prev_rows
        self.kv_writes = (rows[2], rows[1], rows[4])
        return rows

    def extend_host_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """EXTEND: (4, T) int64 per new token (input id, position, out_cache_loc, req_pool_index) and
        (5, B) per request (req_pool_index, seq_len, prefix_len, extend_len, first row in T)."""
        reqs = self.reqs
        pre = np.asarray(self.prefix_lens, dtype=np.int64)  # (B,)
        ext = np.asarray(self.extend_lens, dtype=np.int64)  # (B,)
        pool = np.fromiter((r.req_pool_idx for r in reqs), np.int64, len(reqs))  # (B,)
        starts = np.cumsum(ext) - ext  # (B,)
        total = int(ext.sum())
        tokens = np.empty((4, total), dtype=np.int64)
        new_ids = itertools.chain.from_iterable(
            r.origin_input_ids[p:p + e] if p + e <= len(r.origin_input_ids) else r.fill_ids[p:p + e]
            for r, p, e in zip(reqs, self.prefix_lens, self.extend_lens))
        tokens[0] = np.fromiter(new_ids, np.int64, total)
        tokens[1] = np.arange(total, dtype=np.int64) + np.repeat(pre - starts, ext)  # pre + (row - start)
        tokens[2] = self.out_cache_loc.cpu().numpy()
        tokens[3] = np.repeat(pool, ext)
        self.kv_writes = (tokens[3], tokens[1], tokens[2])
        return tokens, np.stack([pool, pre + ext, pre, ext, starts])

    def next_decode(self, out_cache_loc: torch.Tensor, keep: Optional[list[int]] = None) -> "ScheduleBatch":
        """The decode step after this one, launched before this one's results are read (overlap), for
        the requests of rows `keep` (default: all): each is one token further, so its host rows
        follow from ours, and its input id is this step's sampled token (on the device)."""
        if keep is None or len(keep) == len(self.reqs):
            nxt = ScheduleBatch(ForwardMode.DECODE, self.reqs, out_cache_loc=out_cache_loc)
            rows = None
        else:
            nxt = ScheduleBatch(ForwardMode.DECODE, [self.reqs[j] for j in keep], out_cache_loc=out_cache_loc)
            rows = nxt.prev_rows = np.asarray(keep, dtype=np.int64)
        if self.seq_lens_host is not None:
            nxt.seq_lens_host = (self.seq_lens_host if rows is None else self.seq_lens_host[rows]) + 1
            nxt.req_pool_host = self.req_pool_host if rows is None else self.req_pool_host[rows]
            nxt.derived_rows = True
        return nxt
