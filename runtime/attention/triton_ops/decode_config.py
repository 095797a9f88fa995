"""Which tiles and how many KV splits the split-KV decode (`decode_attention.py`) runs with.

`DecodeConfig` is one set of launch parameters; `DecodePolicy` picks one per decode batch size (the
choice depends on the batch size only, so a captured CUDA graph stays valid for any sequence lengths);
`decode_scratch_numel` sizes the partial-output scratch a config needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the split-KV decode (GPU defaults; tests shrink them to exercise splits)."""

    # Defaults from benchmarks/sweep_decode_attention.py on an H200 (bf16, head_dim 64 and 128, batch
    # 1-256, context 576 and 4096): the config with the smallest mean slowdown against each case's own
    # best (1.06x). Short splits matter most at small batch: at batch 1 a 576-token context cut into
    # 256-token splits ran 3 programs per KV head, each looping serially (12.6 us per layer, where the
    # KV read alone is ~0.5 us); small KV tiles pay off at large batch.
    block_n: int = 32  # KV tokens per inner-loop iteration
    max_kv_splits: int = 64  # upper bound on splits per request (sizes the partial-output scratch)
    min_split_len: int = 32  # do not split a sequence into pieces shorter than this
    target_programs: int = 4 * 132  # stage-1 programs worth launching (about 4 waves on an H200)
    num_warps: int = 4
    num_stages: int = 2
    # A floor on the split cap. At batch 512 x 8 KV heads one split per request already makes 4,096
    # programs, but of equal length they run in ~3.1 waves of the GPU's resident programs, and the last,
    # mostly empty wave costs a whole one: 411 us per layer (700-token contexts), 382 with two splits.
    min_splits: int = 1
    # Stage 2 with one program per (request, head) instead of per request: a small batch has too few
    # requests to spread the merge over (batch 1: one program, looping over its splits).
    merge_per_head: bool = False

    def __post_init__(self):
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n must be a power of two >= 16, got {self.block_n}")
        if min(self.max_kv_splits, self.min_split_len, self.target_programs, self.min_splits) < 1:
            raise ValueError("max_kv_splits, min_split_len, target_programs and min_splits must be >= 1")

    def split_cap(self, batch_size: int, num_kv_heads: int) -> int:
        """Most splits a request of this batch may use: enough programs to fill the GPU, no more."""
        want = -(-self.target_programs // max(1, batch_size * num_kv_heads))
        return max(1, min(self.max_kv_splits, max(want, self.min_splits)))


@dataclass(frozen=True)
class DecodePolicy:
    """The DecodeConfig each decode batch size runs with: a batch of a few requests is latency-bound
    (its merge must be spread over heads: a program per request would loop over its splits alone), a
    large one bandwidth-bound (enough splits to even out the waves, one merge program per request).
    The choice depends on the batch size only, so a captured CUDA graph keeps its kernels right for
    any sequence lengths. The boundary (32) is where batch x heads merge programs stop being cheaper
    than batch programs looping over ~3 splits each. `huge` (optional) serves batches above
    `large_max_batch`."""

    small: DecodeConfig
    large: DecodeConfig
    small_max_batch: int = 32
    huge: Optional[DecodeConfig] = None
    large_max_batch: int = 256

    def for_batch(self, batch_size: int) -> DecodeConfig:
        if batch_size <= self.small_max_batch:
            return self.small
        if self.huge is not None and batch_size > self.large_max_batch:
            return self.huge
        return self.large


def default_decode_policy(num_sms: int) -> DecodePolicy:
    # NOTE: from benchmarks/sweep_decode_attention.py on an H200 (8B heads, bf16, us per layer, old
    # single default -> large): batch 64 x 770 60.0 -> 60.0, batch 256 x 576 195.9 -> 161.3, batch
    # 256 x 2,000 666 -> 518, batch 512 x 700 411 -> 384. Small batches keep the tiles they had (the
    # session-2 sweep's defaults, measured in the full step: 8B batch 1 4.77 ms) and the per-head merge.
    # Above 256 requests (the offline run's first few hundred steps), 64-token KV tiles with 3 stages
    # (sweep_decode_attention.py --launch): batch 512 x 700 367.2 -> 357.5 us; at 256 x 576 they are
    # 0.5% slower (158.5 against 157.7), at 64 x 770 and 1 x 576 the policy's tiles stay the best.
    return DecodePolicy(
        small=DecodeConfig(target_programs=4 * num_sms, merge_per_head=True),
        large=DecodeConfig(target_programs=4 * num_sms, min_splits=2),
        huge=DecodeConfig(target_programs=4 * num_sms, min_splits=2, block_n=64, num_stages=3))


def decode_scratch_numel(batch_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                         cfg: DecodeConfig) -> int:
    """fp32 elements of scratch one decode call needs: partial outputs + log-sum-exps per split.

    NOTE: the split count shrinks as the batch grows (see `split_cap`), so batch * splits stays near
    `target_programs / num_kv_heads` and the scratch stays small even for large batches.
    """
    splits = cfg.split_cap(batch_size, num_kv_heads)
    return batch_size * num_heads * splits * (head_dim + 1)
