"""`sglang.lang.backend.runtime_endpoint`: plait's HTTP backend and in-process Runtime under SGLang's path."""

from plait.backend.engine_backend import Runtime
from plait.backend.runtime_endpoint import RuntimeEndpoint

__all__ = ["Runtime", "RuntimeEndpoint"]
