"""NGRAM drafts (prompt lookup): the tokens that followed the last time the request's latest n tokens
appeared, in its own prompt or output. Costs no model; pays where outputs copy their context
(summaries that quote, extraction, code edits, RAG answers).

`NgramIndex` is a request's own index: for every window size n in [min_n, max_n], the n-gram ending at
each position maps to the position after it (the latest occurrence wins). It grows with the request's
tokens (a few dict writes per token) and starts over when they shrink (a jump-forward rolled one back).
"""

from __future__ import annotations

from typing import Sequence


class NgramIndex:
    def __init__(self, min_n: int, max_n: int):
        self.min_n = min_n
        self.max_n = max_n
        self._next: dict[tuple, int] = {}  # n-gram -> index of the token after its latest occurrence
        self._indexed = 0  # tokens[:_indexed] have their n-grams (those with a token after them) indexed
        self._last: tuple = ()  # the last indexed tokens, to notice a rewrite of what was indexed

    def propose(self, tokens: Sequence[int], max_drafts: int) -> list[int]:
        """Up to `max_drafts` tokens that followed the longest suffix of `tokens` seen before in them."""
        if max_drafts <= 0 or len(tokens) < self.min_n + 1:
            return []
        self._catch_up(tokens)
        n_tokens = len(tokens)
        for n in range(min(self.max_n, n_tokens - 1), self.min_n - 1, -1):
            start = self._next.get(tuple(tokens[n_tokens - n:]))
            if start is not None:
                return list(tokens[start:min(start + max_drafts, n_tokens)])
        return []

    def _catch_up(self, tokens: Sequence[int]) -> None:
        n_tokens = len(tokens)
        k = len(self._last)
        if n_tokens < self._indexed or (k and tuple(tokens[self._indexed - k:self._indexed]) != self._last):
            self._next.clear()  # what was indexed changed: index again
            self._indexed = 0
        # NOTE: the n-grams ending at position e are indexed once the token after them (e + 1) exists,
        # so the suffix itself (nothing after it yet) is never its own match.
        nxt = self._next
        for end in range(max(self._indexed, 1), n_tokens):  # `end`: the index after the n-gram
            for n in range(self.min_n, min(self.max_n, end) + 1):
                nxt[tuple(tokens[end - n:end])] = end
        self._indexed = n_tokens
        self._last = tuple(tokens[max(0, n_tokens - 4):n_tokens])
