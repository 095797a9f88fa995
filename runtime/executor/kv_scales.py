"""An FP8 KV pool's per-layer scales (kvcache/kv_quant.py says why and how they are used): the checkpoint's
when it has them, else 1.0 per layer with a warning.

Checkpoints name them per attention layer as FP8 checkpoints on Hugging Face do (vLLM's and SGLang's
readers take the same): `model.layers.N.self_attn.k_scale` and `.v_scale`, or one `.kv_scale` for both;
a scale is a scalar, or one per KV head (the largest is taken: every head's values then fit).
"""

from __future__ import annotations

import logging
import re
from typing import Optional

import torch

from ..kvcache.kv_quant import kv_dtype_name
from ..kvcache.memory_pool import KVPool
from .loader import safetensors_files

logger = logging.getLogger(__name__)

# (models/llama.py skips the same names when it loads the weights)
_SCALE_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(k_scale|v_scale|kv_scale)$")


def is_kv_scale_name(name: str) -> bool:
    """Whether a checkpoint tensor is a KV-cache scale (read here, not by the model's weight loader)."""
    return _SCALE_NAME.search(name) is not None


def checkpoint_kv_scales(model_path: str, first_layer: int, num_layers: int) -> Optional[tuple[torch.Tensor, ...]]:
    """(k_scale, v_scale), (num_layers,) float32 each, of layers first_layer.. from the folder's safetensors;
    None when it has no KV scales. ValueError when it has some layers' and not others'."""
    found: dict[str, dict[int, float]] = {"k_scale": {}, "v_scale": {}, "kv_scale": {}}
    from safetensors import safe_open

    for file in safetensors_files(model_path):
        with safe_open(file, framework="pt") as st:
            for name in st.keys():
                m = _SCALE_NAME.search(name)
                if m is not None and first_layer <= int(m.group(1)) < first_layer + num_layers:
                    found[m.group(2)][int(m.group(1)) - first_layer] = float(st.get_tensor(name).float().max())
    k = {**found["kv_scale"], **found["k_scale"]}
    v = {**found["kv_scale"], **found["v_scale"]}
    if not k and not v:
        return None
    missing = sorted(set(range(num_layers)) - (set(k) & set(v)))
    if missing:
        raise ValueError(
            f"{model_path} has KV-cache scales (k_scale/v_scale/kv_scale) for some attention layers and not for "
            f"layers {[first_layer + i for i in missing[:8]]}: an incomplete FP8 checkpoint?"
        )
    return (torch.tensor([k[i] for i in range(num_layers)]), torch.tensor([v[i] for i in range(num_layers)]))


def init_kv_scales(pool: KVPool, model_path: str, load_format: str, first_layer: int) -> str:
    """Set an FP8 pool's scales (nothing for another pool); returns where they came from, for the log."""
    if not pool.quantized:
        return "none"
    scales = None if load_format == "dummy" else checkpoint_kv_scales(model_path, first_layer, pool.num_layers)
    if scales is None:
        logger.warning(
            "kv_cache_dtype=%s: the checkpoint has no KV-cache scales (k_scale/v_scale); using 1.0 for every "
            "layer, which holds K/V up to %g in magnitude",
            kv_dtype_name(pool.dtype),
            torch.finfo(pool.dtype).max,
        )
        return "1.0"
    pool.set_scales(*scales)
    return "checkpoint"
