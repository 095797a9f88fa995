"""Facts about the vocabulary that the closing search, the repeated-key mask and the budget guard look
up on every step, computed once per grammar backend from its `TokenizerVocab`.

- `byte_token[b]`: a token spelling exactly the byte b (the search walks the grammar byte by byte).
- `with_prefix(prefix)`: every token whose bytes start with `prefix` (sorted table, bisect).
- `multi_quote_ids`: tokens with two or more '"' (the only ones that can open and close a key at once).
- `stops`: the (W,) int32 bitmask row of the stop tokens; `row_of(ids)` any other.
"""

from __future__ import annotations

import bisect
from typing import Optional

import torch

from .bitmask import bitmask_width
from .vocab import TokenizerVocab

# How many texts `encode` remembers (short completions: a few hundred bytes each at most).
ENCODED_TEXTS = 4096


def _row(vocab_size: int, ids: list[int]) -> torch.Tensor:
    """(W,) int32 bitmask row with the bits of `ids` set."""
    allowed = torch.zeros(bitmask_width(vocab_size) * 32, dtype=torch.int64)
    allowed[torch.tensor(ids, dtype=torch.long)] = 1
    words = (allowed.view(-1, 32) << torch.arange(32, dtype=torch.int64)).sum(dim=1)  # (W,) as uint32 values
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


class TokenTables:
    def __init__(self, vocab: TokenizerVocab) -> None:
        self.vocab = vocab
        self.tokenizer = vocab.tokenizer
        decoded = vocab.decoded
        self.byte_token: list[Optional[int]] = [None] * 256
        for token_id, data in enumerate(decoded):
            if len(data) == 1 and self.byte_token[data[0]] is None:
                self.byte_token[data[0]] = token_id
        self._by_bytes: dict[bytes, int] = {}
        for token_id, data in enumerate(decoded):
            if data:
                self._by_bytes.setdefault(data, token_id)
        entries = sorted((data, token_id) for token_id, data in enumerate(decoded) if data)
        self._sorted_bytes = [data for data, _ in entries]
        self._sorted_ids = [token_id for _, token_id in entries]
        self.multi_quote_ids = tuple(i for i, data in enumerate(decoded) if data.count(b'"') >= 2)
        self.stops = _row(vocab.vocab_size, list(vocab.stop_token_ids))
        self._encoded: dict[bytes, Optional[tuple[int, ...]]] = {}  # `encode`'s results, oldest use first

    def row_of(self, ids: list[int]) -> torch.Tensor:
        """(W,) int32 bitmask row with the bits of `ids` set."""
        return _row(self.vocab.vocab_size, ids)

    def token_of(self, data: bytes) -> Optional[int]:
        """A token spelling exactly `data`, or None."""
        return self._by_bytes.get(data)

    def with_prefix(self, prefix: bytes) -> list[int]:
        """Ids of the tokens whose bytes start with `prefix`."""
        lo = bisect.bisect_left(self._sorted_bytes, prefix)
        out = []
        for i in range(lo, len(self._sorted_bytes)):
            if not self._sorted_bytes[i].startswith(prefix):
                break
            out.append(self._sorted_ids[i])
        return out

    def encode(self, text: bytes) -> Optional[list[int]]:
        """The tokenizer's ids for `text` if they spell exactly it, else None (a new list each call).

        NOTE: remembered by text (ENCODED_TEXTS, least recently used out): the budget closer encodes the same
        short completions ("-01-01", '"}') for every row of a batch on every step, and a tokenizer call
        costs ~50 us."""
        if text in self._encoded:
            ids = self._encoded.pop(text)  # (re-inserted below: most recently used last)
        else:
            ids = self._encode(text)
            if len(self._encoded) >= ENCODED_TEXTS:
                del self._encoded[next(iter(self._encoded))]
        self._encoded[text] = ids
        return None if ids is None else list(ids)

    def _encode(self, text: bytes) -> Optional[tuple[int, ...]]:
        try:
            string = text.decode("utf-8")
        except UnicodeDecodeError:
            return None
        ids = tuple(self.tokenizer.encode(string, add_special_tokens=False))
        if b"".join(self.vocab.decoded[i] if i < len(self.vocab.decoded) else b"?" for i in ids) != text:
            return None
        return ids

    def spell(self, text: bytes) -> Optional[list[int]]:
        """One byte token per byte of `text`, or None if some byte has no token of its own."""
        ids = [self.byte_token[b] for b in text]
        return None if any(i is None for i in ids) else ids
