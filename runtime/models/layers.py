"""Building blocks shared by the model files: the linear layers' matmul routing, RMSNorm, SiLU-and-mul (rotary
embedding: rotary.py, under the same contract).

Each op has two implementations with one numerics contract (see runtime/kernels/ for the details):
- the torch code below, the reference, used for CPU tensors (and matched token for token against
  transformers by tests/models/test_correctness_vs_hf.py);
- a fused Triton kernel from runtime/kernels/, used automatically for CUDA tensors, because at small
  batches a decode step is bound by the number of kernel launches, not by memory (the torch RMSNorm
  alone is ~8 elementwise kernels, rotary ~10, SiLU-and-mul 3).
`use_triton` overrides the choice: None = by device, True = always (CPU only under TRITON_INTERPRET=1,
for tests), False = always torch. At exactly one row (a batch-1 decode step) the Triton path can go one
step further, opt in (the `fused_decode_row` kernel choice: ServerArgs `enable_fused_decode_row`):
`norm_linear` / `silu_linear` run the norm or SiLU-and-mul inside the matmul after it.

The fused paths update in place where the torch ones return new tensors: `RMSNorm(x, residual)`
adds x into `residual`, and `RotaryEmbedding` rotates the q and k it is given. Callers use the
returned tensors and must not rely on the inputs being left alone (or being changed).
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..kernel_choices import current as kernel_choices
from ..quant import fp8_rows
from ..quant.fp8 import FP8_DTYPE, FP8_MAX, MIN_AMAX, Fp8Linear, Fp8Rows
from ..quant.fp8_rows import fp8_linear_by_rows, takes_quantized_rows
from ..quant.linear import QuantizedLinear
from .cpu_matmul import HALF_DTYPES, cpu_linear


def _kernels():
    # NOTE: imported on first use, so CPU-only processes never import triton (and tests can set
    # TRITON_INTERPRET before it is imported).
    from .. import kernels

    return kernels


def _wants_triton(x: torch.Tensor, use_triton: Optional[bool]) -> bool:
    return x.is_cuda if use_triton is None else use_triton


# Rows up to which a CUDA linear layer takes the Triton skinny matmul instead of cuBLAS. One row is
# measured (benchmarks/kernels/bench_gemv.py, the tiles of gemv.pick_gemv_config): faster on every matrix of the
# Llama-3.1-8B and 3.2-1B shapes.
SKINNY_MATMUL_ROWS = 1
# Rows up to which it takes the tensor-core decode matmul (runtime/kernels/decode_gemm.py) instead, and
# up to which a wide matrix (N >= WIDE_MATRIX_N: the LM head) does: where it beat cuBLAS
# (benchmarks/RESULTS.md, bench_decode_gemm.py and bench_one_batch.py). The `decode_gemm` kernel choice
# off (ServerArgs `disable_decode_gemm`) sends those rows to cuBLAS; it is read at each call, so one
# process can capture graphs both ways (bench_one_batch --variants).
DECODE_GEMM_ROWS = 32
DECODE_GEMM_ROWS_WIDE = 64
WIDE_MATRIX_N = 65536


def skinny_linear(
    x: Union[torch.Tensor, Fp8Rows],
    layer: nn.Module,
    out_dtype: Optional[torch.dtype] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """x @ layer.weight^T (+ layer.bias), optionally cast to out_dtype; `layer` is an nn.Linear, or an
    nn.Embedding used as a tied LM head. On CUDA, a decode step's few rows take a Triton matmul that
    streams the weight once: the skinny matmul for one row, the tensor-core decode matmul up to
    DECODE_GEMM_ROWS (its split-K workspace is `layer.split_k_workspace`, shared by a model's layers
    through share_split_k_workspace, else made on first use).

    `out` ((*x.shape[:-1], N); its dtype is the output dtype): the result is written there and returned,
    at no extra pass: the Triton matmuls write it directly, the matmul library's bf16 result is cast
    into it (the cast the path without `out` makes anyway). A CUDA graph's shared logits buffer."""
    if isinstance(x, Fp8Rows):  # an FP8 layer's input, quantized by the norm or activation that made it
        return fp8_linear_by_rows(x, layer, out_dtype, out, _split_k_workspace(layer), kernel_choices().decode_gemm)
    if (
        isinstance(layer, Fp8Linear)
        and x.is_cuda
        and x.dim() == 2
        and x.shape[0] > 0
        and x.stride(-1) == 1
        and x.dtype in (torch.bfloat16, torch.float16)
    ):  # the kernels by rows: quant/fp8_rows.py
        workspace = _split_k_workspace(layer)
        return fp8_linear_by_rows(x, layer, out_dtype, out, workspace, kernel_choices().decode_gemm)
    if isinstance(layer, QuantizedLinear):  # low-precision weights (runtime/quant/): CPU int8 / int4, FP8
        if out is None:
            return layer.linear(x, out_dtype)
        _check_linear_out(out, x, layer.weight, out_dtype)  # (its codes: N rows, whatever the packing)
        return out.copy_(layer.linear(x, out_dtype))
    bias, weight = getattr(layer, "bias", None), layer.weight
    if out is not None:
        _check_linear_out(out, x, weight, out_dtype)
    rows = x.shape[0] if x.dim() == 2 else 0
    if (
        x.is_cuda
        and rows
        and x.stride(-1) == 1
        and weight.dtype in (torch.bfloat16, torch.float16)
        and x.dtype == weight.dtype
    ):
        if rows <= SKINNY_MATMUL_ROWS:
            return _kernels().gemv(x, weight, bias, out_dtype=out_dtype, out=out)
        if (
            rows <= (DECODE_GEMM_ROWS_WIDE if weight.shape[0] >= WIDE_MATRIX_N else DECODE_GEMM_ROWS)
            and kernel_choices().decode_gemm
        ):
            workspace = _split_k_workspace(layer)
            return _kernels().decode_gemm(x, weight, workspace=workspace, out_dtype=out_dtype, out=out, bias=bias)
    if rows and not x.is_cuda and x.dtype == weight.dtype in HALF_DTYPES:  # oneDNN: rounded rows, packed weights
        y = cpu_linear(x, weight, bias, getattr(layer, "cpu_packed_weight", None))
        y = y if out_dtype is None else y.to(out_dtype)
        return y if out is None else out.copy_(y)
    if out is None:
        y = F.linear(x, weight, bias)
        return y if out_dtype is None else y.to(out_dtype)
    if x.dim() == 2 and x.dtype == weight.dtype == out.dtype:
        # No cast to make: the matmul F.linear runs for 2-D input, writing `out` itself.
        return torch.mm(x, weight.t(), out=out) if bias is None else torch.addmm(bias, x, weight.t(), out=out)
    return out.copy_(F.linear(x, weight, bias))


