"""Shared-prefix ("cascade") decode attention: kernels and CUDA-graph hooks (grouping and plans:
test_cascade_plan.py).

Kernels run in Triton's interpreter on a machine without CUDA (tiny shapes and tiles, so every
tile, split and mask path runs) against the torch_native backend over the same paged pools. Tests
marked `gpu` run the compiled kernels at real sizes and an engine end to end (`pytest -m gpu`).
"""

import numpy as np
import torch
from helpers.paged_attention import use_triton_interpreter_without_cuda

use_triton_interpreter_without_cuda()  # before triton is imported

import dataclasses  # noqa: E402

import pytest  # noqa: E402
from plait.runtime.attention import AttentionContext, AttentionHeads  # noqa: E402
from plait.runtime.attention.base import AttentionLayerSpec  # noqa: E402
from plait.runtime.attention.cascade_plan import CascadeConfig, CascadePlanner, build_plan  # noqa: E402
from plait.runtime.attention.prefix_groups import PrefixGroup  # noqa: E402
from plait.runtime.attention.torch_native import TorchNativeAttnBackend  # noqa: E402
from plait.runtime.attention.triton_backend import TritonAttnBackend  # noqa: E402
from plait.runtime.attention.triton_ops import (  # noqa: E402
    DecodeConfig,
    PrefixConfig,
    PrefixPartials,
    decode_attention,
    prefix_attention,
    split_prefix_scratch,
)
from plait.runtime.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from plait.runtime.kvcache.memory_pool import KVPool, ReqToTokenPool  # noqa: E402

torch.set_num_threads(1)
HAS_CUDA = torch.cuda.is_available()

# Tiny tiles: 16-row tiles (4 members at GQA 4), 16-token KV blocks, prefixes split every 16 tokens,
# 5 persistent programs.
TINY_DECODE = DecodeConfig(block_n=16, max_kv_splits=4, min_split_len=8, target_programs=64)
TINY_PREFIX = PrefixConfig(
    block_m=16, block_n=16, min_split_len=16, max_splits=4, target_programs=32, num_programs=5
)  # a persistent program takes several items
EAGER_CASCADE = CascadeConfig(min_prefix_len=8, min_saved_tokens=0, min_batch_size=2)


class _SharedCase:
    """A paged pool where groups of requests hold the same slots for their prefix, as the radix cache
    leaves them, plus requests of their own; batch order shuffled, slots and rows scattered."""

    def __init__(self, heads, kv_heads, head_dim, groups, solo, dtype=torch.float32, device="cpu", seed=0):
        # groups: [(prefix_len, [seq_len of each member])]; solo: [seq_len]
        g = torch.Generator().manual_seed(seed)
        self.layer = AttentionLayerSpec(
            layer_id=0, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, scaling=head_dim**-0.5
        )
        lens, prefixes = [], []
        for p, members in groups:
            lens += members
            prefixes += [p] * len(members)
        lens += solo
        prefixes += [0] * len(solo)
        owned = sum(s - p for s, p in zip(lens, prefixes)) + sum(p for p, _ in groups)
        self.kv_pool = KVPool(owned + 5, 1, kv_heads, head_dim, dtype, device)
        for buf in self.kv_pool.k_buffer + self.kv_pool.v_buffer:
            buf.copy_(torch.randn(buf.shape, generator=g).to(dtype))
        self.r2t_pool = ReqToTokenPool(len(lens) + 4, max(lens) + 8, device)
        self.r2t_pool.host[:] = torch.randint(1, owned, self.r2t_pool.host.shape, generator=g).numpy()  # stale junk
        slots = (torch.randperm(owned, generator=g) + 1).tolist()
        rows = torch.randperm(self.r2t_pool.size, generator=g)[: len(lens)].tolist()
        shared, k = {}, 0
        for i, (s, p) in enumerate(zip(lens, prefixes)):
            key = (i, p) if p == 0 else next(j for j, (gp, _) in enumerate(groups) if gp == p)
            if p and key not in shared:
                shared[key], k = slots[k : k + p], k + p
            own, k = slots[k : k + s - p], k + s - p
            self.r2t_pool.write(rows[i], 0, torch.tensor((shared[key] if p else []) + own, device=device))
        order = torch.randperm(len(lens), generator=g).tolist()
        self.rows = [rows[i] for i in order]
        self.seq_lens = [lens[i] for i in order]
        self.prefixes = [prefixes[i] for i in order]
        self.dtype, self.device, self.g = dtype, device, g

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.g).to(self.device, self.dtype)

    def forward_batch(self, backend, rows=None, seq_lens=None, batch_size=None, host_rows=True):
        rows = self.rows if rows is None else rows
        seq_lens = self.seq_lens if seq_lens is None else seq_lens
        dev = self.device
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=batch_size or len(rows),
            input_ids=torch.zeros(len(rows), dtype=torch.int64, device=dev),
            positions=torch.tensor([max(s - 1, 0) for s in seq_lens], device=dev),
            req_pool_indices=torch.tensor(rows, device=dev),
            seq_lens=torch.tensor(seq_lens, device=dev),
            out_cache_loc=torch.zeros(len(rows), dtype=torch.int64, device=dev),
            seq_lens_cpu=list(seq_lens),
            req_to_token_pool=self.r2t_pool,
            kv_pool=self.kv_pool,
            attn_backend=backend,
            req_pool_indices_cpu=np.asarray(rows, dtype=np.int64) if host_rows else None,
        )


