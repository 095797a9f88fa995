"""Triton's interpreter on a machine without CUDA, chosen before triton is first imported (the attention
kernel tests call it at their top); `PagedCase`: a real paged KV pool with random K/V at scattered slots and a
batch over it, as the attention backends read them; tiny tiles for the interpreter; and the triton backend's
output beside torch_native's on one case."""

import os
import sys

import pytest
import torch
from plait.runtime.attention import AttentionContext, AttentionHeads
from plait.runtime.attention.base import AttentionLayerSpec
from plait.runtime.forward_batch import ForwardBatch, ForwardMode
from plait.runtime.kvcache.memory_pool import KVPool, ReqToTokenPool


def use_triton_interpreter_without_cuda() -> None:
    """TRITON_INTERPRET=1 where there is no CUDA device, before triton is imported by the caller."""

    if not torch.cuda.is_available():
        # NOTE: Triton picks interpreted vs compiled when a function is decorated (its own library
        # included), i.e. when triton is first imported. Best: TRITON_INTERPRET=1 in the environment or
        # conftest.py. If something (transformers' generate does) imported triton earlier in compiled mode,
        # re-import it interpreted: on a machine without CUDA the compiled copy is unusable anyway, and
        # whoever holds it keeps their reference.
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            for _name in [
                m
                for m in sys.modules
                if m == "triton" or m.startswith("triton.") or m.startswith("plait.runtime.attention.triton")
            ]:
                if not _name.startswith("triton._C"):  # the C extension cannot be re-imported
                    del sys.modules[_name]


class PagedCase:
    """A real KVPool + ReqToTokenPool with random K/V at scattered slots, and a batch over them."""

    def __init__(
        self, num_heads, num_kv_heads, head_dim, prefix_lens, extend_lens, dtype=torch.float32, device="cpu", seed=0
    ):
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.layer = AttentionLayerSpec(
            layer_id=1, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, scaling=head_dim**-0.5
        )
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        num_slots = sum(seq_lens) + 7
        self.kv_pool = KVPool(num_slots, 2, num_kv_heads, head_dim, dtype, device)
        for buf in self.kv_pool.k_buffer + self.kv_pool.v_buffer:
            buf.copy_(torch.randn(buf.shape, generator=g).to(dtype))
        self.r2t_pool = ReqToTokenPool(len(seq_lens) + 3, max(seq_lens) + 5, device)
        # Scattered, non-contiguous slots and rows, as after a while of serving.
        slots = torch.randperm(num_slots, generator=g)[: sum(seq_lens)] + 1
        rows = torch.randperm(self.r2t_pool.size, generator=g)[: len(seq_lens)]
        self.slots_per_req, start = [], 0
        for row, n in zip(rows.tolist(), seq_lens):
            self.r2t_pool.write(row, 0, slots[start : start + n].to(device))
            self.slots_per_req.append(slots[start : start + n])
            start += n
        self.rows, self.prefix_lens, self.extend_lens, self.seq_lens = rows.tolist(), prefix_lens, extend_lens, seq_lens
        self.dtype, self.device, self.g = dtype, device, g

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.g).to(self.device, self.dtype)

    def forward_batch(self, mode, backend, rows=None, seq_lens=None, batch_size=None):
        dev = self.device
        rows = self.rows if rows is None else rows
        seq_lens = self.seq_lens if seq_lens is None else seq_lens
        if mode is ForwardMode.DECODE:
            out_loc = [int(self.r2t_pool.req_to_token[r, s - 1]) if s > 0 else 0 for r, s in zip(rows, seq_lens)]
            return ForwardBatch(
                forward_mode=mode,
                batch_size=batch_size or len(rows),
                input_ids=torch.zeros(len(rows), dtype=torch.int64, device=dev),
                positions=torch.tensor([max(s - 1, 0) for s in seq_lens], device=dev),
                req_pool_indices=torch.tensor(rows, device=dev),
                seq_lens=torch.tensor(seq_lens, device=dev),
                out_cache_loc=torch.tensor(out_loc, device=dev),
                seq_lens_cpu=list(seq_lens),
                req_to_token_pool=self.r2t_pool,
                kv_pool=self.kv_pool,
                attn_backend=backend,
            )
        new_slots = torch.cat([s[p:] for s, p in zip(self.slots_per_req, self.prefix_lens)])
        ext = torch.tensor(self.extend_lens, device=dev)
        return ForwardBatch(
            forward_mode=mode,
            batch_size=len(rows),
            input_ids=torch.zeros(int(ext.sum()), dtype=torch.int64, device=dev),
            positions=torch.cat([torch.arange(p, p + e) for p, e in zip(self.prefix_lens, self.extend_lens)]).to(dev),
            req_pool_indices=torch.tensor(rows, device=dev),
            seq_lens=torch.tensor(seq_lens, device=dev),
            out_cache_loc=new_slots.to(dev),
            seq_lens_cpu=list(seq_lens),
            req_to_token_pool=self.r2t_pool,
            kv_pool=self.kv_pool,
            attn_backend=backend,
            extend_prefix_lens=torch.tensor(self.prefix_lens, device=dev),
            extend_seq_lens=ext,
            extend_start_loc=torch.cumsum(ext, 0) - ext,
            extend_prefix_lens_cpu=list(self.prefix_lens),
            extend_seq_lens_cpu=list(self.extend_lens),
        )


