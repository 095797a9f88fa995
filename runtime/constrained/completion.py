"""The shortest valid completion of a constrained output, found with the request's own grammar matcher.

`CompletionSearch.find(matcher, scanner, hints)` returns a `Completion`: bytes that take the matcher
from where it stands to a point where the grammar may end, and the tokens spelling them. It works
for any schema, regex or grammar, because the grammar matcher itself decides what is allowed; the
matcher is walked ahead and rolled back, so it ends where it started. In order, cheapest first:

1. hints: texts that completed an earlier state of the same request (the previous completion, or
   what is left of it once the model wrote its first bytes); a string's content or a number's
   digits rarely change how the text must end. Verified by accepting their tokens.
2. the JSON closers (`JsonScanner.closing_text`: close the string, the literal, every container),
   when the schema needs nothing more there.
3. a search, byte by byte (one single-byte token per step), that consumes the text the grammar
   forces (keys of required properties, separators) without branching. JSON text: depth first,
   trying the bytes that end things first in each context ('"' in a string, '}' after a value, '0'
   where a value starts); a byte that would repeat a key is skipped. Other grammars: iterative
   deepening (shortest in branching bytes), then depth first once that runs out of nodes (a pattern
   like [a-z]{5} has too many short candidates to enumerate).
Every search is bounded (`max_nodes` grammar steps); None means no completion was found within it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Optional, Sequence

import torch

from .base import GrammarMatcher
from .bitmask import bitmask_width
from .json_scan import (
    AFTER_IN_ARRAY,
    AFTER_IN_OBJECT,
    ARRAY_START,
    BROKEN,
    COLON,
    IN_KEY,
    IN_LITERAL,
    IN_STRING,
    KEY,
    OBJECT_START,
    VALUE,
    JsonScanner,
)
from .token_tables import TokenTables

MEMO_STATES = 4096  # search results kept by state, least recently used out (a few hundred bytes each)
_VALUE_START = b'0"[{ntf-123456789'
# The bytes tried first in each context: those that end something, then the shortest content. NOTE: '1'
# before '0' inside strings: a date, time or uuid spelled with ones is a real one (year 0000 is not).
_FIRST = {
    IN_STRING: b'"a1',
    IN_KEY: b'"a1',
    IN_LITERAL: b"}],",
    VALUE: _VALUE_START,
    ARRAY_START: b"]" + _VALUE_START,
    OBJECT_START: b'}"',
    KEY: b'"',
    COLON: b":",
    AFTER_IN_OBJECT: b"},",
    AFTER_IN_ARRAY: b"],",
}
# Every other byte, in the order a completion would rather use them (whitespace and non-ASCII last).
_ANY = (
    b"abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    b"\"}],:{[-+._@/#=;!?$%&'()*<>\\^`|~"
    + b" \t\n\r"
    + bytes(range(0x80, 0x100))
    + bytes(b for b in range(0x20) if b not in b"\t\n\r")
    + b"\x7f"
)


@dataclass(frozen=True)
class Completion:
    text: bytes  # what to append (b"": the grammar may end where it stands)
    token_ids: tuple[int, ...]  # the tokens spelling it
    how: str  # "done" | "hint" | "closers" | "search" | "memo" (a search's result from the same state before)
    nodes: int = 0  # grammar steps the search took


class _OutOfNodes(Exception):
    """The node budget of one search is spent (unwinds the depth-first walk)."""


class CompletionSearch:
    """Shared by the requests of one backend; per-call state only (one scheduler thread), and the texts its
    searches found by state: a search depends only on the grammar and the bytes accepted so far, and a batch of
    requests with one constraint starts from one state (every regex answer's first estimate, every JSON
    object's opening), so the first of them searches and the others reuse its text."""

    def __init__(self, tables: TokenTables, max_nodes: int = 600, max_bytes: int = 400) -> None:
        self.tables = tables
        self._memo: OrderedDict[Hashable, Optional[bytes]] = OrderedDict()  # state -> the search's text
        self.max_nodes = max_nodes
        self.max_bytes = max_bytes
        self._scratch = torch.zeros((1, bitmask_width(tables.vocab.vocab_size)), dtype=torch.int32)  # (1, W)
        self._nodes = 0
        self._steps = 0  # tokens accepted on the matcher by the current search, to roll back
        # How completions were found (reported in the engine's stats): the cheap ways and the searches,
        # the searches that found none, and the time all of it took.
        self.stats = {
            "completion_hints": 0,
            "completion_closers": 0,
            "completion_searches": 0,
            "completion_memo": 0,
            "completion_not_found": 0,
            "completion_ms": 0.0,
            "completion_search_ms": 0.0,
        }

    def find(
        self,
        matcher: GrammarMatcher,
        scanner: Optional[JsonScanner],
        hints: Sequence[bytes] = (),
        state: Optional[Hashable] = None,
    ) -> Optional[Completion]:
        """The shortest completion found (see the module docstring), or None. The matcher and the
        scanner are left as they were. state: what identifies the matcher's state (the grammar's key and
        the bytes accepted), under which a search's text is kept for the next request there."""
        start = time.perf_counter()
        found = self._find(matcher, scanner, hints, state)
        ms = 1000 * (time.perf_counter() - start)
        self.stats["completion_ms"] += ms
        if found is None or found.how == "search":
            self.stats["completion_search_ms"] += ms
        key = (
            "completion_not_found"
            if found is None
            else {
                "hint": "completion_hints",
                "closers": "completion_closers",
                "search": "completion_searches",
                "memo": "completion_memo",
            }.get(found.how)
        )
        if key is not None:
            self.stats[key] += 1
        return found

    def _find(
        self, matcher: GrammarMatcher, scanner: Optional[JsonScanner], hints: Sequence[bytes], state: Optional[Hashable]
    ) -> Optional[Completion]:
        if matcher.is_terminated():
            return None
        if matcher.is_completed():
            return Completion(b"", (), "done")
        for hint in hints:
            found = self.verify(matcher, hint, "hint", scanner)
            if found is not None:
                return found
        if scanner is not None and scanner.context != BROKEN:
            closers = scanner.closing_text()
            found = self.verify(matcher, closers, "closers", scanner) if closers else None
            if found is not None:
                return found
        return self.search_only(matcher, scanner, state)

    def search_only(
        self, matcher: GrammarMatcher, scanner: Optional[JsonScanner], state: Optional[Hashable] = None
    ) -> Optional[Completion]:
        """The completion the search finds, without the cheap paths (a benchmark compares them)."""
        # NOTE: the memo stands in for the search alone, after the hints: a request finds what it would
        # find on its own, batched or not.
        if state is not None and state in self._memo:
            self._memo.move_to_end(state)
            text, how, nodes = self._memo[state], "memo", 0
        else:
            text, how = self._search(matcher, scanner), "search"
            nodes = self._nodes
            if state is not None:
                self._memo[state] = text
                if len(self._memo) > MEMO_STATES:
                    self._memo.popitem(last=False)
        if text is None:
            return None
        found = self.verify(matcher, text, how, scanner)
        if found is None:
            return None
        return Completion(found.text, found.token_ids, how, nodes)

    def verify(
        self, matcher: GrammarMatcher, text: bytes, how: str, scanner: Optional[JsonScanner] = None
    ) -> Optional[Completion]:
        """`text` as a completion if the matcher accepts its tokens and may end after them (and, for JSON
        text, if it writes no key its object already has)."""
        if scanner is not None:
            probe = JsonScanner.from_snapshot(scanner.snapshot())
            probe.feed(text)
            if probe.repeated_key or probe.context == BROKEN:
                return None
        for ids in (self.tables.encode(text), self.tables.spell(text)):
            if ids is not None and _completes(matcher, ids):
                return Completion(text, tuple(ids), how)
        return None

    # ---- the search ----
    def _search(self, matcher: GrammarMatcher, scanner: Optional[JsonScanner]) -> Optional[bytes]:
        self._nodes = 0
        text = bytearray()
        if scanner is not None:
            return self._bounded(
                lambda: self._depth_first(matcher, scanner.from_snapshot(scanner.snapshot()), text, limit=None),
                matcher,
                text,
            )
        for limit in range(1, 64):
            found = self._bounded(lambda: self._depth_first(matcher, None, text, limit), matcher, text)
            if found is not None or self._nodes >= self.max_nodes:
                break
        if found is None:  # out of nodes: the first completion depth first, however long
            self._nodes = 0
            found = self._bounded(lambda: self._depth_first(matcher, None, text, None), matcher, text)
        return found

    def _bounded(self, walk, matcher: GrammarMatcher, text: bytearray) -> Optional[bytes]:
        self._steps = 0
        del text[:]
        try:
            found = walk()
        except _OutOfNodes:
            found = False
        result = bytes(text) if found else None
        if self._steps:
            matcher.rollback(self._steps)
        self._steps = 0
        return result

    def _depth_first(
        self, m: GrammarMatcher, scan: Optional[JsonScanner], text: bytearray, limit: Optional[int]
    ) -> bool:
        """Extend `text` (and the matcher) to a completion; on failure both are as on entry."""
        if m.is_completed():
            return True
        if len(text) >= self.max_bytes or limit == 0:
            return False
        self._nodes += 1
        if self._nodes > self.max_nodes:
            raise _OutOfNodes()
        forced = self._take_forced(m, scan, text)
        if forced and m.is_completed():
            return True
        snap = scan.snapshot() if scan is not None else None
        for byte in self._candidates(m, scan):
            token = self.tables.byte_token[byte]
            if token is None or not m.accept_token(token):
                continue
            self._steps += 1
            if scan is not None:
                scan.feed(bytes((byte,)))
                if scan.repeated_key or scan.context == BROKEN:
                    self._undo(m, scan, snap, 1)
                    continue
            text.append(byte)
            if self._depth_first(m, scan, text, None if limit is None else limit - 1):
                return True
            del text[-1]
            self._undo(m, scan, snap, 1)
        if forced:  # (the scanner is restored by the caller, from its snapshot before this node)
            del text[len(text) - forced :]
            m.rollback(forced)
            self._steps -= forced
        return False

    def _undo(self, m: GrammarMatcher, scan: Optional[JsonScanner], snap: Optional[tuple], n: int) -> None:
        m.rollback(n)
        self._steps -= n
        if scan is not None:
            scan.restore(snap)

    def _take_forced(self, m: GrammarMatcher, scan: Optional[JsonScanner], text: bytearray) -> int:
        """Accept the text the grammar forces here, byte by byte; the number of bytes taken."""
        forced = m.jump_forward_string()
        if not forced:
            return 0
        data = forced.encode("utf-8")
        ids = self.tables.spell(data)
        if ids is None:
            return 0
        for n, token in enumerate(ids):
            if not m.accept_token(token):
                if n:
                    m.rollback(n)
                return 0
        self._steps += len(ids)
        text += data
        if scan is not None:
            scan.feed(data)
        return len(ids)

    def _candidates(self, m: GrammarMatcher, scan: Optional[JsonScanner]):
        """Bytes to try here, best first: the context's own list, then every other allowed byte."""
        first = _FIRST.get(scan.context, b"") if scan is not None else b""
        yield from first
        if scan is not None and scan.context == IN_LITERAL:
            # A number's next digit: those after which it may end first (18, not 100, for minimum 18).
            digits = self._digits_that_end(m)
            first += bytes(digits)
            yield from digits
        m.fill_bitmask(self._scratch, 0)
        words = self._scratch[0].tolist()
        for byte in _ANY:
            token = self.tables.byte_token[byte]
            if token is not None and byte not in first and (words[token >> 5] >> (token & 31)) & 1:
                yield byte

    def _digits_that_end(self, m: GrammarMatcher) -> list[int]:
        ends, others = [], []
        for digit in b"0123456789":
            token = self.tables.byte_token[digit]
            if token is None or not m.accept_token(token):
                continue
            closes = False
            for closer in b"}],":
                after = self.tables.byte_token[closer]
                if after is not None and m.accept_token(after):
                    m.rollback(1)
                    closes = True
                    break
            m.rollback(1)
            (ends if closes else others).append(digit)
        return ends + others


def _completes(matcher: GrammarMatcher, ids: Sequence[int]) -> bool:
    """Whether the matcher accepts `ids` and may end after them; the matcher is left as it was."""
    taken = 0
    for token in ids:
        if not matcher.accept_token(token):
            break
        taken += 1
    ok = taken == len(ids) and matcher.is_completed()
    if taken:
        matcher.rollback(taken)
    return ok