def _context(device="cpu", heads=None, kv_heads=None, head_dim=None, disable=False):
    shape = AttentionHeads.split(heads, kv_heads, head_dim) if heads else None
    return AttentionContext(device, shape, disable_cascade_attention=disable)


def _triton(case, cascade=EAGER_CASCADE, prefix=TINY_PREFIX, decode=TINY_DECODE, disable=False):
    lay = case.layer
    return TritonAttnBackend(
        _context(case.device, lay.num_heads, lay.num_kv_heads, lay.head_dim, disable),
        decode_config=decode,
        cascade_config=cascade,
        prefix_config=prefix,
    )


def _reference(case, q, rows=None, seq_lens=None):
    native = TorchNativeAttnBackend(AttentionContext(case.device))
    fb = case.forward_batch(native, rows, seq_lens)
    native.init_forward_metadata(fb)
    return native.forward_decode(q, case.layer, fb)


def _decode(backend, case, q, **kw):
    fb = case.forward_batch(backend, **kw)
    backend.init_forward_metadata(fb)
    return fb.attn_metadata, backend.forward_decode(q, case.layer, fb)


# ---------------------------------------------------------------- kernels (interpreter on CPU)


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,groups,solo",
    [
        # GQA 4, head_dim 64: a 6-member group (two 4-member tiles) over a 37-token prefix (3 splits, the
        # last partial), a pair over 20, a suffix of just the new token, two requests of their own.
        (8, 2, 64, [(37, [38, 40, 60, 39, 45, 41]), (20, [21, 30])], [9, 50]),
        (4, 4, 128, [(33, [34, 36, 50])], [5]),  # MHA (GQA 1), head_dim 128: 16 members per tile
        (8, 1, 64, [(17, [18, 19, 40])], [30, 2]),  # GQA 8: 2 members per tile
        (9, 3, 64, [(24, [25, 30, 26, 27, 28])], [10]),  # GQA 3 (SmolLM2-135M): a tile of 5 members, 15 rows
    ],
)
@pytest.mark.parametrize("merge_per_head,hpp", [(False, 1), (True, 1), (False, 2)])  # stage 2 per request /
# per (request, head); the suffix's stage 1 with two KV heads a program (where the model's heads allow)
def test_eager_cascade_matches_torch_native(heads, kv_heads, head_dim, groups, solo, merge_per_head, hpp):
    case = _SharedCase(heads, kv_heads, head_dim, groups, solo)
    q = case.randn(len(case.rows), heads, head_dim)
    backend = _triton(
        case, decode=dataclasses.replace(TINY_DECODE, merge_per_head=merge_per_head, kv_heads_per_program=hpp)
    )
    md, got = _decode(backend, case, q)
    assert md.cascade is not None and md.cascade.plan.num_work > 0  # the cascade path ran
    assert sorted(g.prefix_len for g in md.cascade.plan.groups) == sorted(p for p, _ in groups)
    torch.testing.assert_close(got, _reference(case, q), atol=2e-5, rtol=1e-4)


