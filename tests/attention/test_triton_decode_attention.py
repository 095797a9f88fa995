"""The triton attention backend's split-KV decode against the torch_native reference, over real paged pools:
splits, the merge, tiles by batch size, KV heads a program, the CUDA-graph hooks (extend and mixed steps:
test_triton_attention.py).

On a machine without CUDA the kernels run in Triton's interpreter at tiny shapes with tiny tiles. Tests marked
`gpu` run the compiled kernels at real model sizes (`pytest -m gpu`).
"""

import dataclasses

import torch
from helpers.paged_attention import (
    PagedCase,
    attention_context,
    needs_cuda,
    run_backend,
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
    DecodePolicy,
    DecodeSplits,
    decode_attention,
    default_decode_policy,
    needs_plan,
    plan_splits,
)
from plait.runtime.forward_batch import ForwardMode  # noqa: E402

torch.set_num_threads(1)

TINY_EXTEND, TINY_DECODE = tiny_tiles()


def _decode_both(case, decode_config=TINY_DECODE):
    return triton_against_reference(case, ForwardMode.DECODE, decode_config=decode_config)


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
    case = PagedCase(heads, kv_heads, head_dim, [s - 1 for s in seq_lens], [1] * len(seq_lens))
    got, ref = _decode_both(case)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("merge_per_head", [False, True])
def test_decode_with_an_empty_last_split(merge_per_head):
    # seq_len 9 in 4 splits of cdiv(9, 4) = 3 tokens: the 4th split is empty and must be ignored.
    cfg = DecodeConfig(block_n=16, max_kv_splits=4, min_split_len=2, target_programs=64, merge_per_head=merge_per_head)
    case = PagedCase(4, 4, 32, [8, 12], [1, 1])
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
    case = PagedCase(heads, kv_heads, head_dim, [s - 1 for s in seq_lens], [1] * len(seq_lens))
    got, ref = _decode_both(case, decode_config=cfg)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


def test_decode_with_one_split_writes_the_output_from_stage_one():
    # target_programs 1: one split per request, so stage 1 writes the output and stage 2 is skipped.
    cfg = DecodeConfig(block_n=16, max_kv_splits=4, min_split_len=2, target_programs=1)
    assert plan_splits([20, 3, 40], cfg, 2).max_splits == 1
    case = PagedCase(8, 2, 32, [20, 3, 40], [1, 1, 1])
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


@pytest.mark.parametrize("merge_per_head", [False, True])
def test_a_long_request_gets_more_splits_than_its_short_neighbours(merge_per_head):
    # One split length for the step (19 tokens: 151 x 2 KV heads / 16 programs): the 120-token request gets 7
    # splits, the short ones one each, merged per request or per head (in chunks of 2, even splits' count at
    # 5 requests); a padding request gets zeros.
    cfg = DecodeConfig(block_n=16, max_kv_splits=8, min_split_len=8, target_programs=16, merge_per_head=merge_per_head)
    lens = [9, 120, 12, 0, 10]
    plan = plan_splits(lens, cfg, 2)
    rows = plan.table[: 2 * len(lens)].reshape(-1, 2)
    assert rows[:, 0].tolist() == [1, 7, 1, 1, 1] and plan.items == 5 + 6 and plan.max_splits == 7
    items = plan.table[plan.items_at : plan.items_at + 2 * plan.items].reshape(-1, 2).tolist()
    assert items[:5] == [[b, 0] for b in range(5)] and items[5:] == [[1, s] for s in range(1, 7)]
    assert rows[1, 1] == 5  # the long request's second split is item 5
    case = PagedCase(8, 2, 32, [s - 1 for s in lens if s] + [0], [1] * 4 + [1])
    q = case.randn(5, 8, 32)
    seq = torch.tensor(lens)
    rows_t = torch.tensor(case.rows[:3] + [0] + case.rows[3:4])
    for items_cap in (None, 5 + cfg.extra_items(2)):  # exactly the items used; a graph's capacity
        out = torch.full((5, 8, 32), float("nan"))
        splits = DecodeSplits.upload(plan_splits(lens, cfg, 2, items_cap), torch.device("cpu"))
        if items_cap is not None:
            splits.merge = True  # as a graph launches it: stage 2 runs, the one-split requests skip it
        k, v, r2t = case.kv_pool.k_buffer[1], case.kv_pool.v_buffer[1], case.r2t_pool.req_to_token
        decode_attention(q, k, v, out, r2t, rows_t, seq, 32**-0.5, cfg, splits=splits)
        ref = torch.full_like(out, float("nan"))
        alone = DecodeConfig(block_n=16, max_kv_splits=8, min_split_len=8, target_programs=1)
        for b in range(len(lens)):  # each request alone: one split, no stage 2
            one = slice(b, b + 1)
            decode_attention(q[one], k, v, ref[one], r2t, rows_t[one], seq[one], 32**-0.5, alone)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
        assert torch.equal(out[3], torch.zeros(8, 32))


