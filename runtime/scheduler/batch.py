"""One step's batch (`ScheduleBatch`): the requests of a forward step and how many new tokens each
contributes, and the host rows the step's input is built from."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Optional, cast

import numpy as np
import torch

from ..forward_batch import ForwardMode
from ..request import Req
from ..speculative.tree import DraftTree
from ..speculative.verify_step import build_verify_step
from ..step import ImageRows, LogprobRow, StepInput


@dataclass
class VerifyPlan:
    """A VERIFY batch's draft trees (one per request, a lone root where it has no drafts), and which of
    them the runner's drafter fills in (their nodes only sized here)."""

    trees: list[DraftTree]
    model_draft: list[bool]


@dataclass
class DecodeRows:
    """The decode rows of a step: one token for each of B running requests, after its computed KV.

    Built from the requests' host state, or one token past a step still in flight: a request whose last
    token that step is sampling takes it on the device (`prev_src`); its host state is one token behind."""

    seq_lens: np.ndarray  # (B,) int64: kv length including this step's token
    req_pool: np.ndarray  # (B,) int64: request rows of req_to_token
    input_ids: np.ndarray  # (B,) int64: the input token, 0 where it comes from the step in flight
    prev_src: Optional[np.ndarray] = None  # (B,) int64: index among that step's samples, or -1 (host)

    @classmethod
    def of(cls, reqs: list[Req], prev_index: Optional[dict[int, int]] = None) -> "DecodeRows":
        """Rows for `reqs`; `prev_index`: id(request) -> the index of its token among the samples of the step
        in flight (that token is not in the request's host state yet)."""
        n = len(reqs)
        seq = np.fromiter((len(r.origin_input_ids) + len(r.output_ids) for r in reqs), np.int64, n)
        pool = np.fromiter((r.req_pool_idx for r in reqs), np.int64, n)
        ids = np.fromiter((_last_token(r) for r in reqs), np.int64, n)
        src = None
        if prev_index:
            src = np.fromiter((prev_index.get(id(r), -1) for r in reqs), np.int64, n)
            ahead = src >= 0
            if ahead.any():
                seq += ahead
                ids[ahead] = 0
            else:
                src = None
        return cls(seq, pool, ids, src)

    def take(self, keep: np.ndarray) -> "DecodeRows":
        return DecodeRows(
            self.seq_lens[keep],
            self.req_pool[keep],
            self.input_ids[keep],
            None if self.prev_src is None else self.prev_src[keep],
        )


