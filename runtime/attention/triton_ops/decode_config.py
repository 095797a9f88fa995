"""Which tiles and how many KV splits the split-KV decode (`decode_attention.py`) runs with.

`DecodeConfig` is one set of launch parameters; `DecodePolicy` picks one per decode batch size (the
choice depends on the batch size only, so a captured CUDA graph stays valid for any sequence lengths);
`decode_scratch_numel` sizes the partial-output scratch a config needs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the split-KV decode (GPU defaults; tests shrink them to exercise splits)."""

    # Defaults from benchmarks/kernels/sweep_decode_attention.py (bf16, head_dim 64 and 128, batch 1-256,
    # context 576 and 4096): the config with the smallest mean slowdown against each case's own best.
    # Short splits matter most at small batch: a short context cut into long splits runs few programs per
    # KV head, each looping serially, far slower than the KV read; small KV tiles pay off at large batch.
    block_n: int = 32  # KV tokens per inner-loop iteration
    max_kv_splits: int = 64  # upper bound on splits per request (sizes the partial-output scratch)
    min_split_len: int = 32  # do not split a sequence into pieces shorter than this
    target_programs: int = 4 * 132  # stage-1 programs worth launching (about 4 waves on a GPU of 132 SMs)
    num_warps: int = 4
    num_stages: int = 2
    # A floor on the split cap. At batch 512 x 8 KV heads one split per request already makes 4,096
    # programs, but of equal length they run in ~3.1 waves of the GPU's resident programs, and the last,
    # mostly empty wave costs a whole one; two splits even the waves out.
    min_splits: int = 1
    # Stage 2 with one program per (request, head) instead of per request: a small batch has too few
    # requests to spread the merge over (batch 1: one program, looping over its splits).
    merge_per_head: bool = False
    # KV heads one stage-1 program reads side by side (a power of two; fewer where the model's KV heads
    # are not a multiple). Their query heads fill the tile rows, which a single GQA group of 4 pads to 16
    # anyway, so 2 heads cost no extra tensor-core work, and each token's K/V read is one contiguous run
    # of 2 x head_dim elements with half the slot-index loads. Faster from batch 32 up; a batch of one
    # (half the programs) is slower, so small batches keep 1.
    kv_heads_per_program: int = 1

    def __post_init__(self):
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n must be a power of two >= 16, got {self.block_n}")
        if min(self.max_kv_splits, self.min_split_len, self.target_programs, self.min_splits) < 1:
            raise ValueError("max_kv_splits, min_split_len, target_programs and min_splits must be >= 1")
        hpp = self.kv_heads_per_program
        if hpp < 1 or hpp & (hpp - 1):
            raise ValueError(f"kv_heads_per_program must be a power of two >= 1, got {hpp}")

    def heads_per_program(self, num_kv_heads: int) -> int:
        """KV heads one stage-1 program takes: kv_heads_per_program, halved until it divides the model's."""
        hpp = self.kv_heads_per_program
        while num_kv_heads % hpp:
            hpp //= 2
        return hpp

    def split_cap(self, batch_size: int, num_kv_heads: int) -> int:
        """Most splits a request of this batch may use: enough programs to fill the GPU, no more."""
        programs_per_split = batch_size * (num_kv_heads // self.heads_per_program(num_kv_heads))
        want = -(-self.target_programs // max(1, programs_per_split))
        return max(1, min(self.max_kv_splits, max(want, self.min_splits)))


@dataclass(frozen=True)
class DecodePolicy:
    """The DecodeConfig each decode batch size runs with: a batch of a few requests is latency-bound
    (its merge must be spread over heads: a program per request would loop over its splits alone), a
    large one bandwidth-bound (programs reading two KV heads, one merge program per request).
    The choice depends on the batch size only, so a captured CUDA graph keeps its kernels right for
    any sequence lengths.

    `tiers` are (largest batch size, config) pairs in ascending order; `largest` serves every batch
    above the last tier."""

    tiers: tuple[tuple[int, DecodeConfig], ...]
    largest: DecodeConfig

    @classmethod
    def uniform(cls, cfg: DecodeConfig) -> "DecodePolicy":
        """One config for every batch size (tests, sweeps)."""
        return cls((), cfg)

    def for_batch(self, batch_size: int) -> DecodeConfig:
        for max_batch, cfg in self.tiers:
            if batch_size <= max_batch:
                return cfg
        return self.largest


def default_decode_policy(num_sms: int) -> DecodePolicy:
    # NOTE: from benchmarks/kernels/sweep_decode_attention.py (8B heads, bf16; its figures are in
    # benchmarks/RESULTS.md).
    # - Up to 32 requests, one KV head a program and the per-head merge. The boundary (32) is where
    #   batch x heads merge programs stop being cheaper than batch programs looping over ~3 splits each.
    # - Up to 4 requests, 2 pipeline stages; from 5 to 32, 3 (--pack and a stages A/B: 3 stages lose a
    #   little at 1-4 requests and gain from 8 on). Two heads a program lost here, and no case gained.
    # - Above 32 requests a program reads two KV heads (--pack: heads per program x block_n x warps x
    #   stages x target programs; the best for every case was 2 heads, 32-token tiles, 4 warps, 3 stages,
    #   ~2 programs per SM). With half the programs per request, one split per request already fills the
    #   GPU from batch ~66 on: the earlier floor of two splits (a fix for the wave quantization of 4,096
    #   one-head programs at batch 512) and the separate tier above 256 requests (64-token tiles) are no
    #   longer needed.
    latency = DecodeConfig(target_programs=4 * num_sms, merge_per_head=True)
    return DecodePolicy(
        tiers=((4, latency), (32, dataclasses.replace(latency, num_stages=3))),
        largest=DecodeConfig(target_programs=2 * num_sms, kv_heads_per_program=2, num_stages=3),
    )


def decode_scratch_numel(batch_size: int, num_heads: int, num_kv_heads: int, head_dim: int, cfg: DecodeConfig) -> int:
    """fp32 elements of scratch one decode call needs: partial outputs + log-sum-exps per split.

    NOTE: the split count shrinks as the batch grows (see `split_cap`), so batch * splits stays near
    `target_programs / num_kv_heads` and the scratch stays small even for large batches.
    """
    splits = cfg.split_cap(batch_size, num_kv_heads)
    return batch_size * num_heads * splits * (head_dim + 1)
