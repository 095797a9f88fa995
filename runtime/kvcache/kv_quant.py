"""The KV cache's dtype (`kv_cache_dtype`) and, for FP8, how values are scaled into it.

An FP8 pool stores `k / k_scale` (and `v / v_scale`) as float8 with one float32 scale per layer, so a
stored value times its layer's scale is the model's K (V). Attention kernels read the FP8 rows and
dequantize in the kernel (K's scale folds into the softmax scale, V's into the output); writers
(`KVPool.set_kv`, the fused rotary + KV-store kernel) divide by the scale, clamp to the format's largest
finite value and round.

Scale policy: the checkpoint's per-layer scales when it has them (executor/kv_scales.py reads them),
else 1.0 per layer with a warning, as SGLang and vLLM do.
NOTE: scales measured on the first prefills were considered and not taken: FP8 is a floating-point
format, so its relative precision is the same at any scale and a scale only matters where values would
leave its range (e4m3: up to 448, normal down to 2^-6), which 1.0 covers for the K/V of the models served
here (O(1-10)); a scale measured on the first prompts holds for them only and, once K/V were written with
it, can never change without rewriting the cache (cached prefixes, CUDA graphs that read it), and every
rank of a split model would have to agree on it.
"""

from __future__ import annotations

import torch

# kv_cache_dtype names (setting_values.KV_CACHE_DTYPES) -> the pool's dtype; "auto" is the model's.
_DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# The compute capability Triton's FP8 types (fp8e4nv) need: Ada (8.9) and Hopper (9.0) on.
FP8_MIN_CAPABILITY = (8, 9)


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the KV pool stores for setting `name` (ValueError for an unknown one)."""
    if name == "auto":
        return model_dtype
    if name not in _DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {name!r} (one of {['auto', *_DTYPES]})")
    return _DTYPES[name]


def kv_dtype_name(dtype: torch.dtype) -> str:
    """What `/get_server_info` reports: "fp8_e4m3", "fp8_e5m2", or the torch dtype's name ("bfloat16")."""
    return {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}.get(dtype, str(dtype).replace("torch.", ""))


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def check_kv_dtype_supported(dtype: torch.dtype, device: str) -> None:
    """RuntimeError for an FP8 KV cache on a GPU that cannot read it (compute capability below 8.9: no FP8
    conversions in Triton). The CPU's torch_native path widens FP8 in torch and runs anywhere."""
    if not is_fp8(dtype) or torch.device(device).type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        raise RuntimeError(
            f"an FP8 KV cache needs a GPU of compute capability {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} "
            f"or later (Ada, Hopper), this one is {capability[0]}.{capability[1]}: set kv_cache_dtype to auto or bf16"
        )


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x (..., D) / scale (a 0-d float32 tensor) in `dtype`, clamped to its largest finite value (no host sync).

    NOTE: the clamp makes an outlier saturate instead of depending on the cast's overflow rule."""
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-limit, limit).to(dtype)