@pytest.mark.parametrize("merge_per_head", [False, True])
def test_a_request_of_many_splits_is_merged_in_chunks(merge_per_head):
    # 50 splits of 2 tokens: the per-head merge walks them 16 at a time, the per-request one by one.
    cfg = DecodeConfig(
        block_n=16, max_kv_splits=64, min_split_len=2, target_programs=512, merge_per_head=merge_per_head
    )
    assert plan_splits([100, 3], cfg, 2).table[0] == 50
    case = PagedCase(4, 2, 32, [99, 2], [1, 1])
    got, ref = _decode_both(case, decode_config=cfg)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


def test_split_plans_of_equal_and_mixed_lengths():
    large = default_decode_policy(132).for_batch(80)  # two KV heads a program: 4 groups for 8 KV heads
    # Equal requests split evenly (as many splits each as the GPU's programs want).
    assert plan_splits([1400] * 80, large, 8).max_splits == 1
    assert set(plan_splits([770] * 64, large, 8).table[: 2 * 64 : 2].tolist()) == {2}
    tiny = default_decode_policy(132).for_batch(1)
    assert plan_splits([576], tiny, 8).max_splits == 18  # 32-token splits, the shortest allowed
    # A 10% share of 8,000-token requests among 600-token ones: 3 splits each (twice the mean length, 2,680
    # tokens: a batch of 80 fills the GPU with one split each), the others one; at a batch of 40, 10 splits.
    lens = [600] * 72 + [8000] * 8
    plan = plan_splits(lens, large, 8)
    n = plan.table[: 2 * 80 : 2]
    assert set(n[:72].tolist()) == {1} and set(n[72:].tolist()) == {3}
    assert plan_splits([600] * 36 + [8000] * 4, large, 8).table[2 * 36] == 10
    # Requests within twice the mean length of each other stay one split each in a full batch.
    assert plan_splits([512 + 3 * i for i in range(80)], large, 8).max_splits == 1
    # Whatever the lengths, the items fit a graph's capacity (batch + extra_items).
    gen = torch.Generator().manual_seed(0)
    for bs in (1, 3, 17, 40, 80, 300):
        cfg = default_decode_policy(132).for_batch(bs)
        for _ in range(20):
            lens = (torch.randint(0, 9000, (bs,), generator=gen) * (torch.rand(bs, generator=gen) < 0.3)).tolist()
            plan = plan_splits(lens, cfg, 8, bs + cfg.extra_items(8))
            assert plan.items == bs + cfg.extra_items(8)
            assert int(plan.table[: 2 * bs : 2].sum()) - bs <= cfg.extra_items(8)
            # the graphs' quick check (sum and maximum only) agrees with the plan
            assert needs_plan(lens, cfg, 8) == (plan.max_splits > cfg.even_splits(bs, 8))


def test_decode_with_the_large_batch_tiles_matches_torch_native():
    # The policy's tiles above 32 requests (two KV heads a program, 3 stages), at small sizes.
    cfg = default_decode_policy(132).for_batch(64)
    cfg = dataclasses.replace(cfg, max_kv_splits=4, min_split_len=8, target_programs=8)
    case = PagedCase(8, 2, 64, [199, 64, 5, 130], [1] * 4)
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
    case = PagedCase(heads, kv_heads, head_dim, [s - 1 for s in seq_lens], [1] * len(seq_lens))
    got, ref = _decode_both(case, decode_config=cfg)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


