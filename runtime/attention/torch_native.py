"""torch_native: the reference attention backend over the paged KV pool (CPU and GPU).

Gathers each request's K/V from the pool through `req_to_token` and runs
`scaled_dot_product_attention`. Extend runs one request at a time (different prefix and extend
lengths); decode runs the whole batch at once over K/V padded to the longest sequence, and so do a mixed
step's decode rows; verify (draft trees) too, its queries padded to the largest tree and masked by prefix +
tree ancestors, and so do an extend step's requests when they all bring a few tokens (grammar-forced
tails, continuations of cached prompts): one call instead of one per request and layer, the mixed step's
decode rows joining that call where the others bring at most a few tokens. An FP8 pool's rows are
dequantized as they are gathered (kvcache/kv_quant.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from ..forward_batch import ForwardBatch
from .base import AttentionBackend, AttentionLayerSpec
from .context import AttentionContext


@dataclass
class _DecodeMetadata:
    kv_index: Optional[torch.Tensor]  # (B, S_max) int64 kv slots, padded with the dummy slot 0
    mask: Optional[torch.Tensor]  # (B, 1, 1, S_max) bool, True where a real key exists
    # On the CPU, requests of very different lengths in groups of similar ones, each padded to its own
    # longest (`_length_groups`): each group's (rows (b,) int64, its metadata), and no kv_index or mask of
    # the whole batch; None: one group, in order.
    groups: Optional[list] = None


@dataclass
class _VerifyMetadata:
    q_index: torch.Tensor  # (B, E_max) int64 rows of q (the step's new tokens), padded with row 0
    q_valid: torch.Tensor  # (B, E_max) bool
    kv_index: torch.Tensor  # (B, S_max) int64 kv slots of prefix + tree, padded with the dummy slot 0
    mask: torch.Tensor  # (B, 1, E_max, S_max) bool, True where the query sees the key
    # The first row of q when every request brings E_max tokens, one after another (no padding: q's rows are
    # read and written as a view); None otherwise, and then:
    q_start: Optional[int] = None
    q_rows: Optional[torch.Tensor] = None  # (n,) int64: q_index's valid entries, the rows of q brought, in order
    valid_at: Optional[torch.Tensor] = None  # (n,) int64: where those are in q_index flattened
    # `mask` as the additive mask of the folded queries (`_attend_padded`), by (dtype, query heads per kv head)
    _additive: Optional[dict] = None

    def additive_mask(self, dtype: torch.dtype, group: int) -> torch.Tensor:
        """(B, 1, E_max * group, S_max) of `dtype`: 0 where the query sees the key, -inf elsewhere, each query
        token's row repeated for its `group` heads (made once a step, on the first layer)."""
        if self._additive is None:
            self._additive = {}
        mask = self._additive.get((dtype, group))
        if mask is None:
            b, _, e, s = self.mask.shape
            seen = self.mask.unsqueeze(3).expand(b, 1, e, group, s).reshape(b, 1, e * group, s)
            mask = torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(~seen, float("-inf"))
            self._additive[(dtype, group)] = mask
        return mask


@dataclass
class _ExtendMetadata:
    kv_indices: list  # per request after the decode rows: (S_i,) int64 kv slots of prefix + new tokens
    causal_masks: list  # per request after the decode rows: (E_i, S_i) bool, or None when there is no prefix
    # A mixed step's leading decode rows (one token each), attended as one batch like a decode step's.
    decode: Optional[_DecodeMetadata] = None
    num_decode: int = 0
    # The requests after the decode rows as one padded batch, where `_attend_together` says so (then
    # kv_indices and causal_masks are empty).
    short: Optional[_VerifyMetadata] = None


# An extend step's requests are attended together, their queries padded to the longest and their keys to the
# longest prefix + extend, rather than one call per request and layer: always when each brings at most
# SHORT_EXTEND tokens (grammar-forced tails, continuations of cached prompts), and otherwise where the scores
# the padding adds (query-key pairs times heads) cost less than the calls it saves, at EXTEND_CALL_SCORES a
# call (two cores: ~120 us a call, ~2.3 ns a score), with the padded scores under PADDED_SCORES elements.
# (15 chat prompts of ~29 new tokens after a shared system prompt: 450 calls a step became 30.)
SHORT_EXTEND = 16
EXTEND_CALL_SCORES = 1 << 15
PADDED_SCORES = 1 << 24
# A mixed step's decode rows join its other requests' padded batch (one K/V gather and one call a layer
# instead of two) where those bring at most this many tokens: grammar-forced tails and short draft chains,
# which the decode rows are padded to.
DECODE_ROWS_JOIN_EXTEND = 4
# On the CPU a decode row's attention is bound by the K/V it gathers and reads, padding included; a group
# of rows attended apart costs about as much as this many more padded keys (its calls, per layer), so rows
# are grouped by length where the padding it saves is worth more (`_length_groups`).
GROUP_COST_KEYS = 512
# Batches past this many decode rows stay one group (the grouping's search grows with the square).
MAX_GROUPED_ROWS = 64


