"""Incremental detokenization and stop conditions for one request.

`IncrementalDetokenizer.step()` turns newly generated ids into a text delta without ever emitting half a
UTF-8 character (byte-level BPE can split one character over several tokens: the decoder then yields
U+FFFD, and we wait for the next token). Stop strings are matched on the decoded text; the matched stop
string is trimmed unless `no_stop_trim`.
"""

from __future__ import annotations

import re
from typing import Optional


class TextDecoder:
    """`tokenizer.decode` for one id sequence or many at once.

    NOTE: most of a transformers tokenizer's `decode` is Python around the Rust call, and a batch is a
    Python loop over it. Where `decode` would return exactly what the Rust tokenizer
    returns (a `TokenizersBackend` whose clean-up step does nothing), we call the Rust
    tokenizer directly, a whole batch in one call; otherwise `tokenizer.decode` per sequence.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._rust = _exact_rust_tokenizer(tokenizer)

    @classmethod
    def of(cls, tokenizer) -> Optional["TextDecoder"]:
        if tokenizer is None or isinstance(tokenizer, TextDecoder):
            return tokenizer
        return cls(tokenizer)

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        if self._rust is not None:
            return self._rust.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_many(self, seqs: list[list[int]], skip_special_tokens: bool) -> list[str]:
        if self._rust is not None:
            return self._rust.decode_batch(seqs, skip_special_tokens=skip_special_tokens)
        return [self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) for ids in seqs]


def _exact_rust_tokenizer(tokenizer):
    """The Rust `tokenizers.Tokenizer` behind `tokenizer`, when its decode is exactly the tokenizer's."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    cls = type(tokenizer)
    if not (
        isinstance(tokenizer, TokenizersBackend)
        and cls.decode is PreTrainedTokenizerBase.decode
        and cls._decode is TokenizersBackend._decode
    ):
        return None
    rust = getattr(tokenizer, "_tokenizer", None)
    if rust is None or not hasattr(rust, "decode_batch"):
        return None
    if tokenizer.clean_up_tokenization_spaces:
        # TokenizersBackend._decode skips the clean-up for BPE models unless forced; otherwise it
        # rewrites the text, and only tokenizer.decode does that.
        is_bpe = type(tokenizer.backend_tokenizer.model).__name__ == "BPE"
        forced = getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
        if not is_bpe or forced:
            return None
    return rust


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True):
        self.decoder = TextDecoder.of(tokenizer)  # a tokenizer or a shared TextDecoder; None: ids only
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # ids[prefix_offset:read_offset] decode to text already emitted (context)
        self.read_offset = 0
        self.text = ""  # everything decoded so far

    def _decode(self, ids: list[int]) -> str:
        return self.decoder.decode(ids, self.skip_special_tokens)

    def step(self, new_ids: list[int]) -> str:
        """Append ids; return the newly completed text (may be '')."""
        self.ids.extend(new_ids)
        if self.decoder is None:
            return ""
        # NOTE: decoding a window with some context before the new ids keeps the leading-space
        # behaviour of sentencepiece/BPE tokenizers right.
        return self._advance(
            self._decode(self.ids[self.prefix_offset : self.read_offset]), self._decode(self.ids[self.prefix_offset :])
        )

    def _advance(self, prefix_text: str, new_text: str) -> str:
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end: emit whatever is left, even an incomplete character."""
        if self.decoder is None or self.read_offset == len(self.ids):
            return ""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        delta = new_text[len(prefix_text) :]
        self.read_offset = len(self.ids)
        self.text += delta
        return delta


def step_many(detoks: list[IncrementalDetokenizer], tokens: list[int]) -> list[str]:
    """`[d.step([t]) for d, t in zip(detoks, tokens)]` with one decode call per (decoder, skip flag).

    The windows decoded are exactly those of `step`; only the calls are batched (the scheduler
    detokenizes one new token of every running request per step).
    """
    deltas = [""] * len(detoks)
    groups: dict[tuple[int, bool], list[int]] = {}
    for i, (d, t) in enumerate(zip(detoks, tokens)):
        d.ids.append(t)
        if d.decoder is not None:
            groups.setdefault((id(d.decoder), d.skip_special_tokens), []).append(i)
    for (_, skip), idx in groups.items():
        windows = []
        for i in idx:
            d = detoks[i]
            windows.append(d.ids[d.prefix_offset : d.read_offset])
            windows.append(d.ids[d.prefix_offset :])
        texts = detoks[idx[0]].decoder.decode_many(windows, skip)
        for k, i in enumerate(idx):
            deltas[i] = detoks[i]._advance(texts[2 * k], texts[2 * k + 1])
    return deltas


def decode_as_stepped(decoder, seqs: list[list[int]], skip_special_tokens: list[bool]) -> list[str]:
    """Per id list: the text an IncrementalDetokenizer ends with when fed the ids one at a time, then
    flushed (what the scheduler would have produced). `decoder`: a tokenizer or a TextDecoder."""
    decoder = TextDecoder.of(decoder)
    texts = []
    for ids, skip in zip(seqs, skip_special_tokens):
        d = IncrementalDetokenizer(decoder, skip)
        for t in ids:
            d.step([t])
        d.flush()
        texts.append(d.text)
    return texts


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
