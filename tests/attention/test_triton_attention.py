"""The triton attention backend against the torch_native reference, over real paged pools.

On a machine without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set below
before triton is imported) at tiny shapes with tiny tiles, so every loop, split and mask path runs.
Tests marked `gpu` run the compiled kernels at real model sizes (`pytest -m gpu`).
"""

import dataclasses
import os
import sys

import torch

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
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from plait.runtime.attention import AttentionContext, AttentionHeads  # noqa: E402
from plait.runtime.attention.base import AttentionLayerSpec  # noqa: E402
from plait.runtime.attention.torch_native import TorchNativeAttnBackend  # noqa: E402
from plait.runtime.attention.triton_backend import TritonAttnBackend  # noqa: E402
from plait.runtime.attention.triton_ops import (
    DecodeConfig,
    DecodePolicy,
    ExtendConfig,  # noqa: E402
    decode_attention,
    default_decode_policy,
)
from plait.runtime.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from plait.runtime.kvcache.memory_pool import KVPool, ReqToTokenPool  # noqa: E402

torch.set_num_threads(1)

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")

# Tiny tiles so that the interpreter walks several blocks, phases and KV splits at small sizes.
TINY_EXTEND = ExtendConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
TINY_DECODE = DecodeConfig(block_n=16, max_kv_splits=4, min_split_len=8, target_programs=64)


class _Case:
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


def _context(device="cpu", num_attention_heads=None, num_key_value_heads=None, head_dim=None):
    """What a backend is built from; without a head shape it learns it at its first decode call."""
    if num_attention_heads is None:
        return AttentionContext(device)
    return AttentionContext(device, AttentionHeads.split(num_attention_heads, num_key_value_heads, head_dim))


def _run(backend, case, mode, q, k=None, v=None, **fb_kwargs):
    fb = case.forward_batch(mode, backend, **fb_kwargs)
    backend.init_forward_metadata(fb)
    if k is None:  # K/V already in the pool
        fwd = backend.forward_decode if mode is ForwardMode.DECODE else backend.forward_extend
        return fwd(q, case.layer, fb)
    return backend.forward(q, k, v, case.layer, fb)


def _qkv(case, t):
    # q/k/v as the model hands them over: non-contiguous slices of one fused projection output.
    h, hkv = case.layer.num_heads, case.layer.num_kv_heads
    qkv = case.randn(t, h + 2 * hkv, case.layer.head_dim)
    return qkv[:, :h], qkv[:, h : h + hkv], qkv[:, h + hkv :]


def _extend_both(case, extend_config=TINY_EXTEND):
    q, k, v = _qkv(case, sum(case.extend_lens))
    ref = _run(TorchNativeAttnBackend(_context(case.device)), case, ForwardMode.EXTEND, q, k, v)
    got = _run(TritonAttnBackend(_context(case.device), extend_config=extend_config), case, ForwardMode.EXTEND, q, k, v)
    return got, ref


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,prefix_lens,extend_lens",
    [
        (2, 2, 32, [0, 0], [5, 19]),  # no prefix, MHA, one request spans two query blocks
        (8, 2, 64, [7, 0, 33], [9, 17, 1]),  # GQA 4, mixed prefixes, a single-token extend
        (8, 1, 16, [16, 40], [16, 3]),  # GQA 8, prefix and extend on block boundaries
        (4, 1, 80, [21], [20]),  # head_dim 80 (padded to 128 in the kernel)
        (9, 3, 64, [4], [11]),  # GQA 3 (SmolLM2-135M's shape): a group that is not a power of two
        (16, 1, 16, [5, 0], [7, 9]),  # GQA 16 = the tile's 16 rows: one new token per tile
        (32, 1, 16, [3], [4]),  # GQA 32 > block_m: the tile grows to hold one token's whole group
        (8, 2, 32, [40, 40, 40], [6, 3, 5]),  # a shared-prefix shape: short extends after a long prefix
    ],
)
def test_extend_matches_torch_native(heads, kv_heads, head_dim, prefix_lens, extend_lens):
    case = _Case(heads, kv_heads, head_dim, prefix_lens, extend_lens)
    got, ref = _extend_both(case)
    assert got.shape == ref.shape == (sum(extend_lens), heads * head_dim)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


