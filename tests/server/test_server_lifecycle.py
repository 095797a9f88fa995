"""`plait serve`'s own life, now that uvicorn serves on the engine's loop while the main thread waits: a port
in use ends it at once with uvicorn's exit code, and SIGTERM with a stream open shuts it down gracefully;
either way its scheduler process goes with it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import requests
from conftest import free_port, server_pid, server_process

EXIT_DEADLINE_S = 60


def child_pids(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has exited
    except FileNotFoundError:
        return True


def wait_gone(pid: int) -> None:
    deadline = time.time() + EXIT_DEADLINE_S
    while not gone(pid):
        assert time.time() < deadline, f"process {pid} is still running"
        time.sleep(0.1)


def test_a_port_in_use_ends_the_server_at_once(tmp_path):
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        log = tmp_path / "server.log"
        with open(log, "w") as out:
            proc = subprocess.run(
                [sys.executable, "-m", "plait.runtime.server", "--port", str(port), "--num-threads", "1"],
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=120,  # (an exit that ends the engine loop's thread leaves the server waiting forever)
            )
    assert proc.returncode == 3, log.read_text()[-2000:]  # uvicorn's start-up failure
    assert "address already in use" in log.read_text()


def test_sigterm_with_a_stream_open_shuts_down_gracefully(tmp_path):
    log = tmp_path / "server.log"
    with server_process(log, "--num-threads", "1") as url:
        pid = server_pid(url)
        scheduler = child_pids(pid)
        body = {"text": "Tell me about rivers.", "stream": True, "sampling_params": {"max_new_tokens": 4000}}
        with requests.post(url + "/generate", json=body, stream=True, timeout=60) as resp:
            next(resp.iter_lines())  # a stream is open
            os.kill(pid, signal.SIGTERM)
            wait_gone(pid)
        for child in scheduler:
            wait_gone(child)
    assert "Finished server process" in log.read_text()
