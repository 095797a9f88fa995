"""HTTP server: SGLang's native API and the OpenAI API over an Engine, plus /metrics."""

__all__ = ["create_app", "launch_server"]


def __getattr__(name: str):
    # NOTE: on first use, not with the package: `plait serve` starts its engine before the app's modules
    # load (launch.py), and `plait.runtime.server.launch` must not bring them in through this file.
    if name == "create_app":
        from .http_server import create_app

        return create_app
    if name == "launch_server":
        from .launch import launch_server

        return launch_server
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