def test_extend_fp16_pool_and_default_tiles():
    case = _Case(4, 2, 64, [50], [30], dtype=torch.float16)
    got, ref = _extend_both(case, extend_config=None)
    torch.testing.assert_close(got.float(), ref.float(), atol=3e-3, rtol=3e-3)


def _mixed_both(case, decode_rows, extend_config=TINY_EXTEND, decode_config=TINY_DECODE):
    """A mixed step: the first `decode_rows` requests bring one token each (the decode kernel; torch_native's
    batched decode path), the others extend. Returns (triton, torch_native), having checked torch_native's
    mixed path against its one-request-at-a-time extend of the same step."""
    q, k, v = _qkv(case, sum(case.extend_lens))
    outs = []
    for backend, rows in (
        (TorchNativeAttnBackend(_context(case.device)), 0),
        (TorchNativeAttnBackend(_context(case.device)), decode_rows),
        (
            TritonAttnBackend(_context(case.device), extend_config=extend_config, decode_config=decode_config),
            decode_rows,
        ),
    ):
        fb = case.forward_batch(ForwardMode.EXTEND, backend)
        fb.decode_rows = rows
        backend.init_forward_metadata(fb)
        outs.append(backend.forward(q, k, v, case.layer, fb))
    tol = dict(atol=2e-5, rtol=1e-4) if q.dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(outs[1].float(), outs[0].float(), **tol)
    return outs[2], outs[1]


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,prefix_lens,extend_lens,decode_rows",
    [
        (8, 2, 64, [30, 7, 0, 12], [1, 1, 19, 5], 2),  # two decode rows, a fresh prompt, a chunk
        (9, 3, 64, [70, 16], [1, 33], 1),  # SmolLM2's heads; a decode row split over KV, a long chunk
        (4, 4, 32, [5, 9, 2], [1, 1, 1], 2),  # the extend part is itself one token
    ],
)
def test_mixed_step_matches_torch_native(heads, kv_heads, head_dim, prefix_lens, extend_lens, decode_rows):
    case = _Case(heads, kv_heads, head_dim, prefix_lens, extend_lens)
    got, ref = _mixed_both(case, decode_rows)
    assert got.shape == ref.shape == (sum(extend_lens), heads * head_dim)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


def test_torch_native_attends_short_extends_together_as_one_at_a_time(monkeypatch):
    """torch_native's padded path (each request after the decode rows brings <= SHORT_EXTEND tokens: grammar
    tails, cached prompts' last tokens) against its one-request-at-a-time extend of the same step."""
    from plait.runtime.attention import torch_native

    case = _Case(8, 2, 32, [40, 0, 13, 7], [1, 6, 3, 16])
    q, k, v = _qkv(case, sum(case.extend_lens))
    outs = []
    for short in (torch_native.SHORT_EXTEND, 0):
        monkeypatch.setattr(torch_native, "SHORT_EXTEND", short)
        backend = TorchNativeAttnBackend(_context(case.device))
        fb = case.forward_batch(ForwardMode.EXTEND, backend)
        fb.decode_rows = 1
        backend.init_forward_metadata(fb)
        assert (fb.attn_metadata.short is not None) == (short > 0)
        outs.append(backend.forward(q, k, v, case.layer, fb))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


