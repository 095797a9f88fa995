"""A model split over ranks when one of its ranks dies: the server answers 503 (in flight and after, as when
a one-device scheduler dies) instead of hanging, and every rank process exits: none is left waiting at a
collective for a peer that is gone, none is orphaned."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import requests
from conftest import server_info, server_pid, server_process
from helpers.model_folders import build_tokenizer, make_folder
from test_parallel import alive, children_of

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_folder(
        tmp_path_factory.mktemp("tp_failure") / "llama",
        "llama",
        tokenizer=build_tokenizer(),
        max_position_embeddings=2048,
    )


def wait_gone(pids: list[int], deadline_s: float) -> list[int]:
    deadline = time.time() + deadline_s
    while time.time() < deadline and any(alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if alive(p)]


def long_request(url: str, box: dict) -> threading.Thread:
    def go():
        box["response"] = requests.post(
            url + "/generate",
            timeout=300,
            json={"text": "hello there", "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}},
        )

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    deadline = time.time() + 120
    while server_info(url)["num_running_reqs"] < 1:  # it is decoding in the scheduler
        assert thread.is_alive() and time.time() < deadline, box
        time.sleep(0.1)
    return thread


@pytest.mark.parametrize("victim", ["worker", "scheduler"])
def test_a_rank_that_dies_gets_503_and_no_process_outlives_it(folder, tmp_path, victim):
    with server_process(
        tmp_path / "server.log",
        "--model-path",
        folder,
        "--tp-size",
        "2",
        "--num-threads",
        "1",
        "--max-total-tokens",
        "4096",
    ) as url:
        (scheduler,) = children_of(server_pid(url))
        (worker,) = children_of(scheduler)  # rank 1, started by rank 0 (the scheduler process)
        box: dict = {}
        thread = long_request(url, box)
        os.kill(worker if victim == "worker" else scheduler, signal.SIGKILL)
        thread.join(timeout=60)
        assert not thread.is_alive(), "the in-flight request hung after a rank died"
        assert box["response"].status_code == 503, box["response"].text
        assert "the scheduler process died" in box["response"].json()["error"]["message"]
        later = requests.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert later.status_code == 503, later.text
        assert requests.get(url + "/health", timeout=30).status_code == 503
        assert not wait_gone([scheduler, worker], 30), "a rank process outlived its group"
    log = (tmp_path / "server.log").read_text()
    assert "Exception in ASGI application" not in log
    if victim == "worker":  # rank 0 said why it ended the group
        assert "rank 1 of 2" in log or "a step failed on rank 0" in log, log[-3000:]