class TorchNativeAttnBackend(AttentionBackend):
    def __init__(self, ctx: AttentionContext):
        self.device = ctx.device
        # Query heads, for the padded scores' size (_attend_together); a context without them: the most any
        # model plait runs has a rank.
        self.num_heads = ctx.heads.num_heads if ctx.heads is not None else 128

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        r2t = fb.req_to_token_pool.req_to_token
        if fb.forward_mode.is_decode():
            lens = fb.seq_lens_cpu
            fb.attn_metadata = self._decode_metadata(r2t, fb.req_pool_indices, fb.seq_lens, max(lens), list(lens))
            return
        if fb.forward_mode.is_verify():
            fb.attn_metadata = _verify_metadata(fb, self.device)
            return
        d = fb.decode_rows
        decode = None
        ext_cpu = fb.extend_seq_lens_cpu
        if d and max(ext_cpu[d:], default=1) <= DECODE_ROWS_JOIN_EXTEND:
            keys = [p + n for p, n in zip(fb.extend_prefix_lens_cpu, ext_cpu)]
            if _length_groups(keys) is None:  # (lengths so different that padding costs more: attended apart)
                # One padded batch, the decode rows too.
                fb.attn_metadata = _ExtendMetadata([], [], None, 0, _verify_metadata(fb, self.device))
                return
        if d:
            s_max = max(p + 1 for p in fb.extend_prefix_lens_cpu[:d])
            decode = self._decode_metadata(r2t, fb.req_pool_indices[:d], fb.seq_lens[:d], s_max)
        if _attend_together(ext_cpu[d:], fb.extend_prefix_lens_cpu[d:], self.num_heads):
            fb.attn_metadata = _ExtendMetadata([], [], decode, d, _verify_metadata(fb, self.device, first=d))
            return
        kv_indices, masks = [], []
        for i in range(d, fb.batch_size):
            req = int(fb.req_pool_indices[i])
            prefix, ext = fb.extend_prefix_lens_cpu[i], fb.extend_seq_lens_cpu[i]
            kv_indices.append(r2t[req, : prefix + ext].long())
            if prefix == 0:
                masks.append(None)
            else:
                q_pos = torch.arange(ext, device=self.device)[:, None] + prefix
                k_pos = torch.arange(prefix + ext, device=self.device)[None, :]
                masks.append(k_pos <= q_pos)  # (E, S)
        fb.attn_metadata = _ExtendMetadata(kv_indices, masks, decode, d)

    def _decode_metadata(
        self, r2t, rows: torch.Tensor, seq_lens: torch.Tensor, s_max: int, lens_cpu: Optional[list] = None
    ) -> _DecodeMetadata:
        """Decode rows' keys padded to s_max; on the CPU, given the rows' lengths `lens_cpu`, in groups of
        similar lengths when that pads less (`_length_groups`)."""
        groups = _length_groups(lens_cpu) if lens_cpu is not None and torch.device(self.device).type == "cpu" else None
        if groups is not None:
            parts = []
            for members in groups:
                at = torch.tensor(members, dtype=torch.int64)
                part = self._decode_metadata(r2t, rows[at], seq_lens[at], max(lens_cpu[i] for i in members))
                parts.append((at, part))
            return _DecodeMetadata(None, None, parts)
        ar = torch.arange(s_max, device=self.device)
        mask = ar[None, :] < seq_lens[:, None]  # (B, S_max)
        kv_index = r2t[rows, :s_max].long()
        kv_index = torch.where(mask, kv_index, torch.zeros_like(kv_index))
        return _DecodeMetadata(kv_index, mask[:, None, None, :])

    def forward_extend(self, q: torch.Tensor, layer: AttentionLayerSpec, fb: ForwardBatch) -> torch.Tensor:
        md: _ExtendMetadata = fb.attn_metadata
        kv = _LayerKV.of(fb, layer)
        out = torch.empty(q.shape[0], layer.num_heads * layer.head_dim, dtype=q.dtype, device=q.device)
        gqa = layer.num_heads != layer.num_kv_heads
        dtype = scores_dtype(q)
        start = d = md.num_decode
        if md.decode is not None:
            out[:d] = _attend_one_token(q[:d].view(d, layer.num_heads, layer.head_dim), kv, md.decode, layer)
        if md.short is not None:
            _attend_padded(q, kv, md.short, layer, out)
            return out
        for j, i in enumerate(range(d, fb.batch_size)):
            ext = fb.extend_seq_lens_cpu[i]
            # NOTE: 4-D operands: with 3-D ones torch's CPU attention takes its unfused path (2.5x slower at 500
            # tokens, enable_gqa or not).
            qi = q[start : start + ext].transpose(0, 1).to(dtype)[None]  # (1, H, E, D)
            idx = md.kv_indices[j]
            ki, vi = kv.gather(idx[None], 1, dtype)  # (1, Hkv, S, D) each
            mask = md.causal_masks[j]
            oi = F.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=mask, is_causal=mask is None, scale=layer.scaling, enable_gqa=gqa
            )
            out[start : start + ext] = oi[0].transpose(0, 1).reshape(ext, -1)
            start += ext
        return out

    def forward_decode(self, q: torch.Tensor, layer: AttentionLayerSpec, fb: ForwardBatch) -> torch.Tensor:
        md: _DecodeMetadata = fb.attn_metadata
        return _attend_one_token(q, _LayerKV.of(fb, layer), md, layer)

    def forward_verify(self, q: torch.Tensor, layer: AttentionLayerSpec, fb: ForwardBatch) -> torch.Tensor:
        out = torch.empty(q.shape[0], layer.num_heads * layer.head_dim, dtype=q.dtype, device=q.device)
        _attend_padded(q, _LayerKV.of(fb, layer), fb.attn_metadata, layer, out)
        return out


