"""NGRAM drafts (prompt lookup): the tokens that followed the last time the request's latest n tokens
appeared, in its own prompt or output. Costs no model; pays where outputs copy their context
(summaries that quote, extraction, code edits, RAG answers).

`NgramIndex` is a request's own index: a hash of the min_n-gram ending at each position (numpy); a lookup finds
the positions whose hash is the suffix's, extends their latest matches backwards, up to max_n tokens, and the
longest (then the latest) match gives the drafts. It grows with the request's tokens (a few vector operations a
call) and starts over when they change (a jump-forward rolled one back). Drafts proposed on top of other drafts
(`extra`: tokens not committed) are looked up, never indexed.
"""

from __future__ import annotations

from typing import Sequence, Union

import numpy as np

# A lookup extends at most this many of its min_n-gram's latest occurrences (a degenerate repetition has
# thousands; a longer match further back is rare, and missing it costs a draft, never an output).
MAX_CANDIDATES = 64


class TokenView:
    """A request's tokens (its prompt list and its output list, concatenated) without copying them."""

    __slots__ = ("parts", "_len")

    def __init__(self, *parts: Sequence[int]):
        self.parts = parts
        self._len = sum(len(p) for p in parts)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: Union[int, slice]):
        if isinstance(i, slice):
            start, stop, _ = i.indices(self._len)
            out: list[int] = []
            for p in self.parts:
                n = len(p)
                if stop > 0 and start < n:
                    out.extend(p[max(start, 0) : min(stop, n)])
                start, stop = start - n, stop - n
            return out
        if i < 0:
            i += self._len
        for p in self.parts:
            if i < len(p):
                return p[i]
            i -= len(p)
        raise IndexError(i)


class NgramIndex:
    def __init__(self, min_n: int, max_n: int):
        self.min_n = min_n
        self.max_n = max_n
        # NOTE: one key per token, in numpy: keys[e] is a hash of the min_n-gram that ends before position e (the
        # n-gram tokens[e - min_n : e]). Growing it is a few vector operations per call, where a dict entry per
        # token cost a serving host ~0.3 ms a 512-token prompt; a lookup compares the request's keys at once
        # and checks each candidate token by token (so a hash collision is never a match).
        self._keys = np.zeros(0, dtype=np.uint64)  # (room to grow: the first `_indexed` are real)
        self._indexed = 0  # tokens[:_indexed] have their min_n-grams (those with a token after them) indexed
        self._last: tuple = ()  # the last indexed tokens, to notice a rewrite of what was indexed

    def propose(
        self, tokens: Sequence[int], max_drafts: int, extra: Sequence[int] = (), longer_than: int = 0
    ) -> list[int]:
        """Up to `max_drafts` tokens that followed the longest suffix of `tokens` + `extra` seen before in
        `tokens` (the committed ones, indexed here; `extra`: drafts already proposed after them), a suffix
        of more than `longer_than` tokens (and of min_n to max_n); of equally long ones, the latest."""
        if max_drafts <= 0 or len(tokens) < self.min_n + 1:
            return []
        self._catch_up(tokens)
        seq = TokenView(tokens, extra) if extra else tokens
        n_seq, n_tokens = len(seq), len(tokens)
        longest = min(self.max_n, n_seq - 1)
        if longest < max(self.min_n, longer_than + 1):
            return []
        tail = list(seq[n_seq - longest :])  # (the suffix, its last token at tail[-1])
        # (ends of indexed n-grams: min_n .. n_tokens - 1, each with a token after it)
        ends = np.flatnonzero(self._keys[self.min_n : n_tokens] == _key(tail[-self.min_n :])) + self.min_n
        best, best_end = 0, -1
        for end in reversed(ends[-MAX_CANDIDATES:].tolist()):  # latest first: a tie keeps the later occurrence
            k = 0
            limit = min(longest, end)
            while k < limit and tokens[end - 1 - k] == tail[-1 - k]:
                k += 1
            if k >= self.min_n and k > best:
                best, best_end = k, end
                if k == longest:
                    break
        if best <= longer_than:
            return []
        return list(seq[best_end : min(best_end + max_drafts, n_seq)])

    def _catch_up(self, tokens: Sequence[int]) -> None:
        n_tokens = len(tokens)
        k = len(self._last)
        if n_tokens < self._indexed or (k and tuple(tokens[self._indexed - k : self._indexed]) != self._last):
            self._indexed = 0  # what was indexed changed: index again
        # NOTE: the n-grams ending at position e are indexed once the token after them (e + 1) exists,
        # so the suffix itself (nothing after it yet) is never its own match.
        n = self.min_n
        first = max(self._indexed, n)
        if first < n_tokens:
            if n_tokens > self._keys.shape[0]:  # room for twice as many: growing is amortized
                keys = np.zeros(2 * n_tokens, dtype=np.uint64)
                keys[: self._keys.shape[0]] = self._keys
                self._keys = keys
            seg = np.asarray(tokens[first - n : n_tokens], dtype=np.uint64)  # the new n-grams' tokens
            acc = np.zeros(n_tokens - first, dtype=np.uint64)
            for i in range(n):  # (uint64 arithmetic wraps: the same hash as `_key`)
                acc = acc * np.uint64(_BASE) + seg[i : i + n_tokens - first]
            self._keys[first:n_tokens] = acc
        self._indexed = n_tokens
        self._last = tuple(tokens[max(0, n_tokens - 4) : n_tokens])


_BASE = 1_000_003
_MASK = (1 << 64) - 1


def _key(gram: Sequence[int]) -> np.uint64:
    """The hash `_catch_up` stores for an n-gram: its tokens as digits in base _BASE, modulo 2**64."""
    acc = 0
    for t in gram:
        acc = (acc * _BASE + t) & _MASK
    return np.uint64(acc)
