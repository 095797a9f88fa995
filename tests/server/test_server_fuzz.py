"""A seeded fuzzer against a real `plait serve` (subprocess, embedded model, tiny max_tokens); the cases
and the raw HTTP client are in server_fuzzer.py. Then schemathesis fuzzes every operation of the published
OpenAPI schema (/openapi.json, both APIs), a fixed number of generated requests each.

No request may make the server answer 5xx, hang, or die, and after each one a normal request must still
succeed. Every error is a JSON body `{"error": {"message": ...}}` with a 4xx status. At the end the
server's RSS and thread count have not grown much and the KV cache is clean (nothing running, no KV in
use but the evictable prefix cache, no integrity error).
"""

from __future__ import annotations

import json
import socket
import threading
from urllib.parse import urlparse

import pytest
import schemathesis
from conftest import server_info, server_pid, wait_server_idle
from helpers.server_fuzzer import (
    NUM_CASES,
    SEED,
    TOOL,
    VALID_BODIES,
    Reply,
    canary,
    cap_generation,
    chat_body,
    error_body_problem,
    post_json,
    raw_request,
    resources,
    run_cases,
)
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import content_type_conformance, status_code_conformance

# Generated requests per operation of the schema and kind (valid / not; 22 operations): bounds the test's time.
OPENAPI_EXAMPLES = 5

