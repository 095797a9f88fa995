"""What this CPU's instruction set offers low-precision matmuls, read from /proc/cpuinfo and torch: never
assumed (plait's developers run both AMD EPYC with AVX512-BF16/VNNI and Intel Xeon with AMX)."""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# The /proc/cpuinfo flags that matter here: bf16 dot products (AVX512-BF16), matrix tiles (AMX), int8 dot
# products (VNNI).
_FLAGS = ("avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8", "avx512_vnni", "avx_vnni")


@dataclass(frozen=True)
class CpuFeatures:
    flags: tuple[str, ...]  # those of _FLAGS the CPU reports, in _FLAGS order
    torch_capability: str  # torch.backends.cpu.get_cpu_capability(): the kernels ATen dispatches to

    @property
    def fast_bf16(self) -> bool:
        """Whether bf16 matmuls run in hardware (AVX512-BF16 or AMX) rather than widened to float32."""
        return "avx512_bf16" in self.flags or "amx_bf16" in self.flags

    @property
    def amx_bf16(self) -> bool:
        """Whether bf16 matmuls have AMX's matrix tiles (then torch's bf16 attention is fast too; without them,
        with query heads unfolded, it is slower than float32's: attention/torch_native.scores_dtype)."""
        return "amx_bf16" in self.flags

    def describe(self) -> list[str]:
        """The flags and torch's capability, as /get_server_info reports them."""
        return [*self.flags, f"torch:{self.torch_capability}"]


def parse_cpuinfo_flags(text: str) -> tuple[str, ...]:
    """Those of _FLAGS in the first "flags" line of a /proc/cpuinfo text (every core reports the same)."""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            present = set(value.split())
            return tuple(f for f in _FLAGS if f in present)
    return ()


@functools.lru_cache(maxsize=1)
def cpu_features() -> CpuFeatures:
    """This machine's features (read once: they do not change while a process runs)."""
    import torch

    try:
        with open("/proc/cpuinfo") as f:
            flags = parse_cpuinfo_flags(f.read())
    except OSError:  # not Linux: only torch's view is known
        flags = ()
    return CpuFeatures(flags, torch.backends.cpu.get_cpu_capability())


# What dtype "auto" resolves to on a CPU, when set: the suite pins float32 with it (its token-for-token
# references are transformers' float32), and anyone wanting one CPU's outputs on another can too.
CPU_DTYPE_ENV = "PLAIT_CPU_DTYPE"


def auto_cpu_dtype() -> str:
    """dtype "auto" on this CPU: bfloat16 where bf16 matmuls run in hardware (AMX: 1.9x float32's batched decode
    on the 2-core Xeon; AVX512-BF16: 1.6x on the 2-core AMD EPYC, attention kept in float32 there; perplexity
    within 1% of float32's), else float32; $PLAIT_CPU_DTYPE (float32 or bfloat16) overrides the choice."""
    chosen = os.environ.get(CPU_DTYPE_ENV)
    if chosen:  # (set but empty: as unset)
        if chosen not in ("float32", "bfloat16"):
            raise ValueError(f"{CPU_DTYPE_ENV}={chosen!r}: expected float32 or bfloat16")
        return chosen
    return "bfloat16" if cpu_features().fast_bf16 else "float32"


def check_cpu_precision(quantization, dtype, device: str) -> None:
    """The weights' precision against the device it resolved to: int8 / int4 are the CPU's (ValueError on
    a GPU; fp8 is checked by quant/fp8.check_fp8_device), and bfloat16 on a CPU without AVX512-BF16 or AMX
    is allowed but warned of (widened to float32 in software, it is slower than float32)."""
    import torch

    if quantization in ("int8", "int4") and device != "cpu":
        raise ValueError(f"quantization={quantization} runs on the CPU only; this engine resolved device {device}")
    if device == "cpu" and dtype == torch.bfloat16 and not cpu_features().fast_bf16:
        logger.warning(
            "dtype bfloat16 on a CPU without AVX512-BF16 or AMX (flags: %s): expect it slower than float32",
            " ".join(cpu_features().flags) or "none",
        )
