"""A radix tree's node: an edge of token ids and where their K/V live, on the device, in the host tier, or both.

Separate from radix_cache.py because the hierarchical cache (hiradix_cache.py) shares it: a node's tier is
which of `value` (device kv slots) and `host_value` (host-tier slots) it holds. A plain RadixCache only ever
sets `value`.
"""

from __future__ import annotations

from typing import Optional

import torch


class TreeNode:
    __slots__ = ("key", "value", "host_value", "children", "parent", "lock_ref", "last_access")

    def __init__(
        self, key: tuple, value: Optional[torch.Tensor], parent: Optional["TreeNode"], last_access: int
    ) -> None:
        self.key = key  # token ids on the edge from `parent` to this node
        self.value = value  # (len(key),) int64 device kv slots; None: evicted to the host tier
        self.host_value: Optional[torch.Tensor] = None  # (len(key),) int64 host-tier slots, when backed up
        self.children: dict = {}  # first page of the child's key -> child
        self.parent = parent
        self.lock_ref = 0
        self.last_access = last_access

    @property
    def on_device(self) -> bool:
        return self.value is not None

    def __repr__(self) -> str:
        tier = ("D" if self.value is not None else "") + ("H" if self.host_value is not None else "")
        return f"TreeNode(len={len(self.key)}, tier={tier}, lock_ref={self.lock_ref}, children={len(self.children)})"


def split_slots(slots: Optional[torch.Tensor], m: int) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """A node's slots cut after `m` tokens (copies, so neither half keeps the other alive); None stays None."""
    if slots is None:
        return None, None
    return slots[:m].clone(), slots[m:].clone()