# ---------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from conftest import server_process

    log = tmp_path_factory.mktemp("fuzz") / "server.log"
    with server_process(log, "--num-threads", "1", "--max-total-tokens", "4096") as url:
        pid = server_pid(url)
        # Warm up what grows once and stays (the to_thread pool, tokenizer and grammar caches), so the
        # final comparison sees leaks, not first use.
        for path, body in VALID_BODIES:
            post_json(url, path, body)
        threads = [threading.Thread(target=server_info, args=(url,)) for _ in range(40)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        wait_server_idle(url)
        yield {"url": url, "pid": pid, "log": log, "baseline": resources(pid)}


def test_unparseable_http_gets_a_json_400(server):
    """uvicorn answered requests its HTTP parser refused with plain text 'Invalid HTTP request received.'"""
    url = server["url"]
    for path, headers in [
        ("/v1/models/\u00e9", {}),
        ("/generate", {"Content-Length": "-1"}),
        ("/generate", {"Content-Length": "abc"}),
    ]:
        reply = raw_request(url, "POST", path, b"{}", {"Content-Type": "application/json", **headers}, timeout=10)
        assert reply.status == 400, reply
        assert reply.json()["error"]["message"].startswith("malformed HTTP request"), reply
    assert canary(url) is None


def test_absurd_content_length_gets_413_at_once(server):
    """A Content-Length of 1e20 used to make the server wait for that body forever (the client hung)."""
    url = server["url"]
    for path in ("/generate", "/v1/chat/completions", "/flush_cache", "/nope"):
        reply = raw_request(
            url,
            "POST",
            path,
            b"{}",
            {"Content-Type": "application/json", "Content-Length": "99999999999999999999"},
            timeout=10,
        )
        assert reply.status == 413, reply
        assert "too large" in reply.json()["error"]["message"], reply
    assert canary(url) is None


def test_chunked_body_past_the_limit_gets_413():
    """A chunked body has no declared length: it is counted as it arrives (the server would buffer it all).
    The guard wraps a real FastAPI app with a 1,000-byte limit, driven through the ASGI interface the way
    uvicorn drives it: the body comes in pieces, with no Content-Length."""
    import asyncio

    from fastapi import FastAPI
    from plait.runtime.server.errors import install_error_handlers
    from plait.runtime.server.http_guards import BodySizeLimit

    app = FastAPI()
    install_error_handlers(app)

    @app.post("/echo")
    async def echo(body: dict) -> dict:
        return body

    guarded = BodySizeLimit(app, limit=1000)

    async def post_in_pieces(n: int) -> tuple[int, bytes]:
        pieces = [b'{"a": "', *([b"x" * 100] * n), b'"}']
        incoming = [{"type": "http.request", "body": p, "more_body": k < len(pieces) - 1} for k, p in enumerate(pieces)]
        sent: list[dict] = []

        async def receive() -> dict:
            return incoming.pop(0) if incoming else {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/echo",
            "raw_path": b"/echo",
            "root_path": "",
            "query_string": b"",
            "headers": [(b"content-type", b"application/json"), (b"transfer-encoding", b"chunked")],
            "server": ("127.0.0.1", 80),
            "client": ("127.0.0.1", 5000),
        }
        await guarded(scope, receive, send)
        status = next(m["status"] for m in sent if m["type"] == "http.response.start")
        return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")

    (small_status, small_body), (big_status, big_body) = [asyncio.run(post_in_pieces(n)) for n in (5, 50)]
    assert small_status == 200 and json.loads(small_body) == {"a": "x" * 500}
    assert big_status == 413 and "limit is 1000 bytes" in json.loads(big_body)["error"]["message"], big_body


def test_pin_prefix_with_a_lone_surrogate_is_a_400(server):
    """/pin_prefix handed '\\ud800' to the tokenizer: 500 TypeError."""
    reply = raw_request(
        server["url"], "POST", "/pin_prefix", b'{"text": "a\\ud800"}', {"Content-Type": "application/json"}
    )
    assert reply.status == 400 and "not valid Unicode" in reply.json()["error"]["message"], reply


def test_huge_n_is_a_400(server):
    """n = 1e30 on /generate built 1e30 Engine calls on the event loop: the whole server hung (and grew)."""
    for n in (10**30, 2**64, 65):
        reply = post_json(server["url"], "/generate", {"text": "Hi", "sampling_params": {"n": n}}, timeout=10)
        assert reply.status == 400 and "n must be <= 64" in reply.json()["error"]["message"], reply
    assert canary(server["url"]) is None


def test_tool_description_with_a_lone_surrogate_is_a_400(server):
    """A tool's description reaches the prompt unchecked: '\ud800' there was a 500 from the tokenizer."""
    body = json.dumps(chat_body(tools=[TOOL])).replace('"Weather of a city"', '"Weather \\ud800"').encode()
    reply = raw_request(server["url"], "POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    assert reply.status == 400 and "not valid Unicode" in reply.json()["error"]["message"], reply


def test_half_a_body_then_hang_up(server):
    url = server["url"]
    u = urlparse(url)
    body = json.dumps({"text": "Hi", "sampling_params": {"max_new_tokens": 50, "ignore_eos": True}}).encode()
    for _ in range(5):
        with socket.create_connection((u.hostname, u.port)) as sock:
            sock.sendall(
                b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body[: len(body) // 2])
            )
    assert canary(url) is None
    assert wait_server_idle(url)["num_open_http_requests"] == 0


@pytest.mark.parametrize(
    "path, body",
    [
        (
            "/generate",
            {
                "text": "Count to a hundred.",
                "stream": True,
                "sampling_params": {"max_new_tokens": 200, "ignore_eos": True, "n": 2},
            },
        ),
        ("/v1/completions", {"prompt": "Count to a hundred.", "max_tokens": 200, "ignore_eos": True, "stream": True}),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "Count."}],
                "max_tokens": 200,
                "ignore_eos": True,
                "stream": True,
                "tools": [TOOL],
            },
        ),
    ],
)
def test_disconnect_mid_stream_frees_everything(server, path, body):
    url = server["url"]
    u = urlparse(url)
    before = wait_server_idle(url)["generation_tokens"]
    data = json.dumps(body).encode()
    with socket.create_connection((u.hostname, u.port), timeout=60) as sock:
        sock.sendall(
            b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (path.encode(), len(data), data)
        )
        got = b""
        while got.count(b"data: ") < 3:  # a few events in: the request is decoding
            got += sock.recv(4096)
    info = wait_server_idle(url)
    assert info["generation_tokens"] - before < 200, "the abandoned stream ran to max_tokens"
    assert canary(url) is None


