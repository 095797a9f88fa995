"""The Triton segmented LoRA matmul (runtime/lora/sgmv.py), run by Triton's CPU interpreter at small
sizes: the same sums as the torch path (`LoraBatch`'s segments), with segments from the host's runs and
with one segment per token (the CUDA-graph form); rows of the base model left exactly as they were. Also what
the kernels read: a slot as `LoraSlots.write` fills it from an adapter's host image."""

from __future__ import annotations

import gc

import pytest
import torch
from helpers.hopper_compile import compile_for_hopper, ptxas_shipped
from plait.runtime.lora.adapter import TARGETS, LoraAdapter, LoraShapes
from plait.runtime.lora.matmul import LoraBatch
from plait.runtime.lora.sgmv import Segments, one_row_expand_grid, run_expand_tile, sgmv_apply, shrink_plan
from plait.runtime.lora.slots import LoraSlots

SHAPES = LoraShapes(num_layers=2, hidden=64, q_size=64, kv_size=32, intermediate=80)
# Fan-ins long enough to split (none a multiple of a slice), for the split-K shrink.
WIDE = LoraShapes(num_layers=1, hidden=328, q_size=200, kv_size=40, intermediate=456)


@pytest.fixture(scope="module")
def slots():
    """Three slots of random adapters at max rank 8, the third at rank 4 (the rest of its rank zero)."""
    pool = LoraSlots(SHAPES, 3, 8, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(0)
    for target in pool.a:
        pool.a[target][1:].copy_(torch.randn(pool.a[target][1:].shape, generator=gen))
        pool.b[target][1:].copy_(torch.randn(pool.b[target][1:].shape, generator=gen) * 0.1)
        pool.b[target][3, :, :, 4:] = 0
    return pool


@pytest.mark.parametrize("per_token", [False, True])
def test_sgmv_equals_the_torch_segments(slots, per_token):
    request_slots, tokens = [2, 0, 1, 1, 3, 0, 2], [19, 1, 4, 2, 1, 5, 33]  # a run longer than one tile
    reference = LoraBatch.of_rows(slots, request_slots, tokens)
    segments = (
        Segments.per_token(reference.token_slots)
        if per_token
        else Segments.of_runs(reference.segments, reference.token_slots.device)
    )
    T = sum(tokens)
    gen = torch.Generator().manual_seed(1)
    for layer in (0, 1):
        for target, fan_in in (("qkv", SHAPES.hidden), ("o", SHAPES.q_size), ("gate_up", SHAPES.hidden), ("down", 80)):
            x = torch.randn(T, fan_in, generator=gen)
            base_out = torch.randn(T, slots.b[target].shape[2], generator=gen)
            want = reference.apply(layer, target, x, base_out.clone())
            got = sgmv_apply(
                segments,
                slots.a[target],
                slots.b[target],
                layer,
                slots.max_rank,
                slots.out_splits[target],
                x,
                base_out.clone(),
            )
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            base_rows = reference.token_slots == 0
            assert torch.equal(got[base_rows], base_out[base_rows]), (target, layer)


def _random_pool(shapes: LoraShapes, seed: int) -> LoraSlots:
    """Three slots of random float32 adapters at max rank 8, the third at rank 4 (the rest of its rank zero)."""
    pool = LoraSlots(shapes, 3, 8, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(seed)
    for target in pool.a:
        pool.a[target][1:].copy_(torch.randn(pool.a[target][1:].shape, generator=gen) * 0.2)
        pool.b[target][1:].copy_(torch.randn(pool.b[target][1:].shape, generator=gen) * 0.2)
        pool.a[target][3, :, :, :] *= (torch.arange(pool.a[target].shape[2]) % 8 < 4)[:, None]  # rank 4 of 8
        pool.b[target][3, :, :, 4:] = 0
    return pool


@pytest.fixture(scope="module")
def wide():
    return _random_pool(WIDE, 3)


def _kernels(pool, request_slots, tokens, per_token, target, x, y, in_splits, expand_grid=None, run_tile=None):
    """The Triton kernels' y of one target over x, y, with the host's runs or one segment per token."""
    token_slots = torch.repeat_interleave(torch.tensor(request_slots), torch.tensor(tokens)).to(x.device)
    segments = (
        Segments.per_token(token_slots)
        if per_token
        else Segments.of_runs(LoraBatch.of_rows(pool, request_slots, tokens).segments, x.device)
    )
    args = (pool.a[target], pool.b[target], 0, pool.max_rank, pool.out_splits[target])
    return sgmv_apply(segments, *args, x, y.clone(), in_splits, expand_grid, run_tile)


def _torch(pool, request_slots, tokens, target, x, y):
    """The torch segments' y (float32) and which rows are the base model's."""
    reference = LoraBatch.of_rows(pool, request_slots, tokens)
    return reference.apply(0, target, x.float(), y.float().clone()), reference.token_slots == 0


# (request slots, tokens): one token of an adapter (T = 1); 33 tokens, base rows between runs of adapters,
# a run longer than two row tiles.
BATCHES = {"T1": ([2], [1]), "T33": ([1, 0, 3, 2, 0, 1], [3, 2, 1, 20, 1, 6])}


@pytest.mark.parametrize("per_token", [False, True], ids=["runs", "per_token"])
@pytest.mark.parametrize("in_splits", [None, 2, 3, 8])
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_split_k_shrink_equals_the_torch_segments(wide, per_token, in_splits, batch):
    """The shrink split over the input features (slices that do not divide them), the partials summed by
    the expand: float32 equal to the torch path within 1e-4 relative, base rows untouched. Dropping or
    doubling a split's partial moves the result by far more than that."""
    request_slots, tokens = BATCHES[batch]
    T = sum(tokens)
    gen = torch.Generator().manual_seed(4)
    for target in ("qkv", "o", "gate_up", "down"):
        fan_in = WIDE.in_features(next(t for t in TARGETS if t.name == target))
        longest = 1 if per_token else max(tokens[i] for i, s in enumerate(request_slots) if s)
        num_splits, slice_in, _ = shrink_plan(
            T if per_token else 1, longest, fan_in, wide.a[target].shape[2], in_splits
        )
        assert (num_splits - 1) * slice_in < fan_in <= num_splits * slice_in  # every split holds features
        if in_splits and in_splits > 1:
            assert num_splits > 1, (target, in_splits)
        x = torch.randn(T, fan_in, generator=gen)
        y = torch.randn(T, wide.b[target].shape[2], generator=gen)
        got = _kernels(wide, request_slots, tokens, per_token, target, x, y, in_splits)
        want, base_rows = _torch(wide, request_slots, tokens, target, x, y)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item())
        assert torch.equal(got[base_rows], y[base_rows]), target


def _kernels_match_torch(pool, request_slots, tokens, seed, per_token, expand_grid=None, run_tile=None):
    """qkv, gate_up and down through the kernels at the given grid or tile: the torch path's sums within 1e-4
    relative, base rows untouched."""
    T = sum(tokens)
    gen = torch.Generator().manual_seed(seed)
    for target in ("qkv", "gate_up", "down"):
        fan_in = WIDE.in_features(next(t for t in TARGETS if t.name == target))
        x = torch.randn(T, fan_in, generator=gen)
        y = torch.randn(T, pool.b[target].shape[2], generator=gen)
        got = _kernels(pool, request_slots, tokens, per_token, target, x, y, None, expand_grid, run_tile)
        want, base_rows = _torch(pool, request_slots, tokens, target, x, y)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item())
        assert torch.equal(got[base_rows], y[base_rows]), target


