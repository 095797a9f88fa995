"""Which kernels an FP8 layer's matmul takes on CUDA, by the number of rows (tokens) it multiplies.

Decode at small batch is bound by reading the weights, prefill by the tensor cores, and between the two the
fastest FP8 matmul changes with the row count (benchmarks/kernels/bench_fp8_linear.py times every path on the 8B
matrices and prints the routing its figures favour; benchmarks/RESULTS.md, issue 38):

- `gemv`: up to FP8_GEMV_ROWS, the skinny matmul reading the FP8 codes with their scales (kernels/gemv.py,
  CUDA cores; one row: 94 us for the 8B layer's four matrices against bf16's 157, one H100);
- `unit_scaled`: rows from FP8_UNIT_SCALED_FROM to FP8_UNIT_SCALED_TO (0: off), the rows quantized per token,
  the product on cuBLASLt with unit scales (per-tensor `_scaled_mm`, the fastest FP8 matmul alone at 1-256 rows)
  and both scales put back after (kernels/fp8_epilogue.py). Off: with the scales' pass it was no faster than the
  decode matmul at 16-64 rows nor `rowwise` above (one H100, 2026-12-07);
- `decode` / `decode_fp8_rows`: up to FP8_DECODE_ROWS, the tensor-core decode matmul (kernels/fp8_gemm.py) with
  bf16 rows (FP8 weights widened in registers), or from FP8_ROWS_QUANTIZED_FROM with the rows quantized first;
- `rowwise`: above, `torch._scaled_mm` with a scale per row and per channel (Fp8Linear.linear).
The `decode_gemm` kernel choice off sends every row count to `rowwise`.

The paths that quantize the rows (`unit_scaled`, `decode_fp8_rows`, `rowwise`) take them already quantized
(`Fp8Rows`) where the RMSNorm or SiLU-and-mul before the layer wrote its output in FP8 itself
(kernels/fp8_activations.py: one launch less a layer input, ~3-4 us each on an H100 even at one row);
FP8_FUSED_QUANTIZATION off (`fused=0`) quantizes in the layer instead.

A batch-1 step's FP8 layers may also take the op before them inside their one-row matmul (FP8_FUSED_ROW, the parts
of FUSED_ROW_PARTS as bits: `fused_row=7` all three prologues, 8 the other one-row matmuls in the same kernel family).

$PLAIT_FP8_ROWS ("gemv=1,decode=64,quantized_from=2,unit_scaled_from=0,unit_scaled_to=256,fused=1,fused_row=9")
sets them for a process: benchmarks A/B the choices with it.
"""

from __future__ import annotations

import os
from typing import Optional, Union

import torch

from .fp8 import Fp8Linear, Fp8Rows, quantize_rows, scaled_mm_fits

