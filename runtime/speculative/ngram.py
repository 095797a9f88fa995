"""NGRAM drafts (prompt lookup): the tokens that followed the last time the request's latest n tokens
appeared, in its own prompt or output. Costs no model; pays where outputs copy their context
(summaries that quote, extraction, code edits, RAG answers).

`NgramIndex` is a request's own index: each min_n-gram maps to the positions after its occurrences; a lookup
extends its latest occurrences' matches backwards, up to max_n tokens, and the longest (then the latest) match
gives the drafts. It grows with the request's tokens (one dict write per token) and starts over when they
change (a jump-forward rolled one back). Drafts proposed on top of other drafts (`extra`: tokens not
committed) are looked up, never indexed.
"""

from __future__ import annotations

from typing import Sequence, Union

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
        # NOTE: one entry per token, not one per window size: each min_n-gram's end positions (the index after it,
        # ascending); a lookup extends the candidates' matches backwards to max_n. A 512-token prompt is 512
        # dict writes, where an n-gram per size was 4,600 (a serving host's time, with a request every step).
        self._ends: dict[tuple, list[int]] = {}
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
        n_seq = len(seq)
        longest = min(self.max_n, n_seq - 1)
        ends = self._ends.get(tuple(seq[n_seq - self.min_n :]))
        if not ends or longest < max(self.min_n, longer_than + 1):
            return []
        tail = list(seq[n_seq - longest :])  # (the suffix, its last token at tail[-1])
        best, best_end = 0, -1
        for end in reversed(ends[-MAX_CANDIDATES:]):  # latest first: a tie keeps the later occurrence
            # (`end` <= len(tokens) - 1: an indexed n-gram has a token after it)
            k = self.min_n
            limit = min(longest, end)
            while k < limit and tokens[end - 1 - k] == tail[-1 - k]:
                k += 1
            if k > best:
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
            self._ends.clear()  # what was indexed changed: index again
            self._indexed = 0
        # NOTE: the n-grams ending at position e are indexed once the token after them (e + 1) exists,
        # so the suffix itself (nothing after it yet) is never its own match.
        n = self.min_n
        first = max(self._indexed, n)  # the first `end` (the index after a min_n-gram) not indexed yet
        if first < n_tokens:
            seg = list(tokens[first - n : n_tokens])
            ends = self._ends
            for end, gram in zip(range(first, n_tokens), zip(*(seg[i : len(seg) - n + i] for i in range(n)))):
                at = ends.get(gram)
                if at is None:
                    ends[gram] = [end]
                else:
                    at.append(end)
        self._indexed = n_tokens
        self._last = tuple(tokens[max(0, n_tokens - 4) : n_tokens])
