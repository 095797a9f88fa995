"""`sglang.lang.backend.litellm`: plait's LiteLLM backend under SGLang's module path."""

from plait.backend.litellm_backend import LiteLLM

__all__ = ["LiteLLM"]
