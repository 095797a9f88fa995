"""Token ids as radix-tree keys (tuples of ints), their page arithmetic, and the checks on what the scheduler
inserts.

Separate from radix_cache.py because it is one concept: accepting the caller's ids (lists of ints as
the scheduler holds them, tensors, other sequences) and converting only the part that is needed.
"""

from __future__ import annotations

from typing import Sequence

import torch


def as_key(token_ids: Sequence[int] | torch.Tensor) -> tuple:
    if isinstance(token_ids, torch.Tensor):
        return tuple(token_ids.reshape(-1).tolist())
    if type(token_ids) in (list, tuple) and (not token_ids or type(token_ids[0]) is int):
        # NOTE: the scheduler's lists of ints (validated at intake): converting each element again
        # was paid for every ranked, admitted and finished request.
        return tuple(token_ids)
    try:
        return tuple(int(t) for t in token_ids)
    except (TypeError, ValueError) as e:
        raise TypeError(f"token_ids must be a sequence of ints, got {type(token_ids).__name__}: {e}") from None


def key_slice(token_ids, lo: int, hi: int) -> tuple:
    """`token_ids[lo:hi]` as a key, converting only that part."""
    if isinstance(token_ids, torch.Tensor):
        return as_key(token_ids.reshape(-1)[lo:hi])
    if type(token_ids) in (list, tuple):
        return as_key(token_ids[lo:hi])
    return as_key(token_ids)[lo:hi]


def checked_pair(token_ids, kv_indices) -> tuple[int, torch.Tensor]:
    """(number of tokens, kv slots as a flat int64 CPU tensor) after checking that they correspond.

    NOTE: the ids are converted by the caller, only the part it inserts."""
    if isinstance(token_ids, torch.Tensor):
        num = token_ids.numel()
    elif type(token_ids) in (list, tuple):
        num = len(token_ids)
    else:
        num = len(as_key(token_ids))
    if not isinstance(kv_indices, torch.Tensor):
        raise TypeError(f"kv_indices must be a torch.Tensor, got {type(kv_indices).__name__}")
    if kv_indices.dim() == 1 and kv_indices.dtype == torch.int64 and kv_indices.device.type == "cpu":
        kv = kv_indices  # as the scheduler passes them (two tensor ops fewer per insert)
    else:
        kv = kv_indices.reshape(-1).to("cpu", torch.int64)
    if kv.numel() != num:
        raise ValueError(
            f"kv_indices has {kv.numel()} slots but token_ids has {num} tokens; they must correspond one to one"
        )
    return num, kv


def aligned(n: int, page_size: int) -> int:
    """`n` tokens rounded down to whole pages (the tree holds whole pages only)."""
    return n - n % page_size


def child_key(key: tuple, pos: int, page_size: int):
    """What a node's parent files it under: the first token (page size 1) or first page of `key[pos:]`."""
    return key[pos] if page_size == 1 else key[pos : pos + page_size]


def common_len(node_key: tuple, key: tuple, start: int, page_size: int) -> int:
    """Tokens shared by `node_key` and `key[start:]`, rounded down to whole pages."""
    n = min(len(node_key), len(key) - start)
    if key[start : start + n] == node_key[:n]:  # fast path: C-level tuple compare
        m = n
    else:
        m = 0
        while node_key[m] == key[start + m]:
            m += 1
    return m - m % page_size
