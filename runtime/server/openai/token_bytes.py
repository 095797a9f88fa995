"""The raw bytes of a token: `bytes` in the OpenAI chat logprobs.

A token of a byte-level vocabulary may hold only part of a UTF-8 character (an emoji is often three
tokens), and so may a SentencePiece byte-fallback token (`<0xF0>`). Decoded alone, such a token is
U+FFFD, whose UTF-8 bytes are not the token's. OpenAI's `bytes` exists so that clients can join those
tokens back into text, so it must carry the bytes the token stands for, not those of its decoded text.
"""

from __future__ import annotations

import re
from typing import Any, Optional

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins: each byte 0-255 is written as one character, the
    printable Latin-1 ones as themselves, the rest as the code points from 256 upwards, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            alphabet[chr(256 + extra)] = b
            extra += 1
    return alphabet


class TokenBytes:
    """token id (and its decoded text) → the bytes it stands for; cached per id."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._alphabet: Optional[dict[str, int]] = (
            _byte_level_alphabet() if type(decoder).__name__ == "ByteLevel" else None
        )
        # NOTE: added tokens (<|im_end|>, ...) are stored as their text, not in the byte alphabet.
        self._added = set(getattr(tokenizer, "added_tokens_decoder", None) or ())
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: Optional[int], text: str) -> bytes:
        if token_id is None or token_id in self._added:
            return text.encode("utf-8")
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._cache[token_id] = self._raw(token_id) or text.encode("utf-8")
        return cached

    def _raw(self, token_id: int) -> Optional[bytes]:
        try:
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
        except Exception:  # an id outside the vocabulary: nothing better than the text
            return None
        if not isinstance(piece, str):
            return None
        if self._alphabet is not None:
            if all(ch in self._alphabet for ch in piece):
                return bytes(self._alphabet[ch] for ch in piece)
            return None
        match = _BYTE_FALLBACK.fullmatch(piece)
        return bytes([int(match.group(1), 16)]) if match else None
