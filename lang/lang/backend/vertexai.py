"""`sglang.lang.backend.vertexai`: plait's VertexAI backend under SGLang's module path."""

from plait.backend.vertexai_backend import VertexAI

__all__ = ["VertexAI"]