def _split_k_workspace(layer: nn.Module):
    workspace = getattr(layer, "split_k_workspace", None)
    if workspace is None:
        workspace = layer.split_k_workspace = _kernels().SplitKWorkspace()
    return workspace


def weight_rows(layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (n,) of a linear layer's or an embedding's (vocab, hidden) weight -> (n, hidden), in the
    activation dtype (a quantized layer's rows widened)."""
    if isinstance(layer, QuantizedLinear):
        return layer.rows(ids)
    return layer.weight.index_select(0, ids)


def share_split_k_workspace(model: nn.Module) -> None:
    """Give every linear layer of `model` (and its embedding, a tied LM head) one shared split-K workspace
    for the decode matmul: its launches run one after another on one stream, so one buffer serves all,
    instead of one per layer (8B: 32 x 2 MB)."""
    from ..kernels.decode_gemm import SplitKWorkspace  # NOTE: no triton import at model build on the CPU

    workspace = None
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding, QuantizedLinear)):
            workspace = workspace or SplitKWorkspace()
            module.split_k_workspace = workspace


def _check_linear_out(
    out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, out_dtype: Optional[torch.dtype]
) -> None:
    shape = (*x.shape[:-1], weight.shape[0])
    if tuple(out.shape) != shape or out.device != x.device or (out_dtype is not None and out.dtype != out_dtype):
        raise ValueError(
            f"linear out must be {shape} on {x.device}"
            f"{'' if out_dtype is None else ' of ' + str(out_dtype)}; got {tuple(out.shape)} "
            f"{out.dtype} on {out.device}"
        )


