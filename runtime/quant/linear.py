"""Weight-only quantized linear layers for the CPU: the weight stored in int8 or int4 with per-output-channel
(int8) or per-group (int4) scales, the activations left in their dtype. Decode at small batch reads every
weight once per step, so fewer weight bytes is what makes it faster; accuracy bounds are in
tests/models/test_quantized.py and benchmarks/RESULTS.md.

`QuantizedLinear.linear` is what models/layers.skinny_linear calls for these layers; `rows` gives a tied LM
head's rows (speculative verify scores a few tokens through them)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

# Rows up to which int8 takes torch's packed int8 kernel (_weight_int8pack_mm: its cost grows with the
# rows); above it the weight is widened to the activation dtype once per call and the matmul library runs
# the batch (a prefill). The kernel is fast with bf16 activations only (float32 ones take a slow path), so
# x goes in as bf16 whatever the model's dtype (benchmarks/RESULTS.md, low-precision CPU rows).
INT8_PACKED_ROWS = 16
# int4: the weight quantized per group of this many input columns (asymmetric: scale and zero point),
# which keeps 4 bits accurate where one scale per row would not.
INT4_GROUP_SIZE = 32


class QuantizedLinear(nn.Module):
    """A linear layer y = x @ W^T (+ bias) whose W is quantized; `weight` holds the quantized codes (so
    code that checks a layer's weight dtype, the CUDA kernels' tests, sees it is not a float matrix)."""

    in_features: int
    out_features: int

    def linear(self, x: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """x (..., K) -> (..., N) in x's dtype (or out_dtype)."""
        raise NotImplementedError

    def dequantized(self) -> torch.Tensor:
        """W (N, K) in the activation dtype."""
        raise NotImplementedError

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """W[ids] (n, K) in the activation dtype."""
        return self.dequantized().index_select(0, ids)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class Int8Linear(QuantizedLinear):
    """int8 codes with one scale per output channel (symmetric: W ~= codes * scale[n])."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        w = weight.detach().float()  # (N, K)
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)  # (N,)
        codes = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)  # (N, K)
        self.weight = nn.Parameter(codes, requires_grad=False)
        self.dtype = dtype
        # NOTE: the scales kept in float32 too: rounded to bf16 they cost a float32 model accuracy.
        self.scales = nn.Parameter(scales.to(dtype), requires_grad=False)  # (N,) in the activation dtype
        self.kernel_scales = nn.Parameter(scales.to(torch.bfloat16), requires_grad=False)  # (N,): the kernel's
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)

    def dequantized(self) -> torch.Tensor:
        return self.weight.to(self.dtype) * self.scales[:, None]  # (N, K)

    def linear(self, x: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # (M, K)
        if x2.shape[0] <= INT8_PACKED_ROWS:
            xb = x2.to(torch.bfloat16).contiguous()
            y = torch.ops.aten._weight_int8pack_mm(xb, self.weight, self.kernel_scales).to(x.dtype)  # (M, N)
            if self.bias is not None:
                y = y + self.bias
        else:
            y = F.linear(x2.to(self.dtype), self.dequantized(), self.bias)  # (M, N)
        y = y.reshape(*lead, self.out_features)
        return y if out_dtype is None else y.to(out_dtype)


class Int4Linear(QuantizedLinear):
    """int4 codes per group of INT4_GROUP_SIZE input columns, packed for torch's CPU int4 kernel
    (_weight_int4pack_mm_for_cpu), which takes bf16 activations: x is cast to bf16 and back."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = n, k = weight.shape
        if k % INT4_GROUP_SIZE:
            raise ValueError(f"int4 needs in_features divisible by {INT4_GROUP_SIZE}, got {k}")
        self.dtype = dtype
        groups = weight.detach().float().reshape(n, k // INT4_GROUP_SIZE, INT4_GROUP_SIZE)  # (N, G, gs)
        low, high = groups.amin(dim=2), groups.amax(dim=2)  # (N, G)
        scale = ((high - low) / 15.0).clamp(min=1e-12)  # (N, G)
        codes = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
        # The kernel reads W = (code - 8) * scale + zero, so zero = low + 8 * scale.
        scale_zeros = torch.stack([scale, low + 8 * scale], dim=2).transpose(0, 1)  # (G, N, 2)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.reshape(n, k), 1)  # (N, K / 2) uint8
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.scale_zeros = nn.Parameter(scale_zeros.contiguous().to(torch.bfloat16), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)

    def dequantized(self) -> torch.Tensor:
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)  # (K, K): W^T = I @ W^T through the kernel
        return self._matmul(eye).t().to(self.dtype)  # (N, K)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        # x (M, K) bf16 -> (M, N) bf16
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.weight, INT4_GROUP_SIZE, self.scale_zeros)

    def linear(self, x: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        lead = x.shape[:-1]
        y = self._matmul(x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous())  # (M, N)
        y = y.to(out_dtype or self.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)
