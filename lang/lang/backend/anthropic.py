"""`sglang.lang.backend.anthropic`: plait's Anthropic backend under SGLang's module path."""

from plait.backend.anthropic_backend import Anthropic

__all__ = ["Anthropic"]