def test_mixed_step_chunk_metadata_start_on_16_byte_boundaries():
    # Triton specializes a kernel on whether each pointer is 16-byte aligned: chunk metadata sliced past an
    # odd number of int64 decode rows would compile a second extend kernel in the middle of serving.
    case = _Case(8, 2, 64, [30, 7, 0, 12], [1, 1, 19, 5])
    for decode_rows in (1, 2, 3):
        backend = TritonAttnBackend(_context(case.device), extend_config=TINY_EXTEND, decode_config=TINY_DECODE)
        fb = case.forward_batch(ForwardMode.EXTEND, backend)
        fb.decode_rows = decode_rows
        backend.init_forward_metadata(fb)
        ext = fb.attn_metadata.extend
        for t in (ext.req_pool_indices, ext.prefix_lens, ext.extend_lens, ext.extend_start):
            assert t.data_ptr() % 16 == 0, (decode_rows, t)
        assert ext.extend_lens.tolist() == case.extend_lens[decode_rows:]


def _decode_both(case, decode_config=TINY_DECODE):
    q, k, v = _qkv(case, len(case.seq_lens))
    ref = _run(TorchNativeAttnBackend(_context(case.device)), case, ForwardMode.DECODE, q, k, v)
    got = _run(TritonAttnBackend(_context(case.device), decode_config=decode_config), case, ForwardMode.DECODE, q, k, v)
    return got, ref


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,seq_lens",
    [
        (2, 2, 64, [1, 8, 9, 70]),  # MHA; 1 token, exactly one split, 2 splits, capped at 4 splits
        (8, 2, 128, [33, 5]),  # GQA 4
        (8, 1, 96, [64, 17, 2]),  # GQA 8, head_dim 96
        (9, 3, 64, [40, 3]),  # GQA 3 (SmolLM2-135M's shape)
    ],
)
def test_decode_matches_torch_native(heads, kv_heads, head_dim, seq_lens):
    case = _Case(heads, kv_heads, head_dim, [s - 1 for s in seq_lens], [1] * len(seq_lens))
    got, ref = _decode_both(case)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("merge_per_head", [False, True])
def test_decode_with_an_empty_last_split(merge_per_head):
    # seq_len 9 in 4 splits of cdiv(9, 4) = 3 tokens: the 4th split is empty and must be ignored.
    cfg = DecodeConfig(block_n=16, max_kv_splits=4, min_split_len=2, target_programs=64, merge_per_head=merge_per_head)
    case = _Case(4, 4, 32, [8, 12], [1, 1])
    got, ref = _decode_both(case, decode_config=cfg)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,seq_lens",
    [
        (8, 2, 128, [33, 5, 70]),  # GQA 4, up to 4 splits
        (9, 3, 64, [40, 3]),  # GQA 3
    ],
)
def test_decode_merge_per_head_matches_torch_native(heads, kv_heads, head_dim, seq_lens):
    # The small-batch stage 2 (one program per request and head) against the reference.
    cfg = DecodeConfig(block_n=16, max_kv_splits=4, min_split_len=8, target_programs=64, merge_per_head=True)
    case = _Case(heads, kv_heads, head_dim, [s - 1 for s in seq_lens], [1] * len(seq_lens))
    got, ref = _decode_both(case, decode_config=cfg)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


def test_decode_with_one_split_writes_the_output_from_stage_one():
    # target_programs 1: one split per request, so stage 1 writes the output and stage 2 is skipped.
    cfg = DecodeConfig(block_n=16, max_kv_splits=4, min_split_len=2, target_programs=1)
    assert cfg.split_cap(3, 2) == 1
    case = _Case(8, 2, 32, [20, 3, 40], [1, 1, 1])
    got, ref = _decode_both(case, decode_config=cfg)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
    # A padding request (seq_len 0) gets a zero output, not what the buffer held.
    q = case.randn(3, 8, 32)
    out = torch.full((3, 8, 32), float("nan"))
    seq = torch.tensor(case.seq_lens)
    seq[1] = 0
    decode_attention(
        q,
        case.kv_pool.k_buffer[1],
        case.kv_pool.v_buffer[1],
        out,
        case.r2t_pool.req_to_token,
        torch.tensor(case.rows),
        seq,
        32**-0.5,
        cfg,
    )
    assert torch.equal(out[1], torch.zeros(8, 32)) and not out.isnan().any()


