"""The one-row decode matmuls with the op before them folded in (runtime/kernels/gemv_fused.py) against
the unfused ops: rms_norm_torch / SiluAndMul + F.linear, and the unfused Triton kernels, bf16 and FP8 weights. The
decoder's one-row path that runs them: tests/models/test_one_row_path.py.

Without CUDA the kernels run in Triton's CPU interpreter at tiny sizes (K and N not multiples of the
blocks). The interpreter rounds float32 -> bfloat16 by truncation, so bf16 is checked bit for bit
against the unfused Triton kernels (which truncate the same way) and within tolerance against torch;
the `gpu` tests run the real Llama-3.1-8B shapes and the PDL launch inside a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from plait.runtime.kernel_choices import KernelChoices, using
from plait.runtime.models.layers import rms_norm_torch, silu_and_mul_torch

torch.set_num_threads(1)

EPS = 1e-5


def kernels():
    from plait.runtime import kernels as k  # imported in the test, after conftest chose the interpreter

    return k


def fused():
    import importlib

    return importlib.import_module("plait.runtime.kernels.gemv_fused")


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref.double()).norm() / ref.double().norm())


def configs():
    f = fused()
    return [None, f.FusedGemvConfig(block_n=4, block_k=64), f.FusedGemvConfig(block_n=8, resident=True, sub_n=2)]


def unfused_gemv(act: torch.Tensor, w: torch.Tensor, b, cfg) -> torch.Tensor:
    """gemv.py's kernel over the same K chunks as the fused kernel with `cfg`: in the interpreter the two
    then sum in the same order, so the results must be equal bit for bit."""
    f = fused()
    k = w.shape[1]
    cfg = cfg or f.pick_fused_gemv_config(w.shape[0], k)
    k_pow2 = f.next_power_of_2(k)
    block_k = k_pow2 if cfg.resident else min(cfg.block_k, k_pow2)
    from plait.runtime.kernels.gemv import GemvConfig

    return kernels().gemv(act, w, b, GemvConfig(block_n=4, block_k=block_k))


def _inputs(n: int, k: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x, residual = (torch.randn(1, k, generator=g).to(dtype) for _ in range(2))
    norm_w = (1 + 0.2 * torch.randn(k, generator=g)).to(dtype)
    w, b = (torch.randn(n, k, generator=g) * 0.1).to(dtype), torch.randn(n, generator=g).to(dtype)
    return x, residual, norm_w, w, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(37, 200), (5, 1030)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_rmsnorm_gemv_matches_unfused(dtype, n, k, with_residual):
    x, residual, norm_w, w, b = _inputs(n, k, dtype, seed=n + k)
    res_in = residual.clone() if with_residual else None
    torch_out = rms_norm_torch(x, norm_w, EPS, res_in)
    ref_act, ref_res = torch_out if with_residual else (torch_out, x)
    ref = F.linear(ref_act.double(), w.double(), b.double())
    # The unfused Triton kernels, which round exactly like the fused one (interpreter included).
    k_ = kernels()
    if with_residual:
        tri_act, tri_res = k_.fused_add_rmsnorm(x, residual.clone(), norm_w, EPS)
    else:
        tri_act, tri_res = k_.rmsnorm(x, norm_w, EPS), x
    for cfg in configs():
        y, res = k_.rmsnorm_gemv(x, res_in, norm_w, EPS, w, b, config=cfg)
        tri = unfused_gemv(tri_act, w, b, cfg)
        used = cfg or fused().pick_fused_gemv_config(n, k)
        if not used.resident and used.block_k < k:  # several K chunks: the sum of squares in another order
            assert rel_err(y, tri) < (1e-6 if dtype == torch.float32 else 1e-2)
        else:  # the whole row in one chunk, like rmsnorm.py
            assert torch.equal(y, tri)
        assert y.shape == (1, n) and y.dtype == dtype and res.shape == (1, k)
        if with_residual:
            assert torch.equal(res_in, residual)  # the residual given is left alone; the sum is new
            assert torch.equal(res, tri_res)
            if dtype == torch.float32:
                assert torch.equal(res, ref_res)
        else:
            assert res is x
        assert rel_err(y, ref) < (1e-5 if dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,inter", [(37, 200), (6, 1030)])
def test_silu_mul_gemv_matches_unfused(dtype, n, inter):
    g = torch.Generator().manual_seed(inter)
    gate_up = (torch.randn(1, 2 * inter, generator=g) * 3).to(dtype)
    w = (torch.randn(n, inter, generator=g) * 0.1).to(dtype)
    ref = F.linear(silu_and_mul_torch(gate_up).double(), w.double())
    act = kernels().silu_and_mul(gate_up)
    for cfg in configs():
        y = kernels().silu_mul_gemv(gate_up, w, config=cfg)
        assert y.shape == (1, n) and y.dtype == dtype
        assert torch.equal(y, unfused_gemv(act, w, None, cfg))
        assert rel_err(y, ref) < (1e-5 if dtype == torch.float32 else 3e-2)


def test_gemv_row_plain_with_bias_and_float32_logits():
    x, _, _, w, b = _inputs(41, 130, torch.bfloat16, seed=3)
    for cfg in configs():
        y = kernels().gemv_row(x, w, b, out_dtype=torch.float32, config=cfg)
        assert y.dtype == torch.float32
        assert rel_err(y, F.linear(x.double(), w.double(), b.double())) < 1e-6  # fp32 output: no rounding


def test_final_norm_into_lm_head_float32_out():
    x, residual, norm_w, w, _ = _inputs(50, 64, torch.float32, seed=4)
    y, _ = kernels().rmsnorm_gemv(x, residual, norm_w, EPS, w, out_dtype=torch.float32)
    out, _ = rms_norm_torch(x, norm_w, EPS, residual)
    assert rel_err(y, F.linear(out.double(), w.double())) < 1e-5


def _fp8_weight(n: int, k: int, seed: int):
    from plait.runtime.quant.fp8 import quantize_per_channel

    g = torch.Generator().manual_seed(seed)
    codes, scales = quantize_per_channel(torch.randn(n, k, generator=g) * 0.1)
    return codes, scales, codes.double() * scales.double()[:, None]  # (N, K) codes, (N,) scales, W in float64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_gemv_reads_fp8_weights_with_their_row_scales(dtype):
    # Each prologue over FP8 codes: the unfused op, then the product with codes * scale, in float64.
    n, k = 37, 200
    x, residual, norm_w, _, b = _inputs(n, k, dtype, seed=9)
    codes, scales, w = _fp8_weight(n, k, seed=10)
    bound = 1e-5 if dtype == torch.float32 else 3e-2
    for cfg in [
        None,
        fused().FusedGemvConfig(block_n=4, block_k=64),
        fused().FusedGemvConfig(block_n=8, resident=True),
    ]:
        y, res = kernels().rmsnorm_gemv(x, residual, norm_w, EPS, codes, b, config=cfg, weight_scale=scales)
        act, ref_res = rms_norm_torch(x, norm_w, EPS, residual.clone())
        assert y.dtype == dtype and rel_err(y, act.double() @ w.T + b.double()) < bound
        assert torch.equal(res, ref_res) or dtype != torch.float32
        gate_up = torch.cat([x, residual], dim=1)  # (1, 2K)
        y = kernels().silu_mul_gemv(gate_up, codes, config=cfg, weight_scale=scales)
        assert rel_err(y, silu_and_mul_torch(gate_up).double() @ w.T) < bound
        y = kernels().gemv_row(x, codes, b, out_dtype=torch.float32, config=cfg, weight_scale=scales)
        assert y.dtype == torch.float32 and rel_err(y, x.double() @ w.T + b.double()) < 1e-6
    with pytest.raises(ValueError, match="come with a weight_scale"):
        kernels().gemv_row(x, codes)  # FP8 codes read as numbers
    with pytest.raises(ValueError, match="come with a weight_scale"):
        kernels().gemv_row(x, w.float(), weight_scale=scales)  # a scale for float weights
    with pytest.raises(ValueError, match=r"weight_scale must be float32 \(37,\)"):
        kernels().gemv_row(x, codes, weight_scale=scales[:5])


def test_fused_gemv_bad_input_names_the_problem():
    k_ = kernels()
    x, residual, norm_w, w, b = _inputs(8, 32, torch.float32, seed=5)
    with pytest.raises(ValueError, match="one row"):
        k_.rmsnorm_gemv(torch.randn(2, 32), None, norm_w, EPS, w)
    with pytest.raises(ValueError, match=r"residual must be one row \(1, 32\)"):
        k_.rmsnorm_gemv(x, torch.randn(1, 31), norm_w, EPS, w)
    with pytest.raises(ValueError, match="norm weight"):
        k_.rmsnorm_gemv(x, residual, norm_w.to(torch.bfloat16), EPS, w)
    with pytest.raises(ValueError, match=r"weight must be \(N, 32\)"):
        k_.rmsnorm_gemv(x, residual, norm_w, EPS, torch.randn(8, 33))
    with pytest.raises(ValueError, match="bias"):
        k_.gemv_row(x, w, torch.randn(9))
    with pytest.raises(ValueError, match="gate_up must be"):
        k_.silu_mul_gemv(torch.randn(1, 31), w)
    with pytest.raises(ValueError, match="unit stride"):
        k_.gemv_row(torch.randn(1, 64)[:, ::2], w)
    with pytest.raises(ValueError, match="resident-row kernel"):
        k_.gemv_row(torch.randn(1, 9000), torch.randn(2, 9000), config=fused().FusedGemvConfig(resident=True))


def test_fused_gemv_default_tiles_are_gemv_py_measured_ones():
    from plait.runtime.kernels.gemv import pick_gemv_config

    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096), (37, 200)]:
        base, cfg = pick_gemv_config(n, k), fused().pick_fused_gemv_config(n, k)
        assert (cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages) == (
            base.block_n,
            base.block_k,
            base.num_warps,
            base.num_stages,
        )
        assert not cfg.resident  # gemv.py's K loop


def test_pdl_stays_off_without_a_hopper_gpu(monkeypatch):
    # PDL asked for on a machine without one (here the interpreter): both kernel families launch plainly.
    from plait.runtime.kernels.launch import pdl_enabled

    with using(KernelChoices(pdl=True)):
        assert not pdl_enabled(torch.device("cpu"))
    x, _, _, w, b = _inputs(9, 40, torch.float32, seed=6)
    ref = F.linear(x.double(), w.double(), b.double())
    assert rel_err(kernels().gemv(x, w, b), ref) < 1e-6 and rel_err(kernels().gemv_row(x, w, b), ref) < 1e-6


# ---------------------------------------------------------------- GPU, real sizes

gpu = pytest.mark.gpu
SHAPES_8B = {"qkv": (6144, 4096), "gate_up": (28672, 4096), "lm_head": (128256, 4096)}


@gpu
@pytest.mark.parametrize("name", sorted(SHAPES_8B))
def test_gpu_rmsnorm_gemv_bf16_8b_shapes(name):
    n, k = SHAPES_8B[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    x, residual = (torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    norm_w = torch.randn(k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    out_dtype = torch.float32 if name == "lm_head" else None
    tri_act, tri_res = kernels().fused_add_rmsnorm(x, residual.clone(), norm_w, EPS)
    unfused = F.linear(tri_act, w).to(out_dtype or torch.bfloat16)
    y, res = kernels().rmsnorm_gemv(x, residual, norm_w, EPS, w, out_dtype=out_dtype)
    assert torch.equal(res, tri_res) and torch.equal(res, x + residual)
    assert rel_err(y, unfused) < 5e-3
    assert rel_err(y, F.linear(rms_norm_torch(x, norm_w, EPS, residual)[0].double(), w.double())) < 1e-2


@gpu
@pytest.mark.parametrize("name", ["qkv", "o", "gate_up", "down"])
def test_gpu_fused_gemv_fp8_8b_shapes(name):
    # The FP8 one-row kernels with their prologue against the unfused FP8 step (norm / activation kernel, then
    # gemv.py's FP8 matmul) at the 8B layer's shapes, with the FP8 tiles.
    from plait.runtime.quant.fp8 import quantize_per_channel

    n, k = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}[name]
    g = torch.Generator(device="cuda").manual_seed(1)
    x, residual = (torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    norm_w = torch.randn(k, device="cuda", dtype=torch.bfloat16, generator=g)
    codes, scales = quantize_per_channel(torch.randn(n, k, device="cuda", generator=g) * 0.02)
    k_ = kernels()
    if name == "o":
        y, unfused = k_.gemv_row(x, codes, weight_scale=scales), k_.gemv(x, codes, weight_scale=scales)
    elif name == "down":
        gate_up = torch.cat([x, residual], dim=1)
        y = k_.silu_mul_gemv(gate_up, codes, weight_scale=scales)
        unfused = k_.gemv(k_.silu_and_mul(gate_up), codes, weight_scale=scales)
    else:
        y, res = k_.rmsnorm_gemv(x, residual, norm_w, EPS, codes, weight_scale=scales)
        act, tri_res = k_.fused_add_rmsnorm(x, residual.clone(), norm_w, EPS)
        unfused = k_.gemv(act, codes, weight_scale=scales)
        assert torch.equal(res, tri_res)
    assert y.dtype == torch.bfloat16 and rel_err(y, unfused) < 5e-3


@gpu
def test_gpu_silu_mul_gemv_bf16_8b_down():
    g = torch.Generator(device="cuda").manual_seed(1)
    gate_up = torch.randn(1, 2 * 14336, device="cuda", dtype=torch.bfloat16, generator=g) * 3
    w = torch.randn(4096, 14336, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    unfused = F.linear(kernels().silu_and_mul(gate_up), w)
    y = kernels().silu_mul_gemv(gate_up, w)
    assert rel_err(y, unfused) < 5e-3
    assert rel_err(y, F.linear(silu_and_mul_torch(gate_up).double(), w.double())) < 1e-2


@gpu
@pytest.mark.parametrize("pdl", [False, True])
def test_gpu_fused_chain_in_cuda_graph_pdl(pdl):
    # One layer's one-row matmul chain, captured and replayed with new inputs; with PDL on every kernel
    # may start before the previous one ends, so a missing wait would show as a wrong result.
    with using(KernelChoices(pdl=pdl)):
        _fused_chain_in_cuda_graph()


def _fused_chain_in_cuda_graph():
    k_ = kernels()
    g = torch.Generator(device="cuda").manual_seed(2)

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g) * scale

    h, residual = rand(1, 4096), rand(1, 4096)
    n1, n2 = rand(4096, scale=0.1) + 1, rand(4096, scale=0.1) + 1
    w_qkv, w_o, w_gu, w_down = (
        rand(6144, 4096, scale=0.02),
        rand(4096, 4096, scale=0.02),
        rand(28672, 4096, scale=0.02),
        rand(4096, 14336, scale=0.02),
    )

    def chain():
        qkv, res1 = k_.rmsnorm_gemv(h, residual, n1, EPS, w_qkv)
        o = k_.gemv_row(qkv[:, :4096], w_o)
        gate_up, res2 = k_.rmsnorm_gemv(o, res1, n2, EPS, w_gu)
        return k_.silu_mul_gemv(gate_up, w_down), res1, o, res2

    def reference():
        a, res1 = rms_norm_torch(h, n1, EPS, residual)
        o = F.linear(F.linear(a, w_qkv)[:, :4096], w_o)
        a, res2 = rms_norm_torch(o, n2, EPS, res1)
        return F.linear(silu_and_mul_torch(F.linear(a, w_gu)), w_down), res2

    chain()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, out_res1, out_o, out_res2 = chain()
    for _ in range(3):
        h.normal_(generator=g), residual.normal_(generator=g)
        graph.replay()
        ref, ref_res2 = reference()
        # Exact where both sides add the same bf16 values (a float32 sum rounded once): the first residual
        # from the inputs, the second from the chain's own o. A kernel that ran before its input was
        # written (a missing PDL wait) would break these.
        assert torch.equal(out_res1, h + residual)
        assert torch.equal(out_res2, out_o + out_res1)
        # o itself differs from F.linear's in rounding (another summation order), and so does all after it.
        assert rel_err(out_res2, ref_res2) < 1e-2
        assert rel_err(out, ref) < 2e-2
