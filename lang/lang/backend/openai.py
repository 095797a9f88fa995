"""`sglang.lang.backend.openai`: plait's OpenAI backend under SGLang's module path."""

from plait.backend.openai_backend import OpenAI, TokenUsage

__all__ = ["OpenAI", "TokenUsage"]