def test_200_concurrent_connections(server):
    url = server["url"]
    replies: list = [None] * 200

    def one(i: int) -> None:
        try:
            if i % 4 == 0:
                replies[i] = post_json(
                    url, "/generate", {"text": f"Number {i}", "sampling_params": {"max_new_tokens": 1}}, timeout=120
                )
            else:
                replies[i] = raw_request(
                    url, "GET", ["/health", "/v1/models", "/get_server_info", "/metrics"][i % 4], timeout=120
                )
        except OSError as e:
            replies[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(200)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    bad = [(i, r) for i, r in enumerate(replies) if not isinstance(r, Reply) or r.status != 200]
    assert not bad, bad[:5]
    assert canary(url) is None


def test_http10_head_and_options(server):
    url = server["url"]
    reply = raw_request(
        url,
        "POST",
        "/generate",
        json.dumps({"text": "Hi", "sampling_params": {"max_new_tokens": 1}}).encode(),
        {"Content-Type": "application/json"},
        version="HTTP/1.0",
    )
    assert reply.status == 200 and reply.json()["meta_info"]["completion_tokens"] == 1
    assert raw_request(url, "HEAD", "/health").status == 200
    for method, path in [("OPTIONS", "/generate"), ("HEAD", "/generate"), ("DELETE", "/v1/models")]:
        reply = raw_request(url, method, path)
        assert reply.status == 405, (method, path, reply)
        if method != "HEAD":
            assert "method not allowed" in reply.json()["error"]["message"]


def test_fuzz_every_route(server):
    url = server["url"]
    failures = run_cases(url, SEED, NUM_CASES)
    assert not failures, "\n".join(failures[:20])


def test_the_published_openapi_schema_fuzzed(server):
    """Requests generated by schemathesis from the server's own /openapi.json, for every operation of both APIs,
    valid per the schema and not (OPENAPI_EXAMPLES of each kind, derandomized): never a 5xx, statuses and
    content types the schema documents, every 4xx a JSON error naming the field at fault, and a normal request
    still served after each."""
    url = server["url"]
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    failures: list[str] = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 20, [op.label for op in operations]
    for operation in operations:
        for mode in GenerationMode:

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(
                max_examples=OPENAPI_EXAMPLES,
                deadline=None,
                derandomize=True,
                database=None,
                phases=[Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            def fuzz(case) -> None:
                cap_generation(case.path, case.body)
                response = case.call(base_url=url, timeout=60)
                where = f"{case.method} {case.formatted_path} ({mode.value}) {case.body!r:.200}"
                try:
                    case.validate_response(
                        response, checks=[not_a_server_error, status_code_conformance, content_type_conformance]
                    )
                except (Exception, FailureGroup) as e:  # noqa: BLE001 - schemathesis' failures, kept
                    failures.append(f"{where}: {type(e).__name__}: {str(e)[:300]}")
                problem = error_body_problem(
                    case.body, response.status_code, response.headers.get("content-type", ""), response.content
                )
                if problem is not None:
                    failures.append(f"{where}: {problem}")
                if (problem := canary(url)) is not None:
                    failures.append(f"after {where}: {problem}")

            try:
                fuzz()
            except Unsatisfiable:  # nothing to make invalid: the operation takes no input
                assert mode is GenerationMode.NEGATIVE, operation.label
    assert not failures, "\n".join(failures[:20])


def test_no_leak_and_kv_clean_after_everything(server):
    """Runs last: after all of the above the server is idle, its KV cache whole, its resources flat."""
    url = server["url"]
    wait_server_idle(url)
    flushed = raw_request(url, "POST", "/flush_cache")  # also drops the pins the fuzzer made
    assert flushed.status == 200, flushed
    info = server_info(url)
    assert info["kv_used_tokens"] == 0 and info["free_tokens"] == info["max_total_tokens"], info
    assert info["integrity_errors"] == 0 and info["last_integrity_error"] is None, info
    after, before = resources(server["pid"]), server["baseline"]
    print(f"server before {before} after {after}")
    assert after["threads"] <= before["threads"] + 4, (before, after)
    assert after["fds"] <= before["fds"] + 8, (before, after)
    assert after["rss_mb"] <= before["rss_mb"] + 150, (before, after)
    assert "Traceback" not in server["log"].read_text(), server["log"].read_text()[-3000:]
