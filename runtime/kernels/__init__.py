"""Fused Triton kernels for the small per-layer ops (RMSNorm(+residual), rotary, SiLU-and-mul; the norm and
SiLU-and-mul also straight to an FP8 layer's quantized input), the one-row decode matmuls (plain, or with
the norm / SiLU-and-mul before them folded in), and the tensor-core matmuls for decode batches of a few
dozen rows (bf16 weights, and FP8 weights widened in registers).

They run on CUDA tensors (and on CPU tensors under TRITON_INTERPRET=1, for tests). Importing this
package imports triton; `runtime/models/layers.py` imports it only when a fused op is actually used,
so CPU-only runs never need it. Each wrapper checks shapes on the host and launches one kernel with
no host sync, so all of them can be captured in a CUDA graph.
"""

from .activation import silu_and_mul
from .decode_gemm import SplitKWorkspace, decode_gemm
from .fp8_activations import rmsnorm_fp8, silu_and_mul_fp8
from .fp8_gemm import fp8_gemm
from .gemv import gemv
from .gemv_fused import gemv_row, rmsnorm_gemv, silu_mul_gemv
from .rmsnorm import fused_add_rmsnorm, rmsnorm
from .rotary import rotary_and_store_kv, rotary_inplace

__all__ = [
    "SplitKWorkspace",
    "decode_gemm",
    "fp8_gemm",
    "fused_add_rmsnorm",
    "gemv",
    "gemv_row",
    "rmsnorm",
    "rmsnorm_fp8",
    "rmsnorm_gemv",
    "rotary_and_store_kv",
    "rotary_inplace",
    "silu_and_mul",
    "silu_and_mul_fp8",
    "silu_mul_gemv",
]
