"""The HTTP server once its scheduler process is gone: every request, in flight or new, gets a 503 naming
why (as /health does), not a 500 "internal server error"; the server itself stays up to say so."""

from __future__ import annotations

import os
import signal
import threading
import time

import requests
from conftest import server_pid, server_process


def child_pids(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def test_requests_after_the_scheduler_dies_get_503_not_500(tmp_path):
    with server_process(tmp_path / "server.log", "--num-threads", "1") as url:
        schedulers = child_pids(server_pid(url))
        assert len(schedulers) == 1, schedulers
        in_flight: dict = {}

        def long_request():
            in_flight["response"] = requests.post(
                url + "/generate",
                timeout=120,
                json={"text": "Tell me a long story.", "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}},
            )

        worker = threading.Thread(target=long_request, daemon=True)
        worker.start()
        time.sleep(2.0)  # the request is running in the scheduler
        os.kill(schedulers[0], signal.SIGKILL)
        worker.join(timeout=60)
        assert not worker.is_alive(), "the in-flight request hung after the scheduler died"
        r = in_flight["response"]
        assert r.status_code == 503, r.text
        assert "the scheduler process died" in r.json()["error"]["message"]
        for route, body in (
            ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2}}),
            ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
        ):
            later = requests.post(url + route, json=body, timeout=30)
            assert later.status_code == 503, (route, later.text)
            assert "the scheduler process died" in later.json()["error"]["message"]
        assert requests.get(url + "/health", timeout=30).status_code == 503
    assert "Exception in ASGI application" not in (tmp_path / "server.log").read_text()