def test_min_splits_floor_splits_a_full_batch_and_stage_two_merges_them():
    # target_programs 1 alone would give one split per request; min_splits 2 keeps two (the wave
    # quantization fix for large batches), so stage 2 runs, over requests of 1 to 40 tokens.
    cfg = DecodeConfig(block_n=16, max_kv_splits=4, min_split_len=8, target_programs=1, min_splits=2)
    assert cfg.split_cap(512, 8) == 2
    case = _Case(8, 2, 32, [20, 0, 39, 8], [1, 1, 1, 1])
    got, ref = _decode_both(case, decode_config=cfg)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


def test_decode_with_the_large_batch_tiles_matches_torch_native():
    # The policy's tiles above 32 requests (two KV heads a program, 3 stages), at small sizes.
    cfg = default_decode_policy(132).for_batch(64)
    cfg = dataclasses.replace(cfg, max_kv_splits=4, min_split_len=8, target_programs=8)
    case = _Case(8, 2, 64, [199, 64, 5, 130], [1] * 4)
    got, ref = _decode_both(case, decode_config=cfg)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,hpp,seq_lens",
    [
        (16, 4, 32, 2, [33, 5, 70, 1]),  # GQA 4: two heads fill the 16 rows
        (16, 4, 32, 4, [33, 5, 70, 1]),  # four heads: 16 rows, 128 packed columns
        (8, 8, 64, 4, [20, 9]),  # MHA: 4 rows padded to 16
        (12, 6, 48, 2, [40, 3, 17]),  # head_dim 48 padded to 64 per head; 3 programs of 2 heads
        (9, 3, 64, 2, [40, 3]),  # 3 KV heads: 2 does not divide them, so 1 a program
        (14, 2, 64, 2, [25, 60]),  # GQA 7 (Qwen2.5-0.5B): 14 rows
    ],
)
@pytest.mark.parametrize("merge_per_head", [False, True])
def test_decode_with_several_kv_heads_a_program_matches_torch_native(
    heads, kv_heads, head_dim, hpp, seq_lens, merge_per_head
):
    cfg = DecodeConfig(
        block_n=16,
        max_kv_splits=4,
        min_split_len=8,
        target_programs=16,
        kv_heads_per_program=hpp,
        merge_per_head=merge_per_head,
    )
    case = _Case(heads, kv_heads, head_dim, [s - 1 for s in seq_lens], [1] * len(seq_lens))
    got, ref = _decode_both(case, decode_config=cfg)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


def test_kv_heads_per_program_divides_the_model_heads_and_sets_the_split_cap():
    cfg = DecodeConfig(kv_heads_per_program=4, target_programs=64)
    assert [cfg.heads_per_program(n) for n in (8, 4, 6, 3, 1)] == [4, 4, 2, 1, 1]
    # 8 KV heads at 4 a program: a batch of 4 has 8 programs per split, so 8 splits reach 64 programs.
    assert cfg.split_cap(4, 8) == 8 and DecodeConfig(target_programs=64).split_cap(4, 8) == 2
    with pytest.raises(ValueError, match="kv_heads_per_program"):
        DecodeConfig(kv_heads_per_program=3)


def test_default_decode_policy_picks_tiles_by_batch_size():
    policy = default_decode_policy(132)
    tiny, small, large = policy.for_batch(1), policy.for_batch(8), policy.for_batch(256)
    assert policy.for_batch(4) is tiny and policy.for_batch(5) is small and policy.for_batch(32) is small
    assert policy.for_batch(33) is large and policy.for_batch(1000) is large
    assert tiny.merge_per_head and small.merge_per_head and not large.merge_per_head  # batch 1: 32 head merges
    assert (tiny.num_stages, small.num_stages, large.num_stages) == (2, 3, 3)
    assert (small.kv_heads_per_program, large.kv_heads_per_program) == (1, 2)
    assert large.split_cap(64, 8) == 2 and large.split_cap(512, 8) == 1 and tiny.split_cap(1, 8) == 64
    uniform = DecodePolicy.uniform(small)
    assert uniform.for_batch(1) is small and uniform.for_batch(4096) is small
    # The backend's default follows the policy; an explicit config serves every batch size.
    backend = TritonAttnBackend(_context("cpu"))
    assert backend.decode_policy.for_batch(300).kv_heads_per_program == 2
    assert TritonAttnBackend(_context("cpu"), decode_config=TINY_DECODE).decode_policy.for_batch(300) is TINY_DECODE


