"""TokenizerVocab: what every grammar backend needs to know about the tokenizer, computed once.

Grammar matching works on bytes, so each token id is mapped to the exact bytes it stands for
(byte-level BPE `Ġ` -> b" ", SentencePiece `▁` -> b" ", `<0x0A>` -> b"\\n"). Special tokens
(`<|im_start|>`, ...) and ids past the tokenizer's vocabulary (padded model vocab) get no bytes and
are never allowed inside a grammar: a grammar-constrained string must not be able to smuggle in
`<|im_end|>` as text, and padded logit columns must stay masked. Stop tokens are allowed only where
the grammar may end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import xgrammar as xgr


@dataclass(frozen=True)
class TokenizerVocab:
    """Immutable per-engine tokenizer facts shared by the grammar backends.

    `decoded[i]` is the byte string of token i (b"" for special tokens and padding ids);
    `vocab_size` is the width of the model's logits (>= the tokenizer's own size);
    `vocab_type` and `add_prefix_space` follow xgrammar's classification of the tokenizer.
    """

    tokenizer: Any
    decoded: tuple[bytes, ...]
    encoded: tuple[str, ...]  # raw token strings with "" for special/padding ids (xgrammar input)
    vocab_size: int
    vocab_type: str  # "byte_level" | "byte_fallback" | "raw"
    add_prefix_space: bool
    stop_token_ids: tuple[int, ...]
    special_token_ids: frozenset[int]

    @property
    def tokenizer_vocab_size(self) -> int:
        return len(self.decoded)


def build_tokenizer_vocab(
    tokenizer: Any, vocab_size: Optional[int] = None, stop_token_ids: Optional[Sequence[int]] = None
) -> TokenizerVocab:
    """Derive a TokenizerVocab from a Hugging Face tokenizer.

    vocab_size: the model's logit width; defaults to the tokenizer's size. It may exceed the
    tokenizer (padded lm_head) but not fall short of any stop token id.
    stop_token_ids: default `[tokenizer.eos_token_id]`.
    """
    vocab_dict = tokenizer.get_vocab()
    tokenizer_size = max(len(vocab_dict), max(vocab_dict.values()) + 1)
    vocab_size = tokenizer_size if vocab_size is None else int(vocab_size)
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    if stop_token_ids is None:
        if getattr(tokenizer, "eos_token_id", None) is None:
            raise ValueError("the tokenizer has no eos_token_id; pass stop_token_ids explicitly")
        stop_token_ids = [tokenizer.eos_token_id]
    stop_token_ids = tuple(int(t) for t in stop_token_ids)
    if not stop_token_ids:
        raise ValueError("stop_token_ids must not be empty")
    bad = [t for t in stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"stop token id {bad[0]} is outside the vocabulary [0, {vocab_size})")

    # NOTE: xgrammar already knows how to decode byte-level, byte-fallback and raw vocabularies;
    # reusing its decoder keeps both backends byte-for-byte consistent with each other.
    probe = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    for token_id, added in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items():
        if getattr(added, "special", False):
            special.add(int(token_id))
    special -= set(stop_token_ids)

    encoded = [""] * vocab_size
    for token, idx in vocab_dict.items():
        if idx < vocab_size and idx not in special and idx not in stop_token_ids:
            encoded[idx] = token
    decoded = list(probe.decoded_vocab[:vocab_size])
    decoded += [b""] * (vocab_size - len(decoded))
    for idx in range(vocab_size):
        if not encoded[idx]:
            decoded[idx] = b""
    return TokenizerVocab(
        tokenizer=tokenizer,
        decoded=tuple(decoded),
        encoded=tuple(encoded),
        vocab_size=vocab_size,
        vocab_type=probe.vocab_type.name.lower(),
        add_prefix_space=bool(probe.add_prefix_space),
        stop_token_ids=stop_token_ids,
        special_token_ids=frozenset(special | {i for i in range(vocab_size) if not encoded[i]} - set(stop_token_ids)),
    )
