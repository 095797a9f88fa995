"""FP8 (float8_e4m3fn) linear layers: the weight in FP8 with one float32 scale per output channel, the
activations quantized per token (or by a checkpoint's static per-tensor scale) as they arrive, and the
matmul on FP8 tensor cores through `torch._scaled_mm` (scale_a (M, 1), scale_b (1, N), rowwise).
Decode at small batch is bound by reading weights, so half the bytes of bf16 is the gain there; a decode
step's few rows take other kernels (the FP8-reading skinny matmul, cuBLASLt at unit scales, the Triton decode
matmul), chosen by row count in quant/fp8_rows.py.

On the CPU torch's `_scaled_mm` runs too (a reference kernel, slower than float32): the same numbers the
GPU's tensor cores compute, so the CPU suite covers the quantization, the scales and the checkpoints."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from .linear import QuantizedLinear

logger = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
# The smallest amax a scale is taken from: an all-zero row (a padding row, an unused channel) gets a tiny
# scale instead of a division by zero.
MIN_AMAX = 1e-12


def check_fp8_device(device: str, dtype: torch.dtype, device_index: int = 0) -> None:
    """FP8 weights against the device and dtype the engine resolved: on a GPU, FP8 tensor cores (compute
    capability >= 8.9: Ada, Hopper and newer) and half-precision activations, else a ValueError; on the CPU
    a warning (torch's reference FP8 matmul: correct, slower than float32; int8 is the CPU's fast path)."""
    if device == "cpu":
        logger.warning(
            "quantization=fp8 on the CPU runs torch's reference FP8 matmul: slower than float32 (int8 is faster)"
        )
        return
    capability = torch.cuda.get_device_capability(device_index)
    if capability < (8, 9):
        name = torch.cuda.get_device_name(device_index)
        raise ValueError(
            f"quantization=fp8 needs FP8 tensor cores (compute capability >= 8.9: Ada, Hopper or newer); "
            f"{name} has {capability[0]}.{capability[1]}. Leave quantization unset (bf16 weights)"
        )
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"quantization=fp8 on a GPU computes in bfloat16 or float16, got dtype {dtype}")


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W (N, K) float -> (codes (N, K) float8_e4m3fn, scales (N,) float32), W ~= codes * scales[:, None]."""
    w = weight.detach().float()  # (N, K)
    scales = w.abs().amax(dim=1).clamp(min=MIN_AMAX) / FP8_MAX  # (N,)
    codes = (w / scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)  # (N, K)
    return codes, scales


