"""One-row skinny matmuls with the small op before them folded in: y = op(x) @ W^T, one launch each.

At batch 1 a decode step is bound by weight bandwidth plus each kernel's gap and ramp, and the
ops between the matmuls (add + RMSNorm, SiLU-and-mul) move almost no bytes. So each program of the
matmul recomputes the op for the K values it multiplies (the row is at most a few tens of KB and comes
from L2 after the first program touched it), then streams its BLOCK_N rows of W as gemv.py does. Per
layer, add+RMSNorm -> QKV, add+RMSNorm -> gate_up and SiLU-and-mul -> down are one launch each (down
was three: activation, cuBLAS, its split-K reduce).

Prologues (the PROLOGUE constexpr), numerics step for step those of the unfused kernels:
- PLAIN: a = x.
- ADD_RMSNORM (as rmsnorm.py): s = (x + residual) rounded to x.dtype (s = x without a residual);
  a = norm_w * (float32(s) / sqrt(mean(s^2) + eps)).to(x.dtype), rounded to x.dtype. Every program
  sums the squares over the whole row; program 0 alone writes s into a *new* residual buffer (never in
  place: the other programs are still reading the old one).
- SILU_MUL (as activation.py): x = [gate | up] (1, 2K); a = (silu(gate).to(dtype) * up).to(dtype).
Products with W are accumulated in float32 and rounded to the output dtype once. FP8 weights (`weight_scale`
given: float8_e4m3fn codes, one float32 scale a row, quant/fp8.py) are read as stored and widened in registers,
the row's scale multiplying its sum once at the end, as gemv.py does.

Two loop shapes (`FusedGemvConfig.resident`):
- K loop (like gemv.py, and the default, with gemv.py's measured tiles): each program walks K in BLOCK_K
  chunks for its BLOCK_N rows; ADD_RMSNORM reads the row twice (sum of squares, then the matmul).
- resident row (K <= MAX_RESIDENT_K): the whole activation row lives in registers, computed once; the
  program walks its BLOCK_N rows of W SUB_N at a time, each a full-K run.

Programmatic dependent launch (Hopper; opt in with ServerArgs enable_pdl, see launch.py's `pdl_enabled`): the
kernel is launched so that it may start while the previous kernel finishes; it waits for the previous
kernel before touching activations or writing anything (the K loop before any load, as gemv.py; the
resident row after loading its first rows of W, which nobody writes), and lets the next kernel launch
as soon as all its programs are running.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .gemv import pick_gemv_config
from .launch import check_device, next_power_of_2, pdl_enabled

PLAIN = tl.constexpr(0)
ADD_RMSNORM = tl.constexpr(1)
SILU_MUL = tl.constexpr(2)

MAX_RESIDENT_K = 8192  # widest row the resident-row kernel holds in registers


@dataclass(frozen=True)
class FusedGemvConfig:
    block_n: int = 8  # rows of W per program
    block_k: int = 1024  # K loop: columns per step
    num_warps: int = 4
    num_stages: int = 3
    resident: bool = False  # resident-row loop instead of the K loop
    sub_n: int = 2  # resident row: rows of W per step (full K each)


@triton.jit
def _residual_sum(X, Residual, offs_k, k_mask, HAS_RESIDUAL: tl.constexpr):
    """x (+ residual) at offs_k, rounded to x's dtype exactly like torch's `x + residual`."""
    x = tl.load(X + offs_k, mask=k_mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(Residual + offs_k, mask=k_mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _inv_rms(sum_sq, eps, K: tl.constexpr):
    # NOTE: div_rn/sqrt_rn, not `/` and rsqrt (approximate PTX), as in rmsnorm.py. (1,) -> (1,)
    mean_sq = tl.div_rn(sum_sq, tl.full((1,), K, tl.float32))
    return tl.div_rn(1.0, tl.sqrt_rn(mean_sq + eps))


@triton.jit
def _normalize(s, NormW, offs_k, k_mask, inv_rms):
    """RMSNorm output for the columns of s (1, BK): rounded to s's dtype before and after the weight."""
    normed = (s.to(tl.float32) * inv_rms[:, None]).to(s.dtype)
    nw = tl.load(NormW + offs_k, mask=k_mask, other=0.0)
    return (nw.to(tl.float32) * normed.to(tl.float32)).to(s.dtype)


