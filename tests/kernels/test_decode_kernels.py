"""The decode-time kernels that replace library calls: the skinny matmul (runtime/kernels/gemv.py) against
float64 matmul, and the greedy argmax (argmax.py) against torch.argmax. CPU interpreter at small
sizes, the GPU at the real decode shapes."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)


def gemv_module():
    import importlib

    return importlib.import_module("plait.runtime.kernels.gemv")  # after conftest chose the interpreter


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("n,k", [(40, 100), (64, 256), (7, 1030), (12, 4500)])
def test_gemv_matches_float64(rows, n, k):
    g = gemv_module()
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    x, w, b = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    for cfg in (g.GemvConfig(), g.GemvConfig(block_n=16, block_k=64, num_warps=2, num_stages=2)):
        y = g.gemv(x, w, b, cfg)
        assert y.shape == (rows, n) and not torch.isnan(y).any()
        assert rel_err(y, x.double() @ w.double().T + b.double()) < 1e-6
    assert rel_err(g.gemv(x, w), x.double() @ w.double().T) < 1e-6


def test_gemv_strided_rows_and_bad_input():
    g = gemv_module()
    base = torch.randn(4, 300)
    x = base[:, :128]  # rows with a stride of 300: a view like a slice of a fused output
    w = torch.randn(32, 128)
    assert rel_err(g.gemv(x, w), x.double() @ w.double().T) < 1e-6
    with pytest.raises(ValueError, match="rows"):
        g.gemv(torch.randn(9, 128), w)
    with pytest.raises(ValueError, match="weight"):
        g.gemv(torch.randn(1, 64), w)
    with pytest.raises(ValueError, match="unit stride"):
        g.gemv(torch.randn(128, 2).t(), w)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (28672, 4096), (128256, 2048)])
def test_gpu_gemv_bf16_real_shapes(rows, n, k):
    g = gemv_module()
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    y = g.gemv(x, w)
    assert rel_err(y, x.double() @ w.double().T) < 1e-2


@pytest.mark.gpu
def test_gpu_gemv_pdl_chain_in_cuda_graph():
    # PDL on: each skinny matmul may start while the kernel before it finishes, so a missing wait
    # would read a stale x. Replayed with new inputs, the chain must equal the plain launches bit for bit
    # (the two builds differ only in the wait and launch-dependents instructions).
    g = gemv_module()
    gen = torch.Generator(device="cuda").manual_seed(3)

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen) * scale

    x, w_qkv, w_o, w_head = (
        rand(1, 4096),
        rand(6144, 4096, scale=0.02),
        rand(4096, 4096, scale=0.02),
        rand(32000, 4096, scale=0.02),
    )

    def chain():
        o = g.gemv(g.gemv(x, w_qkv)[:, :4096], w_o)  # (1, 4096): PDL kernel after PDL kernel
        return g.gemv(o * 2, w_head, out_dtype=torch.float32)  # after a plain torch kernel

    from plait.runtime.kernel_choices import KernelChoices, using
    from plait.runtime.kernels.launch import pdl_enabled

    with using(KernelChoices(pdl=True)):
        assert pdl_enabled(x.device) == (torch.cuda.get_device_capability(x.device)[0] >= 9)
        chain()  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain()
    for _ in range(3):
        x.normal_(generator=gen)
        graph.replay()
        ref = chain()  # plain launches (PDL off outside the choices)
        assert torch.equal(out, ref)


def test_pdl_by_rows_on_for_one_fp8_row_only():
    from plait.runtime.kernel_choices import KernelChoices
    from plait.runtime.server_args import ServerArgs

    fp8 = ServerArgs(model_path="m", quantization="fp8").kernel_choices()
    assert not fp8.pdl and fp8.pdl_max_rows == 1
    assert ServerArgs(model_path="m", quantization="fp8", tp_size=2).kernel_choices().pdl_max_rows == 0
    assert fp8.for_rows(1).pdl and not fp8.for_rows(2).pdl and fp8.for_rows(2) is fp8
    bf16 = ServerArgs(model_path="m").kernel_choices()
    assert not bf16.for_rows(1).pdl  # bf16's batch-1 step: measured no gain
    assert ServerArgs(model_path="m", enable_pdl=True).kernel_choices().for_rows(64).pdl  # everywhere when asked
    assert KernelChoices(pdl_max_rows=4).for_rows(4).pdl


# ---------------------------------------------------------------- greedy argmax (runtime/kernels/argmax.py)


def argmax_rows():
    import importlib

    return importlib.import_module("plait.runtime.kernels.argmax").argmax_rows


@pytest.mark.parametrize("rows,vocab", [(1, 10), (3, 4096), (2, 4097), (4, 9000)])
def test_argmax_rows_matches_torch(rows, vocab):
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab))
    assert torch.equal(argmax_rows()(x), x.argmax(-1))


def test_argmax_rows_ties_go_to_the_first_index_across_chunks_and_bf16():
    x = torch.zeros(3, 9000)
    x[0, 5000] = x[0, 8000] = 1.0  # a tie in two different 4096-wide chunks
    x[1, :] = float("-inf")  # nothing finite: index 0, like torch
    x[2, 4095] = x[2, 4096] = 2.0  # a tie across a chunk boundary
    assert argmax_rows()(x).tolist() == [5000, 0, 4095] == x.argmax(-1).tolist()
    y = torch.randn(2, 5000).to(torch.bfloat16)
    y[:, 7] = y[:, 4100] = 100.0
    assert argmax_rows()(y).tolist() == [7, 7]
    with pytest.raises(ValueError, match="unit stride"):
        argmax_rows()(torch.randn(8, 2).t())


def test_greedy_tokens_uses_torch_on_the_cpu():
    from plait.runtime.executor.sampler import greedy_tokens

    x = torch.randn(5, 300)
    assert torch.equal(greedy_tokens(x), x.argmax(-1))


@pytest.mark.gpu
def test_gpu_argmax_rows_real_vocab():
    x = torch.randn(256, 128256, device="cuda")
    assert torch.equal(argmax_rows()(x), x.argmax(-1))
