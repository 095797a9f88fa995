"""Fused Triton kernels (RMSNorm(+residual), rotary, SiLU-and-mul) against the torch reference in layers.py.

Without CUDA the kernels run in Triton's CPU interpreter (conftest.py sets TRITON_INTERPRET=1 before
triton is imported) at small shapes, chosen so that masks, row groups and several blocks are hit.
The interpreter rounds float32 -> bfloat16 by truncation (the GPU rounds to nearest even), so on the
CPU bf16 is checked to within an ulp and exactness is checked in fp32/fp16; the `gpu` tests check
bf16 at real sizes against torch on the GPU, and that the ops capture into a CUDA graph. The ops in a
whole decoder stack: test_fused_decoder.py.
"""

import pytest
import torch
import torch.nn.functional as F
from plait.runtime.models.layers import (
    RMSNorm,
    SiluAndMul,
    rms_norm_torch,
    silu_and_mul,
    silu_and_mul_torch,
)
from plait.runtime.models.rotary import RotaryEmbedding, rotary_torch

torch.set_num_threads(1)

HAS_CUDA = torch.cuda.is_available()
CPU_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
MANTISSA_BITS = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}


def kernels():
    from plait.runtime import kernels as k  # imported in the test, after conftest chose the interpreter

    return k


def assert_close_ulps(actual: torch.Tensor, expected: torch.Tensor, ulps: float):
    """|actual - expected| <= ulps units in the last place of expected's dtype (relative)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    a, e = actual.float(), expected.float()
    step = 2.0 ** -MANTISSA_BITS[expected.dtype]
    bound = ulps * step * e.abs() + 1e-30
    worst = ((a - e).abs() - bound).max().item()
    assert worst <= 0, f"max excess over {ulps} ulp(s): {worst:.3g}, max abs diff {(a - e).abs().max().item():.3g}"


def cpu_ulps(dtype: torch.dtype) -> float:
    # fp32: summation order and FMA-free arithmetic leave a few ulps; fp16: numpy rounds like torch;
    # bf16: the interpreter truncates instead of rounding, one ulp per cast, two casts in a row.
    return {torch.float32: 8, torch.float16: 1, torch.bfloat16: 2}[dtype]


def qkv_views(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype, device="cpu", seed=0):
    """q (T, H, D), k (T, Hkv, D), v: strided views of one fused QKV output, like the model's."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(tokens, q_size + 2 * kv_size, generator=g).to(dtype).to(device)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return (
        qkv,
        q.view(tokens, heads, head_dim),
        k.view(tokens, kv_heads, head_dim),
        v.view(tokens, kv_heads, head_dim),
    )