FP8_GEMV_ROWS = 1
FP8_UNIT_SCALED_FROM = 0
FP8_UNIT_SCALED_TO = 256
FP8_DECODE_ROWS = 64
# From two rows the decode matmul takes FP8 rows: with the norm or SiLU-and-mul writing them, that is the fastest
# routing bench_fp8_linear measured at 16-64 rows (one H100, 2026-12-07: 95 and 107 us for the 8B layer's four
# matrices against 108 and 132 with bf16 rows).
FP8_ROWS_QUANTIZED_FROM = FP8_GEMV_ROWS + 1
FP8_FUSED_QUANTIZATION = 1
# A batch-1 decode step's FP8 layers on the one-row path of kernels/gemv_fused.py (models/layers.fuses_decode_row),
# whatever `fused_decode_row` says for half-precision layers: a bit for each part below that takes it (0: none, the
# step runs as any other). "qkv" / "gate_up": the RMSNorm before it inside the matmul; "down": SiLU-and-mul; "plain":
# the one-row matmuls without a prologue (o_proj, and the others where their bit is off) through that kernel family
# instead of gemv.py's (its K a compile-time constant). QKV's norm and "plain" (9) measured the fastest; the wide
# matrices lose more to their prologue than the launch saved (benchmarks/RESULTS.md, issue 38).
FUSED_ROW_PARTS = {"qkv": 1, "gate_up": 2, "down": 4, "plain": 8}
FP8_FUSED_ROW = FUSED_ROW_PARTS["qkv"] | FUSED_ROW_PARTS["plain"]
FP8_ROWS_ENV = "PLAIT_FP8_ROWS"
_ENV_NAMES = {
    "gemv": "FP8_GEMV_ROWS",
    "unit_scaled_from": "FP8_UNIT_SCALED_FROM",
    "unit_scaled_to": "FP8_UNIT_SCALED_TO",
    "decode": "FP8_DECODE_ROWS",
    "quantized_from": "FP8_ROWS_QUANTIZED_FROM",
    "fused": "FP8_FUSED_QUANTIZATION",
    "fused_row": "FP8_FUSED_ROW",
}
_QUANTIZING_PATHS = ("unit_scaled", "decode_fp8_rows", "rowwise")
# Rows the few-row kernels take at most: the decode matmul's tiles (kernels/fp8_gemm.MAX_ROWS), the skinny
# matmul's unrolled rows.
_MAX_DECODE_ROWS, _MAX_GEMV_ROWS = 256, 8


def set_fp8_rows(text: str) -> None:
    """Set the bounds from "name=N,..." (the names of $PLAIT_FP8_ROWS); anything else is a ValueError naming the
    items it takes."""
    values = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        if key.strip() not in _ENV_NAMES or not value.strip().isdigit():
            raise ValueError(f"{FP8_ROWS_ENV}={text!r}: expected items " + ", ".join(f"{k}=N" for k in _ENV_NAMES))
        values[_ENV_NAMES[key.strip()]] = int(value)
    if values.get("FP8_DECODE_ROWS", FP8_DECODE_ROWS) > _MAX_DECODE_ROWS:
        raise ValueError(f"{FP8_ROWS_ENV}={text!r}: decode rows go up to {_MAX_DECODE_ROWS}")
    if values.get("FP8_FUSED_ROW", FP8_FUSED_ROW) > sum(FUSED_ROW_PARTS.values()):
        raise ValueError(f"{FP8_ROWS_ENV}={text!r}: fused_row is a sum of the bits {FUSED_ROW_PARTS}")
    if values.get("FP8_GEMV_ROWS", FP8_GEMV_ROWS) > _MAX_GEMV_ROWS:
        raise ValueError(f"{FP8_ROWS_ENV}={text!r}: gemv rows go up to {_MAX_GEMV_ROWS}")
    globals().update(values)


if os.environ.get(FP8_ROWS_ENV):
    set_fp8_rows(os.environ[FP8_ROWS_ENV])


def fused_row(part: str) -> bool:
    """Whether a batch-1 step's FP8 layers take the fused one-row kernel for `part` (FUSED_ROW_PARTS)."""
    return bool(FP8_FUSED_ROW & FUSED_ROW_PARTS[part])


def fp8_path(rows: int, decode_kernels: bool = True) -> str:
    """The path an FP8 layer's matmul of `rows` rows takes on CUDA (the names above)."""
    if not decode_kernels:
        return "rowwise"
    if rows <= FP8_GEMV_ROWS:
        return "gemv"
    if FP8_UNIT_SCALED_FROM and FP8_UNIT_SCALED_FROM <= rows <= FP8_UNIT_SCALED_TO:
        return "unit_scaled"
    if rows <= FP8_DECODE_ROWS:
        return "decode_fp8_rows" if rows >= FP8_ROWS_QUANTIZED_FROM else "decode"
    return "rowwise"