def quantize_rows(x: torch.Tensor, static_scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations x (M, K) -> (codes (M, K) float8_e4m3fn, scales (M, 1) float32): one scale per row (per
    token, dynamic), or a checkpoint's calibrated per-tensor scale (`static_scale`, (1,)) for every row.
    Device ops only (no host sync), so it runs inside a CUDA graph. On a GPU one Triton kernel
    (kernels/fp8_quant.py), the same codes; the torch ops below are the CPU's path and its reference."""
    if x.is_cuda and x.stride(-1) == 1:
        from ..kernels.fp8_quant import quantize_rows_fp8  # Triton: loaded only where a GPU runs it

        return quantize_rows_fp8(x, static_scale, FP8_MAX, MIN_AMAX)
    xf = x.float()  # (M, K)
    if static_scale is None:
        scales = xf.abs().amax(dim=1, keepdim=True).clamp(min=MIN_AMAX) / FP8_MAX  # (M, 1)
    else:
        scales = static_scale.view(1, 1).expand(x.shape[0], 1).contiguous()  # (M, 1)
    codes = (xf / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)  # (M, K)
    return codes, scales


@dataclass
class Fp8Rows:
    """Activations already in FP8, as the kernel that produced them wrote them (an RMSNorm or SiLU-and-mul that
    quantizes its own output for the FP8 layer after it: kernels/fp8_activations.py): codes (M, K)
    float8_e4m3fn, scales (M, 1) float32 (quantize_rows' layout), and `dtype`, the activations' own dtype
    (the layer's output dtype)."""

    codes: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape


def scaled_mm_fits(n: int, k: int) -> bool:
    """Whether FP8 tensor cores (cuBLASLt through `_scaled_mm`) take a (N, K) weight: both multiples of 16."""
    return n % 16 == 0 and k % 16 == 0


class Fp8Linear(QuantizedLinear):
    """y = x @ (codes * weight_scale[:, None])^T (+ bias). `weight` (N, K) float8_e4m3fn, `weight_scale`
    (N,) float32 (a fused layer's parts each keep their own rows' scales), `input_scale` (1,) float32 when
    the activations take a static scale (a checkpoint with activation_scheme "static"), else None: per
    token. Built empty for a checkpoint to fill (`load_weights` through quant/checkpoint.py), or from a
    float layer (`from_float`)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str,
        static_input_scale: bool = False,
    ):
        super().__init__()
        self.in_features, self.out_features, self.dtype = in_features, out_features, dtype
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device), requires_grad=False
        )
        self.weight_scale = nn.Parameter(
            torch.ones(out_features, dtype=torch.float32, device=device), requires_grad=False
        )
        self.input_scale: Optional[nn.Parameter] = None
        if static_input_scale:
            # NOTE: zero until loaded: a fused layer's parts each bring a scale and it keeps their largest.
            self.input_scale = nn.Parameter(torch.zeros(1, dtype=torch.float32, device=device), requires_grad=False)
        # The scale cuBLASLt's FP8 matmul takes for each operand where the real scales are applied after it
        # (quant/fp8_rows.unit_scaled_linear): a device tensor made once, not inside a captured graph.
        self.unit_scale: torch.Tensor
        self.register_buffer("unit_scale", torch.ones((), dtype=torch.float32, device=device), persistent=False)
        self.bias: Optional[nn.Parameter] = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: Optional[torch.Tensor], dtype: torch.dtype) -> "Fp8Linear":
        """A float layer's weight (N, K) quantized per output channel; its bias kept in `dtype`."""
        n, k = weight.shape
        layer = cls(k, n, bias is not None, dtype, weight.device)
        codes, scales = quantize_per_channel(weight)
        layer.weight.data.copy_(codes)
        layer.weight_scale.data.copy_(scales)
        if bias is not None:
            layer.bias.data.copy_(bias.detach())
        return layer

    def dequantized(self) -> torch.Tensor:
        return (self.weight.float() * self.weight_scale[:, None]).to(self.dtype)  # (N, K)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.weight.index_select(0, ids).float() * self.weight_scale.index_select(0, ids)[:, None]
        return w.to(self.dtype)  # (n, K)

    def linear(self, x: Union[torch.Tensor, Fp8Rows], out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        if isinstance(x, Fp8Rows):  # quantized by the kernel that made them (2-D, shapes the tensor cores take)
            return self._scaled_mm(x.codes, x.scales, out_dtype or x.dtype)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # (M, K)
        if x2.shape[0] == 0 or not scaled_mm_fits(self.out_features, self.in_features):
            # Shapes the FP8 tensor cores refuse (tiny test models): the same codes, widened.
            y = F.linear(x2.to(self.dtype), self.dequantized(), self.bias)  # (M, N)
        else:
            codes, scales = quantize_rows(x2, self.input_scale)  # (M, K) fp8, (M, 1)
            y = self._scaled_mm(codes, scales, None)
        y = y.reshape(*lead, self.out_features)
        target = out_dtype or x.dtype
        return y if y.dtype == target else y.to(target)

    def _scaled_mm(self, codes: torch.Tensor, scales: torch.Tensor, out_dtype: Optional[torch.dtype]) -> torch.Tensor:
        """FP8 rows (M, K) with their scales (M, 1) through the weight, rowwise-scaled, + bias -> (M, N) in out_dtype
        (None: what the matmul wrote)."""
        # NOTE: on CUDA rowwise scaling writes bf16 only; the CPU's kernel writes the model's dtype.
        mm_dtype = torch.bfloat16 if codes.is_cuda else self.dtype
        y = torch._scaled_mm(
            codes,
            self.weight.t(),  # (K, N), column-major: the layout the FP8 matmul wants
            scale_a=scales,
            scale_b=self.weight_scale.view(1, -1),  # (1, N)
            out_dtype=mm_dtype,
        )  # (M, N)
        if self.bias is not None:
            y = y + self.bias.to(mm_dtype)
        return y if out_dtype is None or y.dtype == out_dtype else y.to(out_dtype)

    def extra_repr(self) -> str:
        static = ", static input scale" if self.input_scale is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3{static}"
