"""NGRAM drafts (prompt lookup): the tokens that followed the last time the request's latest n tokens
appeared, in its own prompt or output. Costs no model; pays where outputs copy their context
(summaries that quote, extraction, code edits, RAG answers).

`NgramIndex` is a request's own index: for every window size n in [min_n, max_n], the n-gram ending at
each position maps to the position after it (the latest occurrence wins). It grows with the request's
tokens (a few dict writes per token) and starts over when they change (a jump-forward rolled one back).
Drafts proposed on top of other drafts (`extra`: tokens not committed) are looked up, never indexed.
"""

from __future__ import annotations

from typing import Sequence, Union


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
        self._next: dict[tuple, int] = {}  # n-gram -> index of the token after its latest occurrence
        self._indexed = 0  # tokens[:_indexed] have their n-grams (those with a token after them) indexed
        self._last: tuple = ()  # the last indexed tokens, to notice a rewrite of what was indexed

    def propose(
        self, tokens: Sequence[int], max_drafts: int, extra: Sequence[int] = (), longer_than: int = 0
    ) -> list[int]:
        """Up to `max_drafts` tokens that followed the longest suffix of `tokens` + `extra` seen before in
        `tokens` (the committed ones, indexed here; `extra`: drafts already proposed after them), a suffix
        of more than `longer_than` tokens."""
        if max_drafts <= 0 or len(tokens) < self.min_n + 1:
            return []
        self._catch_up(tokens)
        seq = TokenView(tokens, extra) if extra else tokens
        n_seq = len(seq)
        for n in range(min(self.max_n, n_seq - 1), max(self.min_n, longer_than + 1) - 1, -1):
            start = self._next.get(tuple(seq[n_seq - n :]))
            if start is not None:
                return list(seq[start : min(start + max_drafts, n_seq)])
        return []

    def _catch_up(self, tokens: Sequence[int]) -> None:
        n_tokens = len(tokens)
        k = len(self._last)
        if n_tokens < self._indexed or (k and tuple(tokens[self._indexed - k : self._indexed]) != self._last):
            self._next.clear()  # what was indexed changed: index again
            self._indexed = 0
        # NOTE: the n-grams ending at position e are indexed once the token after them (e + 1) exists,
        # so the suffix itself (nothing after it yet) is never its own match.
        lo = max(self._indexed, 1)  # the first `end` (the index after an n-gram) not indexed yet
        if lo < n_tokens:
            # NOTE: one slice of the request's tokens, and each window size's n-grams made and stored by zip and
            # dict.update (C loops): a 512-token prompt's first lookup indexes ~4,600 n-grams, per token a
            # Python loop over slices of the token view cost ~18 ms a request, enough to make a serving host
            # fall behind the GPU. Within a size, later positions overwrite earlier ones (the latest wins).
            base = max(0, lo - self.max_n)
            seg = list(tokens[base:n_tokens])
            nxt = self._next
            for n in range(self.min_n, self.max_n + 1):
                first = max(lo, n)  # n-grams ending at `end` need end >= n
                if first >= n_tokens:
                    break
                at, count = first - n - base, n_tokens - first
                grams = zip(*(seg[at + i : at + i + count] for i in range(n)))
                nxt.update(zip(grams, range(first, n_tokens)))
        self._indexed = n_tokens
        self._last = tuple(tokens[max(0, n_tokens - 4) : n_tokens])