def takes_quantized_rows(layer: Fp8Linear, rows: int, decode_kernels: bool = True) -> bool:
    """Whether `layer`'s matmul of `rows` rows on CUDA quantizes them (so the kernel before it may hand them over
    in FP8): a path that quantizes, a shape the FP8 tensor cores take, fused quantization on."""
    return (
        bool(FP8_FUSED_QUANTIZATION)
        and fp8_path(rows, decode_kernels) in _QUANTIZING_PATHS
        and scaled_mm_fits(layer.out_features, layer.in_features)
    )


def fp8_linear_by_rows(
    x: Union[torch.Tensor, Fp8Rows],
    layer: Fp8Linear,
    out_dtype: Optional[torch.dtype],
    out: Optional[torch.Tensor],
    workspace,
    decode_kernels: bool = True,
) -> torch.Tensor:
    """x (M, K) bf16/fp16 on CUDA (unit stride on K), or its FP8 rows already made (where takes_quantized_rows),
    through `layer` by the path its rows take; `out` as models/layers.skinny_linear's; `workspace` the decode
    matmul's split-K workspace."""
    from .. import kernels  # Triton: imported where a GPU (or the interpreter) runs it

    path = fp8_path(x.shape[0], decode_kernels)
    if path == "unit_scaled" and not scaled_mm_fits(layer.out_features, layer.in_features):
        path = "rowwise"  # a shape cuBLASLt's FP8 matmul refuses (tiny test models): Fp8Linear.linear widens
    if isinstance(x, Fp8Rows) and path not in _QUANTIZING_PATHS:
        raise ValueError(f"FP8 rows handed to the {path!r} path, which takes {x.dtype} rows ({x.shape[0]} rows)")
    if path == "gemv":
        return kernels.gemv(x, layer.weight, layer.bias, out_dtype=out_dtype, out=out, weight_scale=layer.weight_scale)
    if path == "unit_scaled":
        return unit_scaled_linear(x, layer, out_dtype, out)
    if path == "rowwise":
        y = layer.linear(x, out_dtype)
        return y if out is None else out.copy_(y)
    x_scale = None
    if path == "decode_fp8_rows":  # FP8 rows: the output still in x's dtype (or out's)
        out_dtype = out.dtype if out is not None else (out_dtype or x.dtype)
        x, x_scale = _codes(x, layer)
    assert isinstance(x, torch.Tensor)
    return kernels.fp8_gemm(
        x, layer.weight, layer.weight_scale, layer.bias,
        workspace=workspace, out_dtype=out_dtype, out=out, x_scale=x_scale,
    )  # fmt: skip


def _codes(x: Union[torch.Tensor, Fp8Rows], layer: Fp8Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """x's FP8 codes (M, K) and row scales (M, 1): as handed over, or quantized here."""
    return (x.codes, x.scales) if isinstance(x, Fp8Rows) else quantize_rows(x, layer.input_scale)


def unit_scaled_linear(
    x: Union[torch.Tensor, Fp8Rows],
    layer: Fp8Linear,
    out_dtype: Optional[torch.dtype] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """x (M, K) through `layer`: the rows quantized per token (or by the layer's static scale), their product with
    the FP8 weight on cuBLASLt at unit scales (rounded to bf16), then rows' and channels' scales and the bias in
    one pass (kernels/fp8_epilogue.py), into `out` or a new tensor of out_dtype (default x's)."""
    from ..kernels.fp8_epilogue import scale_rows_cols

    codes, x_scale = _codes(x, layer)  # (M, K) fp8, (M, 1)
    unit = layer.unit_scale
    y = torch._scaled_mm(codes, layer.weight.t(), scale_a=unit, scale_b=unit, out_dtype=torch.bfloat16)  # (M, N)
    target = out.dtype if out is not None else (out_dtype or x.dtype)
    if out is None and target == torch.bfloat16:
        out = y  # in place, over the matmul's own output
    return scale_rows_cols(y, x_scale, layer.weight_scale, layer.bias, out=out, out_dtype=target)
