"""plait.runtime: the colocated inference runtime (Engine, scheduler, caches, models)."""

from .sampling_params import SamplingParams
from .server_args import ServerArgs


def __getattr__(name):
    # Lazy: importing plait.runtime must stay cheap (no torch model code) for the DSL and the CLI.
    if name == "Engine":
        from .engine.engine import Engine

        return Engine
    raise AttributeError(name)


__all__ = ["Engine", "ServerArgs", "SamplingParams"]
