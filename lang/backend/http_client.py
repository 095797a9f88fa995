"""The HTTP side of RuntimeEndpoint: one pooled session to a server, and errors that say what went wrong.

requests' own messages are walls of urllib3 internals ("Max retries exceeded ... NewConnectionError",
"No connection adapters were found", "Response ended prematurely"). A program's state keeps the
exception as its error(), so each failure is re-raised with the same requests type (callers may catch
`requests.exceptions.ConnectionError` or `Timeout`) and a message naming the URL, the cause and the fix.
"""

from __future__ import annotations

import http.client
import socket
import ssl
from contextlib import contextmanager
from typing import Any, Iterator, Optional
from urllib.parse import urlparse

# NOTE: run_batch runs up to num_threads programs at once, each with requests in flight, and the pin
# service adds a few more. requests' default pool keeps 10 connections per host and warns ("Connection
# pool is full, discarding connection") for every extra one. Idle connections beyond what a batch uses
# are never opened, so a large bound costs nothing.
CONNECTION_POOL_SIZE = 256

START_HINT = (
    "start one with `python -m plait.runtime.server --port PORT` (or SGLang's launch_server); a server "
    "still loading its model does not listen yet (wait for its 'plait server ready' line); or check the URL"
)


def check_base_url(base_url: str) -> str:
    """The server's root URL without a trailing slash; a URL without http(s):// is an error naming it."""
    if not isinstance(base_url, str) or not base_url:
        raise ValueError(f"RuntimeEndpoint needs the server's URL, such as 'http://127.0.0.1:30000'; got {base_url!r}")
    parsed = urlparse(base_url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(
            f"RuntimeEndpoint needs a URL starting with http:// or https://, such as "
            f"'http://127.0.0.1:30000'; got {base_url!r}"
        )
    return base_url.rstrip("/")


class EndpointHTTP:
    """GET/POST/stream against one server: a pooled session, the bearer key, TLS `verify`, `timeout`."""

    def __init__(self, base_url: str, api_key: Optional[str], verify: Any, timeout: Optional[float]) -> None:
        import requests

        self.base_url = check_base_url(base_url)
        self.api_key = api_key
        self.verify = verify
        self.timeout = timeout
        self.session = requests.Session()
        adapter = requests.adapters.HTTPAdapter(pool_connections=1, pool_maxsize=CONNECTION_POOL_SIZE)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)
        self._answered_once = False  # a failure after the server has answered means it went away

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def get(self, path: str) -> Any:
        """GET -> the decoded JSON body; a non-200 answer raises."""
        res = self.request("GET", path)
        self.check(res, path)
        return res.json()

    def post(self, path: str, payload: Optional[dict] = None) -> Any:
        """POST -> the response; a non-200 answer raises."""
        res = self.request("POST", path, payload)
        self.check(res, path)
        return res

    def request(self, method: str, path: str, payload: Optional[dict] = None, stream: bool = False) -> Any:
        """The response whatever its status; a transport failure raises with a message that names it."""
        with self.reaching(path):
            res = self.session.request(
                method,
                self.base_url + path,
                json=payload if method == "POST" else None,
                headers=self.headers(),
                verify=self.verify,
                stream=stream,
                timeout=self.timeout,
            )
        self._answered_once = True
        return res

    def stream_lines(self, path: str, payload: dict) -> Iterator[str]:
        """POST with stream=True: the response's lines as they arrive (a broken stream raises)."""
        res = self.request("POST", path, payload, stream=True)
        try:
            self.check(res, path)
            with self.reaching(path):
                for line in res.iter_lines(decode_unicode=False):
                    yield line.decode("utf-8") if isinstance(line, bytes) else line
        finally:
            res.close()  # a reader that stops early hangs up, and the server aborts the request

    def check(self, res: Any, path: str) -> None:
        """Raise for a non-200 answer: ValueError for a request the server refused as invalid (HTTP 400,
        as the in-process Engine raises ValueError for it), RuntimeError otherwise."""
        if res.status_code == 200:
            return
        detail = error_message(res)
        hint = ""
        if res.status_code == 401:
            hint = (
                " (the api_key given was refused)"
                if self.api_key
                else " (the server wants an API key: pass RuntimeEndpoint(url, api_key=...))"
            )
        elif res.status_code == 404 and urlparse(self.base_url).path not in ("", "/"):
            hint = (
                f" (RuntimeEndpoint takes the server's root URL, such as "
                f"'{urlparse(self.base_url)._replace(path='').geturl()}', not a route)"
            )
        error = ValueError if res.status_code == 400 else RuntimeError
        raise error(f"{self.base_url}{path} answered HTTP {res.status_code}{hint}: {detail}")

    @contextmanager
    def reaching(self, path: str) -> Iterator[None]:
        """Re-raise a transport failure of `path` with a message that says which and what to do."""
        import requests

        url = self.base_url + path
        try:
            yield
        except requests.exceptions.ConnectTimeout as e:  # also a ConnectionError: it must come first
            raise type(e)(f"no server answered at {url} within timeout={self.timeout}s: {START_HINT}") from e
        except requests.exceptions.Timeout as e:
            raise type(e)(
                f"{url} sent no answer within timeout={self.timeout}s (RuntimeEndpoint(timeout=...) "
                f"bounds each wait for the server; None waits as long as it takes)"
            ) from e
        except requests.exceptions.ChunkedEncodingError as e:
            raise type(e)(
                f"the server at {self.base_url} ended {path}'s stream before its last chunk "
                f"({failure_cause(e)}): did it exit or restart?"
            ) from e
        except requests.exceptions.ConnectionError as e:
            if self._answered_once:
                raise type(e)(
                    f"the server at {self.base_url} stopped answering during {path} "
                    f"({failure_cause(e)}): it answered before; did it exit or restart?"
                ) from e
            raise type(e)(f"no server answered at {url} ({failure_cause(e)}): {START_HINT}") from e


def error_message(res: Any) -> str:
    """The message of an error answer: plait's and OpenAI's {"error": {"message"}}, FastAPI's {"detail"},
    or the body as text."""
    try:
        body = res.json()
    except ValueError:
        return res.text
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return error["message"]
        if isinstance(error, str):
            return error
        if "detail" in body:
            return str(body["detail"])
    return str(body)


def failure_cause(error: BaseException) -> str:
    """A few words for the root cause of a requests failure (its chain of causes and args)."""
    seen: set[int] = set()
    pending: list[Any] = [error]
    while pending:
        e = pending.pop(0)
        if id(e) in seen or not isinstance(e, BaseException):
            continue
        seen.add(id(e))
        if isinstance(e, ConnectionRefusedError):
            return "connection refused: nothing listens on that port"
        if isinstance(e, socket.gaierror):
            return "the host name does not resolve"
        if isinstance(e, ssl.SSLError):
            return "TLS failed: is it an http:// server?"
        if isinstance(e, http.client.RemoteDisconnected):
            return "the server closed the connection without an answer"
        if isinstance(e, ConnectionResetError):
            return "the connection was reset by the server"
        if isinstance(e, http.client.IncompleteRead):
            return "the connection closed in the middle of the response"
        pending.extend([e.__cause__, e.__context__, getattr(e, "reason", None), *e.args])
    return str(error) or type(error).__name__