def test_cascade_off_without_host_rows_or_when_disabled():
    case = _SharedCase(8, 2, 64, [(20, [21, 25, 30])], [7])
    q = case.randn(4, 8, 64)
    ref = _reference(case, q)
    for backend, kw in [
        (_triton(case), {"host_rows": False}),
        (_triton(case, disable=True), {}),
        (_triton(case, cascade=CascadeConfig(min_prefix_len=8, min_saved_tokens=0, min_batch_size=5)), {}),
    ]:
        md, got = _decode(backend, case, q, **kw)
        assert md.cascade is None
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


def test_mixed_step_decode_rows_read_their_shared_prefixes_once():
    # A mixed step's decode rows (all but the last request) group by prefix as a decode step's do; the last
    # request extends its final token (the extend kernel), the same attention as its decode would be.
    case = _SharedCase(8, 2, 64, [(37, [38, 40, 60, 39]), (20, [21, 30])], [9, 50])
    n = len(case.rows)
    q = case.randn(n, 8, 64)
    ref = _reference(case, q)
    backend = _triton(case)
    fb = case.forward_batch(backend)
    fb.forward_mode = ForwardMode.EXTEND
    fb.decode_rows = n - 1
    fb.extend_seq_lens_cpu = [1] * n
    fb.extend_prefix_lens_cpu = [s - 1 for s in case.seq_lens]
    backend.init_forward_metadata(fb)
    md = fb.attn_metadata
    assert md.num_decode == n - 1
    assert md.decode.cascade is not None and md.decode.cascade.plan.num_work > 0  # the cascade path ran
    got = backend.forward_extend(q.view(n, -1), case.layer, fb)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


def test_kernels_with_an_empty_suffix_and_padding_rows():
    # A member whose whole sequence is the shared prefix (no suffix: stage 1 writes nothing for it),
    # a 1-token suffix, and a padding row (seq_len 0) that must come out zero.
    case = _SharedCase(8, 2, 64, [(30, [30, 31, 45])], [12])
    n = len(case.rows)
    rows, lens = case.rows + [0], case.seq_lens + [0]
    q = case.randn(n + 1, 8, 64)
    members = np.array([i for i in range(n) if case.prefixes[i]])
    planner = CascadePlanner(EAGER_CASCADE, TINY_PREFIX, 8, 2)
    layout = planner.layout(n + 1)
    plan = build_plan(
        [PrefixGroup(30, members)], np.asarray(rows), layout, planner.members_per_tile, planner.target_work, TINY_PREFIX
    )
    tables = layout.views(torch.from_numpy(plan.packed))
    scratch = torch.empty(plan.num_partials * 8 * 65)
    o, lse = split_prefix_scratch(scratch, plan.num_partials, 8, 64)
    k, v, r2t = case.kv_pool.k_buffer[0], case.kv_pool.v_buffer[0], case.r2t_pool.req_to_token
    prefix_attention(q, k, v, r2t, tables, o, lse, case.layer.scaling, TINY_PREFIX)
    out = torch.empty_like(q)
    decode_attention(
        q,
        k,
        v,
        out,
        r2t,
        torch.tensor(rows),
        torch.tensor(lens),
        case.layer.scaling,
        TINY_DECODE,
        prefix=PrefixPartials(tables.req_info, o, lse, TINY_PREFIX.max_splits),
    )
    torch.testing.assert_close(out[:n], _reference(case, q[:n]).view(n, 8, 64), atol=2e-5, rtol=1e-4)
    assert torch.count_nonzero(out[n]) == 0


