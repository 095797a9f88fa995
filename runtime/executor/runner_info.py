"""`RunnerInfo`: the facts a step runner states about itself, fixed at start-up.

The model runner makes it once its KV pool is sized; the runners built over one (a split model's rank
0, the draft-and-verify runner) share it, changing only what differs for them (`dataclasses.replace`);
the scheduler sizes its queues and reports its stats from it (`runner.info`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RunnerInfo:
    device: str  # "cpu" or "cuda"
    dtype: torch.dtype  # of the weights (and of the KV cache, unless kv_cache_dtype says otherwise)
    context_len: int  # the longest sequence a request may reach
    vocab_size: int
    hidden_size: int  # of the model's residual stream (what a pipeline stage sends on)
    eos_token_ids: tuple[int, ...]
    max_total_tokens: int  # kv slots in the pool
    max_running_requests: int  # requests decoded together (rows of req_to_token, less the dummy row)
    attention_backend: str  # the backend's name, resolved from the settings
    # Whether `launch` returns before the device finishes (overlap scheduling pays only then).
    supports_overlap: bool
    tp_size: int = 1  # ranks the model's heads are split over
    # Device memory held (get_stats reports them): the KV cache's and the weights' (one rank's shard).
    kv_cache_bytes: int = 0
    weight_bytes: int = 0
    quantization: str = "none"  # the linear layers' weights: "int8", "int4", "fp8" or "none" (in `dtype`)
    kv_cache_dtype: str = ""  # what the KV pool stores: "fp8_e4m3", "fp8_e5m2", or a dtype's name ("bfloat16")
    cpu_features: tuple[str, ...] = ()  # on the CPU: its low-precision features (quant/cpu_features.py)

    def __post_init__(self) -> None:
        if min(self.context_len, self.vocab_size, self.max_total_tokens, self.max_running_requests) <= 0:
            raise ValueError(f"a runner's sizes must be positive: {self}")

    @property
    def memory_bytes(self) -> dict[str, int]:
        """{"kv_cache_bytes": ..., "weight_bytes": ...}, as get_stats reports them."""
        return {"kv_cache_bytes": self.kv_cache_bytes, "weight_bytes": self.weight_bytes}
