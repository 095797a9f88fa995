"""Incremental detokenization and stop conditions for one request.

`IncrementalDetokenizer.step()` turns newly generated ids into a text delta without ever emitting half a
UTF-8 character (byte-level BPE can split one character over several tokens: the decoder then yields
U+FFFD, and we wait for the next token). Stop strings are matched on the decoded text; the matched stop
string is trimmed unless `no_stop_trim`.
"""

from __future__ import annotations

import re
from typing import Optional


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # ids[prefix_offset:read_offset] decode to text already emitted (context)
        self.read_offset = 0
        self.text = ""  # everything decoded so far

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, new_ids: list[int]) -> str:
        """Append ids; return the newly completed text (may be '')."""
        if self.tokenizer is None:
            self.ids.extend(new_ids)
            return ""
        self.ids.extend(new_ids)
        # NOTE: decoding a window with some context before the new ids keeps the leading-space
        # behaviour of sentencepiece/BPE tokenizers right.
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end: emit whatever is left, even an incomplete character."""
        if self.tokenizer is None or self.read_offset == len(self.ids):
            return ""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        delta = new_text[len(prefix_text):]
        self.read_offset = len(self.ids)
        self.text += delta
        return delta


def find_stop_string(text: str, delta_len: int, stops: list[str]) -> Optional[tuple[int, str]]:
    """Earliest stop string that ends inside the last `delta_len` characters → (start index, stop)."""
    best = None
    for s in stops:
        # Only look where a match could newly appear: the stop may straddle the old/new boundary.
        begin = max(0, len(text) - delta_len - len(s) + 1)
        idx = text.find(s, begin)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, s)
    return best


def find_stop_regex(text: str, patterns: list[re.Pattern]) -> Optional[tuple[int, int, str]]:
    best = None
    for p in patterns:
        m = p.search(text)
        if m and (best is None or m.start() < best[0]):
            best = (m.start(), m.end(), m.group(0))
    return best