def test_cuda_graph_hooks_carry_the_step_tables():
    case = _SharedCase(8, 2, 32, [(24, [25, 30, 27]), (40, [41, 44])], [6, 19])
    lay = case.layer
    backend = _triton(case, cascade=CascadeConfig(min_prefix_len=8, min_saved_tokens=0, min_batch_size=4))
    backend.init_cuda_graph_state(max_bs=8)
    q = case.randn(8, lay.num_heads, lay.head_dim)

    def step(rows, lens, hook, batch_size=8):
        fb = case.forward_batch(backend, rows=rows, seq_lens=lens, batch_size=batch_size)
        hook(fb)
        return fb.attn_metadata, backend.forward_decode(q[:batch_size], lay, fb)

    md0, _ = step(case.rows, case.seq_lens, backend.init_forward_metadata_capture_cuda_graph)
    assert md0.cascade is not None and md0.cascade.plan is None  # captured with empty tables
    assert int(md0.cascade.tables.work_len) == 0
    replay = backend.init_forward_metadata_replay_cuda_graph
    n = len(case.rows)
    md1, out1 = step(case.rows, case.seq_lens, replay)
    assert md1.cascade.plan is not None and len(md1.cascade.plan.groups) == 2
    assert md1.cascade.tables.work_len.data_ptr() == md0.cascade.tables.work_len.data_ptr()  # static storage
    torch.testing.assert_close(out1[:n], _reference(case, q[:n]), atol=2e-5, rtol=1e-4)
    assert torch.count_nonzero(out1[n:]) == 0  # padding rows
    # Next step, same requests one token further: the tables are not uploaded again.
    uploaded = backend._cascade._uploaded
    lens2 = [s + 1 for s in case.seq_lens]
    for i, (r, s) in enumerate(zip(case.rows, lens2)):  # the new tokens' slots (any valid slot)
        case.r2t_pool.write(r, s - 1, torch.tensor([1 + i]))
    md2, out2 = step(case.rows, lens2, replay)
    assert backend._cascade._uploaded is uploaded
    torch.testing.assert_close(out2[:n], _reference(case, q[:n], seq_lens=lens2), atol=2e-5, rtol=1e-4)
    # Requests without sharing at the same batch size: the tables say "no group", output still exact.
    solo = [i for i in range(n) if not case.prefixes[i]]
    rows3, lens3 = [case.rows[i] for i in solo] * 2, [case.seq_lens[i] for i in solo] * 2
    md3, out3 = step(rows3, lens3, replay)
    assert md3.cascade.plan is None and int(md3.cascade.tables.work_len) == 0
    torch.testing.assert_close(out3[:4], _reference(case, q[:4], rows=rows3, seq_lens=lens3), atol=2e-5, rtol=1e-4)
    # Below min_batch_size the graph has no cascade kernels at all (batch 1 keeps its step).
    md4, _ = step(case.rows[:2], case.seq_lens[:2], backend.init_forward_metadata_capture_cuda_graph, 2)
    assert md4.cascade is None