@pytest.mark.parametrize("expand_grid", [(4, 256), (3, 64)])
def test_one_row_expand_with_rows_and_columns_a_program(wide, expand_grid):
    """The one-row expand taking several rows (the last program's partly past the end) and wide column tiles
    (across sub-projections' bounds): the torch path's sums, base rows untouched."""
    _kernels_match_torch(wide, *BATCHES["T33"], seed=5, per_token=True, expand_grid=expand_grid)


@pytest.mark.parametrize("run_tile", [None, (16, 64), (32, 128)])
def test_runs_expand_in_tiles_of_the_rule_and_others(wide, run_tile):
    """Runs longer than RUN_EXPAND_ROWS (the rule's 64 x 128 tiles, the last one partly past the run's end)
    and shorter, beside base rows, in each tile: the torch path's sums, base rows untouched."""
    assert run_expand_tile(130) == (64, 128) and run_expand_tile(9) == (16, 64)
    _kernels_match_torch(wide, [1, 0, 2, 3], [70, 5, 130, 9], seed=6, per_token=False, run_tile=run_tile)


@pytest.mark.parametrize(
    "device,per_token",
    [
        pytest.param("cpu", True, id="cpu-per_token"),  # the interpreter's tl.dot over bf16 is wrong (numpy
        # has no bf16), so the row tiles run on a GPU only
        pytest.param("cuda", False, marks=pytest.mark.gpu, id="gpu-runs"),
        pytest.param("cuda", True, marks=pytest.mark.gpu, id="gpu-per_token"),
    ],
)
def test_split_k_in_bfloat16_within_its_rounding(wide, device, per_token):
    """bf16 x, adapters and y, the shrink split in 3: within 2^-6 of |y| + max |delta| of the float32 torch
    path over the same (bf16-rounded) values. y's store rounds to bf16 (2^-9 of |y + delta|); the row tiles
    round the shrunk rows to bf16 before their dot, an error that scales with the terms s_r * b_r rather than
    their sum (their sum may cancel), hence max |delta| rather than each element's (a rounding model of both
    over 50 random batches stays under 0.6 of 2^-7 of it)."""
    request_slots, tokens = BATCHES["T33"]
    T = sum(tokens)
    gen = torch.Generator().manual_seed(5)
    pool16 = LoraSlots(WIDE, 3, 8, torch.bfloat16, device)
    for target in wide.a:
        pool16.a[target].copy_(wide.a[target])
        pool16.b[target].copy_(wide.b[target])
    for target in ("qkv", "down"):
        fan_in = wide.a[target].shape[3]
        x = torch.randn(T, fan_in, generator=gen).bfloat16()
        y = torch.randn(T, wide.b[target].shape[2], generator=gen).bfloat16()
        got = _kernels(pool16, request_slots, tokens, per_token, target, x.to(device), y.to(device), 3).cpu()
        want, base_rows = _torch(_float32_copy(pool16), request_slots, tokens, target, x, y)
        bound = 2**-6 * (y.float().abs() + (want - y.float()).abs().max())
        assert ((got.float() - want).abs() <= bound).all(), (target, (got.float() - want).abs().max().item())
        assert torch.equal(got[base_rows], y[base_rows]), target