def test_kv_heads_per_program_divides_the_model_heads_and_sets_the_extra_splits():
    cfg = DecodeConfig(kv_heads_per_program=4, target_programs=64, min_split_len=8)
    assert [cfg.heads_per_program(n) for n in (8, 4, 6, 3, 1)] == [4, 4, 2, 1, 1]
    # 8 KV heads at 4 a program: 2 programs per split, so 32 extra splits make 64 programs.
    assert cfg.extra_items(8) == 32 and DecodeConfig(target_programs=64).extra_items(8) == 8
    # 4 requests of 64 tokens: 8 splits each at 4 heads a program, 2 each at one head a program.
    assert plan_splits([64] * 4, cfg, 8).max_splits == 8
    assert plan_splits([64] * 4, DecodeConfig(target_programs=64, min_split_len=8), 8).max_splits == 2
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
    assert large.extra_items(8) == 66 and tiny.extra_items(8) == 66 and tiny.max_row_splits(8) == 64
    # An FP8 pool's tiles take twice the tokens (the same bytes a tile), the rest as bf16's.
    fp8 = default_decode_policy(132, kv_fp8=True)
    assert [fp8.for_batch(bs).block_n for bs in (1, 8, 256)] == [64, 64, 64] and tiny.block_n == 32
    assert dataclasses.replace(fp8.for_batch(256), block_n=32) == large
    fp8_pool = dataclasses.replace(attention_context("cpu"), kv_dtype=torch.float8_e4m3fn)
    assert TritonAttnBackend(fp8_pool).decode_policy.for_batch(1).block_n == 64
    uniform = DecodePolicy.uniform(small)
    assert uniform.for_batch(1) is small and uniform.for_batch(4096) is small
    # The backend's default follows the policy; an explicit config serves every batch size.
    backend = TritonAttnBackend(attention_context("cpu"))
    assert backend.decode_policy.for_batch(300).kv_heads_per_program == 2
    assert (
        TritonAttnBackend(attention_context("cpu"), decode_config=TINY_DECODE).decode_policy.for_batch(300)
        is TINY_DECODE
    )


def test_cuda_graph_hooks_pad_and_reuse_static_buffers():
    case = PagedCase(8, 2, 32, [10, 24, 3, 40, 5], [1] * 5)
    layer = case.layer
    backend = TritonAttnBackend(
        attention_context(num_attention_heads=8, num_key_value_heads=2, head_dim=32), decode_config=TINY_DECODE
    )
    backend.init_cuda_graph_state(max_bs=4)
    scratch_ptr = backend._scratch.data_ptr()
    reference = TorchNativeAttnBackend(attention_context())
    q = case.randn(4, layer.num_heads, layer.head_dim)

    def graph_step(rows, seq_lens, hook):
        fb = case.forward_batch(ForwardMode.DECODE, backend, rows=rows, seq_lens=seq_lens, batch_size=4)
        hook(fb)
        return fb.attn_metadata, backend.forward_decode(q, layer, fb)

    # Capture with 4 real requests.
    md1, out1 = graph_step(case.rows[:4], case.seq_lens[:4], backend.init_forward_metadata_capture_cuda_graph)
    ref1 = run_backend(reference, case, ForwardMode.DECODE, q, rows=case.rows[:4], seq_lens=case.seq_lens[:4])
    torch.testing.assert_close(out1, ref1, atol=2e-5, rtol=1e-4)

    # Replay with 3 real requests: the backend pads the 4th (stale from the capture) to empty.
    rows2, lens2 = case.rows[2:], case.seq_lens[2:]
    md2, out2 = graph_step(rows2, lens2, backend.init_forward_metadata_replay_cuda_graph)
    ref2 = run_backend(reference, case, ForwardMode.DECODE, q[:3], rows=rows2, seq_lens=lens2)
    torch.testing.assert_close(out2[:3], ref2, atol=2e-5, rtol=1e-4)
    assert torch.count_nonzero(out2[3]) == 0  # the padding request attends over nothing
    # A captured graph would read the same static storage, now holding the new batch.
    assert md2.seq_lens.data_ptr() == md1.seq_lens.data_ptr()
    assert md2.req_pool_indices.data_ptr() == md1.req_pool_indices.data_ptr()
    assert md1.seq_lens.tolist() == lens2 + [0]

    # Replay padded by the caller instead (seq_len 1 on row 0, i.e. the dummy slot).
    rows3, lens3 = [case.rows[4], case.rows[0], 0, 0], [case.seq_lens[4], case.seq_lens[0], 1, 1]
    _, out3 = graph_step(rows3, lens3, backend.init_forward_metadata_replay_cuda_graph)
    ref3 = run_backend(reference, case, ForwardMode.DECODE, q[:2], rows=rows3[:2], seq_lens=lens3[:2])
    torch.testing.assert_close(out3[:2], ref3, atol=2e-5, rtol=1e-4)

    # An eager batch above max_bs still works and leaves the graphs' scratch where it was.
    q5 = case.randn(5, layer.num_heads, layer.head_dim)
    got5 = run_backend(backend, case, ForwardMode.DECODE, q5)
    torch.testing.assert_close(got5, run_backend(reference, case, ForwardMode.DECODE, q5), atol=2e-5, rtol=1e-4)
    assert backend._scratch.data_ptr() == scratch_ptr

    with pytest.raises(ValueError, match="max_bs"):  # 5 requests > max_bs 4
        backend.init_forward_metadata_replay_cuda_graph(case.forward_batch(ForwardMode.DECODE, backend))