@triton.jit
def _activation(
    X, Residual, NormW, offs_k, k_mask, inv_rms, K: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr
):
    """The matmul's input at columns offs_k (1, BK), as float32 holding values of x's dtype."""
    if PROLOGUE == ADD_RMSNORM:
        a = _normalize(_residual_sum(X, Residual, offs_k, k_mask, HAS_RESIDUAL), NormW, offs_k, k_mask, inv_rms)
    elif PROLOGUE == SILU_MUL:
        gate = tl.load(X + offs_k, mask=k_mask, other=0.0)
        up = tl.load(X + K + offs_k, mask=k_mask, other=0.0)
        g = gate.to(tl.float32)
        # NOTE: tl.exp as in activation.py (fast exp2-based; its few-ulp error vanishes in the rounding).
        act = tl.div_rn(g, 1.0 + tl.exp(-g)).to(gate.dtype)
        a = (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    else:
        a = tl.load(X + offs_k, mask=k_mask, other=0.0)
    return a.to(tl.float32)


@triton.jit
def _store_rows(Y, B, Scale, rows, acc, N, HAS_BIAS: tl.constexpr, W_FP8: tl.constexpr):
    mask = rows < N
    if W_FP8:
        acc = acc * tl.load(Scale + rows, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(B + rows, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + rows, acc.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _fused_gemv_kloop_kernel(
    X,
    Residual,
    ResidualOut,
    NormW,
    W,
    Scale,
    B,
    Y,
    N,
    stride_wn,
    eps,
    K: tl.constexpr,
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    W_FP8: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
    PREFETCH_W: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
    w_rows = W + rows.to(tl.int64)[:, None] * stride_wn  # (BN, 1) row starts
    n_mask = (rows < N)[:, None]  # (BN, 1)
    cols = tl.arange(0, BLOCK_K)[None, :]  # (1, BK)
    if PREFETCH_W:  # the first weight tile first: before the PDL wait (weights are constant) and the norm's pass
        w_first = tl.load(w_rows + cols, mask=n_mask & (cols < K), other=0.0)  # (BN, BK)
    if USE_PDL:
        # NOTE: otherwise before any load. Loading the first weight tile before the wait hides its latency, but
        # the tile then stays live through the sum of squares: norm->LM head (bf16) took 106 registers a thread
        # instead of 72 (sm_90 build), fewer programs per SM for a bandwidth-bound loop; an FP8 tile is a
        # quarter of that one's bytes a thread (PREFETCH_W).
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if PROLOGUE == ADD_RMSNORM:
        is_first = (cols * 0 + pid) == 0  # (1, BK): program 0 writes the residual (a mask, not a branch)
        sum_sq = tl.zeros((1, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + cols  # (1, BK)
            ks_mask = ks < K
            s = _residual_sum(X, Residual, ks, ks_mask, HAS_RESIDUAL)  # (1, BK)
            if HAS_RESIDUAL:
                tl.store(ResidualOut + ks, s, mask=ks_mask & is_first)
            h = s.to(tl.float32)
            sum_sq += h * h
        inv_rms = _inv_rms(tl.sum(sum_sq, axis=1), eps, K)  # (1,)
    else:
        inv_rms = tl.full((1,), 1.0, tl.float32)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    k_start = 0
    if PREFETCH_W:
        a = _activation(X, Residual, NormW, cols, cols < K, inv_rms, K, PROLOGUE, HAS_RESIDUAL)  # (1, BK)
        acc += tl.sum(a * w_first.to(tl.float32), axis=1)  # (BN,)
        k_start = BLOCK_K
    for k0 in range(k_start, K, BLOCK_K):  # gemv.py's loop: one weight tile and its activations per step
        kk = k0 + cols  # (1, BK)
        kk_mask = kk < K
        w = tl.load(w_rows + kk, mask=n_mask & kk_mask, other=0.0)  # (BN, BK)
        a = _activation(X, Residual, NormW, kk, kk_mask, inv_rms, K, PROLOGUE, HAS_RESIDUAL)  # (1, BK)
        acc += tl.sum(a * w.to(tl.float32), axis=1)  # (BN,)
    _store_rows(Y, B, Scale, rows, acc, N, HAS_BIAS, W_FP8)


@triton.jit
def _fused_gemv_resident_kernel(
    X,
    Residual,
    ResidualOut,
    NormW,
    W,
    Scale,
    B,
    Y,
    N,
    stride_wn,
    eps,
    K: tl.constexpr,
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    W_FP8: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SUB_N: tl.constexpr,
    K_POW2: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, K_POW2)[None, :]  # (1, KP): the whole row
    k_mask = cols < K
    sub = tl.arange(0, SUB_N)  # (SN,)
    row0 = pid * BLOCK_N
    rows = row0 + sub
    w = tl.load(
        W + rows.to(tl.int64)[:, None] * stride_wn + cols, mask=(rows < N)[:, None] & k_mask, other=0.0
    )  # (SN, KP), loaded before the PDL wait like the K loop's first tile
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if PROLOGUE == ADD_RMSNORM:
        s = _residual_sum(X, Residual, cols, k_mask, HAS_RESIDUAL)  # (1, KP), read once
        if HAS_RESIDUAL:
            tl.store(ResidualOut + cols, s, mask=k_mask & ((cols * 0 + pid) == 0))  # program 0 only
        h = s.to(tl.float32)
        a = _normalize(s, NormW, cols, k_mask, _inv_rms(tl.sum(h * h, axis=1), eps, K)).to(tl.float32)
    else:
        a = _activation(
            X, Residual, NormW, cols, k_mask, tl.full((1,), 1.0, tl.float32), K, PROLOGUE, HAS_RESIDUAL
        )  # (1, KP)
    _store_rows(Y, B, Scale, rows, tl.sum(a * w.to(tl.float32), axis=1), N, HAS_BIAS, W_FP8)
    for n0 in range(SUB_N, BLOCK_N, SUB_N):
        rows_n = row0 + n0 + sub  # (SN,)
        w_n = tl.load(
            W + rows_n.to(tl.int64)[:, None] * stride_wn + cols, mask=(rows_n < N)[:, None] & k_mask, other=0.0
        )  # (SN, KP)
        _store_rows(Y, B, Scale, rows_n, tl.sum(a * w_n.to(tl.float32), axis=1), N, HAS_BIAS, W_FP8)


def pick_fused_gemv_config(n: int, k: int, fp8: bool = False) -> FusedGemvConfig:
    """Default tiles for every prologue: gemv.py's choice for the same (N, K) and weight format (block_n, block_k,
    warps, stages, and its K loop rather than the resident row), because those were swept.
    NOTE: the first guess for the prologues (twice the rows per program, 3 stages: fewer programs
    re-reading the activation row) lost bandwidth against gemv.py's kernel with its own tiles
    (bench_fused_gemv.py; --sweep to retune)."""
    base = pick_gemv_config(n, k, fp8)
    return FusedGemvConfig(base.block_n, base.block_k, base.num_warps, base.num_stages, resident=False)


def _check_row(op: str, name: str, t: torch.Tensor, k: int) -> None:
    if t.dim() != 2 or t.shape[0] != 1 or t.shape[1] != k:
        raise ValueError(f"{op}: {name} must be one row (1, {k}), got {tuple(t.shape)}")
    if t.stride(1) != 1:
        raise ValueError(f"{op}: {name} needs unit stride on its last dim")


def _launch(
    op: str,
    prologue: int,
    x: torch.Tensor,
    k: int,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    residual: Optional[torch.Tensor],
    norm_weight: Optional[torch.Tensor],
    eps: float,
    out_dtype: Optional[torch.dtype],
    config: Optional[FusedGemvConfig],
    weight_scale: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    check_device(op, x, weight, bias, residual, norm_weight, weight_scale)
    if weight.dim() != 2 or weight.shape[1] != k or weight.stride(1) != 1:
        raise ValueError(f"{op}: weight must be (N, {k}) with unit stride on K, got {tuple(weight.shape)}")
    n = weight.shape[0]
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"{op}: bias must be ({n},), got {tuple(bias.shape)}")
    fp8 = weight_scale is not None
    if fp8 != (weight.dtype == torch.float8_e4m3fn):
        raise ValueError(f"{op}: float8_e4m3fn weights come with a weight_scale, and only they do (got {weight.dtype})")
    if weight_scale is not None and (weight_scale.dtype != torch.float32 or tuple(weight_scale.shape) != (n,)):
        raise ValueError(
            f"{op}: weight_scale must be float32 ({n},), got {weight_scale.dtype} {tuple(weight_scale.shape)}"
        )
    cfg = config or pick_fused_gemv_config(n, k, fp8)
    if cfg.resident and next_power_of_2(k) > MAX_RESIDENT_K:
        raise ValueError(f"{op}: the resident-row kernel holds rows up to {MAX_RESIDENT_K}, got K={k}")
    y = torch.empty(1, n, dtype=out_dtype or x.dtype, device=x.device)
    residual_out = torch.empty_like(x) if residual is not None else x
    pdl = pdl_enabled(x.device)
    args = (
        x,
        residual if residual is not None else x,
        residual_out,
        norm_weight if norm_weight is not None else x,
        weight,
        weight_scale if weight_scale is not None else weight,
        bias if bias is not None else weight,
        y,
        n,
        weight.stride(0),
        eps,
    )
    flags = dict(
        K=k,
        PROLOGUE=prologue,
        HAS_RESIDUAL=residual is not None,
        HAS_BIAS=bias is not None,
        W_FP8=fp8,
        BLOCK_N=cfg.block_n,
        USE_PDL=pdl,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if pdl:
        flags["launch_pdl"] = True
    grid = (triton.cdiv(n, cfg.block_n),)
    if cfg.resident:
        _fused_gemv_resident_kernel[grid](*args, SUB_N=min(cfg.sub_n, cfg.block_n), K_POW2=next_power_of_2(k), **flags)
    else:
        block_k = min(cfg.block_k, next_power_of_2(k))
        _fused_gemv_kloop_kernel[grid](*args, BLOCK_K=block_k, PREFETCH_W=fp8, **flags)
    return y, residual_out


def rmsnorm_gemv(
    x: torch.Tensor,
    residual: Optional[torch.Tensor],
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    config: Optional[FusedGemvConfig] = None,
    weight_scale: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm(x + residual) (1, K) @ weight (N, K)^T (+ bias) -> (y (1, N), new residual (1, K)).
    `weight_scale` ((N,) float32): `weight` holds float8_e4m3fn codes, W = codes * weight_scale[:, None] (the same
    in the functions below).

    residual None (a model's first norm) normalises x alone and returns x itself as the residual.
    The residual sum goes to a new tensor; `residual` is left alone."""
    op = "rmsnorm_gemv"
    k = x.shape[-1] if x.dim() else 0
    _check_row(op, "x", x, k)
    if residual is not None:
        _check_row(op, "residual", residual, k)
        if residual.dtype != x.dtype:
            raise ValueError(f"{op}: residual dtype {residual.dtype} differs from x's {x.dtype}")
    if norm_weight.shape != (k,) or norm_weight.dtype != x.dtype or norm_weight.stride(0) != 1:
        raise ValueError(
            f"{op}: norm weight must be contiguous ({k},) in {x.dtype}, got "
            f"{tuple(norm_weight.shape)} {norm_weight.dtype}"
        )
    return _launch(
        op, ADD_RMSNORM.value, x, k, weight, bias, residual, norm_weight, eps, out_dtype, config, weight_scale
    )


def silu_mul_gemv(
    gate_up: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    config: Optional[FusedGemvConfig] = None,
    weight_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """(silu(gate) * up) (1, K) @ weight (N, K)^T (+ bias) -> (1, N), with gate_up = [gate | up] (1, 2K)."""
    op = "silu_mul_gemv"
    if gate_up.dim() != 2 or gate_up.shape[-1] % 2:
        raise ValueError(f"{op}: gate_up must be (1, 2K), got {tuple(gate_up.shape)}")
    k = gate_up.shape[-1] // 2
    _check_row(op, "gate_up", gate_up, 2 * k)
    return _launch(op, SILU_MUL.value, gate_up, k, weight, bias, None, None, 0.0, None, config, weight_scale)[0]


def gemv_row(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    config: Optional[FusedGemvConfig] = None,
    weight_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """x (1, K) @ weight (N, K)^T (+ bias) -> (1, N): gemv.py's one-row matmul in this family, so a chain
    of one-row matmuls can use programmatic dependent launch throughout."""
    op = "gemv_row"
    k = x.shape[-1] if x.dim() else 0
    _check_row(op, "x", x, k)
    return _launch(op, PLAIN.value, x, k, weight, bias, None, None, 0.0, out_dtype, config, weight_scale)[0]
