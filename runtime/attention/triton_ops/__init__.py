"""Triton attention kernels over the paged KV pool (used by `triton_backend.py`)."""

from .decode_attention import DecodeSplits, decode_attention
from .decode_config import (
    DecodeConfig,
    DecodePolicy,
    SplitPlan,
    decode_scratch_numel,
    default_decode_policy,
    needs_plan,
    plan_splits,
    split_table_numel,
)
from .decode_merge import PrefixPartials
from .extend_attention import ExtendConfig, default_extend_config, extend_attention, tree_attention
from .prefix_attention import PrefixConfig, PrefixTables, prefix_attention, prefix_partial_numel, split_prefix_scratch

__all__ = [
    "DecodeConfig",
    "DecodePolicy",
    "DecodeSplits",
    "SplitPlan",
    "default_decode_policy",
    "ExtendConfig",
    "PrefixConfig",
    "PrefixPartials",
    "PrefixTables",
    "decode_attention",
    "decode_scratch_numel",
    "default_extend_config",
    "extend_attention",
    "needs_plan",
    "plan_splits",
    "split_table_numel",
    "prefix_attention",
    "prefix_partial_numel",
    "split_prefix_scratch",
    "tree_attention",
]
