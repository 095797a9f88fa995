"""The triton attention backend's extend and mixed steps against the torch_native reference, over real paged
pools (decode: test_triton_decode_attention.py).

On a machine without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set below before triton
is imported) at tiny shapes with tiny tiles, so every loop, split and mask path runs. Tests marked `gpu` run the
compiled kernels at real model sizes (`pytest -m gpu`).
"""

import torch
from helpers.paged_attention import (
    HAS_CUDA,
    PagedCase,
    attention_context,
    fused_qkv,
    needs_cuda,
    tiny_tiles,
    triton_against_reference,
    use_triton_interpreter_without_cuda,
)

use_triton_interpreter_without_cuda()


import pytest  # noqa: E402
from plait.runtime.attention.torch_native import TorchNativeAttnBackend  # noqa: E402
from plait.runtime.attention.triton_backend import TritonAttnBackend  # noqa: E402
from plait.runtime.attention.triton_ops import (  # noqa: E402
    DecodeConfig,
    decode_attention,
)
from plait.runtime.forward_batch import ForwardMode  # noqa: E402

torch.set_num_threads(1)

TINY_EXTEND, TINY_DECODE = tiny_tiles()


def _extend_both(case, extend_config=TINY_EXTEND):
    return triton_against_reference(case, ForwardMode.EXTEND, extend_config=extend_config)


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
    case = PagedCase(heads, kv_heads, head_dim, prefix_lens, extend_lens)
    got, ref = _extend_both(case)
    assert got.shape == ref.shape == (sum(extend_lens), heads * head_dim)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


def test_extend_fp16_pool_and_default_tiles():
    case = PagedCase(4, 2, 64, [50], [30], dtype=torch.float16)
    got, ref = _extend_both(case, extend_config=None)
    torch.testing.assert_close(got.float(), ref.float(), atol=3e-3, rtol=3e-3)