def _float32_copy(pool: LoraSlots) -> LoraSlots:
    """A float32 pool holding `pool`'s (lower precision) values."""
    out = LoraSlots(pool.shapes, pool.num_slots, pool.max_rank, torch.float32, "cpu")
    for target in out.a:
        out.a[target].copy_(pool.a[target].cpu())
        out.b[target].copy_(pool.b[target].cpu())
    return out


def test_the_split_rule_at_the_8b_shape():
    """shrink_plan at Llama-3.1-8B's fan-ins, rank 16 (qkv K = 48, down K = 16): decode's one-row segments
    split until ~2,048 programs or 128-feature slices; prefill's row tiles alone fill the GPU (one split)."""
    for T, want_qkv, want_down in ((1, 32, 28), (8, 32, 28), (32, 32, 28), (128, 16, 16), (512, 4, 4)):
        assert shrink_plan(T, 1, 4096, 48)[0] == want_qkv, T
        assert shrink_plan(T, 1, 14336, 16)[0] == want_down, T
    assert shrink_plan(1, 32, 4096, 48)[0] == 8  # one run of 32 rows: two tiles, at most 8 partials held
    assert shrink_plan(4, 512, 4096, 48)[0] == 2  # 128 row tiles
    assert shrink_plan(1, 2048, 14336, 16)[0] == 2
    assert shrink_plan(8, 2048, 14336, 16)[0] == 1
    # Row tiles of gate_up (28,672 columns over 4,096 features), and runs of 64 rows into qkv's 6,144: one
    # split (the expand would read the partials once per 64 columns); down's 4,096 over 14,336 still split.
    assert shrink_plan(8, 4, 4096, 32, fan_out=28672)[0] == 1 and shrink_plan(8, 4, 4096, 32)[0] == 8
    assert shrink_plan(8, 64, 4096, 48, fan_out=6144)[0] == 1 and shrink_plan(8, 16, 4096, 48, fan_out=6144)[0] == 8
    assert shrink_plan(8, 64, 14336, 16, fan_out=4096)[0] == 8
    # one prompt's prefill alone (16 row tiles): its tiles split even for wide targets
    assert shrink_plan(1, 256, 4096, 48, fan_out=6144)[0] == 8 and shrink_plan(1, 256, 4096, 32, fan_out=28672)[0] == 8
    assert shrink_plan(2, 512, 4096, 48, fan_out=6144)[0] == 1  # 64 row tiles
    assert shrink_plan(1, 1, 4096, 32, fan_out=28672)[0] == 32  # one-row segments (decode) split as before
    for fan_in in (64, 80, 4096, 14336):
        for T in (1, 3, 33, 300):
            splits, slice_in, block_in = shrink_plan(T, 1, fan_in, 48)
            assert slice_in % block_in == 0 and (splits - 1) * slice_in < fan_in <= splits * slice_in