def attention_context(device="cpu", num_attention_heads=None, num_key_value_heads=None, head_dim=None):
    """What a backend is built from; without a head shape it learns it at its first decode call."""
    if num_attention_heads is None:
        return AttentionContext(device)
    return AttentionContext(device, AttentionHeads.split(num_attention_heads, num_key_value_heads, head_dim))


def run_backend(backend, case, mode, q, k=None, v=None, **fb_kwargs):
    fb = case.forward_batch(mode, backend, **fb_kwargs)
    backend.init_forward_metadata(fb)
    if k is None:  # K/V already in the pool
        fwd = backend.forward_decode if mode is ForwardMode.DECODE else backend.forward_extend
        return fwd(q, case.layer, fb)
    return backend.forward(q, k, v, case.layer, fb)


def fused_qkv(case, t):
    # q/k/v as the model hands them over: non-contiguous slices of one fused projection output.
    h, hkv = case.layer.num_heads, case.layer.num_kv_heads
    qkv = case.randn(t, h + 2 * hkv, case.layer.head_dim)
    return qkv[:, :h], qkv[:, h : h + hkv], qkv[:, h + hkv :]


HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def tiny_tiles():
    """(ExtendConfig, DecodeConfig) with tiny tiles, so that the interpreter walks several blocks, phases and
    KV splits at small sizes (imported here, after the caller chose the interpreter)."""
    from plait.runtime.attention.triton_ops import DecodeConfig, ExtendConfig

    return (
        ExtendConfig(block_m=16, block_n=16, num_warps=4, num_stages=1),
        DecodeConfig(block_n=16, max_kv_splits=4, min_split_len=8, target_programs=64),
    )


def triton_against_reference(case, mode, **triton_configs):
    """(triton's output, torch_native's) for `case`'s batch in `mode` (EXTEND: its new tokens; DECODE: a token
    per request), over the same pool and q/k/v. `triton_configs`: the triton backend's extend_config /
    decode_config."""
    from plait.runtime.attention.torch_native import TorchNativeAttnBackend
    from plait.runtime.attention.triton_backend import TritonAttnBackend

    q, k, v = fused_qkv(case, sum(case.extend_lens) if mode is ForwardMode.EXTEND else len(case.seq_lens))
    ref = run_backend(TorchNativeAttnBackend(attention_context(case.device)), case, mode, q, k, v)
    got = run_backend(TritonAttnBackend(attention_context(case.device), **triton_configs), case, mode, q, k, v)
    return got, ref