# The one-row decode path (a batch-1 decode step on CUDA): each RMSNorm runs inside the matmul after it
# and SiLU-and-mul inside the down projection (runtime/kernels/gemv_fused.py), which removes 3-4 of a
# layer's ~11 launches. Off by default: the launches it saves were worth less than the weight
# bandwidth the fused kernels lose (benchmarks/RESULTS.md, bench_fused_gemv.py and bench_one_batch.py;
# its tiles mirror gemv.py's, so re-measure before turning it on).
# FUSE_NORM_INTO_GATE_UP (on the fused path): False keeps the post-attention norm as its own kernel before
# cuBLAS's gate_up, which streams that (largest) matrix faster than the fused kernel.
FUSE_NORM_INTO_GATE_UP = False


def fuses_decode_row(x: torch.Tensor, weight: torch.Tensor, use_triton: Optional[bool]) -> bool:
    """Whether x (T, K) takes the fused one-row kernels: the path switched on (`fused_decode_row`; for FP8 weights
    also quant/fp8_rows.FP8_FUSED_ROW), exactly one row of half precision, weights of x's dtype or FP8 codes, and
    the Triton path chosen (`use_triton` as for the other layers: None = CUDA tensors)."""
    fp8 = weight.dtype == FP8_DTYPE
    return (
        (kernel_choices().fused_decode_row or (fp8 and bool(fp8_rows.FP8_FUSED_ROW)))
        and _wants_triton(x, use_triton)
        and x.dim() == 2
        and x.shape[0] == 1
        and x.stride(-1) == 1
        and x.dtype in (torch.bfloat16, torch.float16)
        and (fp8 or x.dtype == weight.dtype)
    )


def fuses_prologue(layer: nn.Module, part: str) -> bool:
    """On the one-row path, whether `layer` (the decoder's `part`: "qkv", "gate_up", "down") runs the op before it
    inside its matmul: FP8 layers as quant/fp8_rows.FP8_FUSED_ROW says, half-precision ones always but gate-up's
    norm (FUSE_NORM_INTO_GATE_UP)."""
    if isinstance(layer, Fp8Linear):
        return fp8_rows.fused_row(part)
    return part != "gate_up" or FUSE_NORM_INTO_GATE_UP


def one_row_linear(x: torch.Tensor, layer: nn.Module, part: str = "plain") -> torch.Tensor:
    """On the one-row path, `layer`'s matmul without a prologue: the fused kernels' family (row_linear), but for FP8
    layers whose "plain" bit is off (gemv.py's kernel, as any one-row step) and half-precision gate-up (the matmul
    library: FUSE_NORM_INTO_GATE_UP says why)."""
    if isinstance(layer, Fp8Linear):
        return row_linear(x, layer) if fp8_rows.fused_row("plain") else skinny_linear(x, layer)
    return layer(x) if part == "gate_up" else row_linear(x, layer)