@dataclass(eq=False)
class ScheduleBatch:
    """The requests of one forward step and how many new tokens each contributes.

    DECODE: one token per request. EXTEND: prefill chunks (new prompt tokens over a cached prefix), led by
    `num_decode` running requests that decode one token in the same forward (a mixed step). VERIFY: each
    request's draft tree (speculative decoding)."""

    mode: ForwardMode
    reqs: list[Req]
    prefix_lens: list[int] = field(default_factory=list)  # kv already in the pool (EXTEND)
    extend_lens: list[int] = field(default_factory=list)  # new tokens this step (EXTEND)
    out_cache_loc: Optional[torch.Tensor] = None  # (T,) kv slots allocated for the new tokens (host)
    # The decode rows (DECODE: every request; EXTEND: the first `num_decode`), when the scheduler built
    # them (None: computed from the requests' host state when the step is built).
    decode: Optional[DecodeRows] = None
    num_decode: int = 0  # EXTEND: leading decode rows
    # Where this step's new tokens' kv slots go, once the step is built: (req slots, positions, kv
    # slots), each (T,) int64 on the host (the device table and its host copy get the same writes).
    kv_writes: Optional[tuple[np.ndarray, np.ndarray, np.ndarray]] = None
    verify: Optional[VerifyPlan] = None  # VERIFY: the trees; out_cache_loc holds every node's slot
    # The requests whose token this step samples, in the order of its sampled ids (set by `to_step`).
    sampled: list[Req] = field(default_factory=list)

    @property
    def batch_size(self) -> int:
        return len(self.reqs)

    @property
    def seq_lens_host(self) -> Optional[np.ndarray]:
        """DECODE: (B,) kv lengths including this step's token (None until the rows exist)."""
        return None if self.decode is None else self.decode.seq_lens

    @property
    def decode_reqs(self) -> list[Req]:
        return self.reqs if self.mode.is_decode() else self.reqs[: self.num_decode]

    @property
    def slots(self) -> torch.Tensor:
        """(T,) the kv slots allocated for the step's new tokens (`out_cache_loc`, given to every batch)."""
        assert self.out_cache_loc is not None, "a batch is built with its new tokens' kv slots"
        return self.out_cache_loc

    def _decode_rows(self) -> DecodeRows:
        """The decode rows, built from the requests' host state the first time they are needed."""
        if self.decode is None:
            self.decode = DecodeRows.of(self.decode_reqs)
        return self.decode

    def sample_index(self) -> dict[int, int]:
        """id(request) -> index of its token among this step's sampled ids."""
        return {id(r): j for j, r in enumerate(self.sampled)}

    @classmethod
    def mixed(cls, decode: "ScheduleBatch", prefill: "ScheduleBatch") -> "ScheduleBatch":
        """One EXTEND step of `decode`'s requests (one token each, first) and `prefill`'s chunks."""
        rows = decode.decode if decode.decode is not None else DecodeRows.of(decode.reqs)
        n = len(decode.reqs)
        return cls(
            ForwardMode.EXTEND,
            decode.reqs + prefill.reqs,
            (rows.seq_lens - 1).tolist() + prefill.prefix_lens,
            [1] * n + prefill.extend_lens,
            torch.cat([decode.slots, prefill.slots]),
            decode=rows,
            num_decode=n,
        )

    def prefill_part(self) -> tuple[list[Req], list[int], list[int]]:
        """EXTEND: (requests, cached prefixes, new tokens) of the prefill rows (after the decode rows)."""
        d = self.num_decode
        return self.reqs[d:], self.prefix_lens[d:], self.extend_lens[d:]

    def decode_host_rows(self) -> np.ndarray:
        """(5, B) int64: input ids, positions, req_pool_indices, seq_lens, out_cache_loc of a decode step."""
        d = self._decode_rows()
        rows = np.empty((5, len(self.reqs)), dtype=np.int64)
        rows[0] = d.input_ids
        rows[1] = d.seq_lens - 1
        rows[2] = d.req_pool
        rows[3] = d.seq_lens
        rows[4] = self.slots.cpu().numpy()
        self.kv_writes = (rows[2], rows[1], rows[4])
        return rows

    def next_decode(self, out_cache_loc: torch.Tensor, keep: Optional[list[int]] = None) -> "ScheduleBatch":
        """The decode step after this one (DECODE), launched before this one's results are read, for the
        requests of rows `keep` (default: all): each is one token further, so its rows follow from ours,
        and its input id is this step's sampled token (on the device)."""
        rows = np.arange(len(self.reqs), dtype=np.int64) if keep is None else np.asarray(keep, dtype=np.int64)
        reqs = self.reqs if keep is None else [self.reqs[j] for j in keep]
        d = self._decode_rows().take(rows)
        nxt = DecodeRows(d.seq_lens + 1, d.req_pool, np.zeros_like(d.input_ids), rows)
        return ScheduleBatch(ForwardMode.DECODE, reqs, out_cache_loc=out_cache_loc, decode=nxt)

    def to_step(self) -> StepInput:
        """The step as plain data for the runner."""
        reqs = self.reqs
        if self.mode.is_verify():
            assert self.verify is not None, "a VERIFY batch is built with its trees"
            step = build_verify_step(
                _table_rows(reqs),
                [r.kv_len for r in reqs],
                self.verify.trees,
                self.slots.numpy(),
                self.verify.model_draft,
            )
            step.sample_rows = []  # every node is scored; the runner reads the trees
            step.sampling_reqs = list(range(len(reqs)))
            step.sampling = [r.sampling for r in reqs]
            self.kv_writes = step.kv_writes
            self.sampled = list(reqs)
            return step
        if self.mode.is_decode():
            rows = self.decode_host_rows()  # (5, B)
            d, kv_writes = self._decode_rows(), self.kv_writes
            assert kv_writes is not None  # decode_host_rows recorded them
            everyone = list(range(len(reqs)))
            self.sampled = list(reqs)
            return StepInput(
                self.mode,
                len(reqs),
                rows,
                d.seq_lens.tolist(),
                kv_writes,
                sample_rows=everyone,
                sampling_reqs=everyone,
                sampling=[r.sampling for r in reqs],
                prev_src=d.prev_src,
            )
        return self._extend_step()

    def _extend_step(self) -> StepInput:
        reqs, nd = self.reqs, self.num_decode
        decode = self._decode_rows() if nd else None
        decode_ids = decode.input_ids.tolist() if decode is not None else []
        new_ids = itertools.chain(
            decode_ids,
            itertools.chain.from_iterable(
                r.origin_input_ids[p : p + e] if p + e <= len(r.origin_input_ids) else r.fill_ids[p : p + e]
                for r, p, e in zip(reqs[nd:], self.prefix_lens[nd:], self.extend_lens[nd:])
            ),
        )
        step = StepInput.extend(
            _table_rows(reqs),
            self.prefix_lens,
            self.extend_lens,
            new_ids,
            self.slots.cpu().numpy(),
        )
        self.kv_writes = step.kv_writes
        step.decode_rows = nd
        if decode is not None and decode.prev_src is not None:
            src = np.full(step.num_tokens, -1, dtype=np.int64)
            src[:nd] = decode.prev_src  # a decode row's one token is its row in T
            step.prev_src = src
        # A decode row's next token follows its sampled one (-1): none is known yet.
        step.following_ids = [-1] * nd + [
            _token_at(r, p + e) for r, p, e in zip(reqs[nd:], self.prefix_lens[nd:], self.extend_lens[nd:])
        ]
        self.sampled = list(reqs[:nd])
        step.sample_rows = list(range(nd))
        step.sampling_reqs = list(range(nd))
        step.sampling = [r.sampling for r in reqs[:nd]]
        offset = nd
        for i in range(nd, len(reqs)):
            r, pre, ext = reqs[i], self.prefix_lens[i], self.extend_lens[i]
            if pre + ext == r.seq_len and not r.prefill_only:
                step.sample_rows.append(offset + ext - 1)
                step.sampling_reqs.append(i)
                step.sampling.append(r.sampling)
                self.sampled.append(r)
            if r.needs_input_logprobs():
                prompt = r.origin_input_ids
                first = max(r.logprob_start_len, 1, pre + 1, r.input_logprob_next)
                # NOTE: a chunk's last row predicts the next chunk's first prompt token: computed here,
                # since the next chunk has no row before it.
                for pos in range(first, min(pre + ext + 1, len(prompt))):
                    step.logprob_rows.append(
                        LogprobRow(i, offset + (pos - 1 - pre), pos, prompt[pos], r.top_logprobs_num)
                    )
            if pre + ext == r.seq_len and r.prefill_only and r.return_logprob and r.top_logprobs_num:
                # max_new_tokens=0 with top logprobs: no token, but the next token's distribution (the
                # "position" past the prompt; SGLang programs read it, e.g. to branch on the top-k).
                step.logprob_rows.append(
                    LogprobRow(i, offset + ext - 1, len(r.origin_input_ids), 0, r.top_logprobs_num, next_token=True)
                )
            if r.images:
                step.images.extend(_image_rows(r, pre, ext, offset))
            offset += ext
        return step


def _table_rows(reqs: list[Req]) -> list[int]:
    """Each request's row of req_to_token: a request in a batch holds one (assigned at admission)."""
    rows = [r.req_pool_idx for r in reqs]
    assert None not in rows, "a request in a batch holds a req_to_token row"
    return cast(list[int], rows)


def _image_rows(r: Req, pre: int, ext: int, offset: int) -> list[ImageRows]:
    """The image tokens among a request's new prompt positions [pre, pre + ext), whose first is row
    `offset` of the step: a chunk may hold part of an image (the rest was cached, or comes next chunk)."""
    rows = []
    for image in r.images:
        first, end = max(image.offset, pre), min(image.offset + image.length, pre + ext)
        if first < end:
            rows.append(ImageRows(offset + first - pre, first - image.offset, end - first, image.pixels, image.hash))
    return rows


def _last_token(r: Req) -> int:
    return r.output_ids[-1] if r.output_ids else r.origin_input_ids[-1]


def _token_at(r: Req, i: int) -> int:
    """r.fill_ids[i] without building fill_ids; -1 past the end."""
    n = len(r.origin_input_ids)
    if i < n:
        return r.origin_input_ids[i]
    return r.output_ids[i - n] if i - n < len(r.output_ids) else -1
