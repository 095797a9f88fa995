"""`sglang.lang.backend.base_backend`: plait's backend interface under SGLang's module path."""

from plait.backend.base import BaseBackend

__all__ = ["BaseBackend"]