def test_the_one_row_expand_grid_by_programs():
    # one row a program while rows x 64-column tiles stay few (decode's qkv, o, down at 32 rows); 4 rows x 256
    # columns past ONE_ROW_EXPAND_MANY programs (gate_up's 28,672 columns at 32 rows, everything at 128)
    assert [one_row_expand_grid(32, out) for out in (6144, 4096, 28672)] == [(1, 64), (1, 64), (4, 256)]
    assert [one_row_expand_grid(128, out) for out in (6144, 4096)] == [(4, 256), (4, 256)]
    assert one_row_expand_grid(1, 28672) == (1, 64)


def test_sgmv_of_a_batch_without_adapters_changes_nothing(slots):
    x, y = torch.randn(5, SHAPES.hidden), torch.randn(5, slots.b["qkv"].shape[2])
    segments = Segments.of_runs([], "cpu")
    assert torch.equal(sgmv_apply(segments, slots.a["qkv"], slots.b["qkv"], 0, 8, [64, 32, 32], x, y.clone()), y)
    per_token = Segments.per_token(torch.zeros(5, dtype=torch.int64))
    assert torch.equal(sgmv_apply(per_token, slots.a["qkv"], slots.b["qkv"], 0, 8, [64, 32, 32], x, y.clone()), y)


