"""Which tiles and how many KV splits the split-KV decode (`decode_attention.py`) runs with.

`DecodeConfig` is one set of launch parameters; `DecodePolicy` picks one per decode batch size (the
choice depends on the batch size only, so a captured CUDA graph keeps its kernels for any sequence lengths);
`even_splits` is how many splits the kernels give each request by themselves (from the batch size: a
captured graph stays valid for any lengths); `plan_splits` cuts each request's KV for one step from its
length, for the steps where that differs (a long request among short ones); `decode_scratch_numel` sizes
the partial-output scratch a config needs.

How a step's KV is split: every request has at least one split, and a step has `target_programs` programs'
worth of extra splits to hand out (`DecodeConfig.extra_items`). One split length serves the whole step,
long enough that all the splits together make about `target_programs` programs: sum(KV) x KV-head groups /
target_programs tokens, at least `min_split_len`, and where one split a request already fills the GPU, at
least twice the mean length. A request gets cdiv(its KV, that length) splits, so a batch of equal requests
splits as evenly as before, and in a batch of mixed lengths an 8,000-token request gets more splits than its
600-token neighbours instead of walking its KV in one program while they wait (benchmarks/RESULTS.md, issue
32: 3-5x the step's attention time at a 10% share of long requests).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the split-KV decode (GPU defaults; tests shrink them to exercise splits)."""

    # Defaults from benchmarks/kernels/sweep_decode_attention.py (bf16, head_dim 64 and 128, batch 1-256,
    # context 576 and 4096): the config with the smallest mean slowdown against each case's own best.
    # Short splits matter most at small batch: a short context cut into long splits runs few programs per
    # KV head, each looping serially, far slower than the KV read; small KV tiles pay off at large batch.
    block_n: int = 32  # KV tokens per inner-loop iteration
    max_kv_splits: int = 64  # upper bound on splits per request (sizes stage 2's merge tile)
    min_split_len: int = 32  # do not split a sequence into pieces shorter than this
    target_programs: int = 4 * 132  # stage-1 programs worth launching (about 4 waves on a GPU of 132 SMs)
    num_warps: int = 4
    num_stages: int = 2
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
        if min(self.max_kv_splits, self.min_split_len, self.target_programs) < 1:
            raise ValueError("max_kv_splits, min_split_len and target_programs must be >= 1")
        hpp = self.kv_heads_per_program
        if hpp < 1 or hpp & (hpp - 1):
            raise ValueError(f"kv_heads_per_program must be a power of two >= 1, got {hpp}")

    def heads_per_program(self, num_kv_heads: int) -> int:
        """KV heads one stage-1 program takes: kv_heads_per_program, halved until it divides the model's."""
        hpp = self.kv_heads_per_program
        while num_kv_heads % hpp:
            hpp //= 2
        return hpp

    def head_groups(self, num_kv_heads: int) -> int:
        """Stage-1 programs per split: the model's KV heads in groups of heads_per_program."""
        return num_kv_heads // self.heads_per_program(num_kv_heads)

    def extra_items(self, num_kv_heads: int) -> int:
        """Splits beyond each request's first that one step may hand out: target_programs' worth of
        programs. A step's split length keeps the splits it cuts within this bound (`plan_splits`), so
        a captured graph's grid of (batch + extra_items) splits holds any step of its batch size."""
        return -(-self.target_programs // self.head_groups(num_kv_heads))

    def even_splits(self, batch_size: int, num_kv_heads: int) -> int:
        """The splits the kernels give each request of a batch this size without a plan (the batch's share of
        target_programs, fewer where a request is shorter than that many min_split_len pieces); also the
        per-head merge's chunk of a plan's splits."""
        want = -(-self.target_programs // max(1, batch_size * self.head_groups(num_kv_heads)))
        return max(1, min(self.max_kv_splits, want))

    def max_row_splits(self, num_kv_heads: int) -> int:
        """Most splits one request can get (stage 2 merges them in one tile)."""
        return max(1, min(self.max_kv_splits, 1 + self.extra_items(num_kv_heads)))


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


def default_decode_policy(num_sms: int, kv_fp8: bool = False) -> DecodePolicy:
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
    # - An FP8 pool (kv_fp8): a token's K/V row is half the bytes, so the KV tiles take twice the tokens
    #   (the bytes a program has in flight stay the bf16 tiles'). `sweep_decode_attention.py --kv-dtype
    #   fp8_e4m3 --launch` on an H100 found no better launch at 64 requests x 1,536 keys (92.3 us, best 92.9).
    block_n = 64 if kv_fp8 else 32
    latency = DecodeConfig(block_n=block_n, target_programs=4 * num_sms, merge_per_head=True)
    return DecodePolicy(
        tiers=((4, latency), (32, dataclasses.replace(latency, num_stages=3))),
        largest=DecodeConfig(block_n=block_n, target_programs=2 * num_sms, kv_heads_per_program=2, num_stages=3),
    )


def decode_scratch_numel(batch_size: int, num_heads: int, num_kv_heads: int, head_dim: int, cfg: DecodeConfig) -> int:
    """fp32 elements of scratch one decode call needs: a partial output + log-sum-exp per split and head,
    for the most splits a step of this batch can have (a first split per request + the extra ones)."""
    return (batch_size + cfg.extra_items(num_kv_heads)) * num_heads * (head_dim + 1)


def _align16(n: int) -> int:
    return -(-n // 16) * 16  # sections of the table start 64-byte aligned, as the kernels specialize them


def split_table_numel(batch_size: int, items_cap: int) -> int:
    """int32 elements of a split plan's table (`SplitPlan`) for a batch and an item capacity."""
    return 2 * _align16(max(batch_size, 1)) + 2 * _align16(max(items_cap, 1))


@dataclass(frozen=True)
class SplitPlan:
    """One step's KV splits, as the kernels read them from one int32 table:

    rows (rows_cap, 2): per request, its split count and the item index of its second split;
    items (items_cap, 2) from `items_at`: per stage-1 item, its request (-1: none) and split index.
    Items 0..B-1 are the requests' first splits, the extra splits follow request by request. Stage 1 runs
    a program per (KV-head group, item) and writes item i's partials at row i of the scratch; stage 2
    merges each request's rows."""

    table: np.ndarray  # int32 (items_at + 2 * items_cap,)
    items_at: int  # where the items section starts (a multiple of 16)
    items: int  # items to launch: B + the extra splits (or a graph's fixed capacity)
    max_splits: int  # the most splits any request got (1: every request writes its output in stage 1)


def step_split_len(total: int, batch: int, cfg: DecodeConfig, num_kv_heads: int) -> int:
    """The one split length of a step of `batch` requests holding `total` KV tokens (module docstring)."""
    groups = cfg.head_groups(num_kv_heads)
    split_len = max(cfg.min_split_len, -(-total * groups // cfg.target_programs))
    if batch * groups >= cfg.target_programs:
        # NOTE: a batch this large fills the GPU with one split per request: splits are then only for
        # balance, and a request up to twice the mean length is no tail worth a merge stage (a batch of
        # about one length keeps one split each, written out by stage 1 alone).
        split_len = max(split_len, -(-2 * total // batch))
    return split_len


def needs_plan(suffix_lens: Sequence[int], cfg: DecodeConfig, num_kv_heads: int, batch: Optional[int] = None) -> bool:
    """Whether a step's plan would give some request more splits than even splits do (`plan_splits`'
    max_splits > `even_splits`), from the lengths' sum and maximum alone: the check every graph step makes,
    a few microseconds where building the plan is tens. `batch`: the padded batch the lengths are the first
    of (its empty rows change neither the sum nor the maximum)."""
    b = len(suffix_lens) if batch is None else batch
    if b == 0 or not len(suffix_lens):
        return False
    longest = max(max(suffix_lens), 0)
    split_len = step_split_len(max(sum(suffix_lens), 0), b, cfg, num_kv_heads)
    most = min(-(-longest // split_len), cfg.max_row_splits(num_kv_heads))
    return most > cfg.even_splits(b, num_kv_heads)


def plan_splits(
    suffix_lens: Sequence[int] | np.ndarray,
    cfg: DecodeConfig,
    num_kv_heads: int,
    items_cap: Optional[int] = None,
) -> SplitPlan:
    """Split each request's KV (its length after any shared prefix the cascade kernels attend) for one
    step (see the module docstring). `items_cap`: the grid's fixed item count (a graph's
    batch + extra_items); None: exactly the items used."""
    lens = np.maximum(np.asarray(suffix_lens, dtype=np.int64), 0)
    b = len(lens)
    split_len = step_split_len(int(lens.sum()), b, cfg, num_kv_heads)
    n = np.clip(-(-lens // split_len), 1, cfg.max_row_splits(num_kv_heads))  # (B,)
    extra = n - 1
    num_extra = int(extra.sum())  # <= sum(lens) / split_len <= extra_items, by the split length's choice
    items = b + num_extra
    cap = items if items_cap is None else items_cap
    if cap < items:
        raise AssertionError(f"{items} decode splits > the grid's {cap}")  # extra_items' bound is wrong
    rows_cap = _align16(max(b, 1))
    table = np.zeros(split_table_numel(b, cap), dtype=np.int32)
    rows = table[: 2 * b].reshape(b, 2)
    rows[:, 0] = n
    first_extra = b + np.cumsum(extra) - extra  # (B,) item index of each request's second split
    rows[:, 1] = first_extra
    its = table[2 * rows_cap :].reshape(-1, 2)
    its[:b, 0] = np.arange(b)
    its[:b, 1] = 0
    owner = np.repeat(np.arange(b), extra)  # (num_extra,)
    its[b:items, 0] = owner
    its[b:items, 1] = np.arange(b, items) - np.repeat(first_extra, extra) + 1
    its[items:, 0] = -1
    its[items:, 1] = 0
    return SplitPlan(table, 2 * rows_cap, cap, int(n.max(initial=1)))