def one_row_norm_linear(
    x: torch.Tensor, residual: Optional[torch.Tensor], norm: "RMSNorm", layer: nn.Module, part: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """On the one-row path, layer(norm(x + residual)) -> (out, new residual): one launch where fuses_prologue, else
    the norm's kernel (adding x into the residual in place, as on the other paths), then the matmul."""
    if fuses_prologue(layer, part):
        return norm_linear(x, residual, norm, layer)
    h, residual = (norm(x), x) if residual is None else norm(x, residual)
    return one_row_linear(h, layer, part), residual


def one_row_silu_linear(gate_up: torch.Tensor, act: "SiluAndMul", layer: nn.Module) -> torch.Tensor:
    """On the one-row path, layer(silu_and_mul(gate_up)): one launch where fuses_prologue, else two."""
    if fuses_prologue(layer, "down"):
        return silu_linear(gate_up, layer)
    return one_row_linear(act(gate_up), layer, "down")


def _weight_scale(layer: nn.Module) -> Optional[torch.Tensor]:
    return layer.weight_scale if isinstance(layer, Fp8Linear) else None


def norm_linear(
    x: torch.Tensor,
    residual: Optional[torch.Tensor],
    norm: "RMSNorm",
    layer: nn.Module,
    out_dtype: Optional[torch.dtype] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One row: layer(norm(x + residual)) in one launch -> (out (1, N), new residual (1, K)). residual
    None (the first layer) normalises x alone and returns x as the residual. `layer` as in skinny_linear."""
    return _kernels().rmsnorm_gemv(
        x,
        residual,
        norm.weight,
        norm.eps,
        layer.weight,
        getattr(layer, "bias", None),
        out_dtype=out_dtype,
        weight_scale=_weight_scale(layer),
    )


def silu_linear(gate_up: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """One row: layer(silu_and_mul(gate_up)) in one launch; gate_up (1, 2I) -> (1, N)."""
    return _kernels().silu_mul_gemv(gate_up, layer.weight, layer.bias, weight_scale=_weight_scale(layer))


def row_linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """One row: layer(x) with the same kernel family as norm_linear / silu_linear (x (1, K) -> (1, N))."""
    return _kernels().gemv_row(x, layer.weight, layer.bias, weight_scale=_weight_scale(layer))


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None):
    """Reference RMSNorm (optionally of x + residual): returns out, or (out, x + residual)."""
    # NOTE: computed in float32 and cast back, exactly as transformers does, so greedy outputs match.
    if residual is not None:
        x = x + residual
        residual = x
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(dtype)
    return out if residual is None else (out, residual)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, use_triton: Optional[bool] = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.use_triton = use_triton

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        # x: (T, dim) or (T, H, dim); residual like x. Returns out, or (out, x + residual).
        if not _wants_triton(x, self.use_triton):
            return rms_norm_torch(x, self.weight, self.eps, residual)
        if residual is None:
            return _kernels().rmsnorm(x, self.weight, self.eps)
        return _kernels().fused_add_rmsnorm(x, residual, self.weight, self.eps)


def _fp8_input(x: torch.Tensor, layer: nn.Module, use_triton: Optional[bool]) -> bool:
    """Whether the kernel making x (T, K) should write it as FP8 rows for `layer`: an FP8 layer on CUDA (or the
    interpreter) whose path for T rows quantizes them (quant/fp8_rows.takes_quantized_rows)."""
    return (
        isinstance(layer, Fp8Linear)
        and _wants_triton(x, use_triton)
        and x.dim() == 2
        and x.shape[0] > 0
        and x.stride(-1) == 1
        and x.dtype in (torch.bfloat16, torch.float16)
        and takes_quantized_rows(layer, x.shape[0], kernel_choices().decode_gemm)
    )


def norm_for_linear(
    norm: "RMSNorm", x: torch.Tensor, residual: Optional[torch.Tensor], layer: nn.Module
) -> tuple[Union[torch.Tensor, Fp8Rows], torch.Tensor]:
    """norm(x + residual) as `layer`'s input, and the residual stream (x itself where residual is None, as for the
    first layer): FP8 rows written by the norm's kernel where `layer` quantizes its rows (kernels/fp8_activations.py),
    else the norm's output (RMSNorm.forward)."""
    if _fp8_input(x, layer, norm.use_triton):
        static = layer.input_scale  # type: ignore[union-attr]
        codes, scales = _kernels().rmsnorm_fp8(x, norm.weight, norm.eps, residual, static, FP8_MAX, MIN_AMAX)
        return Fp8Rows(codes, scales, x.dtype), (x if residual is None else residual)
    if residual is None:
        return norm(x), x
    return norm(x, residual)


def silu_and_mul_for_linear(act: "SiluAndMul", gate_up: torch.Tensor, layer: nn.Module) -> Union[torch.Tensor, Fp8Rows]:
    """silu(gate) * up as `layer`'s input: FP8 rows where `layer` quantizes its rows, else act(gate_up)."""
    if _fp8_input(gate_up, layer, act.use_triton):
        codes, scales = _kernels().silu_and_mul_fp8(gate_up, layer.input_scale, FP8_MAX, MIN_AMAX)  # type: ignore[union-attr]
        return Fp8Rows(codes, scales, gate_up.dtype)
    return act(gate_up)


def silu_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(gate_up: torch.Tensor, use_triton: Optional[bool] = None) -> torch.Tensor:
    """(T, 2I) = [gate | up] -> (T, I) = silu(gate) * up."""
    if _wants_triton(gate_up, use_triton):
        return _kernels().silu_and_mul(gate_up)
    return silu_and_mul_torch(gate_up)


class SiluAndMul(nn.Module):
    """`silu_and_mul` as a module, so `set_use_triton` reaches it like the other layers."""

    def __init__(self, use_triton: Optional[bool] = None):
        super().__init__()
        self.use_triton = use_triton

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(gate_up, self.use_triton)


def set_use_triton(model: nn.Module, use_triton: Optional[bool]) -> None:
    """Force (True), forbid (False) or auto-select by device (None) the fused kernels in a model."""
    for module in model.modules():
        if hasattr(module, "use_triton"):  # RMSNorm, SiluAndMul, rotary.RotaryEmbedding
            module.use_triton = use_triton