def _cuda_pool(dtype, shapes: LoraShapes = SHAPES) -> tuple[LoraSlots, LoraSlots]:
    """The same random adapters in a CPU float32 pool (the reference) and a CUDA pool of `dtype`; A scaled
    by sqrt(64 / fan-in), so a wider fan-in's sums stay within the bf16 tolerance fitted at 64."""
    cpu = LoraSlots(shapes, 3, 16, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(2)
    for target in cpu.a:
        scale = 0.2 * (64 / cpu.a[target].shape[3]) ** 0.5
        cpu.a[target][1:].copy_(torch.randn(cpu.a[target][1:].shape, generator=gen) * scale)
        cpu.b[target][1:].copy_(torch.randn(cpu.b[target][1:].shape, generator=gen) * 0.2)
    gpu = LoraSlots(shapes, 3, 16, dtype, "cuda")
    for target in cpu.a:
        gpu.a[target].copy_(cpu.a[target])
        gpu.b[target].copy_(cpu.b[target])
    return cpu, gpu


@pytest.mark.gpu
def test_gpu_step_rows_go_up_without_waiting_for_the_device():
    # A LoRA step's rows and segments are known on the host; their copies must not wait for the step in
    # flight (overlap scheduling), here a kernel still running.
    pool = LoraSlots(SHAPES, 3, 8, torch.float32, "cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of one busy kernel
    batch = LoraBatch.of_rows(pool, [2, 0, 1, 1], [5, 7, 1, 2])
    assert not torch.cuda.current_stream().query()
    seg = batch.device_segments
    assert seg.starts.tolist() == [0, 12] and seg.lengths.tolist() == [5, 3] and seg.slots.tolist() == [2, 1]
    assert seg.longest == 5 and batch.token_slots.tolist() == [2] * 5 + [0] * 7 + [1] * 3


@pytest.mark.gpu
@pytest.mark.parametrize("shapes", [SHAPES, WIDE], ids=["small", "wide"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sgmv_compiled_on_the_gpu_eager_and_in_a_cuda_graph(dtype, shapes):
    """What the runner runs on a GPU: LoraBatch picks the kernels (segments eagerly; one per token in a
    captured graph, replayed with other slots), equal to the CPU's torch segments within the dtype. WIDE's
    fan-in the rule splits (two partials) in the graph's one-row form."""
    cpu, gpu = _cuda_pool(dtype, shapes)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=5e-2)
    request_slots, tokens = [2, 0, 1, 3, 2, 1], [40, 3, 17, 1, 70, 137]
    T = sum(tokens)
    x = torch.randn(T, shapes.hidden)
    y = torch.randn(T, gpu.b["qkv"].shape[2])
    last = shapes.num_layers - 1  # (WIDE has one layer)
    want = LoraBatch.of_rows(cpu, request_slots, tokens).apply(last, "qkv", x, y.clone())
    eager = LoraBatch.of_rows(gpu, request_slots, tokens)
    assert eager.device_segments is not None and eager.device_segments.longest == 137
    got = eager.apply(last, "qkv", x.to("cuda", dtype), y.to("cuda", dtype))
    torch.testing.assert_close(got.float().cpu(), want, **tol)
    # a decode batch in a graph: the slots are data
    bs = 11  # not a multiple of the one-row expand's rows a program
    slots = torch.zeros(bs, dtype=torch.int64, device="cuda")
    xs, ys = (
        torch.randn(bs, shapes.hidden, device="cuda", dtype=dtype),
        torch.zeros(bs, gpu.b["qkv"].shape[2], device="cuda", dtype=dtype),
    )
    out = torch.empty_like(ys)
    LoraBatch(gpu, slots).apply(0, "qkv", xs, ys.clone())  # compiled before the capture, as the runner warms up
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out.copy_(LoraBatch(gpu, slots).apply(0, "qkv", xs, ys.clone()))
    for row_slots in ([1, 0, 2, 3, 3, 0, 1, 2, 2, 0, 1], [0] * bs, [3] * bs):
        slots.copy_(torch.tensor(row_slots))
        graph.replay()
        ref = LoraBatch.of_rows(cpu, row_slots, [1] * bs).apply(0, "qkv", xs.float().cpu(), ys.float().cpu())
        torch.testing.assert_close(out.float().cpu(), ref, **tol)


@pytest.mark.skipif(not ptxas_shipped(), reason="this Triton wheel has no NVIDIA backend with ptxas")
def test_sgmv_kernels_compile_for_hopper(tmp_path):
    """The shrink and expand compiled for sm_90 here (the interpreter runs them above; only a GPU's compiler
    rejects what it cannot lower): the 8B's qkv, gate_up and down, one-row segments and runs."""
    ok, failed, output = compile_for_hopper(["lora"], tmp_path)
    assert not failed, output
    assert len(ok) == 12, output


def test_slot_write_from_the_adapters_host_image():
    # A slot holds each module's A and B at the max rank (zero-padded), in the slots' dtype; the adapter's
    # host image is made once, reused by later writes (a swap back), and dropped with the adapter.
    gen = torch.Generator().manual_seed(3)
    L, r = SHAPES.num_layers, 4
    weights = {}
    for t in TARGETS:
        for module in t.modules:
            if module in ("k_proj", "up_proj"):
                weights[module] = None  # a module the adapter leaves alone
                continue
            fan_in, fan_out = SHAPES.in_features(t), SHAPES.out_features(module)
            weights[module] = (torch.randn(L, r, fan_in, generator=gen), torch.randn(L, fan_out, r, generator=gen))
    adapter = LoraAdapter("x", "/nowhere", r, weights)
    pool = LoraSlots(SHAPES, 3, 8, torch.bfloat16, "cpu")
    pool.write(2, adapter)
    for t in TARGETS:
        out = 0
        for j, module in enumerate(t.modules):
            size = SHAPES.out_features(module)
            a = pool.a[t.name][2, :, j * 8 : (j + 1) * 8]  # (L, R, in)
            b = pool.b[t.name][2, :, out : out + size]  # (L, size, R)
            if weights[module] is None:
                assert not a.any() and not b.any()
            else:
                assert torch.equal(a[:, :r], weights[module][0].to(torch.bfloat16)) and not a[:, r:].any()
                assert torch.equal(b[:, :, :r], weights[module][1].to(torch.bfloat16)) and not b[:, :, r:].any()
            out += size
        assert not pool.a[t.name][1].any() and not pool.a[t.name][3].any()  # other slots untouched
    image = pool.host_image(adapter)
    pool.write(1, adapter)
    assert pool.host_image(adapter) is image and torch.equal(pool.a["qkv"][1], pool.a["qkv"][2])
    del adapter, image
    gc.collect()
    assert not pool._images
