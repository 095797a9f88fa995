"""No repeated keys: mask the tokens that would write a property name its object already has.

A JSON object with the same key twice parses to the last one only, and it is where small models'
loops start (`{"type":"string","required":"field","type":"string",...`). xgrammar already lets a
declared property appear at most once (and keeps declared names out of the additional ones), but
additional property names, any-JSON objects and outlines' regexes admit repeats; a grammar cannot
exclude them without spelling out every set of names. So the mask is cut at run time, from the
`JsonScanner`'s view of the text:

- inside a key string, with `cur` written so far: every token starting with `used[len(cur):] + '"'`
  for a key `used` of this object that starts with `cur` (a sorted-vocabulary prefix lookup);
- and, inside any object, the few allowed tokens with two or more quotes (the only ones that can open
  and close a key at once) are scanned from the current state, and those that would close a
  repeated key are masked.
Exact for every tokenization: a key is either closed inside one token that also opened it (second
case) or by a token that starts inside it (first case).
"""

from __future__ import annotations

import torch

from .json_scan import IN_KEY, JsonScanner
from .token_tables import TokenTables

_CACHE_LIMIT = 4096


class RepeatedKeyMask:
    """Shared by the requests of one backend (a cache of prefix rows); stateless per request."""

    def __init__(self, tables: TokenTables) -> None:
        self.tables = tables
        ids = torch.tensor(tables.multi_quote_ids, dtype=torch.long)
        self._multi_ids = ids
        self._multi_words = ids >> 5  # (Q,)
        self._multi_bits = (ids & 31).to(torch.int32)  # (Q,)
        self._rows: dict[bytes, torch.Tensor] = {}

    def apply(self, scanner: JsonScanner, row: torch.Tensor) -> None:
        """Clear, in the (W,) int32 bitmask `row`, the tokens that would repeat a key."""
        if scanner.context == IN_KEY:
            current = scanner.key
            for used in scanner.current_keys():
                if used.startswith(current):
                    row &= ~self._prefix_row(used[len(current):] + b'"')
        if not scanner.depth or not len(self._multi_ids):
            return
        allowed = ((row[self._multi_words] >> self._multi_bits) & 1).nonzero().flatten().tolist()
        if not allowed:
            return
        snap = scanner.snapshot()
        probe = JsonScanner()
        decoded = self.tables.vocab.decoded
        for i in allowed:
            token = int(self._multi_ids[i])
            probe.restore(snap)
            probe.feed(decoded[token])
            if probe.repeated_key:
                row[token >> 5] &= ~_bit(token & 31)

    def _prefix_row(self, prefix: bytes) -> torch.Tensor:
        row = self._rows.get(prefix)
        if row is None:
            if len(self._rows) >= _CACHE_LIMIT:
                self._rows.clear()
            row = self._rows[prefix] = self.tables.row_of(self.tables.with_prefix(prefix))
        return row


def _bit(i: int) -> int:
    return (1 << i) - (1 << 32) if i == 31 else (1 << i)  # int32 two's complement for bit 31
