"""Host side of shared-prefix ("cascade") decode attention: which groups, how split, in what tables.

Per decode step the backend asks a `CascadePlanner` for a `CascadePlan`: the prefix groups of the
batch (`prefix_groups.py`) turned into the int32 tables the kernels read (`prefix_attention.py`),
packed into one array so that a step uploads them with a single copy.

Caching (the step's host time matters at batch 256-1,024): while no EXTEND step ran (the backend
calls `invalidate()` on each; only they write the prefix positions of req_to_token rows), a decode
batch's requests keep their rows' contents except for appended tokens, so a group's shared prefix
stays valid while its members stay. Hence:
- the same rows as last step: the last plan is reused as it is (the backend skips the upload too);
- a subset of last step's rows (requests finished): last step's groups, minus the rows that left;
- anything else (new requests, an EXTEND step since): the groups are found again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from .prefix_groups import PrefixGroup, find_prefix_groups
from .triton_ops.prefix_attention import GROUP_FIELDS, WORK_FIELDS, PrefixConfig, PrefixTables


@dataclass(frozen=True)
class CascadeConfig:
    """When the shared-prefix kernel is used (see TritonAttnBackend; thresholds reasoned below)."""

    # NOTE: a group's saving is (members - 1) * prefix tokens of KV per KV head; its cost is a tile
    # program per 16 members and, per member and prefix split, a partial of GQA x (head_dim + 1) fp32
    # written and read back (about 2 x GQA = 8 tokens' worth of KV at Llama's shape). A 64-token
    # prefix (two KV blocks) shared by two requests already saves more than it costs.
    min_prefix_len: int = 64
    min_group_size: int = 2
    # Whole batch: below this many KV tokens saved (per KV head) the plain split-KV decode runs. 4,096
    # tokens is 8 MB of K/V per layer at the 8B shape, about what the extra
    # launch and the partials' round trip cost.
    min_saved_tokens: int = 4096
    # Decode graphs below this batch size never get the cascade kernels: a batch-1 step keeps exactly
    # its kernels, and small batches split every request's KV many ways already (their prefix reads
    # mostly hit L2).
    min_batch_size: int = 16

    def __post_init__(self):
        if self.min_prefix_len < 1 or self.min_group_size < 2 or self.min_saved_tokens < 0:
            raise ValueError("min_prefix_len must be >= 1, min_group_size >= 2 and min_saved_tokens >= 0")
        if self.min_batch_size < 2:
            raise ValueError(f"min_batch_size must be >= 2, got {self.min_batch_size}")


def _align(n: int) -> int:
    return -(-n // 16) * 16  # 64-byte sections: the kernels see aligned table pointers


@dataclass(frozen=True)
class CascadeLayout:
    """Where each table lives in one int32 array, for `batch_size` rows (graphs: the padded size).

    work_len (1) | req_info (batch, 3) | groups (max_groups, GROUP_FIELDS) | members (batch) | work
    (max_work, WORK_FIELDS). A captured graph's grid is (max_work, KV heads).
    """

    batch_size: int
    max_groups: int
    max_work: int

    @property
    def req_info_at(self) -> int:
        return 16

    @property
    def groups_at(self) -> int:
        return self.req_info_at + _align(3 * self.batch_size)

    @property
    def members_at(self) -> int:
        return self.groups_at + _align(GROUP_FIELDS * self.max_groups)

    @property
    def work_at(self) -> int:
        return self.members_at + _align(self.batch_size)

    @property
    def numel(self) -> int:
        return self.work_at + _align(WORK_FIELDS * self.max_work)

    def views(self, buf: torch.Tensor) -> PrefixTables:
        """The kernels' views of a packed int32 buffer of >= numel elements (host or device)."""
        if buf.dtype != torch.int32 or buf.numel() < self.numel:
            raise ValueError(f"cascade tables need int32 x >= {self.numel}, got {buf.dtype} x {buf.numel()}")
        b = self.batch_size
        return PrefixTables(
            groups=buf[self.groups_at : self.groups_at + GROUP_FIELDS * self.max_groups].view(-1, GROUP_FIELDS),
            members=buf[self.members_at : self.members_at + b],
            work=buf[self.work_at : self.work_at + WORK_FIELDS * self.max_work].view(-1, WORK_FIELDS),
            work_len=buf[0:1],
            req_info=buf[self.req_info_at : self.req_info_at + 3 * b].view(b, 3),
        )


