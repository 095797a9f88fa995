"""Triton attention kernels over the paged KV pool (used by `triton_backend.py`)."""

from .decode_attention import decode_attention
from .decode_config import DecodeConfig, DecodePolicy, decode_scratch_numel, default_decode_policy
from .decode_merge import PrefixPartials
from .extend_attention import ExtendConfig, default_extend_config, extend_attention, tree_attention
from .prefix_attention import PrefixConfig, PrefixTables, prefix_attention, prefix_partial_numel, split_prefix_scratch

__all__ = [
    "DecodeConfig",
    "DecodePolicy",
    "default_decode_policy",
    "ExtendConfig",
    "PrefixConfig",
    "PrefixPartials",
    "PrefixTables",
    "decode_attention",
    "decode_scratch_numel",
    "default_extend_config",
    "extend_attention",
    "prefix_attention",
    "prefix_partial_numel",
    "split_prefix_scratch",
    "tree_attention",
]
