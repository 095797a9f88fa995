"""`Runtime.url`: plait's HTTP API over a Runtime's in-process Engine, served on demand.

SGLang's Runtime is a server it launched, so programs read `runtime.url` and post to `/generate` or build a
`RuntimeEndpoint(runtime.url)`. plait's Runtime runs the Engine in-process; the first read of `url` serves
the same app `plait serve` serves over it, on a free localhost port, from a thread of its own (the routes
read the Engine's streams from that thread's event loop), until the Runtime shuts down.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, Optional

START_TIMEOUT_S = 60.0


class LocalHTTPServer:
    def __init__(self, engine: Any) -> None:
        import uvicorn
        from plait.runtime.server.http_server import create_app

        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        host, port = self._sock.getsockname()
        self.url = f"http://{host}:{port}"
        config = uvicorn.Config(create_app(engine, engine.server_args), log_level="warning", access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True, name="plait-runtime-http"
        )
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the Runtime's HTTP server did not start on {self.url}")
            time.sleep(0.01)

    def stop(self, timeout: Optional[float] = 10.0) -> None:
        """Stop serving (requests in flight are given `timeout` seconds) and close the socket."""
        self._server.should_exit = True
        self._thread.join(timeout)
        self._sock.close()
