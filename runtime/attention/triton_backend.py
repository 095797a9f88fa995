"""triton: the default attention backend on GPU (paged extend with cached prefix, split-KV decode).

Kernels live in `triton_ops/`. Both read K/V straight from the pool through `req_to_token`, so the
per-step metadata is only a handful of (B,) tensors that the ForwardBatch already holds: nothing is
flattened or copied per step. Decode needs no host data (CUDA-graph friendly) except for a step with a long
request among short ones (eight or more requests): its split plan, made from the host's lengths and
uploaded as one small int32 table (triton_splits.py).

What the backend reads from its `AttentionContext` (context.py): `device`, where metadata and scratch
live; `heads`, this rank's head shape, which pre-sizes the decode scratch in `init_cuda_graph_state`
(without it the scratch is sized at the first decode call); `disable_cascade_attention`.

CUDA-graph contract (decode only):
- `init_cuda_graph_state(max_bs)` once, before any capture.
- `init_forward_metadata_capture_cuda_graph(fb, cascade)` / `..._replay_cuda_graph(fb, cascade)` with
  `fb.batch_size` = the captured (padded) batch size `bs <= max_bs`, and `fb.req_pool_indices` /
  `fb.seq_lens` holding either `bs` entries or only the real `n <= bs` ones. The backend copies them
  into its own static buffers; entries `n..bs` become empty requests (seq_len 0: zero output, no KV
  read). Padding entries the caller supplies itself may use seq_len 0, or seq_len 1 with any valid
  `req_to_token` row (row 0); their `out_cache_loc` must be the dummy slot 0.
- Nothing in the decode path syncs with the host, so replay only needs the two copies above (and,
  for graphs with the cascade kernels, one copy of the step's prefix-group tables).
- A ragged variant per batch size from 8 (`has_ragged_graph`, `ragged=True`; triton_splits.py): the kernels
  of a split plan over the batch size's item capacity, its table copied into a static buffer at each replay.
  A step should replay it only when `decode_uses_ragged(fb)`.
- Two variants per batch size where `has_cascade_graph(bs)` (cascade on, bs >= its min_batch_size):
  `cascade=False`, the plain split-KV decode (exactly the kernels of a backend without cascade), and
  `cascade=True`, the cascade kernels. A step should replay the cascade one only when
  `decode_uses_cascade(fb)` (its batch has a prefix group): with nothing grouped they cost ~10% more.
  `cascade=None` (the default) means the cascade variant wherever there is one.

Shared-prefix ("cascade") decode (`triton_cascade.py`, off with `disable_cascade_attention`): when
requests of a decode batch share a prefix of KV slots (radix cache hits), the prefix is attended once
per tile of members and the split-KV decode covers only each request's suffix. It needs the batch's
rows on the host: `fb.req_pool_indices_cpu` (without it, decode is plain) and the host mirror of
req_to_token. EXTEND steps reset its cached grouping (they are what rewrites rows' prefixes).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..forward_batch import ForwardBatch
from ..kvcache.kv_quant import is_fp8
from .base import AttentionBackend, AttentionLayerSpec
from .cascade_plan import CascadeConfig
from .context import AttentionContext, AttentionHeads
from .triton_cascade import CascadeStep, TritonCascade
from .triton_ops import (
    DecodeConfig,
    DecodePolicy,
    DecodeSplits,
    ExtendConfig,
    PrefixConfig,
    decode_attention,
    decode_scratch_numel,
    default_decode_policy,
    extend_attention,
)
from .triton_ops.extend_attention import TreeMasks
from .triton_splits import TritonSplits


@dataclass
class TritonDecodeMetadata:
    req_pool_indices: torch.Tensor  # (B,) rows of req_to_token
    seq_lens: torch.Tensor  # (B,) tokens to attend over, including the new one; 0 = padding
    cascade: Optional[CascadeStep] = None  # shared-prefix tables of this step, when it uses them
    splits: Optional[DecodeSplits] = None  # the step's split plan (None: even splits, from the batch size)


@dataclass
class TritonExtendMetadata:
    req_pool_indices: torch.Tensor  # (B,)
    prefix_lens: torch.Tensor  # (B,) cached tokens before the new ones
    extend_lens: torch.Tensor  # (B,) new tokens
    extend_start: torch.Tensor  # (B,) row of each request's first new token in q
    max_extend_len: int


@dataclass
class TritonMixedMetadata:
    """A mixed step: its first `num_decode` requests decode one token each (the split-KV decode kernel),
    the others extend (the extend kernel, which reads its rows by their offsets in q)."""

    num_decode: int
    decode: TritonDecodeMetadata
    extend: TritonExtendMetadata


@dataclass
class TritonVerifyMetadata:
    """A VERIFY step's draft trees (see forward_batch.py). Chains run the extend kernel: their new tokens
    see the prefix and the tree columns before them, as an extend over prefix + tree - new tokens."""

    req_pool_indices: torch.Tensor  # (B,)
    prefix_lens: torch.Tensor  # (B,) keys every new token sees
    extend_lens: torch.Tensor  # (B,) new tokens
    extend_start: torch.Tensor  # (B,)
    tree_lens: torch.Tensor  # (B,) tree columns, the new tokens last
    max_extend_len: int
    tree_mask: Optional[torch.Tensor] = None  # (sum E_b * N_b,) uint8; None: chains
    mask_offsets: Optional[torch.Tensor] = None  # (B,)


class TritonAttnBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(
        self,
        ctx: AttentionContext,
        decode_config: Optional[DecodeConfig] = None,
        extend_config: Optional[ExtendConfig] = None,
        cascade_config: Optional[CascadeConfig] = None,
        prefix_config: Optional[PrefixConfig] = None,
    ):
        self.device = torch.device(ctx.device)
        if self.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"the triton attention backend needs a CUDA device, not {self.device.type!r} "
                "(use attention_backend='torch_native'; TRITON_INTERPRET=1 runs it slowly on CPU)"
            )
        # An explicit config (tests, sweeps) serves every batch size; the default picks by batch size (and
        # by the pool's dtype: an FP8 pool's tiles hold twice the tokens).
        kv_fp8 = ctx.kv_dtype is not None and is_fp8(ctx.kv_dtype)
        self.decode_policy = (
            DecodePolicy.uniform(decode_config)
            if decode_config is not None
            else default_decode_policy(_num_sms(self.device), kv_fp8=kv_fp8)
        )
        self.extend_config = extend_config  # None: picked per head_dim by the kernel module
        self.head_shape: Optional[AttentionHeads] = ctx.heads
        self._scratch: Optional[torch.Tensor] = None  # flat fp32 decode scratch; fixed once graphs are on
        self._scratch_max_bs = 0  # batch size the scratch is (or will be) sized for
        self._graph_req_pool_indices: Optional[torch.Tensor] = None  # (max_bs,) static
        self._graph_seq_lens: Optional[torch.Tensor] = None  # (max_bs,) static
        self._cascade_on = not ctx.disable_cascade_attention
        self._cascade_config = cascade_config or CascadeConfig()
        sms = _num_sms(self.device)
        self._prefix_config = prefix_config or PrefixConfig(num_programs=2 * sms, target_programs=4 * sms)
        self._cascade: Optional[TritonCascade] = None  # built once the head shape is known
        self._splits = TritonSplits(self.device, self.decode_policy)  # split plans, for steps that need one

    # ---- per-step metadata ----
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if fb.forward_mode.is_decode():
            cascade = self._cascade_state()
            step = cascade.eager_step(fb) if cascade is not None else None
            splits = self._eager_splits(fb.seq_lens_cpu, step)
            fb.attn_metadata = TritonDecodeMetadata(fb.req_pool_indices, fb.seq_lens, step, splits)
            return
        if self._cascade is not None:
            self._cascade.invalidate()  # this step rewrites rows' prefixes
        if fb.forward_mode.is_verify():
            fb.attn_metadata = self._verify_metadata(fb)
            return
        if fb.extend_seq_lens_cpu is None or fb.extend_prefix_lens_cpu is None:
            raise ValueError("an EXTEND ForwardBatch needs extend_seq_lens_cpu and extend_prefix_lens_cpu")
        extend_lens = fb.extend_seq_lens
        if extend_lens is None:
            extend_lens = torch.tensor(fb.extend_seq_lens_cpu, dtype=torch.int64, device=self.device)
        prefix_lens = fb.extend_prefix_lens
        if prefix_lens is None:
            prefix_lens = torch.tensor(fb.extend_prefix_lens_cpu, dtype=torch.int64, device=self.device)
        extend_start = fb.extend_start_loc
        if extend_start is None:
            extend_start = torch.cumsum(extend_lens, 0) - extend_lens  # (B,) exclusive prefix sum
        d = fb.decode_rows
        # NOTE: past the decode rows the chunks' metadata are copies, not slices: a slice past an odd number
        # of int64 rows starts 8 bytes off a 16-byte boundary, and Triton compiles another variant of the
        # extend kernel for such a pointer, in the middle of serving, the first time a step has that shape.
        chunks = (lambda t: t[d:].clone()) if d else (lambda t: t)
        extend = TritonExtendMetadata(
            chunks(fb.req_pool_indices),
            chunks(prefix_lens),
            chunks(extend_lens),
            chunks(extend_start),
            max(fb.extend_seq_lens_cpu[d:], default=0),
        )
        if d:
            # NOTE: decode rows in the extend kernel would each get a program per block of the longest
            # chunk's tokens (all but one empty) and no split of long contexts: they get the decode kernel.
            # Their shared prefixes are read once per group, as in a decode step (the planner was just
            # invalidated: this step's new rows may reuse table rows).
            cascade = self._cascade_state()
            grouped = cascade.eager_step(fb, d) if cascade is not None else None
            splits = self._eager_splits(fb.seq_lens_cpu[:d], grouped)
            decode = TritonDecodeMetadata(fb.req_pool_indices[:d], fb.seq_lens[:d], grouped, splits)
            fb.attn_metadata = TritonMixedMetadata(d, decode, extend)
        else:
            fb.attn_metadata = extend

    def forward_extend(self, q: torch.Tensor, layer: AttentionLayerSpec, fb: ForwardBatch) -> torch.Tensor:
        md = fb.attn_metadata
        q = q.view(q.shape[0], layer.num_heads, layer.head_dim)  # (T, H, D)
        out = torch.empty(q.shape[0], layer.num_heads * layer.head_dim, dtype=q.dtype, device=q.device)
        if isinstance(md, TritonMixedMetadata):
            d = md.num_decode
            self._decode(q[:d], out[:d], md.decode, layer, fb)
            md = md.extend
        self._extend(q, out, md, layer, fb)
        return out  # (T, H * D)

    def _extend(self, q, out, md, layer: AttentionLayerSpec, fb: ForwardBatch, tree: Optional[TreeMasks] = None):
        """The extend kernel: q (T, H, D) of the requests `md` (extend or verify metadata) lays out, into out
        (T, H * D); `tree`: a VERIFY step's draft trees (the kernel's tree branch)."""
        extend_attention(
            q,
            fb.kv_pool.k_buffer[layer.layer_id],
            fb.kv_pool.v_buffer[layer.layer_id],
            out.view(q.shape),
            fb.req_to_token_pool.req_to_token,
            md.req_pool_indices,
            md.prefix_lens,
            md.extend_lens,
            md.extend_start,
            md.max_extend_len,
            layer.scaling,
            self.extend_config,
            tree,
            kv_scales=fb.kv_pool.layer_scales(layer.layer_id),
        )

    def _verify_metadata(self, fb: ForwardBatch) -> TritonVerifyMetadata:
        ext = fb.extend_seq_lens
        tree_lens = fb.tree_lens if fb.tree_lens is not None else ext
        start = fb.extend_start_loc if fb.extend_start_loc is not None else torch.cumsum(ext, 0) - ext
        max_ext = max(fb.extend_seq_lens_cpu, default=0)
        if fb.tree_mask is None:  # chains: the extend kernel over the keys before each new token
            return TritonVerifyMetadata(
                fb.req_pool_indices, fb.extend_prefix_lens + tree_lens - ext, ext, start, tree_lens, max_ext
            )
        return TritonVerifyMetadata(
            fb.req_pool_indices,
            fb.extend_prefix_lens,
            ext,
            start,
            tree_lens,
            max_ext,
            fb.tree_mask.to(torch.uint8),
            fb.tree_mask_offsets,
        )

    def forward_verify(self, q: torch.Tensor, layer: AttentionLayerSpec, fb: ForwardBatch) -> torch.Tensor:
        md: TritonVerifyMetadata = fb.attn_metadata
        q = q.view(q.shape[0], layer.num_heads, layer.head_dim)  # (T, H, D)
        out = torch.empty(q.shape[0], layer.num_heads * layer.head_dim, dtype=q.dtype, device=q.device)
        # (chains: the plain extend kernel; trees: its tree branch, what tree_attention launches)
        tree = None if md.tree_mask is None else TreeMasks(md.tree_lens, md.tree_mask, md.mask_offsets)
        self._extend(q, out, md, layer, fb, tree)
        return out  # (T, H * D)

    def forward_decode(self, q: torch.Tensor, layer: AttentionLayerSpec, fb: ForwardBatch) -> torch.Tensor:
        md: TritonDecodeMetadata = fb.attn_metadata
        batch = md.seq_lens.shape[0]
        q = q.view(batch, layer.num_heads, layer.head_dim)  # (B, H, D)
        out = torch.empty(batch, layer.num_heads * layer.head_dim, dtype=q.dtype, device=q.device)
        self._decode(q, out, md, layer, fb)
        return out  # (B, H * D)

    def _decode(
        self, q: torch.Tensor, out: torch.Tensor, md: TritonDecodeMetadata, layer: AttentionLayerSpec, fb: ForwardBatch
    ) -> None:
        """One token per request: q (B, H, D) attends over its request's KV into out (B, H * D)."""
        batch = q.shape[0]
        k_buffer, v_buffer = fb.kv_pool.k_buffer[layer.layer_id], fb.kv_pool.v_buffer[layer.layer_id]
        r2t = fb.req_to_token_pool.req_to_token
        scales = fb.kv_pool.layer_scales(layer.layer_id)  # an FP8 pool's; None otherwise
        scratch = self._decode_scratch(batch, layer.num_heads, layer.num_kv_heads, layer.head_dim)
        prefix, join = None, None
        # NOTE: a layer of another head shape than the one the cascade tables were sized for (none
        # in our models) runs the plain decode, which ignores the tables and is still exact.
        shape = AttentionHeads(layer.num_heads, layer.num_kv_heads, layer.head_dim)
        if md.cascade is not None and shape == self.head_shape:
            join = self._cascade.launch_prefix(md.cascade, q, k_buffer, v_buffer, r2t, layer.scaling, scales)
            prefix = self._cascade.prefix_partials(md.cascade)
        decode_attention(
            q,
            k_buffer,
            v_buffer,
            out.view(q.shape),
            r2t,
            md.req_pool_indices,
            md.seq_lens,
            layer.scaling,
            self.decode_policy.for_batch(batch),
            scratch=scratch,
            prefix=prefix,
            before_merge=join,
            kv_scales=scales,
            splits=md.splits if shape == self.head_shape else None,
        )

    def _eager_splits(self, seq_lens: Sequence[int], step: Optional[CascadeStep]) -> Optional[DecodeSplits]:
        """An eager decode step's split plan, or None (even splits; and always with shared-prefix tables,
        see triton_splits.py)."""
        if step is not None or self.head_shape is None:
            return None
        return self._splits.eager(seq_lens, self.head_shape.num_kv_heads)

    def _cascade_state(self) -> Optional[TritonCascade]:
        if self._cascade is None and self._cascade_on and self.head_shape is not None:
            hs = self.head_shape
            self._cascade = TritonCascade(
                self.device, self._cascade_config, self._prefix_config, hs.num_heads, hs.num_kv_heads, hs.head_dim
            )
        return self._cascade

    def _decode_scratch(self, batch: int, num_heads: int, num_kv_heads: int, head_dim: int) -> Optional[torch.Tensor]:
        shape = AttentionHeads(num_heads, num_kv_heads, head_dim)
        if self.head_shape is None:
            self.head_shape = shape
        if shape != self.head_shape:
            return None  # an unexpected layer shape: decode_attention allocates its own scratch
        graphs_enabled = self._graph_seq_lens is not None
        if self._scratch is None or (batch > self._scratch_max_bs and not graphs_enabled):
            self._allocate_scratch(max(batch, self._scratch_max_bs))
        if batch > self._scratch_max_bs:
            # NOTE: once graphs are enabled the shared scratch never moves: captured graphs hold its
            # address. Batches above the largest graph run eagerly with scratch from the allocator.
            return None
        return self._scratch

    def _allocate_scratch(self, max_bs: int) -> None:
        hs = self.head_shape
        numel = max(
            decode_scratch_numel(bs, hs.num_heads, hs.num_kv_heads, hs.head_dim, self.decode_policy.for_batch(bs))
            for bs in range(1, max_bs + 1)
        )
        self._scratch = torch.empty(numel, dtype=torch.float32, device=self.device)
        self._scratch_max_bs = max_bs

    # ---- CUDA graphs (decode) ----
    def init_cuda_graph_state(self, max_bs: int) -> None:
        if max_bs < 1:
            raise ValueError(f"max_bs must be >= 1, got {max_bs}")
        self._graph_req_pool_indices = torch.zeros(max_bs, dtype=torch.int64, device=self.device)
        self._graph_seq_lens = torch.zeros(max_bs, dtype=torch.int64, device=self.device)
        self._splits.init_graph_state(max_bs, self.head_shape.num_kv_heads if self.head_shape is not None else 1)
        if self._scratch is None or self._scratch_max_bs < max_bs:
            # Sized before any capture (when the head shape is known) so that every graph shares one
            # scratch buffer that never moves; otherwise the first decode call sizes it for max_bs.
            self._scratch = None
            self._scratch_max_bs = max_bs
            if self.head_shape is not None:
                self._allocate_scratch(max_bs)
        cascade = self._cascade_state()
        if cascade is not None:
            cascade.init_graph_state(max_bs)

    def has_cascade_graph(self, bs: int) -> bool:
        """Whether decode graphs of batch `bs` also come with the cascade kernels (`cascade=True`)."""
        return self._cascade is not None and self._cascade.graph_batch(bs)

    def decode_uses_cascade(self, fb: ForwardBatch) -> bool:
        """Whether this graph step (fb.batch_size: the padded size) should replay the cascade variant:
        there is one and the step's plan groups at least one prefix. Plans on the host (cached while
        the batch's requests stay; the replay hook then reuses the plan)."""
        return self.has_cascade_graph(fb.batch_size) and self._cascade.graph_plan(fb) is not None

    def has_ragged_graph(self, bs: int) -> bool:
        """Whether decode graphs of batch `bs` also come in a ragged variant (`ragged=True`): the kernels of
        a split plan, for steps where a long request among short ones needs more splits than even splits
        give (below 8 requests even splits already cut every request into 17 or more)."""
        return self.head_shape is not None and self._splits.graph_batch(bs)

    def decode_uses_ragged(self, fb: ForwardBatch) -> bool:
        """Whether this graph step (fb.batch_size: the padded size; not a cascade step) needs the ragged
        variant (from its lengths' sum and maximum; the replay hook then makes the plan)."""
        bs = fb.batch_size
        if not self.has_ragged_graph(bs):
            return False
        assert self.head_shape is not None  # (has_ragged_graph)
        return self._splits.uneven(fb.seq_lens_cpu, self.head_shape.num_kv_heads, bs)

    def init_forward_metadata_capture_cuda_graph(
        self, fb: ForwardBatch, cascade: Optional[bool] = None, ragged: bool = False
    ) -> None:
        fb.attn_metadata = self._load_graph_inputs(fb, capture=True, cascade=cascade, ragged=ragged)

    def init_forward_metadata_replay_cuda_graph(
        self, fb: ForwardBatch, cascade: Optional[bool] = None, ragged: bool = False
    ) -> None:
        fb.attn_metadata = self._load_graph_inputs(fb, capture=False, cascade=cascade, ragged=ragged)

    def _load_graph_inputs(
        self, fb: ForwardBatch, capture: bool, cascade: Optional[bool], ragged: bool = False
    ) -> TritonDecodeMetadata:
        if self._graph_seq_lens is None:
            raise RuntimeError("call init_cuda_graph_state(max_bs) before capturing or replaying a graph")
        if not fb.forward_mode.is_decode():
            raise ValueError("CUDA graphs are only captured for DECODE batches")
        bs, max_bs = fb.batch_size, self._graph_seq_lens.shape[0]
        n = fb.seq_lens.shape[0]
        if bs > max_bs or n > bs or fb.req_pool_indices.shape[0] != n:
            raise ValueError(f"graph batch of {n} requests padded to {bs} does not fit max_bs {max_bs}")
        available = self.has_cascade_graph(bs)
        if cascade and not available:
            raise ValueError(
                f"no decode graph with the cascade kernels for batch {bs} (cascade attention "
                "disabled, or the batch is below its min_batch_size or above max_bs)"
            )
        req, seq = self._graph_req_pool_indices[:bs], self._graph_seq_lens[:bs]
        req[:n].copy_(fb.req_pool_indices, non_blocking=True)
        seq[:n].copy_(fb.seq_lens, non_blocking=True)
        if n < bs:
            req[n:].zero_()
            seq[n:].zero_()  # empty requests: no KV read, zero output
        # The plain variant carries no tables at all: decode_attention then runs the pre-cascade kernels.
        step = self._cascade.graph_step(fb, capture=capture) if available and cascade is not False else None
        if not ragged:  # even splits: the kernels take their layout from the grid, no plan
            return TritonDecodeMetadata(req, seq, step)
        if step is not None or not self.has_ragged_graph(bs):
            raise ValueError(f"no ragged decode graph for batch {bs} (or asked for one with the cascade kernels)")
        assert self.head_shape is not None  # (has_ragged_graph)
        return TritonDecodeMetadata(
            req, seq, None, self._splits.graph_step(fb.seq_lens_cpu, self.head_shape.num_kv_heads, bs)
        )


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # a Hopper card's count (an H100 SXM's); only the split heuristic uses it
