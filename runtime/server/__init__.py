"""HTTP server: SGLang's native API and the OpenAI API over an Engine, plus /metrics."""

from .http_server import create_app, launch_server

__all__ = ["create_app", "launch_server"]
