"""The Triton segmented LoRA matmul (runtime/lora/sgmv.py), run by Triton's CPU interpreter at small
sizes: the same sums as the torch path (`LoraBatch`'s segments), with segments from the host's runs and
with one segment per token (the CUDA-graph form); rows of the base model left exactly as they were."""

from __future__ import annotations

import pytest
import torch
from plait.runtime.lora.adapter import LoraShapes
from plait.runtime.lora.matmul import LoraBatch
from plait.runtime.lora.sgmv import Segments, sgmv_apply
from plait.runtime.lora.slots import LoraSlots

SHAPES = LoraShapes(num_layers=2, hidden=64, q_size=64, kv_size=32, intermediate=80)


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


def test_sgmv_of_a_batch_without_adapters_changes_nothing(slots):
    x, y = torch.randn(5, SHAPES.hidden), torch.randn(5, slots.b["qkv"].shape[2])
    segments = Segments.of_runs([], "cpu")
    assert torch.equal(sgmv_apply(segments, slots.a["qkv"], slots.b["qkv"], 0, 8, [64, 32, 32], x, y.clone()), y)
    per_token = Segments.per_token(torch.zeros(5, dtype=torch.int64))
    assert torch.equal(sgmv_apply(per_token, slots.a["qkv"], slots.b["qkv"], 0, 8, [64, 32, 32], x, y.clone()), y)


def _cuda_pool(dtype) -> tuple[LoraSlots, LoraSlots]:
    """The same random adapters in a CPU float32 pool (the reference) and a CUDA pool of `dtype`."""
    cpu = LoraSlots(SHAPES, 3, 16, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(2)
    for target in cpu.a:
        cpu.a[target][1:].copy_(torch.randn(cpu.a[target][1:].shape, generator=gen) * 0.2)
        cpu.b[target][1:].copy_(torch.randn(cpu.b[target][1:].shape, generator=gen) * 0.2)
    gpu = LoraSlots(SHAPES, 3, 16, dtype, "cuda")
    for target in cpu.a:
        gpu.a[target].copy_(cpu.a[target])
        gpu.b[target].copy_(cpu.b[target])
    return cpu, gpu


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sgmv_compiled_on_the_gpu_eager_and_in_a_cuda_graph(dtype):
    """What the runner runs on a GPU: LoraBatch picks the kernels (segments eagerly; one per token in a
    captured graph, replayed with other slots), equal to the CPU's torch segments within the dtype."""
    cpu, gpu = _cuda_pool(dtype)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=5e-2)
    request_slots, tokens = [2, 0, 1, 3, 2], [40, 3, 17, 1, 70]
    T = sum(tokens)
    x = torch.randn(T, SHAPES.hidden)
    y = torch.randn(T, gpu.b["qkv"].shape[2])
    want = LoraBatch.of_rows(cpu, request_slots, tokens).apply(1, "qkv", x, y.clone())
    eager = LoraBatch.of_rows(gpu, request_slots, tokens)
    assert eager.device_segments is not None
    got = eager.apply(1, "qkv", x.to("cuda", dtype), y.to("cuda", dtype))
    torch.testing.assert_close(got.float().cpu(), want, **tol)
    # a decode batch in a graph: the slots are data
    bs = 8
    slots = torch.zeros(bs, dtype=torch.int64, device="cuda")
    xs, ys = (
        torch.randn(bs, SHAPES.hidden, device="cuda", dtype=dtype),
        torch.zeros(bs, 128, device="cuda", dtype=dtype),
    )
    out = torch.empty_like(ys)
    LoraBatch(gpu, slots).apply(0, "qkv", xs, ys.clone())  # compiled before the capture, as the runner warms up
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out.copy_(LoraBatch(gpu, slots).apply(0, "qkv", xs, ys.clone()))
    for row_slots in ([1, 0, 2, 3, 3, 0, 1, 2], [0] * bs, [3] * bs):
        slots.copy_(torch.tensor(row_slots))
        graph.replay()
        ref = LoraBatch.of_rows(cpu, row_slots, [1] * bs).apply(0, "qkv", xs.float().cpu(), ys.float().cpu())
        torch.testing.assert_close(out.float().cpu(), ref, **tol)