# ---------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("rows,dim", [(5, 96), (3, 576), (2, 2048)])
def test_rmsnorm_matches_torch(dtype, rows, dim):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(rows, dim, generator=g) * 3).to(dtype)
    w = torch.randn(dim, generator=g).to(dtype)
    out = kernels().rmsnorm(x, w, 1e-6)
    assert_close_ulps(out, rms_norm_torch(x, w, 1e-6), cpu_ulps(dtype))


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_fused_add_rmsnorm_updates_residual_in_place(dtype):
    g = torch.Generator().manual_seed(2)
    x, residual = (torch.randn(6, 200, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(200, generator=g).to(dtype)
    ref_out, ref_residual = rms_norm_torch(x, w, 1e-5, residual)
    x_before = x.clone()
    out, new_residual = kernels().fused_add_rmsnorm(x, residual, w, 1e-5)
    assert new_residual is residual  # the sum was written back into the caller's buffer
    assert torch.equal(x, x_before)
    if dtype is torch.bfloat16:
        assert_close_ulps(new_residual, ref_residual, 1)
        ref_out = rms_norm_torch(new_residual, w, 1e-5)  # don't count the sum's truncation twice
    else:  # a single rounded add: exact
        assert torch.equal(new_residual, ref_residual)
    assert_close_ulps(out, ref_out, cpu_ulps(dtype))


@pytest.mark.parametrize("dim", [64, 2048])
def test_fused_add_rmsnorm_fp16_bit_exact(dim):
    # The normalised value is rounded to fp16 before the weight multiply, and a product of two fp16
    # values is exact in fp32, so the only rounding left is torch's own: fp16 agrees bit for bit.
    g = torch.Generator().manual_seed(3)
    x, residual = (torch.randn(4, dim, generator=g).half() for _ in range(2))
    w = torch.randn(dim, generator=g).half()
    ref_out, _ = rms_norm_torch(x, w, 1e-6, residual)
    out, _ = kernels().fused_add_rmsnorm(x, residual.clone(), w, 1e-6)
    assert torch.equal(out, ref_out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_per_head_on_strided_view(dtype):
    # Qwen3's q/k norm: rows are (token, head) pairs of a slice of the fused QKV output; 45 rows of
    # head_dim 128 make two row groups with a masked tail.
    qkv, q, k, _ = qkv_views(9, 5, 1, 128, dtype)
    w = torch.randn(128).to(dtype)
    before = qkv.clone()
    out_q, out_k = kernels().rmsnorm(q, w, 1e-6), kernels().rmsnorm(k, w, 1e-6)
    assert out_q.shape == q.shape and out_q.is_contiguous()
    assert_close_ulps(out_q, rms_norm_torch(q, w, 1e-6), cpu_ulps(dtype))
    assert_close_ulps(out_k, rms_norm_torch(k, w, 1e-6), cpu_ulps(dtype))
    assert torch.equal(qkv, before)


def test_rmsnorm_single_row_vector():
    x, residual, w = torch.randn(40), torch.randn(40), torch.randn(40)
    ref_out, ref_res = rms_norm_torch(x, w, 1e-6, residual)
    out, res = kernels().fused_add_rmsnorm(x, residual, w, 1e-6)
    assert out.shape == (40,) and res is residual and torch.equal(res, ref_res)
    assert torch.allclose(out, ref_out, rtol=1e-5, atol=1e-6)


def test_rmsnorm_promotes_to_weight_dtype_like_torch():
    x = torch.randn(3, 64).to(torch.bfloat16)
    w = torch.randn(64)  # float32 weight, bf16 activations
    ref = rms_norm_torch(x, w, 1e-6)
    out = kernels().rmsnorm(x, w, 1e-6)
    assert out.dtype == ref.dtype == torch.float32
    # normalised value truncated (interpreter) vs rounded to bf16, then an exact fp32 multiply
    assert torch.allclose(out, ref, rtol=2**-7, atol=0)


def test_rmsnorm_module_dispatch():
    norm = RMSNorm(48, 1e-6)
    norm.weight.data.normal_()
    x, residual = torch.randn(4, 48), torch.randn(4, 48)
    kept = residual.clone()
    ref_out, ref_res = norm(x, residual)  # CPU tensors, use_triton=None: the torch path
    assert torch.equal(residual, kept)  # ... which leaves the caller's residual alone
    norm.use_triton = True
    out, res = norm(x, residual)
    assert res is residual and torch.equal(res, ref_res)
    assert torch.allclose(out, ref_out, rtol=1e-5, atol=1e-6)
    assert torch.allclose(norm(x), RMSNorm.forward(_torch_twin(norm), x), rtol=1e-5, atol=1e-6)


def _torch_twin(norm: RMSNorm) -> RMSNorm:
    twin = RMSNorm(norm.weight.shape[0], norm.eps, use_triton=False)
    twin.weight.data.copy_(norm.weight.data)
    return twin


# ---------------------------------------------------------------- rotary


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 64), (3, 1, 128), (6, 3, 80)])
def test_rotary_in_place_matches_torch(dtype, heads, kv_heads, head_dim):
    rope = RotaryEmbedding(head_dim, 300, 10000.0, None)
    qkv, q, k, v = qkv_views(7, heads, kv_heads, head_dim, dtype)
    positions = torch.tensor([0, 1, 2, 299, 150, 7, 7])
    ref_q, ref_k = rotary_torch(positions, q, k, rope.cos_cache, rope.sin_cache)
    v_before = v.clone()
    out_q, out_k = kernels().rotary_inplace(q, k, positions, rope.cos_cache, rope.sin_cache)
    assert out_q is q and out_k is k
    assert torch.equal(v, v_before)  # only q and k are touched in the shared QKV buffer
    ulps = {torch.float32: 4, torch.float16: 0, torch.bfloat16: 1}[dtype]
    assert_close_ulps(q, ref_q, ulps)
    assert_close_ulps(k, ref_k, ulps)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_torch_rotary_of_q_and_k_side_by_side_equals_each_apart(dtype):
    """rotary_torch rotates q and k sliced from one QKV output as one tensor: bitwise the same as rotating
    copies of them one at a time (and as transformers' formula in float32), v untouched."""
    from plait.runtime.models.rotary import _side_by_side

    rope = RotaryEmbedding(64, 300, 10000.0, None)
    qkv, q, k, v = qkv_views(6, 9, 3, 64, dtype)
    assert _side_by_side(q, k) is not None and _side_by_side(q.clone(), k.clone()) is None
    assert _side_by_side(k, q) is None
    v_before = v.clone()
    positions = torch.tensor([0, 5, 299, 17, 17, 1])
    got_q, got_k = rotary_torch(positions, q, k, rope.cos_cache, rope.sin_cache)
    apart_q, apart_k = rotary_torch(positions, q.clone(), k.clone(), rope.cos_cache, rope.sin_cache)
    assert torch.equal(got_q, apart_q) and torch.equal(got_k, apart_k) and torch.equal(v, v_before)
    cos = torch.cat([rope.cos_cache[positions]] * 2, -1)[:, None]
    sin = torch.cat([rope.sin_cache[positions]] * 2, -1)[:, None]
    for x, got in ((q, got_q), (k, got_k)):
        xf = x.float()
        rotate_half = torch.cat([-xf[..., 32:], xf[..., :32]], -1)
        assert torch.equal(got, (xf * cos + rotate_half * sin).to(dtype))


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 64), (6, 3, 80)])
def test_rotary_and_store_kv_writes_rotated_k_and_v_into_the_cache(dtype, heads, kv_heads, head_dim):
    rope = RotaryEmbedding(head_dim, 300, 10000.0, None)
    qkv, q, k, v = qkv_views(5, heads, kv_heads, head_dim, dtype, seed=2)
    positions = torch.tensor([0, 299, 150, 7, 7])
    loc = torch.tensor([3, 9, 1, 4, 6])
    ref_q, ref_k = rotary_torch(positions, q, k, rope.cos_cache, rope.sin_cache)
    k_before, v_before = k.clone(), v.clone()
    k_cache = torch.full((10, kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full((10, kv_heads, head_dim), float("nan"), dtype=dtype)
    out_q = kernels().rotary_and_store_kv(q, k, v, positions, rope.cos_cache, rope.sin_cache, k_cache, v_cache, loc)
    ulps = {torch.float32: 4, torch.float16: 0, torch.bfloat16: 1}[dtype]
    assert out_q is q
    assert_close_ulps(q, ref_q, ulps)
    assert_close_ulps(k_cache[loc], ref_k, ulps)
    assert torch.equal(v_cache[loc], v_before)
    assert torch.equal(k, k_before)  # k itself is left unrotated: only the cache gets the rotated copy
    untouched = torch.ones(10, dtype=torch.bool)
    untouched[loc] = False
    assert torch.isnan(k_cache[untouched]).all() and torch.isnan(v_cache[untouched]).all()
    with pytest.raises(ValueError, match="loc"):
        kernels().rotary_and_store_kv(q, k, v, positions, rope.cos_cache, rope.sin_cache, k_cache, v_cache, loc[:2])
    with pytest.raises(ValueError, match="cache"):
        kernels().rotary_and_store_kv(q, k, v, positions, rope.cos_cache, rope.sin_cache, k_cache[:, :1], v_cache, loc)


def test_rotary_llama3_scaling_and_int32_positions():
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    rope = RotaryEmbedding(64, 512, 500000.0, scaling)
    _, q, k, _ = qkv_views(5, 2, 1, 64, torch.float32, seed=4)
    positions = torch.tensor([3, 511, 64, 0, 200], dtype=torch.int32)
    ref_q, ref_k = rope(positions.long(), q, k)  # torch path on the CPU
    rope.use_triton = True
    out_q, out_k = rope(positions, q, k)
    assert torch.allclose(out_q, ref_q, rtol=1e-6, atol=1e-6)
    assert torch.allclose(out_k, ref_k, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- SiLU-and-mul


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("shape", [(3, 2 * 1500), (1, 2 * 64), (2, 3, 2 * 40)])
def test_silu_and_mul_matches_torch(dtype, shape):
    gate_up = (torch.randn(shape, generator=torch.Generator().manual_seed(5)) * 4).to(dtype)
    out = kernels().silu_and_mul(gate_up)
    ref = silu_and_mul_torch(gate_up)
    assert out.shape == ref.shape
    # torch's CPU exp is SLEEF's, the interpreter's numpy's: one ulp apart at most before rounding
    assert_close_ulps(out, ref, {torch.float32: 4, torch.float16: 1, torch.bfloat16: 2}[dtype])


def test_silu_and_mul_dispatch():
    gate_up = torch.randn(4, 96)
    assert torch.equal(silu_and_mul(gate_up), silu_and_mul_torch(gate_up))
    fused = SiluAndMul(use_triton=True)(gate_up)
    assert torch.allclose(fused, F.silu(gate_up[:, :48]) * gate_up[:, 48:], rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- bad input


def test_bad_input_names_the_problem():
    k = kernels()
    with pytest.raises(ValueError, match="weight must have shape"):
        k.rmsnorm(torch.randn(2, 8), torch.ones(9), 1e-6)
    with pytest.raises(ValueError, match="residual must match x"):
        k.fused_add_rmsnorm(torch.randn(2, 8), torch.randn(3, 8), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="even last dim"):
        k.silu_and_mul(torch.randn(2, 7))
    _, q, kk, _ = qkv_views(3, 2, 1, 16, torch.float32)
    with pytest.raises(ValueError, match="cos/sin caches"):
        k.rotary_inplace(q, kk, torch.zeros(3, dtype=torch.long), torch.ones(10, 4), torch.ones(10, 4))
    with pytest.raises(ValueError, match="disagree on T"):
        k.rotary_inplace(q, kk, torch.zeros(2, dtype=torch.long), torch.ones(10, 8), torch.ones(10, 8))
    with pytest.raises(ValueError, match="int32 or int64"):
        k.rotary_inplace(q, kk, torch.zeros(3), torch.ones(10, 8), torch.ones(10, 8))


# ---------------------------------------------------------------- GPU, real sizes

gpu = pytest.mark.gpu


def _mismatch_fraction(a, b):
    return (a != b).float().mean().item()


@gpu
@pytest.mark.parametrize("tokens", [1, 8192])
def test_gpu_fused_add_rmsnorm_bf16(tokens):
    g = torch.Generator(device="cuda").manual_seed(0)
    x, residual = (torch.randn(tokens, 4096, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    w = torch.randn(4096, device="cuda", generator=g, dtype=torch.bfloat16)
    ref_out, ref_res = rms_norm_torch(x, w, 1e-5, residual)
    out, res = kernels().fused_add_rmsnorm(x, residual, w, 1e-5)
    assert res is residual and torch.equal(res, ref_res)
    assert_close_ulps(out, ref_out, 2)  # GPU: torch reduces the mean of squares in another order
    assert _mismatch_fraction(out, ref_out) < 0.01
    plain = kernels().rmsnorm(x, w, 1e-5)
    assert_close_ulps(plain, rms_norm_torch(x, w, 1e-5), 2)  # GPU: torch reduces the mean of squares in another order


@gpu
@pytest.mark.parametrize("hidden", [576, 2048, 8192])
def test_gpu_rmsnorm_hidden_sizes(hidden):
    x = torch.randn(333, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    out = kernels().rmsnorm(x, w, 1e-6)
    assert_close_ulps(out, rms_norm_torch(x, w, 1e-6), 2)  # GPU: torch reduces the mean of squares in another order


@gpu
def test_gpu_qk_norm_and_rotary_bf16_real_sizes():
    qkv, q, k, v = qkv_views(8192, 32, 8, 128, torch.bfloat16, device="cuda")
    w = torch.randn(128, device="cuda", dtype=torch.bfloat16)
    assert_close_ulps(
        kernels().rmsnorm(q, w, 1e-6), rms_norm_torch(q, w, 1e-6), 2
    )  # GPU: torch reduces the mean of squares in another order
    rope = RotaryEmbedding(128, 131072, 500000.0, None).cuda()
    positions = torch.randint(0, 131072, (8192,), device="cuda")
    ref_q, ref_k = rotary_torch(positions, q, k, rope.cos_cache, rope.sin_cache)
    v_before = v.clone()
    kernels().rotary_inplace(q, k, positions, rope.cos_cache, rope.sin_cache)
    assert torch.equal(v, v_before)
    for out, ref in ((q, ref_q), (k, ref_k)):
        # NOTE: not ulps of the result: x1*c - x2*s can cancel to a small value whose error is an ulp of
        # the (larger) products, and FMA contraction moves that. Bound it by an ulp of the input scale.
        torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=2**-5)
        assert _mismatch_fraction(out, ref) < 0.01


@gpu
def test_gpu_silu_and_mul_bf16_real_size():
    gate_up = torch.randn(8192, 2 * 14336, device="cuda", dtype=torch.bfloat16) * 4
    out = kernels().silu_and_mul(gate_up)
    ref = silu_and_mul_torch(gate_up)
    assert_close_ulps(out, ref, 1)
    assert _mismatch_fraction(out, ref) < 0.01


@gpu
def test_gpu_ops_capture_in_cuda_graph():
    # Capturing fails on a host sync; replaying with new inputs proves nothing was baked in.
    k = kernels()
    x, residual = (
        torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16),
        torch.empty(8, 4096, device="cuda", dtype=torch.bfloat16),
    )
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    _, q, kk, _ = qkv_views(8, 32, 8, 128, torch.bfloat16, device="cuda")
    rope = RotaryEmbedding(128, 4096, 10000.0, None).cuda()
    positions = torch.zeros(8, dtype=torch.long, device="cuda")
    gate_up = torch.randn(8, 2 * 1024, device="cuda", dtype=torch.bfloat16)

    def step():
        out, _ = k.fused_add_rmsnorm(x, residual, w, 1e-5)
        k.rotary_inplace(q, kk, positions, rope.cos_cache, rope.sin_cache)
        return out, k.silu_and_mul(gate_up)

    residual.zero_()
    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, act = step()
    for seed in (1, 2):
        torch.manual_seed(seed)
        x.normal_(), residual.normal_(), gate_up.normal_(), q.normal_(), kk.normal_()
        positions.random_(0, 4096)
        expect_res = x + residual
        expect_out = rms_norm_torch(expect_res, w, 1e-5)
        expect_q, expect_k = rotary_torch(positions, q, kk, rope.cos_cache, rope.sin_cache)
        expect_act = silu_and_mul_torch(gate_up)
        graph.replay()
        assert torch.equal(residual, expect_res)
        assert_close_ulps(out, expect_out, 1)
        assert_close_ulps(q, expect_q, 1)
        assert_close_ulps(kk, expect_k, 1)
        assert_close_ulps(act, expect_act, 1)