def test_ragged_graph_variant_serves_a_long_request_among_short_ones():
    # A batch of 8 x 2 KV heads fills the 16 programs with one split a request (even splits) unless a
    # request is long enough that its plan gives it more: the ragged variant, with the plan's items and a
    # merge. The eager step takes the same kernels.
    cfg = DecodeConfig(block_n=16, max_kv_splits=16, min_split_len=8, target_programs=16)
    lens = [12, 10, 9, 11, 12, 10, 9, 11]
    case = PagedCase(8, 2, 32, [n - 1 for n in lens] + [159] + [n - 1 for n in lens[1:]], [1] * 16)
    backend = TritonAttnBackend(attention_context(num_attention_heads=8, num_key_value_heads=2, head_dim=32), cfg)
    backend.init_cuda_graph_state(max_bs=8)
    assert backend.has_ragged_graph(8) and not backend.has_ragged_graph(4)
    assert cfg.even_splits(8, 2) == 1
    reference = TorchNativeAttnBackend(attention_context())
    q = case.randn(8, 8, 32)

    def step(first, ragged):
        rows, lens = case.rows[first : first + 8], case.seq_lens[first : first + 8]
        fb = case.forward_batch(ForwardMode.DECODE, backend, rows=rows, seq_lens=lens, batch_size=8)
        uses = backend.decode_uses_ragged(fb)
        backend.init_forward_metadata_replay_cuda_graph(fb, ragged=ragged)
        got = backend.forward_decode(q, case.layer, fb)
        ref = run_backend(reference, case, ForwardMode.DECODE, q, rows=rows, seq_lens=lens)
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
        eager = run_backend(backend, case, ForwardMode.DECODE, q, rows=rows, seq_lens=lens)
        torch.testing.assert_close(eager, ref, atol=2e-5, rtol=1e-4)
        return uses, fb.attn_metadata.splits

    # Lengths 9-12: even splits (one each), the plain graph, no plan.
    uses, splits = step(0, ragged=False)
    assert not uses and splits is None
    # A 160-token request among them: its plan gives it 3 splits (58 tokens: twice the mean length).
    uses, splits = step(8, ragged=True)
    assert uses and splits.merge and splits.items == 8 + cfg.extra_items(2)
    with pytest.raises(ValueError, match="ragged"):
        backend.init_forward_metadata_replay_cuda_graph(
            case.forward_batch(
                ForwardMode.DECODE, backend, rows=case.rows[:4], seq_lens=case.seq_lens[:4], batch_size=4
            ),
            ragged=True,
        )


