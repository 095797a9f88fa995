"""`create_grammar_backend`: the named grammar backend for a Hugging Face tokenizer."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from .base import BACKEND_NAMES, GrammarBackend
from .outlines_backend import OutlinesBackend
from .vocab import build_tokenizer_vocab
from .xgrammar_backend import XGrammarBackend


def create_grammar_backend(
    name: str,
    tokenizer: Any,
    vocab_size: Optional[int] = None,
    num_threads: int = 1,
    compile_timeout: float = 60.0,
    stop_token_ids: Optional[Sequence[int]] = None,
) -> GrammarBackend:
    """Build the named backend ("xgrammar" | "outlines") for a Hugging Face tokenizer.

    vocab_size: the model's logit width (may exceed the tokenizer's; extra ids are never allowed).
    stop_token_ids: tokens that end a finished grammar (default: the tokenizer's eos)."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"grammar_backend must be one of {list(BACKEND_NAMES)}, got {name!r}")
    vocab = build_tokenizer_vocab(tokenizer, vocab_size, stop_token_ids)
    backend = XGrammarBackend if name == "xgrammar" else OutlinesBackend
    return backend(vocab, num_threads=num_threads, compile_timeout=compile_timeout)