def test_cuda_graph_hooks_pad_and_reuse_static_buffers():
    case = _Case(8, 2, 32, [10, 24, 3, 40, 5], [1] * 5)
    layer = case.layer
    backend = TritonAttnBackend(
        _context(num_attention_heads=8, num_key_value_heads=2, head_dim=32), decode_config=TINY_DECODE
    )
    backend.init_cuda_graph_state(max_bs=4)
    scratch_ptr = backend._scratch.data_ptr()
    reference = TorchNativeAttnBackend(_context())
    q = case.randn(4, layer.num_heads, layer.head_dim)

    def graph_step(rows, seq_lens, hook):
        fb = case.forward_batch(ForwardMode.DECODE, backend, rows=rows, seq_lens=seq_lens, batch_size=4)
        hook(fb)
        return fb.attn_metadata, backend.forward_decode(q, layer, fb)

    # Capture with 4 real requests.
    md1, out1 = graph_step(case.rows[:4], case.seq_lens[:4], backend.init_forward_metadata_capture_cuda_graph)
    ref1 = _run(reference, case, ForwardMode.DECODE, q, rows=case.rows[:4], seq_lens=case.seq_lens[:4])
    torch.testing.assert_close(out1, ref1, atol=2e-5, rtol=1e-4)

    # Replay with 3 real requests: the backend pads the 4th (stale from the capture) to empty.
    rows2, lens2 = case.rows[2:], case.seq_lens[2:]
    md2, out2 = graph_step(rows2, lens2, backend.init_forward_metadata_replay_cuda_graph)
    ref2 = _run(reference, case, ForwardMode.DECODE, q[:3], rows=rows2, seq_lens=lens2)
    torch.testing.assert_close(out2[:3], ref2, atol=2e-5, rtol=1e-4)
    assert torch.count_nonzero(out2[3]) == 0  # the padding request attends over nothing
    # A captured graph would read the same static storage, now holding the new batch.
    assert md2.seq_lens.data_ptr() == md1.seq_lens.data_ptr()
    assert md2.req_pool_indices.data_ptr() == md1.req_pool_indices.data_ptr()
    assert md1.seq_lens.tolist() == lens2 + [0]

    # Replay padded by the caller instead (seq_len 1 on row 0, i.e. the dummy slot).
    rows3, lens3 = [case.rows[4], case.rows[0], 0, 0], [case.seq_lens[4], case.seq_lens[0], 1, 1]
    _, out3 = graph_step(rows3, lens3, backend.init_forward_metadata_replay_cuda_graph)
    ref3 = _run(reference, case, ForwardMode.DECODE, q[:2], rows=rows3[:2], seq_lens=lens3[:2])
    torch.testing.assert_close(out3[:2], ref3, atol=2e-5, rtol=1e-4)

    # An eager batch above max_bs still works and leaves the graphs' scratch where it was.
    q5 = case.randn(5, layer.num_heads, layer.head_dim)
    got5 = _run(backend, case, ForwardMode.DECODE, q5)
    torch.testing.assert_close(got5, _run(reference, case, ForwardMode.DECODE, q5), atol=2e-5, rtol=1e-4)
    assert backend._scratch.data_ptr() == scratch_ptr

    with pytest.raises(ValueError, match="max_bs"):  # 5 requests > max_bs 4
        backend.init_forward_metadata_replay_cuda_graph(case.forward_batch(ForwardMode.DECODE, backend))