@dataclass
class _LayerKV:
    """One layer's K/V buffers in the pool, and their scales when the pool stores FP8 (else None)."""

    k_buf: torch.Tensor  # (N, Hkv, D)
    v_buf: torch.Tensor
    scales: Optional[tuple[torch.Tensor, torch.Tensor]]  # 0-d float32 (k_scale, v_scale)

    @classmethod
    def of(cls, fb: ForwardBatch, layer: AttentionLayerSpec) -> "_LayerKV":
        pool, i = fb.kv_pool, layer.layer_id
        return cls(pool.k_buffer[i], pool.v_buffer[i], pool.layer_scales(i))

    def gather(self, index: torch.Tensor, token_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows at `index` (any shape), the token axis `token_dim` swapped with the head axis after
        it, widened to `dtype`: (*index.shape with Hkv at token_dim, D) each. FP8 rows are dequantized
        here, as they are gathered (times their layer's scale)."""
        k = _gather(self.k_buf, index).transpose(token_dim, token_dim + 1).to(dtype)
        v = _gather(self.v_buf, index).transpose(token_dim, token_dim + 1).to(dtype)
        if self.scales is None:
            return k, v
        return k * self.scales[0], v * self.scales[1]


def scores_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype a request's extend attention (query heads unfolded, enable_gqa) computes in: q's own, except bf16 /
    fp16 on a CPU without AMX, where torch's attention kernels in half precision so called were 4-7x slower than
    widening q, K and V to float32 first (decode rows on an AMD EPYC with AVX512-BF16, before `folded_dtype`; a
    433-token prompt about even); on an Intel Xeon with AMX bf16 attention was the faster."""
    if q.device.type != "cpu" or q.dtype == torch.float32:
        return q.dtype
    from ..quant.cpu_features import cpu_features

    return q.dtype if cpu_features().amx_bf16 else torch.float32


def folded_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype attention computes in where each kv head's query heads are folded into the query axis (decode
    rows, padded batches): q's own, except fp16 on a CPU without AMX (widened to float32). Folded, torch's CPU
    attention in bf16 beats widening to float32 on an AMD EPYC without AMX too (a layer of 32 decode rows at 450
    keys: 3.4 against 5.2 ms; 16 rows of 4 tokens: 1.0 against 5.0), where with enable_gqa it is 2-4x slower."""
    if q.device.type != "cpu" or q.dtype != torch.float16:
        return q.dtype
    return scores_dtype(q)


def _attend_one_token(q: torch.Tensor, kv: _LayerKV, md: _DecodeMetadata, layer: AttentionLayerSpec) -> torch.Tensor:
    """One query token per request, q (B, H, D), over each request's K/V padded to the longest (of its
    group, when grouped): (B, H * D)."""
    if md.groups is not None:
        out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)
        for at, part in md.groups:
            out.index_copy_(0, at, _attend_one_token(q.index_select(0, at), kv, part, layer))  # (b, H * D)
        return out
    dtype = folded_dtype(q)
    k, v = kv.gather(md.kv_index, 1, dtype)  # (B, Hkv, S, D) each
    b, heads, dim = q.shape
    # NOTE: each kv head's query heads are the query axis of one call, (B, Hkv, G, D): the same scores as
    # (B, H, 1, D) with enable_gqa, and the CPU's bf16 attention fast without AMX (`folded_dtype`).
    qb = q.reshape(b, layer.num_kv_heads, heads // layer.num_kv_heads, dim).to(dtype)
    o = F.scaled_dot_product_attention(qb, k, v, attn_mask=md.mask, scale=layer.scaling)  # (B, Hkv, G, D)
    return o.reshape(b, -1).to(q.dtype)


def _attend_padded(
    q: torch.Tensor, kv: _LayerKV, md: _VerifyMetadata, layer: AttentionLayerSpec, out: torch.Tensor
) -> None:
    """The requests of `md`, their queries padded to the longest, in one call: their rows of `out` written.

    NOTE: each kv head's query heads are folded into the query axis (B, Hkv, E * G, D), with an additive
    mask, rather than handed to the kernel as (B, H, E, D) with enable_gqa: the same scores, and on the
    CPU 1.2-2.5x faster for 2-16 query tokens (two cores; one token is not, so decode rows keep enable_gqa)."""
    heads, kv_heads, dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
    group = heads // kv_heads
    b, e = md.q_index.shape
    dtype = folded_dtype(q)
    k, v = kv.gather(md.kv_index, 1, dtype)  # (B, Hkv, S, D) each
    q3 = q.view(q.shape[0], heads, dim)
    if md.q_start is None:  # (index_select / index_copy_: on the CPU faster than indexing with tensors)
        qb = q3.index_select(0, md.q_index.view(-1)).view(b, e, heads, dim)
    else:
        qb = q3[md.q_start : md.q_start + b * e].view(b, e, heads, dim)
    qb = qb.view(b, e, kv_heads, group, dim).transpose(1, 2).reshape(b, kv_heads, e * group, dim).to(dtype)
    o = F.scaled_dot_product_attention(qb, k, v, attn_mask=md.additive_mask(dtype, group), scale=layer.scaling)
    o = o.to(q.dtype).view(b, kv_heads, e, group, dim).transpose(1, 2).reshape(b, e, heads * dim)  # (B, E, H * D)
    if md.q_start is None:
        assert md.q_rows is not None and md.valid_at is not None
        out.index_copy_(0, md.q_rows, o.view(b * e, heads * dim).index_select(0, md.valid_at))
    else:
        out[md.q_start : md.q_start + b * e] = o.view(b * e, heads * dim)


def _verify_metadata(fb: ForwardBatch, device, first: int = 0) -> _VerifyMetadata:
    """Queries padded to the largest tree, keys to the longest prefix + tree; the mask sees the prefix
    whole and the tree through fb.tree_mask (causal without one: a chain). first: the requests from this
    one on (an extend step's after its decode rows, each a chain)."""
    ext_cpu = fb.extend_seq_lens_cpu[first:]
    tree_cpu = (fb.tree_lens_cpu or fb.extend_seq_lens_cpu)[first:]
    e_max = max(ext_cpu)
    s_max = max(p + n for p, n in zip(fb.extend_prefix_lens_cpu[first:], tree_cpu))
    pre, ext = fb.extend_prefix_lens[first:], fb.extend_seq_lens[first:]  # (B,) each
    tree = fb.tree_lens[first:] if fb.tree_lens is not None else ext
    starts = (
        fb.extend_start_loc
        if fb.extend_start_loc is not None
        else torch.cumsum(fb.extend_seq_lens, 0) - fb.extend_seq_lens
    )[first:]
    e = torch.arange(e_max, device=device)  # (E,)
    cols = torch.arange(s_max, device=device)  # (S,)
    q_valid = e[None, :] < ext[:, None]  # (B, E)
    q_index = torch.where(q_valid, starts[:, None] + e[None, :], torch.zeros_like(q_valid, dtype=torch.int64))
    rel = cols[None, :] - pre[:, None]  # (B, S) tree column of each key (< 0: the prefix)
    in_tree = (rel >= 0) & (rel < tree[:, None])  # (B, S)
    if fb.tree_mask is None:  # a chain: new token e is tree column tree - ext + e, and sees up to it
        seen = rel[:, None, :] <= (tree - ext)[:, None, None] + e[None, :, None]  # (B, E, S)
    else:
        flat = (
            fb.tree_mask_offsets[:, None, None] + e[None, :, None] * tree[:, None, None] + rel.clamp(min=0)[:, None, :]
        )  # (B, E, S)
        ok = in_tree[:, None, :] & q_valid[:, :, None]
        seen = fb.tree_mask[torch.where(ok, flat, torch.zeros_like(flat))] & ok
    mask = (rel < 0)[:, None, :] | (in_tree[:, None, :] & seen)  # (B, E, S)
    mask &= q_valid[:, :, None]
    mask[:, :, 0] |= ~q_valid  # padding queries see one key (no NaN); their output is dropped
    kv_index = fb.req_to_token_pool.req_to_token[fb.req_pool_indices[first:], :s_max].long()  # (B, S)
    kv_index = torch.where(cols[None, :] < (pre + tree)[:, None], kv_index, torch.zeros_like(kv_index))
    if min(ext_cpu) == e_max:  # no padding: the queries are q's rows from the first request's on, as they are
        return _VerifyMetadata(q_index, q_valid, kv_index, mask[:, None], sum(fb.extend_seq_lens_cpu[:first]))
    valid_at = q_valid.view(-1).nonzero().view(-1)
    return _VerifyMetadata(q_index, q_valid, kv_index, mask[:, None], None, q_index.view(-1)[valid_at], valid_at)


def _attend_together(ext: list, prefix: list, heads: int) -> bool:
    """Whether requests bringing `ext` new tokens after `prefix` cached ones each are attended as one padded
    batch of `heads` query heads (SHORT_EXTEND, EXTEND_CALL_SCORES, PADDED_SCORES above)."""
    if len(ext) < 2:
        return False
    if max(ext) <= SHORT_EXTEND:
        return True
    e_max, s_max = max(ext), max(p + e for p, e in zip(prefix, ext))
    padded = len(ext) * e_max * s_max * heads
    added = padded - sum(e * (p + e) for p, e in zip(prefix, ext)) * heads
    return padded <= PADDED_SCORES and added <= (len(ext) - 1) * EXTEND_CALL_SCORES


def _length_groups(lens: list) -> Optional[list]:
    """Decode rows by key count `lens` (B,) -> groups of row numbers, each to be padded to its longest, that
    minimize the keys gathered plus GROUP_COST_KEYS a group; None when one group is best (or the batch is
    past MAX_GROUPED_ROWS). Groups are runs of the rows sorted by length, found by dynamic programming."""
    n = len(lens)
    if n < 2 or n > MAX_GROUPED_ROWS:
        return None
    order = sorted(range(n), key=lambda i: -lens[i])  # longest first: a run's first row is its longest
    best = [0] + [0] * n  # best[j]: the cost of the first j rows of `order`
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        best[j], cut[j] = min((best[i] + GROUP_COST_KEYS + (j - i) * lens[order[i]], i) for i in range(j))
    if cut[n] == 0:
        return None
    groups, j = [], n
    while j > 0:
        groups.append(order[cut[j] : j])
        j = cut[j]
    return groups[::-1]


def _gather(buf: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """buf (N, Hkv, D) rows at `index` (any shape) → (*index.shape, Hkv, D).

    NOTE: index_select on the flattened rows is faster on the CPU than advanced indexing, and this
    gather is a large share of a CPU decode step.
    """
    rows = buf.view(buf.shape[0], -1).index_select(0, index.reshape(-1))
    return rows.view(*index.shape, buf.shape[1], buf.shape[2])
