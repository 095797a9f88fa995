"""SiLU-and-mul (the SwiGLU gate) as one Triton launch.

gate_up (T, 2I) holds [gate | up] per row; out (T, I) = silu(gate) * up with the same rounding as
`F.silu(gate) * up` in torch: silu computed in float32 and rounded to the input dtype, then the
product of two input-dtype values rounded again (exact in fp32 for bf16/fp16 operands). The GPU's
exp is not correctly rounded, so float32 results may differ from torch by a few ulps (and a bf16/fp16
result, rarely, by one ulp of its dtype where the silu value sits on a rounding boundary).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import check_device, next_power_of_2, pdl_launch_args, pdl_wait_then_release


@triton.jit
def silu_mul(gate, up):
    """silu(gate) * up elementwise, rounded to gate's dtype as torch's `F.silu(gate) * up` rounds."""
    g = gate.to(tl.float32)
    # NOTE: tl.exp is the GPU's fast exp2-based approximation (libdevice's accurate expf does not run
    # in the interpreter); its few-ulp error vanishes in the rounding to bf16/fp16.
    act = tl.div_rn(g, 1.0 + tl.exp(-g)).to(gate.dtype)
    return (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def _silu_and_mul_kernel(GateUp, Out, inter, stride_in, stride_out, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_wait_then_release(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,)
    mask = cols < inter
    gate = tl.load(GateUp + row * stride_in + cols, mask=mask, other=0.0)
    up = tl.load(GateUp + row * stride_in + inter + cols, mask=mask, other=0.0)
    tl.store(Out + row * stride_out + cols, silu_mul(gate, up), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(..., 2I) -> (..., I): silu(gate) * up; returns a new contiguous tensor."""
    check_device("silu_and_mul", gate_up)
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        raise ValueError(f"silu_and_mul expects (..., 2I) with an even last dim, got {tuple(gate_up.shape)}")
    inter = gate_up.shape[-1] // 2
    x = gate_up.reshape(-1, 2 * inter)  # (T, 2I); a view when the rows are contiguous
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype, device=gate_up.device)
    rows = x.shape[0]
    if rows == 0 or inter == 0:
        return out
    block = min(1024, next_power_of_2(inter))
    _silu_and_mul_kernel[(rows, triton.cdiv(inter, block))](
        x, out, inter, x.stride(0), inter, BLOCK=block, num_warps=4, **pdl_launch_args(x.device)
    )
    return out
