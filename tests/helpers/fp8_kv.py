"""Paired KV pools for FP8 KV-cache tests: one stores FP8 with per-layer scales, the other (the reference) holds
exactly what the FP8 one dequantizes to, in a wide dtype. An attention path reading the FP8 pool must then match
the same path reading the reference pool up to float rounding (the kernels fold the scales into the softmax
scale and the output instead of widening K/V first), so any gap is a dequantization bug, not FP8's rounding."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from plait.runtime.attention.base import AttentionLayerSpec
from plait.runtime.forward_batch import ForwardBatch, ForwardMode
from plait.runtime.kvcache.kv_quant import quantize
from plait.runtime.kvcache.memory_pool import KVPool, ReqToTokenPool

K_SCALE, V_SCALE = 0.5, 2.0  # not 1.0, so a scale left out or applied twice shows


class Fp8Case:
    """Requests of `prefix_lens` cached + `extend_lens` new tokens over scattered slots of both pools (layer 1 of
    2, so a layer index mix-up shows). `magnitude`: K/V are randn * magnitude before quantization. `shared`:
    every request's first `shared` positions hold the same slots (a prefix the radix cache shares)."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        prefix_lens: list[int],
        extend_lens: list[int],
        fp8_dtype: torch.dtype = torch.float8_e4m3fn,
        ref_dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        magnitude: float = 3.0,
        seed: int = 0,
        shared: int = 0,
    ):
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.layer = AttentionLayerSpec(1, num_heads, num_kv_heads, head_dim, head_dim**-0.5)
        self.prefix_lens, self.extend_lens = prefix_lens, extend_lens
        self.seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        num_slots = sum(self.seq_lens) + 7
        self.fp8 = KVPool(num_slots, 2, num_kv_heads, head_dim, fp8_dtype, device)
        self.fp8.set_scales(torch.tensor([1.0, K_SCALE]), torch.tensor([1.0, V_SCALE]))
        self.ref = KVPool(num_slots, 2, num_kv_heads, head_dim, ref_dtype, device)
        for layer in range(2):
            for bufs, ref_bufs, scale in (
                (self.fp8.k_buffer, self.ref.k_buffer, self.fp8.k_scale[layer]),
                (self.fp8.v_buffer, self.ref.v_buffer, self.fp8.v_scale[layer]),
            ):
                values = (torch.randn(bufs[layer].shape, generator=g) * magnitude).to(device)
                bufs[layer].copy_(quantize(values, scale, fp8_dtype))
                ref_bufs[layer].copy_((bufs[layer].float() * scale).to(ref_dtype))
        self.r2t = ReqToTokenPool(len(self.seq_lens) + 3, max(self.seq_lens) + 5, device)
        slots = torch.randperm(num_slots, generator=g)[: sum(self.seq_lens)] + 1
        self.rows = torch.randperm(self.r2t.size, generator=g)[: len(self.seq_lens)].tolist()
        self.slots_per_req, start = [], shared
        for row, n in zip(self.rows, self.seq_lens):
            own = torch.cat([slots[:shared], slots[start : start + n - shared]])
            self.r2t.write(row, 0, own.to(device))
            self.slots_per_req.append(own)
            start += n - shared
        self.device, self.ref_dtype, self.g = device, ref_dtype, g

    def q(self, tokens: int) -> torch.Tensor:
        """(T, H, D) queries in the reference dtype (the model's)."""
        shape = (tokens, self.layer.num_heads, self.layer.head_dim)
        return torch.randn(shape, generator=self.g).to(self.device, self.ref_dtype)

    def batch(self, mode: ForwardMode, pool: KVPool, backend, decode_rows: int = 0, tree: bool = False) -> ForwardBatch:
        """A DECODE batch (each request's last token), or an EXTEND / VERIFY one (its new tokens) over `pool`.
        VERIFY: the new tokens are a draft tree over the prefix, each seeing the tree columns up to itself
        (`tree`: through an explicit mask, else as a chain)."""
        dev = self.device
        rows = torch.tensor(self.rows, device=dev)
        seq = torch.tensor(self.seq_lens, device=dev)
        common = dict(
            req_pool_indices=rows,
            seq_lens=seq,
            seq_lens_cpu=list(self.seq_lens),
            req_to_token_pool=self.r2t,
            kv_pool=pool,
            attn_backend=backend,
        )
        if mode is ForwardMode.DECODE:
            common["req_pool_indices_cpu"] = np.asarray(self.rows, dtype=np.int64)  # (the cascade plans from it)
            loc = [int(s[-1]) for s in self.slots_per_req]
            return ForwardBatch(
                forward_mode=mode,
                batch_size=len(self.rows),
                input_ids=torch.zeros(len(self.rows), dtype=torch.int64, device=dev),
                positions=seq - 1,
                out_cache_loc=torch.tensor(loc, device=dev),
                **common,
            )
        ext = torch.tensor(self.extend_lens, device=dev)
        fb = ForwardBatch(
            forward_mode=mode,
            batch_size=len(self.rows),
            input_ids=torch.zeros(int(ext.sum()), dtype=torch.int64, device=dev),
            positions=torch.cat([torch.arange(p, p + e) for p, e in zip(self.prefix_lens, self.extend_lens)]).to(dev),
            out_cache_loc=torch.cat([s[p:] for s, p in zip(self.slots_per_req, self.prefix_lens)]).to(dev),
            extend_prefix_lens=torch.tensor(self.prefix_lens, device=dev),
            extend_seq_lens=ext,
            extend_start_loc=torch.cumsum(ext, 0) - ext,
            extend_prefix_lens_cpu=list(self.prefix_lens),
            extend_seq_lens_cpu=list(self.extend_lens),
            decode_rows=decode_rows,
            **common,
        )
        if mode is ForwardMode.VERIFY:
            fb.tree_lens, fb.tree_lens_cpu = ext, list(self.extend_lens)
            if tree:
                masks = [torch.ones(e, e, dtype=torch.bool).tril() for e in self.extend_lens]
                for m in masks:  # a branch: node 2 does not see node 1 (both children of the root)
                    if m.shape[0] > 2:
                        m[2, 1] = False
                fb.tree_mask = torch.cat([m.reshape(-1) for m in masks]).to(dev)
                sizes = torch.tensor([e * e for e in self.extend_lens])
                fb.tree_mask_offsets = (torch.cumsum(sizes, 0) - sizes).to(dev)
        return fb


def attend(backend, case: Fp8Case, pool: KVPool, mode: ForwardMode, q: torch.Tensor, **kwargs) -> torch.Tensor:
    """The backend's attention of `q` over K/V already in `pool` (nothing is written): (T, H * D)."""
    fb = case.batch(mode, pool, backend, **kwargs)
    backend.init_forward_metadata(fb)
    if mode is ForwardMode.DECODE:
        return backend.forward_decode(q, case.layer, fb)
    if mode is ForwardMode.VERIFY:
        return backend.forward_verify(q, case.layer, fb)
    return backend.forward_extend(q, case.layer, fb)


def both(make_backend, case: Fp8Case, mode: ForwardMode, tokens: Optional[int] = None, **kwargs):
    """(output over the FP8 pool, output over the reference pool), from fresh backends and the same queries."""
    q = case.q(
        tokens if tokens is not None else (len(case.rows) if mode is ForwardMode.DECODE else sum(case.extend_lens))
    )
    return (
        attend(make_backend(), case, case.fp8, mode, q, **kwargs),
        attend(make_backend(), case, case.ref, mode, q, **kwargs),
    )