@dataclass
class CascadePlan:
    groups: list[PrefixGroup]
    layout: CascadeLayout
    packed: np.ndarray  # (layout.numel,) int32: the tables, ready to upload
    num_work: int
    num_partials: int  # prefix partial slots written
    saved_tokens: int
    partial_slots: Optional[int]  # the bound it was planned under (None: none)


class CascadePlanner:
    """Plans per step; caches the grouping while the batch's requests stay (see the module docstring)."""

    def __init__(self, config: CascadeConfig, prefix_config: PrefixConfig, num_heads: int, num_kv_heads: int):
        self.config = config
        self.prefix_config = prefix_config
        self.members_per_tile = prefix_config.members_per_tile(num_heads // num_kv_heads)
        self.target_work = -(-prefix_config.target_programs // num_kv_heads)  # work items x KV heads
        self._rows: Optional[np.ndarray] = None  # the batch the cached groups are for
        self._groups: list[PrefixGroup] = []
        self._row_group: Optional[np.ndarray] = None  # (table rows,) group index; -1 ungrouped, -2 absent
        self._plan: Optional[CascadePlan] = None  # last plan, for the same rows and layout
        self.recomputes = 0  # times the groups were found from the table (tests, benchmarks)

    def layout(self, batch_size: int) -> CascadeLayout:
        max_groups = max(1, batch_size // self.config.min_group_size)
        max_work = max(self.target_work, max_groups + -(-batch_size // self.members_per_tile))
        return CascadeLayout(batch_size, max_groups, max_work)

    def invalidate(self) -> None:
        """Rows' prefixes may have changed (an EXTEND step ran): forget every cached grouping."""
        self._rows = self._row_group = self._plan = None
        self._groups = []

    def plan(
        self,
        table: np.ndarray,
        rows: np.ndarray,
        seq_lens: np.ndarray,
        layout: CascadeLayout,
        partial_slots: Optional[int] = None,
    ) -> Optional[CascadePlan]:
        """The plan for a decode batch (rows of req_to_token, lengths including the new token), or
        None when no group pays. `partial_slots` bounds the prefix partials (a fixed scratch)."""
        rows = np.asarray(rows, dtype=np.int64)
        if len(rows) > layout.batch_size:
            raise ValueError(f"{len(rows)} requests do not fit a cascade layout for {layout.batch_size}")
        if partial_slots is not None and partial_slots < layout.batch_size:
            raise ValueError(f"partial_slots {partial_slots} < batch size {layout.batch_size}")
        last = self._plan
        if (
            last is not None
            and last.layout == layout
            and last.partial_slots == partial_slots
            and self._rows is not None
            and len(rows) == len(self._rows)
            and np.array_equal(rows, self._rows)
        ):
            return last
        groups = self._groups_for(table, rows, seq_lens)
        self._plan = None
        if sum(g.saved_tokens for g in groups) < max(1, self.config.min_saved_tokens):
            return None
        self._plan = build_plan(
            groups, rows, layout, self.members_per_tile, self.target_work, self.prefix_config, partial_slots
        )
        return self._plan

    def _groups_for(self, table, rows, seq_lens) -> list[PrefixGroup]:
        if self._rows is not None and len(rows) == len(self._rows) and np.array_equal(rows, self._rows):
            return self._groups
        gid = self._row_group[rows] if self._row_group is not None else None
        if gid is not None and (gid >= -1).all():  # requests left, none came: last groups, restricted
            groups = _restrict(self._groups, gid, self.config.min_group_size)
        else:
            lens = np.asarray(seq_lens, dtype=np.int64) - 1  # the new token's slot is the request's own
            groups = find_prefix_groups(table, rows, lens, self.config.min_prefix_len, self.config.min_group_size)
            self.recomputes += 1
        self._rows, self._groups = rows.copy(), groups
        self._row_group = np.full(table.shape[0], -2, dtype=np.int64)
        self._row_group[rows] = -1
        for k, g in enumerate(groups):
            self._row_group[rows[g.members]] = k
        return groups


def _restrict(groups: list[PrefixGroup], gid: np.ndarray, min_group_size: int) -> list[PrefixGroup]:
    """Last step's groups over this step's batch (gid: (B,) each request's old group, -1 none)."""
    grouped = np.flatnonzero(gid >= 0)
    order = grouped[np.argsort(gid[grouped], kind="stable")]  # by group, ascending batch index within
    keys = gid[order]
    starts = np.flatnonzero(np.concatenate(([True], keys[1:] != keys[:-1])))
    ends = np.append(starts[1:], len(keys))
    out = [
        PrefixGroup(groups[keys[s]].prefix_len, order[s:e])
        for s, e in zip(starts.tolist(), ends.tolist())
        if e - s >= min_group_size
    ]
    out.sort(key=lambda g: -g.saved_tokens)
    return out


def build_plan(
    groups: list[PrefixGroup],
    rows: np.ndarray,
    layout: CascadeLayout,
    members_per_tile: int,
    target_work: int,
    cfg: PrefixConfig,
    partial_slots: Optional[int] = None,
) -> CascadePlan:
    """Tables for the kernels: tiles of `members_per_tile`, prefixes split to reach `target_work`
    work items (when there are fewer tiles) in BLOCK_N-aligned, non-empty splits."""
    groups = groups[: layout.max_groups]
    n = np.array([len(g.members) for g in groups], dtype=np.int64)  # (G,)
    prefix = np.array([g.prefix_len for g in groups], dtype=np.int64)  # (G,)
    tiles = -(-n // members_per_tile)  # (G,)
    factor = max(1, target_work // max(1, int(tiles.sum())))
    while True:
        splits = np.minimum(np.minimum(factor, cfg.max_splits), np.maximum(1, prefix // cfg.min_split_len))
        split_len = _cdiv(_cdiv(prefix, splits), cfg.block_n) * cfg.block_n  # cdiv(P, s) rounded up to BLOCK_N
        splits = -(-prefix // split_len)  # no empty split after the rounding
        if partial_slots is None or int((n * splits).sum()) <= partial_slots or factor == 1:
            break
        factor //= 2
    num_work = int((tiles * splits).sum())
    if num_work > layout.max_work:
        raise AssertionError(f"cascade work list {num_work} > {layout.max_work}")  # the layout's bound is wrong

    member_start = np.cumsum(n) - n
    slot_count = n * splits
    slot_base = np.cumsum(slot_count) - slot_count
    members = np.concatenate([g.members for g in groups]) if groups else np.zeros(0, np.int64)  # (M,)
    local = np.arange(len(members)) - np.repeat(member_start, n)  # (M,) index within the group

    packed = np.zeros(layout.numel, dtype=np.int32)
    packed[0] = num_work
    req_info = packed[layout.req_info_at : layout.req_info_at + 3 * layout.batch_size].reshape(-1, 3)
    req_info[members, 0] = np.repeat(prefix, n)
    req_info[members, 1] = np.repeat(slot_base, n) + local * np.repeat(splits, n)
    req_info[members, 2] = np.repeat(splits, n)
    table = packed[layout.groups_at : layout.groups_at + GROUP_FIELDS * len(groups)].reshape(-1, GROUP_FIELDS)
    table[:] = np.stack(
        [member_start, n, prefix, rows[members[member_start]] if len(groups) else n, split_len, splits, slot_base],
        axis=1,
    )
    packed[layout.members_at : layout.members_at + len(members)] = members
    per_group = tiles * splits  # (G,) work items
    g_of = np.repeat(np.arange(len(groups)), per_group)  # (W,)
    k = np.arange(num_work) - np.repeat(np.cumsum(per_group) - per_group, per_group)
    work = packed[layout.work_at : layout.work_at + WORK_FIELDS * num_work].reshape(-1, WORK_FIELDS)
    work[:, 0] = g_of
    work[:, 1] = k // splits[g_of]
    work[:, 2] = k % splits[g_of]
    return CascadePlan(
        groups, layout, packed, num_work, int(slot_count.sum()), int(sum(g.saved_tokens for g in groups)), partial_slots
    )


def _cdiv(a, b):
    """Ceiling division (ints or int arrays)."""
    return -(-a // b)
