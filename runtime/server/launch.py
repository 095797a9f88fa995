"""`plait serve`'s start: the engine first, the HTTP app's modules loaded beside it.

NOTE: FastAPI, pydantic and the API modules are slow to import; imported first, as the
package used to, they came before the engine's scheduler process was launched. Here they load on a
thread while the engine waits for its scheduler process.
"""

from __future__ import annotations

import importlib
import logging

from ..engine.engine import Engine
from ..engine.loop import in_background
from ..server_args import ServerArgs


def launch_server(server_args: ServerArgs) -> None:
    """Build the Engine, serve until SIGINT/SIGTERM, then shut the Engine down."""
    logging.basicConfig(level=server_args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app_modules = in_background(importlib.import_module, "plait.runtime.server.http_server")
    engine = Engine(**_engine_kwargs(server_args))
    try:
        app_modules.result().serve(engine, server_args)
    finally:
        engine.shutdown()


def _engine_kwargs(server_args: ServerArgs) -> dict:
    import dataclasses

    return dataclasses.asdict(server_args)
