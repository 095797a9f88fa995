"""DSL programs over HTTP: RuntimeEndpoint against a real `python -m plait.runtime.server` subprocess.

Each test pins what a trial of programs talking to a server found broken: run_batch with more threads
than requests' connection pool, flush_cache's answer, messages for a wrong URL, a missing API key, a
request timeout and a server that dies in the middle of a batch. One server (with an API key, the
embedded model) serves the module; the last test kills it. Gens are a few tokens.
"""

import logging
import os
import signal
import threading
import time

import plait as sgl
import pytest
import requests
from conftest import free_port, server_pid, server_process

API_KEY = "endpoint-trial-key"


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    log = tmp_path_factory.mktemp("endpoint") / "server.log"
    with server_process(log, "--num-threads", "1", "--api-key", API_KEY) as base:
        yield base


@pytest.fixture(scope="module")
def backend(url):
    be = sgl.RuntimeEndpoint(url, api_key=API_KEY)
    sgl.set_default_backend(be)
    yield be
    sgl.set_default_backend(None)


@sgl.function
def qa(s, question):
    s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=3, stop="\n")


@sgl.function
def story(s, topic):
    s += "Write a long story about " + topic + ":" + sgl.gen("story", max_tokens=300, ignore_eos=True)


# ---------------------------------------------------------------- connection handling


def test_run_batch_wider_than_the_connection_pool_discards_no_connections(backend, caplog):
    # With num_threads > 10, requests' default pool warned "Connection pool is full, discarding
    # connection" for every extra connection, and each request paid a new TCP connection.
    with caplog.at_level(logging.WARNING, logger="urllib3"):
        states = qa.run_batch([{"question": f"What is {i} + 1?"} for i in range(16)], temperature=0, num_threads=16)
    assert [s.error() for s in states] == [None] * 16
    assert not [r for r in caplog.records if "pool is full" in r.getMessage()]


def test_prefix_cache_is_reused_over_http(backend):
    context = "Background: rivers carry water from the mountains to the sea. " * 4
    assert sgl.flush_cache() is True
    first = qa.run(question=context + "Name one.", temperature=0).get_meta_info("answer")
    second = qa.run(question=context + "Name two.", temperature=0).get_meta_info("answer")
    assert first["cached_tokens"] == 0
    assert second["cached_tokens"] >= second["prompt_tokens"] - 8  # all but the differing tail


def test_flush_cache_answers_like_the_engine(backend, url):
    # It returned the response's raw text, and raised when the server refused (requests running),
    # where Engine.flush_cache answers True / False.
    assert sgl.flush_cache() is True
    state = story.run(topic="a lighthouse", temperature=0, stream=True)
    pieces = state.text_iter("story")
    next(pieces)  # the request is running now
    try:
        assert sgl.flush_cache() is False
    finally:
        requests.post(
            url + "/abort_request", json={"abort_all": True}, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30
        )
        state.sync()


# ---------------------------------------------------------------- clear errors


def test_a_url_without_its_scheme_is_named():
    # requests said "No connection adapters were found for '127.0.0.1:30000/get_model_info'".
    with pytest.raises(ValueError, match=r"http:// or https://.*'127\.0\.0\.1:30000'"):
        sgl.RuntimeEndpoint("127.0.0.1:30000")


def test_a_port_nothing_listens_on_says_why_and_that_a_server_may_still_be_loading():
    with pytest.raises(
        requests.exceptions.ConnectionError,
        match=r"connection refused.*python -m plait\.runtime\.server.*still loading",
    ):
        sgl.RuntimeEndpoint(f"http://127.0.0.1:{free_port()}")


def test_a_url_with_a_route_says_to_give_the_servers_root(url):
    with pytest.raises(
        RuntimeError,
        match=r"HTTP 404 \(RuntimeEndpoint takes the server's root URL, such as "
        r"'http://127\.0\.0\.1:\d+'",
    ):
        sgl.RuntimeEndpoint(url + "/v1", api_key=API_KEY)


def test_a_missing_or_wrong_api_key_is_named(url):
    with pytest.raises(
        RuntimeError,
        match=r"HTTP 401 \(the server wants an API key: pass "
        r"RuntimeEndpoint\(url, api_key=\.\.\.\)\)",
    ):
        sgl.RuntimeEndpoint(url)
    with pytest.raises(RuntimeError, match=r"HTTP 401 \(the api_key given was refused\)"):
        sgl.RuntimeEndpoint(url, api_key="not-the-key")


def test_a_request_the_server_refuses_fails_as_in_process(backend):
    # The in-process Engine raises ValueError("the request needs up to ... tokens"); over HTTP it was a
    # RuntimeError holding the whole JSON error body.
    @sgl.function
    def too_long(s):
        s += "Hi" + sgl.gen("x", max_tokens=100_000)

    error = too_long.run(temperature=0).error()
    assert isinstance(error, ValueError)
    assert str(error).endswith(
        "/generate answered HTTP 400: the request needs up to 100001 tokens (1 in the prompt"
        " + max_new_tokens 100000), more than the context length 8192: lower max_new_tokens"
        " or shorten the prompt"
    )


def test_a_request_timeout_ends_the_program_with_a_named_timeout(backend, url):
    impatient = sgl.RuntimeEndpoint(url, api_key=API_KEY, timeout=0.5)
    state = story.run(topic="a storm", temperature=0, backend=impatient)
    error = state.error()
    assert isinstance(error, requests.exceptions.ReadTimeout)
    assert "/generate sent no answer within timeout=0.5s" in str(error)
    requests.post(
        url + "/abort_request", json={"abort_all": True}, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30
    )


# ---------------------------------------------------------------- the server dies (kills the module's server: last)


def test_server_killed_mid_run_batch_ends_every_program_with_a_clear_error(backend, url):
    streamed = story.run(topic="a ship", temperature=0, stream=True)
    pieces = streamed.text_iter("story")
    results: list = []
    batch = threading.Thread(
        target=lambda: results.extend(
            story.run_batch([{"topic": f"town {i}"} for i in range(6)], temperature=0, num_threads=3)
        ),
        daemon=True,
    )
    batch.start()
    next(pieces)  # the stream runs, and so (queued or running) does the batch
    os.kill(server_pid(url), signal.SIGKILL)
    with pytest.raises(
        RuntimeError,
        match=r"variable 'story' failed.*ended /generate's stream before its last "
        r"chunk .*did it exit or restart\?",
    ):
        list(pieces)
    batch.join(timeout=60)
    assert not batch.is_alive(), "run_batch hung after the server died"
    assert len(results) == 6
    for state in results:
        # Failed in flight (the connection dropped) or at the next request (refused): both say so.
        assert isinstance(state.error(), requests.exceptions.ConnectionError)
        assert "it answered before; did it exit or restart?" in str(state.error())
    # A later program fails at once, with the same message.
    started = time.time()
    late = qa.run(question="Hi", temperature=0)
    assert "stopped answering during /generate (connection refused" in str(late.error())
    assert time.time() - started < 30
