"""Loops the grammar would let run to the budget: the same tokens over and over, or a run of digits.

A small model under a grammar falls into loops the grammar allows: `"1234567890123456…"` inside a
string, `{"type":[{"type":[{"type":[…` nesting, a space repeated where whitespace is free. Left
alone they run to max_new_tokens and the output is cut mid-object. `RepetitionWatch` notices them
cheaply (a few integer comparisons per token), so the closing (closing.py) can end the text
validly long before the budget is spent:

- the last `span` tokens repeat with a period p <= MAX_PERIOD, where span >= max(MIN_SPAN,
  MIN_REPEATS * p): 32 equal tokens, or a 10-token unit four times;
- more than MAX_DIGITS digits in a row (longer than any integer or identifier worth writing);
- the last WINDOW tokens use at most FEW distinct tokens: a loop that drifts, so no period holds
  (`"name_name": "x", "name_name_name": "x", ...`, each key a little longer than the last).
"""

from __future__ import annotations

import collections

MAX_PERIOD = 16
MIN_SPAN = 32
MIN_REPEATS = 4
MAX_DIGITS = 32
WINDOW = 64
FEW = 8


class RepetitionWatch:
    """Per request. `feed` each accepted token; `looping` turns True once a loop is seen."""

    def __init__(self) -> None:
        self._tokens: list[int] = []
        self._data: list[bytes] = []
        # runs[p]: how many positions in a row (ending at the last token) equal the token p earlier.
        self._runs = [0] * (MAX_PERIOD + 1)
        self._digits = 0
        self._window: collections.deque = collections.deque()
        self._counts: collections.Counter = collections.Counter()
        self.looping = False
        self.why = ""

    def feed(self, token_id: int, data: bytes) -> None:
        self._tokens.append(token_id)
        self._data.append(data)
        self._step(len(self._tokens) - 1)

    def rollback(self, num_tokens: int) -> None:
        """Forget the last tokens; the counters are rebuilt from the tail that can still matter."""
        if num_tokens <= 0:
            return
        del self._tokens[len(self._tokens) - num_tokens :]
        del self._data[len(self._data) - num_tokens :]
        self._runs = [0] * (MAX_PERIOD + 1)
        self._digits = 0
        self._window.clear()
        self._counts.clear()
        self.looping = False
        tail = max(MAX_PERIOD * MIN_REPEATS + MAX_DIGITS, WINDOW)
        for i in range(max(0, len(self._tokens) - tail), len(self._tokens)):
            self._step(i)

    def _step(self, i: int) -> None:
        tokens, runs = self._tokens, self._runs
        token = tokens[i]
        for p in range(1, min(MAX_PERIOD, i) + 1):
            runs[p] = runs[p] + 1 if tokens[i - p] == token else 0
            if runs[p] + p >= max(MIN_SPAN, MIN_REPEATS * p) and not self.looping:
                self.looping, self.why = True, f"{runs[p] + p} tokens repeating every {p}"
        data = self._data[i]
        if data and data.isdigit():
            self._digits += len(data)
        else:
            stripped = data.rstrip(b"0123456789")
            self._digits = len(data) - len(stripped)
        if self._digits > MAX_DIGITS and not self.looping:
            self.looping, self.why = True, f"{self._digits} digits in a row"
        self._window.append(token)
        self._counts[token] += 1
        if len(self._window) > WINDOW:
            old = self._window.popleft()
            self._counts[old] -= 1
            if not self._counts[old]:
                del self._counts[old]
        if len(self._window) == WINDOW and len(self._counts) <= FEW and not self.looping:
            self.looping, self.why = True, f"{len(self._counts)} distinct tokens in the last {WINDOW}"