def test_bad_shapes_are_rejected_with_a_clear_error(monkeypatch):
    case = _Case(6, 4, 32, [3], [1])
    q = case.randn(1, 6, 32)
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
        decode_attention(
            q,
            case.kv_pool.k_buffer[0],
            case.kv_pool.v_buffer[0],
            out,
            case.r2t_pool.req_to_token,
            torch.tensor(case.rows),
            torch.tensor(case.seq_lens),
            1.0,
            TINY_DECODE,
        )
    with pytest.raises(ValueError, match="block_n"):
        DecodeConfig(block_n=24)
    if not HAS_CUDA:
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(ValueError, match="needs a CUDA device"):
            TritonAttnBackend(_context("cpu"))


# ---------------------------------------------------------------- GPU, real sizes (pytest -m gpu)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("head_dim", [128, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_extend_real_sizes(head_dim, dtype):
    case = _Case(32, 8, head_dim, [3000, 0, 517], [1096, 2048, 1], dtype=dtype, device="cuda")
    got, ref = _extend_both(case, extend_config=None)
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@needs_cuda
def test_gpu_mixed_step_real_sizes():
    lens = [4096, 1, 700, 17]
    case = _Case(32, 8, 128, [s - 1 for s in lens] + [3000, 0], [1] * 4 + [1096, 512], torch.bfloat16, "cuda")
    got, ref = _mixed_both(case, 4, extend_config=None, decode_config=None)
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("head_dim", [128, 64])
def test_gpu_decode_real_sizes(head_dim):
    lens = [4096, 1, 4000, 17, 2048, 300, 1024, 4095]
    case = _Case(32, 8, head_dim, [s - 1 for s in lens], [1] * len(lens), dtype=torch.bfloat16, device="cuda")
    got, ref = _decode_both(case, decode_config=None)
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@needs_cuda
def test_gpu_decode_large_batch_takes_the_large_batch_tiles():
    gen = torch.Generator().manual_seed(3)
    lens = torch.randint(1, 900, (300,), generator=gen).tolist()  # 300 requests: two KV heads a program
    case = _Case(32, 8, 128, [s - 1 for s in lens], [1] * len(lens), dtype=torch.bfloat16, device="cuda")
    got, ref = _decode_both(case, decode_config=None)
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@needs_cuda
def test_gpu_decode_cuda_graph_capture_and_replay():
    lens = [4096, 100, 2500, 7, 1500, 3000]
    case = _Case(32, 8, 128, [s - 1 for s in lens], [1] * len(lens), dtype=torch.bfloat16, device="cuda")
    layer = case.layer
    backend = TritonAttnBackend(_context("cuda", num_attention_heads=32, num_key_value_heads=8, head_dim=128))
    backend.init_cuda_graph_state(max_bs=8)
    q = case.randn(8, layer.num_heads, layer.head_dim)
    fb = case.forward_batch(ForwardMode.DECODE, backend, rows=case.rows[:3], seq_lens=lens[:3], batch_size=8)
    backend.init_forward_metadata_capture_cuda_graph(fb)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.forward_decode(q, layer, fb)  # warm-up compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward_decode(q, layer, fb)
    reference = TorchNativeAttnBackend(_context("cuda"))
    for rows, seq_lens in [(case.rows[:3], lens[:3]), (case.rows[3:], lens[3:]), (case.rows, lens)]:
        fb = case.forward_batch(ForwardMode.DECODE, backend, rows=rows, seq_lens=seq_lens, batch_size=8)
        backend.init_forward_metadata_replay_cuda_graph(fb)
        graph.replay()
        n = len(rows)
        ref = _run(reference, case, ForwardMode.DECODE, q[:n], rows=rows, seq_lens=seq_lens)
        torch.testing.assert_close(out[:n].float(), ref.float(), atol=2e-2, rtol=2e-2)
        assert torch.count_nonzero(out[n:]) == 0
