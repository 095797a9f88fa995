"""Token bitmasks: allocate once per batch, fill per constrained row, apply in place to the logits.

Layout: int32 (B, W) with W = ceil(V / 32); bit j of word w allows token 32 * w + j. Both grammar
backends write this layout. Rows of unconstrained requests are neither filled nor applied: the
caller passes only the constrained row indices, so a free request in a mixed batch pays nothing.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

Rows = Union[Sequence[int], torch.Tensor]


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_token_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    """(batch, ceil(vocab_size / 32)) int32 CPU tensor, all bits set (everything allowed).

    CPU because the matchers fill it on the host; pinned where a GPU exists so the copy to the
    logits' device can be non-blocking."""
    if batch < 0 or vocab_size < 1:
        raise ValueError(f"bad bitmask shape: batch={batch}, vocab_size={vocab_size}")
    return torch.full((batch, bitmask_width(vocab_size)), -1, dtype=torch.int32, pin_memory=torch.cuda.is_available())


def _bit_positions(device: torch.device) -> torch.Tensor:
    return torch.arange(32, dtype=torch.int32, device=device)  # (32,)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(R, W) int32 -> (R, vocab_size) bool, True = allowed (tokens past W * 32 are disallowed)."""
    rows, width = bitmask.shape
    bits = (bitmask.unsqueeze(-1) >> _bit_positions(bitmask.device)) & 1  # (R, W, 32)
    allowed = bits.view(rows, width * 32).bool()  # (R, W*32)
    if vocab_size <= width * 32:
        return allowed[:, :vocab_size]
    pad = torch.zeros((rows, vocab_size - width * 32), dtype=torch.bool, device=bitmask.device)
    return torch.cat([allowed, pad], dim=1)


def allowed_ids(row: torch.Tensor) -> torch.Tensor:
    """The tokens a (W,) int32 row of bits allows, ascending (int64, on the row's device). Reads only the
    row's nonzero words: a grammar state that allows a few tokens costs a few words, not the vocabulary."""
    return set_bits(row.unsqueeze(0))[1]


def set_bits(bitmask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every allowed (row, token) of (R, W) int32 bits: (rows, token ids), int64, by row then token. Reads
    only the nonzero words."""
    at = bitmask.nonzero()  # (k, 2) (row, word) of each nonzero word
    bits = (bitmask[at[:, 0], at[:, 1]].unsqueeze(1) >> _bit_positions(bitmask.device)) & 1  # (k, 32)
    word, bit = bits.nonzero(as_tuple=True)
    return at[word, 0], at[word, 1] * 32 + bit


def bits_at(bitmask: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """(R, n) bool: whether each row of (R, W) int32 bits allows each of the tokens `ids` (n,) int64."""
    words = bitmask.index_select(1, ids >> 5)  # (R, n): the word holding each token's bit
    return ((words >> (ids & 31).to(torch.int32)) & 1).bool()


def single_token(row: torch.Tensor) -> Optional[int]:
    """The one token a (W,) int32 row of bits allows, or None (none, or two or more)."""
    ids = allowed_ids(row)
    return int(ids[0]) if ids.numel() == 1 else None


def allow(row: torch.Tensor, token_id: int) -> None:
    """Set token `token_id`'s bit in a (W,) int32 row."""
    bit = token_id & 31
    row[token_id >> 5] |= (1 << bit) - (1 << 32) if bit == 31 else (1 << bit)


def apply_token_bitmask_inplace(logits: torch.Tensor, bitmask: torch.Tensor, rows: Rows) -> None:
    """Set disallowed logits to -inf, in place, for the given batch rows only.

    logits: float (B, V) on any device; bitmask: int32 (B, W) (any device; moved to the logits').
    Columns of V beyond the bitmask's W * 32 (padded model vocabulary) are masked off too.
    Rows not listed are untouched."""
    if logits.dim() != 2 or bitmask.dim() != 2:
        raise ValueError(f"expected 2-D logits and bitmask, got {tuple(logits.shape)} and {tuple(bitmask.shape)}")
    if bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32, got {bitmask.dtype}")
    if bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"bitmask has {bitmask.shape[0]} rows but logits have {logits.shape[0]}")
    index = torch.as_tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True)
    if index.numel() == 0:
        return
    vocab = logits.shape[1]
    masks = bitmask.to(logits.device, non_blocking=True).index_select(0, index)  # (R, W)
    allowed = unpack_bitmask(masks, vocab)  # (R, V)
    selected = logits.index_select(0, index)  # (R, V)
    selected.masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, index, selected)