def _mixed_both(case, decode_rows, extend_config=TINY_EXTEND, decode_config=TINY_DECODE):
    """A mixed step: the first `decode_rows` requests bring one token each (the decode kernel; torch_native's
    batched decode path), the others extend. Returns (triton, torch_native), having checked torch_native's
    mixed path against its one-request-at-a-time extend of the same step."""
    q, k, v = fused_qkv(case, sum(case.extend_lens))
    outs = []
    for backend, rows in (
        (TorchNativeAttnBackend(attention_context(case.device)), 0),
        (TorchNativeAttnBackend(attention_context(case.device)), decode_rows),
        (
            TritonAttnBackend(attention_context(case.device), extend_config=extend_config, decode_config=decode_config),
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
    case = PagedCase(heads, kv_heads, head_dim, prefix_lens, extend_lens)
    got, ref = _mixed_both(case, decode_rows)
    assert got.shape == ref.shape == (sum(extend_lens), heads * head_dim)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


def test_mixed_step_decode_rows_of_a_split_plan():
    # Nine decode rows, one of them long, and a prefill chunk: the decode rows take the step's split plan
    # (even splits would give each one split here), the chunk the extend kernel.
    ragged = DecodeConfig(block_n=16, max_kv_splits=16, min_split_len=8, target_programs=18)
    case = PagedCase(8, 2, 32, [6, 9, 4, 7, 5, 8, 150, 6, 5, 20], [1] * 9 + [13])
    q, k, v = fused_qkv(case, sum(case.extend_lens))
    outs = []
    heads = attention_context(case.device, 8, 2, 32)
    for backend in (
        TorchNativeAttnBackend(attention_context(case.device)),
        TritonAttnBackend(heads, extend_config=TINY_EXTEND, decode_config=ragged),
    ):
        fb = case.forward_batch(ForwardMode.EXTEND, backend)
        fb.decode_rows = 9
        backend.init_forward_metadata(fb)
        outs.append(backend.forward(q, k, v, case.layer, fb))
    splits = fb.attn_metadata.decode.splits
    assert splits is not None and splits.merge and splits.items > 9
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "prefix_lens,extend_lens",
    [
        ([40, 0, 13, 7], [1, 6, 3, 16]),  # each brings <= SHORT_EXTEND tokens (grammar tails, cached prompts)
        ([40, 28, 28, 28, 28], [1, 29, 31, 27, 30]),  # chat prompts after a shared system prompt: little padding
        ([5, 0, 0], [1, 24, 20]),  # no prefix: the causal mask alone
        ([40, 10, 20], [1, 6, 6]),  # as many tokens each: q's rows read and written as a view
        ([40, 33, 12, 7], [1, 2, 2, 1]),  # forced tails: the decode row joins the padded batch
        ([900, 33, 12], [1, 2, 3]),  # the same, but the decode row's keys are many more: it is attended apart
    ],
)
def test_torch_native_attends_extends_together_as_one_at_a_time(monkeypatch, prefix_lens, extend_lens):
    """torch_native's padded path for an extend step's requests after the decode rows (`_attend_together`;
    with the decode row too where the others bring a few tokens) against its one-request-at-a-time extend of
    the same step."""
    from plait.runtime.attention import torch_native

    case = PagedCase(8, 2, 32, prefix_lens, extend_lens)
    q, k, v = fused_qkv(case, sum(case.extend_lens))
    outs = []
    for together in (True, False):
        if not together:
            monkeypatch.setattr(torch_native, "SHORT_EXTEND", 0)
            monkeypatch.setattr(torch_native, "PADDED_SCORES", 0)
            monkeypatch.setattr(torch_native, "DECODE_ROWS_JOIN_EXTEND", 0)
        backend = TorchNativeAttnBackend(attention_context(case.device, 8, 2, 32))
        fb = case.forward_batch(ForwardMode.EXTEND, backend)
        fb.decode_rows = 1
        backend.init_forward_metadata(fb)
        md = fb.attn_metadata
        assert (md.short is not None) == together
        joined = together and max(extend_lens[1:]) <= 4 and prefix_lens[0] < 100
        assert (md.num_decode == 0 and md.decode is None) == joined
        if together:
            assert (md.short.q_start is not None) == (len(set(extend_lens[md.num_decode :])) == 1)
        outs.append(backend.forward(q, k, v, case.layer, fb))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


def test_torch_native_attends_apart_where_padding_would_cost_more():
    from plait.runtime.attention.torch_native import PADDED_SCORES, _attend_together

    assert _attend_together([3, 16, 1], [900, 0, 4], heads=9)  # all short: together whatever the keys
    assert _attend_together([29, 31, 27], [28, 28, 28], heads=9)
    assert not _attend_together([400, 20], [0, 0], heads=9)  # one long prompt among short ones: 2x the pairs
    assert not _attend_together([30], [0], heads=9)  # one request: nothing to batch
    n = int((PADDED_SCORES / 9 / 16) ** 0.5) + 1  # 16 equal prompts just past the padded scores' bound
    assert _attend_together([n - 8] * 16, [0] * 16, heads=9) and not _attend_together([n] * 16, [0] * 16, heads=9)


def test_mixed_step_chunk_metadata_start_on_16_byte_boundaries():
    # Triton specializes a kernel on whether each pointer is 16-byte aligned: chunk metadata sliced past an
    # odd number of int64 decode rows would compile a second extend kernel in the middle of serving.
    case = PagedCase(8, 2, 64, [30, 7, 0, 12], [1, 1, 19, 5])
    for decode_rows in (1, 2, 3):
        backend = TritonAttnBackend(
            attention_context(case.device), extend_config=TINY_EXTEND, decode_config=TINY_DECODE
        )
        fb = case.forward_batch(ForwardMode.EXTEND, backend)
        fb.decode_rows = decode_rows
        backend.init_forward_metadata(fb)
        ext = fb.attn_metadata.extend
        for t in (ext.req_pool_indices, ext.prefix_lens, ext.extend_lens, ext.extend_start):
            assert t.data_ptr() % 16 == 0, (decode_rows, t)
        assert ext.extend_lens.tolist() == case.extend_lens[decode_rows:]


def test_bad_shapes_are_rejected_with_a_clear_error(monkeypatch):
    case = PagedCase(6, 4, 32, [3], [1])
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
            TritonAttnBackend(attention_context("cpu"))


# ---------------------------------------------------------------- GPU, real sizes (pytest -m gpu)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("head_dim", [128, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_extend_real_sizes(head_dim, dtype):
    case = PagedCase(32, 8, head_dim, [3000, 0, 517], [1096, 2048, 1], dtype=dtype, device="cuda")
    got, ref = _extend_both(case, extend_config=None)
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@needs_cuda
def test_gpu_mixed_step_real_sizes():
    lens = [4096, 1, 700, 17]
    case = PagedCase(32, 8, 128, [s - 1 for s in lens] + [3000, 0], [1] * 4 + [1096, 512], torch.bfloat16, "cuda")
    got, ref = _mixed_both(case, 4, extend_config=None, decode_config=None)
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)
