"""Regressions found by the server soak (benchmarks/soak/soak_server.py): requests that kept running after
their client gave up. Each test drives a real `python -m plait.runtime.server` subprocess."""

from __future__ import annotations

import json
import socket
import threading
import time
from urllib.parse import urlparse

import pytest
import requests
from conftest import server_info, server_process, wait_server_idle

MAX_NEW = 80  # ignore_eos: a request nobody aborts generates exactly this many tokens


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("soak") / "server.log"
    with server_process(log, "--num-threads", "1", "--max-total-tokens", "2048") as url:
        yield url


def _requests_ended(url: str) -> float:
    """Generation requests the server has ended (any finish reason), from /metrics."""
    text = requests.get(url + "/metrics", timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("plait_requests_total{"))


def test_client_that_disconnects_at_once_gets_its_request_aborted(server):
    """A client that sends a request and hangs up at once (a timeout, a killed process) used to have its
    abort lost: the disconnect was seen before the request reached the scheduler, so it ran to the end."""
    before = wait_server_idle(server)["generation_tokens"]
    ended = _requests_ended(server)
    body = json.dumps(
        {
            "text": "Tell me a long story.",
            "sampling_params": {"max_new_tokens": MAX_NEW, "ignore_eos": True, "temperature": 0},
        }
    ).encode()
    u = urlparse(server)
    for _ in range(3):
        with socket.create_connection((u.hostname, u.port)) as sock:
            sock.sendall(
                b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
    deadline = time.time() + 120
    while _requests_ended(server) < ended + 3:  # all three reached the server and ended
        assert time.time() < deadline, "the requests never ended"
        time.sleep(0.2)
    generated = wait_server_idle(server)["generation_tokens"] - before
    assert generated < 3 * MAX_NEW, f"{generated} tokens generated for 3 clients that had hung up"


def test_abort_request_stops_every_sample_of_n(server):
    """/abort_request on an n > 1 request: samples that had not started yet (they wait for the first
    one's prefill) used to start afterwards and run to max_new_tokens."""
    rid = "soak-abort-n"
    out = {}

    def run():
        out["r"] = requests.post(
            server + "/generate",
            timeout=300,
            json={
                "text": "Write a poem about the sea. " * 20,
                "rid": rid,
                "sampling_params": {"n": 3, "max_new_tokens": MAX_NEW, "ignore_eos": True},
            },
        )

    t = threading.Thread(target=run)
    t.start()
    deadline = time.time() + 60
    while server_info(server)["num_open_http_requests"] < 3:
        assert time.time() < deadline and t.is_alive(), "the request never opened"
        time.sleep(0.02)
    aborted = requests.post(server + "/abort_request", json={"rid": rid}, timeout=30).json()["aborted"]
    assert sorted(aborted) == sorted([rid, f"{rid}-0", f"{rid}-1", f"{rid}-2"])
    t.join(120)
    r = out["r"]
    assert r.status_code == 200, r.text
    reasons = [o["meta_info"]["finish_reason"]["type"] for o in r.json()]
    assert reasons == ["abort"] * 3, reasons
    info = wait_server_idle(server)
    assert info["kv_used_tokens"] == 0 and not info["last_integrity_error"]
    # The samples that never started are in the metrics with their real (short) latency, not the time
    # since the clock's epoch.
    text = requests.get(server + "/metrics", timeout=30).text
    count = next(
        float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith("plait_e2e_request_latency_seconds_count")
    )
    under_300s = next(
        float(ln.split()[-1])
        for ln in text.splitlines()
        if ln.startswith("plait_e2e_request_latency_seconds_bucket") and 'le="300.0"' in ln
    )
    assert under_300s == count


def test_grammar_cache_size_is_reported(server):
    """The soak watches the grammar compile cache fill (each entry holds token-mask tables)."""
    for k in range(2):
        schema = {"type": "object", "properties": {f"soak_{k}": {"type": "integer"}}, "required": [f"soak_{k}"]}
        r = requests.post(
            server + "/generate",
            timeout=120,
            json={"text": "JSON:", "sampling_params": {"max_new_tokens": 1, "json_schema": json.dumps(schema)}},
        )
        assert r.status_code == 200, r.text
    info = server_info(server)
    assert info["grammar_cache_size"] >= 2 and info["grammar_cache_misses"] >= 2


def test_engine_abort_before_a_stream_is_read_and_of_every_sample_of_n():
    # Engine.abort used to drop an abort for a request not submitted yet (a streamed request starts
    # when first read: it then ran to the end), and aborting an n > 1 request's rid reached no sample.
    import threading

    from plait.runtime import Engine

    params = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    with Engine(num_threads=1) as engine:
        stream = engine.generate(prompt="Tell me a story.", sampling_params=params, stream=True, rid="early")
        engine.abort("early")
        chunks = list(stream)
        assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort"
        assert chunks[-1]["meta_info"]["completion_tokens"] == 0

        out = {}
        worker = threading.Thread(
            target=lambda: out.update(
                result=engine.generate(
                    prompt="Tell me a story.", sampling_params={**params, "temperature": 1.0, "n": 2}, rid="both"
                )
            )
        )
        worker.start()
        deadline = time.time() + 60
        while engine.get_server_info()["num_running_reqs"] < 2:  # both samples decoding
            assert time.time() < deadline and worker.is_alive()
            time.sleep(0.05)
        engine.abort("both")
        worker.join(timeout=60)
        reasons = [o["meta_info"]["finish_reason"]["type"] for o in out["result"]]
        assert reasons == ["abort", "abort"]
        assert all(o["meta_info"]["completion_tokens"] < MAX_NEW for o in out["result"])
        assert engine.check_integrity() is True
        assert (
            engine.generate(prompt="hi", sampling_params={"max_new_tokens": 2})["meta_info"]["finish_reason"]["type"]
            == "length"
        )