def test_graph_variants_plain_and_cascade():
    # Batch sizes >= min_batch_size get two graphs: the plain one must be exactly the decode of a backend
    # without cascade, and a step asks for the cascade one only when it has a group.
    case = _SharedCase(8, 2, 32, [(24, [25, 30, 27]), (40, [41, 44])], [6, 19])
    lay, n = case.layer, len(case.rows)
    config = CascadeConfig(min_prefix_len=8, min_saved_tokens=0, min_batch_size=4)
    backend = _triton(case, cascade=config)
    backend.init_cuda_graph_state(max_bs=8)
    assert [bs for bs in (1, 2, 4, 8, 9) if backend.has_cascade_graph(bs)] == [4, 8]
    q = case.randn(8, lay.num_heads, lay.head_dim)

    def step(be, hook, batch_size=8, **kw):
        fb = case.forward_batch(
            be,
            rows=kw.pop("rows", None),
            seq_lens=kw.pop("seq_lens", None),
            batch_size=batch_size,
            host_rows=kw.pop("host_rows", True),
        )
        hook(fb, **kw)
        return fb.attn_metadata, be.forward_decode(q[:batch_size], lay, fb)

    md, _ = step(backend, backend.init_forward_metadata_capture_cuda_graph, cascade=False)
    assert md.cascade is None  # the plain graph is captured without any cascade table
    md, _ = step(backend, backend.init_forward_metadata_capture_cuda_graph, cascade=True)
    assert md.cascade is not None and int(md.cascade.tables.work_len) == 0
    # The shared batch: the query plans once; the replay hook reuses that plan.
    fb = case.forward_batch(backend, batch_size=8)
    assert backend.decode_uses_cascade(fb)
    recomputes, plan = backend._cascade.planner.recomputes, backend._cascade.planner._plan
    md, out = step(backend, backend.init_forward_metadata_replay_cuda_graph, cascade=True)
    assert md.cascade.plan is plan and backend._cascade.planner.recomputes == recomputes
    torch.testing.assert_close(out[:n], _reference(case, q[:n]), atol=2e-5, rtol=1e-4)
    # The plain variant of the same batch: bit for bit what a backend with cascade disabled computes.
    disabled = _triton(case, cascade=config, disable=True)
    disabled.init_cuda_graph_state(max_bs=8)
    _, ref = step(disabled, disabled.init_forward_metadata_replay_cuda_graph)
    md, out = step(backend, backend.init_forward_metadata_replay_cuda_graph, cascade=False)
    assert md.cascade is None and torch.equal(out, ref)
    # No group, no host rows, or a batch size without the variant: the plain graph.
    solo = [i for i in range(n) if not case.prefixes[i]]
    rows, lens = [case.rows[i] for i in solo] * 2, [case.seq_lens[i] for i in solo] * 2
    assert not backend.decode_uses_cascade(case.forward_batch(backend, rows=rows, seq_lens=lens, batch_size=8))
    assert not backend.decode_uses_cascade(case.forward_batch(backend, batch_size=8, host_rows=False))
    assert not backend.decode_uses_cascade(
        case.forward_batch(backend, rows=case.rows[:2], seq_lens=case.seq_lens[:2], batch_size=2)
    )
    with pytest.raises(ValueError, match="no decode graph with the cascade kernels"):
        step(
            backend,
            backend.init_forward_metadata_replay_cuda_graph,
            batch_size=2,
            rows=case.rows[:2],
            seq_lens=case.seq_lens[:2],
            cascade=True,
        )
    # disable_cascade_attention: no variant at any size.
    assert not any(disabled.has_cascade_graph(bs) for bs in (1, 4, 8))
    assert not disabled.decode_uses_cascade(case.forward_batch(disabled, batch_size=8))
    with pytest.raises(ValueError, match="no decode graph with the cascade kernels"):
        step(disabled, disabled.init_forward_metadata_capture_cuda_graph, cascade=True)


def test_bad_prefix_config_is_rejected():
    with pytest.raises(ValueError, match="block_m"):
        PrefixConfig(block_m=48)
    with pytest.raises(ValueError, match="min_batch_size"):
        CascadeConfig(min_batch_size=1)


