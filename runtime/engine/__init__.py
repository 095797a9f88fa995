"""The Engine wing: the in-process API (`Engine`), its background event loop, the tokenizer manager and
the translation of SGLang-style `generate` arguments into scheduler requests. It talks to the scheduler
process over ZMQ only: nothing here imports the scheduler, the executor or the KV cache."""

from .engine import Engine

__all__ = ["Engine"]
