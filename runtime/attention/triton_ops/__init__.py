"""Triton attention kernels over the paged KV pool (used by `triton_backend.py`)."""

from .decode_attention import DecodeConfig, decode_attention, decode_scratch_numel
from .extend_attention import ExtendConfig, default_extend_config, extend_attention

__all__ = ["DecodeConfig", "ExtendConfig", "decode_attention", "decode_scratch_numel",
           "default_extend_config", "extend_attention"]