# ---------------------------------------------------------------- GPU, real sizes (pytest -m gpu)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("head_dim", [128, 64])
def test_gpu_decode_real_sizes(head_dim):
    lens = [4096, 1, 4000, 17, 2048, 300, 1024, 4095]
    case = PagedCase(32, 8, head_dim, [s - 1 for s in lens], [1] * len(lens), dtype=torch.bfloat16, device="cuda")
    got, ref = _decode_both(case, decode_config=None)
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@needs_cuda
def test_gpu_decode_large_batch_takes_the_large_batch_tiles():
    gen = torch.Generator().manual_seed(3)
    lens = torch.randint(1, 900, (300,), generator=gen).tolist()  # 300 requests: two KV heads a program
    case = PagedCase(32, 8, 128, [s - 1 for s in lens], [1] * len(lens), dtype=torch.bfloat16, device="cuda")
    got, ref = _decode_both(case, decode_config=None)
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@needs_cuda
def test_gpu_decode_cuda_graph_capture_and_replay():
    lens = [4096, 100, 2500, 7, 1500, 3000]
    case = PagedCase(32, 8, 128, [s - 1 for s in lens], [1] * len(lens), dtype=torch.bfloat16, device="cuda")
    layer = case.layer
    backend = TritonAttnBackend(attention_context("cuda", num_attention_heads=32, num_key_value_heads=8, head_dim=128))
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
    reference = TorchNativeAttnBackend(attention_context("cuda"))
    for rows, seq_lens in [(case.rows[:3], lens[:3]), (case.rows[3:], lens[3:]), (case.rows, lens)]:
        fb = case.forward_batch(ForwardMode.DECODE, backend, rows=rows, seq_lens=seq_lens, batch_size=8)
        backend.init_forward_metadata_replay_cuda_graph(fb)
        graph.replay()
        n = len(rows)
        ref = run_backend(reference, case, ForwardMode.DECODE, q[:n], rows=rows, seq_lens=seq_lens)
        torch.testing.assert_close(out[:n].float(), ref.float(), atol=2e-2, rtol=2e-2)
        assert torch.count_nonzero(out[n:]) == 0


@pytest.mark.gpu
@needs_cuda
def test_gpu_eager_plans_of_any_item_count_compile_no_new_variant():
    # An eager step's plan has a different item count every step (a long request among short ones). Neither the
    # count nor a stride made of it may pick a kernel variant: Triton specializes an int on being a multiple of
    # 16, and a variant first met while serving compiles mid-step (~1 s for every request in flight). Found on an
    # H100: the unused prefix strides of the merge carried the item count. Batch 20 takes the per-head merge,
    # 40 the per-request one; each pair of lengths gives item counts on both sides of a multiple of 16.
    from plait.runtime.executor.compile_watch import CompileWatch

    policy = default_decode_policy(torch.cuda.get_device_properties(0).multi_processor_count)
    case = PagedCase(32, 8, 128, [4095] * 40, [1] * 40, dtype=torch.bfloat16, device="cuda")
    k, v, r2t = case.kv_pool.k_buffer[1], case.kv_pool.v_buffer[1], case.r2t_pool.req_to_token
    q = case.randn(40, 32, 128)
    rows = torch.tensor(case.rows, device="cuda")

    def run(long_len: int, batch: int) -> int:
        lens = [long_len] + [64] * (batch - 1)
        cfg = policy.for_batch(batch)
        plan = plan_splits(lens, cfg, 8)
        out = torch.empty(batch, 32, 128, dtype=torch.bfloat16, device="cuda")
        seq = torch.tensor(lens, device="cuda")
        splits = DecodeSplits.upload(plan, q.device)
        decode_attention(q[:batch], k, v, out, r2t, rows[:batch], seq, 128**-0.5, cfg, splits=splits)
        torch.cuda.synchronize()
        return plan.items

    for batch in (20, 40):
        run(200, batch)  # compiles this batch's variants
    watch = CompileWatch()
    assert watch.start()
    items = [run(long_len, batch) for batch in (20, 40) for long_len in (200, 291, 886, 1500, 3000)]
    assert {n % 16 == 0 for n in items} == {True, False}  # both sides of the specialization were met
    assert watch.count == 0, f"compiled after the first steps: {watch.names}"