# ---------------------------------------------------------------- GPU, real sizes (pytest -m gpu)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [128, 64])
def test_gpu_cascade_real_sizes(head_dim):
    case = _SharedCase(
        32,
        8,
        head_dim,
        [(2000, [2001 + i % 70 for i in range(40)]), (700, [701, 900, 1500])],
        [4000, 1, 300],
        dtype=torch.bfloat16,
        device="cuda",
    )
    q = case.randn(len(case.rows), 32, head_dim)
    backend = TritonAttnBackend(_context("cuda", 32, 8, head_dim), cascade_config=CascadeConfig(min_batch_size=2))
    md, got = _decode(backend, case, q)
    assert md.cascade is not None and len(md.cascade.plan.groups) == 2
    torch.testing.assert_close(got.float(), _reference(case, q).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_eager_cascade_step_does_not_wait_for_the_device():
    # A mixed step's decode rows plan their cascade while the step before is still running (overlap
    # scheduling): the plan's tables go up from pinned memory, so the host does not wait for that step.
    case = _SharedCase(32, 8, 128, [(1500, [1501 + 3 * i for i in range(30)])], [800, 20], torch.bfloat16, "cuda")
    backend = TritonAttnBackend(_context("cuda", 32, 8, 128), cascade_config=CascadeConfig(min_batch_size=2))
    q = case.randn(len(case.rows), 32, 128)
    fb = case.forward_batch(backend)
    stream = torch.cuda.current_stream()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # the step in flight: ~1 s of one busy kernel
    backend.init_forward_metadata(fb)
    assert not stream.query()  # planned and uploaded while the device was still busy
    assert fb.attn_metadata.cascade is not None
    got = backend.forward_decode(q, case.layer, fb)
    torch.testing.assert_close(got.float(), _reference(case, q).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_cascade_in_a_cuda_graph():
    case = _SharedCase(
        32, 8, 128, [(1500, [1501 + 3 * i for i in range(30)])], [800, 20], dtype=torch.bfloat16, device="cuda"
    )
    lay = case.layer
    backend = TritonAttnBackend(_context("cuda", 32, 8, 128))
    backend.init_cuda_graph_state(max_bs=48)
    q = case.randn(48, 32, 128)
    fb = case.forward_batch(backend, batch_size=48)
    backend.init_forward_metadata_capture_cuda_graph(fb)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.forward_decode(q, lay, fb)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward_decode(q, lay, fb)
    n = len(case.rows)
    for rows, lens in [
        (case.rows, case.seq_lens),
        (case.rows[::-1][:20], case.seq_lens[::-1][:20]),
        (case.rows[-2:], case.seq_lens[-2:]),
    ]:
        fb = case.forward_batch(backend, rows=rows, seq_lens=lens, batch_size=48)
        backend.init_forward_metadata_replay_cuda_graph(fb)
        graph.replay()
        m = len(rows)
        ref = _reference(case, q[:m], rows=rows, seq_lens=lens)
        torch.testing.assert_close(out[:m].float(), ref.float(), atol=2e-2, rtol=2e-2)
        assert torch.count_nonzero(out[m:]) == 0
    assert n == 32


@pytest.mark.gpu
def test_gpu_engine_greedy_outputs_same_with_and_without_cascade(tmp_path):
    from conftest import make_random_model
    from plait.runtime import Engine

    model = make_random_model(str(tmp_path / "llama"), "llama", seed=5)  # 4 heads / 2 KV heads, head_dim 16
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(2, 256, (300,), generator=g).tolist()
    prompts = [
        shared + torch.randint(2, 256, (int(n),), generator=g).tolist()
        for n in torch.randint(3, 40, (40,), generator=g)
    ]
    sp = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    outs = []
    for disable in (False, True):
        with Engine(
            model_path=model, attention_backend="triton", dtype="float32", disable_cascade_attention=disable
        ) as eng:
            # The prefix goes into the radix cache first, so the batch's 40 requests share its slots and
            # decode as one group (graph bucket 48 >= min_batch_size) with the cascade on.
            eng.generate(input_ids=shared + [5], sampling_params={"max_new_tokens": 1})
            outs.append([o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=sp)])
            assert eng.check_integrity()
    assert outs[0] == outs[1]
