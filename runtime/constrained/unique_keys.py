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

Where the grammar restricts names (a pattern, propertyNames), a key can also be *forced* to end as a
used one: after `"m` a one-character name pattern leaves only `"`. So the tokens that spell a used key's
next bytes (a handful: the prefixes of what is left of it) are looked ahead: one whose text the
grammar then forces on to the end of a used key is masked too. `closes_repeated_key` lets jump-forward
refuse forced text that would still end in a repeated key; if a mask is left with nothing, the
grammar's own row is kept (a repeated key rather than no token at all) and `unavoidable` counts it.
"""

from __future__ import annotations

import torch

from .base import GrammarMatcher
from .json_scan import IN_KEY, KEY, OBJECT_START, JsonScanner
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
        self.unavoidable = 0  # masks that only a repeated key could continue (the grammar's row was kept)

    def apply(self, scanner: JsonScanner, row: torch.Tensor, matcher: GrammarMatcher) -> None:
        """Clear, in the (W,) int32 bitmask `row` of `matcher`'s next token, the tokens that would
        repeat a key."""
        if not scanner.depth:
            return
        before = row.clone()
        self._block(scanner, row, matcher)
        if not bool(row.any()):
            row.copy_(before)
            self.unavoidable += 1

    def closes_repeated_key(self, scanner: JsonScanner, text: bytes) -> bool:
        probe = JsonScanner.from_snapshot(scanner.snapshot())
        probe.feed(text)
        return probe.repeated_key

    def _block(self, scanner: JsonScanner, row: torch.Tensor, matcher: GrammarMatcher) -> None:
        context = scanner.context
        if context in (IN_KEY, KEY, OBJECT_START):
            # What is left to write of each used key from here ('"' first before the key has begun).
            current = scanner.key if context == IN_KEY else None
            keys = scanner.current_keys()
            rests = [
                used[len(current) :] if current is not None else b'"' + used
                for used in keys
                if current is None or used.startswith(current)
            ]
            for rest in rests:
                if current is not None:
                    row &= ~self._prefix_row(rest + b'"')
                self._block_forced(row, matcher, rest)
        if not len(self._multi_ids):
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

    def _block_forced(self, row: torch.Tensor, matcher: GrammarMatcher, rest: bytes) -> None:
        """Mask the allowed tokens spelling the start of `rest` after which the grammar forces the rest of
        a used key (and its closing quote)."""
        for n in range(1, len(rest) + 1):
            token = self.tables.token_of(rest[:n])
            if token is None or not (int(row[token >> 5]) >> (token & 31)) & 1:
                continue
            if not matcher.accept_token(token):
                continue
            forced = matcher.jump_forward_string() or ""
            matcher.rollback(1)
            if forced.encode("utf-8").startswith(rest[n:] + b'"'):
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
