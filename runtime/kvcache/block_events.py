"""The radix tree's changes as KV events over fixed-size blocks, in vLLM's event format.

An external router (the Gateway API Inference Extension's endpoint pickers, llm-d, the vLLM router)
keeps, per server, the set of token blocks the server holds, keyed by a chained block hash, and sends
a request where most of its blocks are. It learns that set from three events: BlockStored (new blocks,
with their hashes, their parent block's hash and their token ids), BlockRemoved and AllBlocksCleared.

The tree caches token paths; its edges start and end wherever requests diverged (any page), so blocks
are laid over paths, not edges: block j of a path is its tokens [j * B, (j + 1) * B). A path's
complete blocks are cached while the path is. The edge from depth d0 to d1 *owns* the blocks that end
in (d0, d1]: added when the edge is added, removed when it is evicted. A split moves ownership between
the two halves of an edge but changes no path, so it is no event; a leaf evicted takes the blocks that
end inside it (its parent's path no longer holds them whole).

Block hashes chain like vLLM's: sha256 over the parent block's hash and the block's token ids, cut to
63 bits (an int both a signed and an unsigned 64-bit reader take), so equal prefixes on any replica
hash equally.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any, Optional, Protocol

# NOTE: vLLM's own cache is on the GPU and its events say so; a consumer that reads `medium` to tell
# tiers apart sees where plait's cache is.
MEDIUMS = ("GPU", "CPU")


class CacheNode(Protocol):
    @property
    def key(self) -> tuple: ...  # token ids of the edge from `parent`

    @property
    def parent(self) -> Optional["CacheNode"]: ...


class CacheEventListener(Protocol):
    """What the radix tree tells as it changes (on the scheduler thread). `stored(node)`: a new edge, its
    path complete from the root; `removed(node)`: a leaf about to be evicted (its path still attached);
    `cleared()`: everything dropped."""

    def stored(self, node: CacheNode) -> None: ...

    def removed(self, node: CacheNode) -> None: ...

    def cleared(self) -> None: ...


def block_hash(parent: Optional[int], token_ids: tuple) -> int:
    """The chained hash of one block: its parent block's hash (None for a path's first) and its ids."""
    digest = hashlib.sha256()
    digest.update(b"-" if parent is None else parent.to_bytes(8, "big"))
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return int.from_bytes(digest.digest()[:8], "big") >> 1


def path_tokens(node: CacheNode) -> tuple:
    """The token ids a node's path spells from the root."""
    keys = []
    above: Optional[CacheNode] = node
    while above is not None:
        keys.append(above.key)
        above = above.parent
    return tuple(t for key in reversed(keys) for t in key)


class BlockEvents:
    """A `CacheEventListener` that records the tree's changes as vLLM's KV events (dicts in its wire
    field order), taken by the publisher once per scheduler step (`take`)."""

    def __init__(self, block_size: int, medium: str = "GPU") -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if medium not in MEDIUMS:
            raise ValueError(f"medium must be one of {list(MEDIUMS)}, got {medium!r}")
        self.block_size = block_size
        self.medium = medium
        self._events: list[dict[str, Any]] = []

    def stored(self, node: CacheNode) -> None:
        parent, hashes, tokens = self._owned_blocks(node)
        if hashes:
            self._events.append(
                {
                    "type": "BlockStored",
                    "block_hashes": hashes,
                    "parent_block_hash": parent,
                    "token_ids": tokens,
                    "block_size": self.block_size,
                    "lora_id": None,
                    "medium": self.medium,
                    "lora_name": None,
                }
            )

    def removed(self, node: CacheNode) -> None:
        hashes = self._owned_blocks(node)[1]
        if hashes:
            self._events.append({"type": "BlockRemoved", "block_hashes": hashes, "medium": self.medium})

    def cleared(self) -> None:
        # Nothing recorded before a reset matters to a consumer that is told everything went.
        self._events = [{"type": "AllBlocksCleared"}]

    def take(self) -> list[dict[str, Any]]:
        """The events since the last take, oldest first."""
        events, self._events = self._events, []
        return events

    def _owned_blocks(self, node: CacheNode) -> tuple[Optional[int], list[int], list[int]]:
        """The blocks ending inside `node`'s edge: (the hash of the block before the first of them, or
        None; their hashes; their token ids)."""
        tokens = path_tokens(node)
        b = self.block_size
        end = len(tokens)
        first, last = (end - len(node.key)) // b, end // b  # blocks [first, last)
        if first >= last:
            return None, [], []
        parent = None
        for j in range(first):  # the chain up to the first owned block
            parent = block_hash(parent, tokens[j * b : (j + 1) * b])
        before, hashes = parent, []
        for j in range(first, last):
            parent = block_hash(parent, tokens[j * b : (j + 1) * b])
            hashes.append(parent)
        return before, hashes, list(tokens[first * b : last * b])
