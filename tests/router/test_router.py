"""`plait router` over real replicas (two CPU `plait serve` processes on a small random model): a
conversation's turns go to the replica that holds its prefix, streams come through byte for byte,
native and OpenAI routes (the real `openai` client), its own /metrics, and a replica that dies is
skipped: a request in flight on it is sent again to the other, a stream in flight ends with an error
naming it. The prefix tree and the policy alone: tests/router/test_router_policy.py."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import requests
from conftest import free_port
from helpers.model_folders import TEMPLATE, build_tokenizer, make_folder

pytestmark = pytest.mark.timeout(600)

HEADER = "X-Plait-Replica"


def wait_healthy(procs_urls, log_paths, deadline_s=600):
    deadline = time.time() + deadline_s
    pending = dict(procs_urls)
    while pending:
        for url, proc in list(pending.items()):
            if proc.poll() is not None:
                pytest.fail(f"{url} exited with {proc.returncode}:\n{log_paths[url].read_text()[-3000:]}")
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    del pending[url]
            except requests.ConnectionError:
                pass
        assert time.time() < deadline, f"not healthy: {list(pending)}"
        time.sleep(0.3)


@contextlib.contextmanager
def processes(tmp_path, commands: dict[str, list[str]]):
    """Start every command at once (url -> argv), yield {url: process} once all answer /health."""
    procs, logs = {}, {}
    try:
        for i, (url, argv) in enumerate(commands.items()):
            logs[url] = tmp_path / f"proc{i}.log"
            with open(logs[url], "w") as log:
                procs[url] = subprocess.Popen(
                    [sys.executable, *argv],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, "PYTHONUNBUFFERED": "1"},
                )
        wait_healthy(procs, logs)
        yield procs
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("router")
    tokenizer = build_tokenizer()
    tokenizer.chat_template = TEMPLATE
    folder = make_folder(tmp / "llama", "llama", tokenizer=tokenizer, max_position_embeddings=2048)
    ports = [free_port() for _ in range(2)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    serve = {
        url: [
            "-m",
            "plait.runtime.server",
            "--model-path",
            folder,
            "--port",
            str(port),
            "--num-threads",
            "1",
            "--max-total-tokens",
            "8192",
        ]
        for url, port in zip(urls, ports)
    }
    with processes(tmp, serve) as replicas:
        router_port = free_port()
        router_url = f"http://127.0.0.1:{router_port}"
        router = {
            router_url: [
                "-m",
                "plait.runtime.router",
                "--worker-urls",
                *urls,
                "--port",
                str(router_port),
                "--health-check-interval",
                "0.5",
            ]
        }
        with processes(tmp, router):
            yield {"router": router_url, "replicas": replicas, "urls": urls}


def generate(url: str, text: str, n: int = 8, **extra) -> requests.Response:
    r = requests.post(
        url + "/generate",
        timeout=120,
        json={"text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0, **extra}},
    )
    assert r.status_code == 200, r.text
    return r


SYSTEMS = [f"system: you are helper number {i}, be brief and kind. " * 3 for i in range(4)]


def test_a_conversations_turns_go_where_its_prefix_is_cached(cluster):
    router = cluster["router"]
    homes = {}
    for system in SYSTEMS:
        history = system
        seen = []
        for turn in range(3):
            history += f" user: hello there, turn {turn}? assistant:"
            r = generate(router, history)
            seen.append(r.headers[HEADER])
            if turn:  # the replica had its earlier turns cached
                assert r.json()["meta_info"]["cached_tokens"] > 0, r.json()["meta_info"]
            history += r.json()["text"]
        assert len(set(seen)) == 1, seen
        homes[system] = seen[0]
    # Conversations nobody holds go to the replica with the most room: they spread.
    assert set(homes.values()) == set(cluster["urls"]), homes
    metrics = requests.get(router + "/metrics", timeout=30).text
    assert 'plait_router_requests_total{reason="prefix"' in metrics or 'reason="prefix"' in metrics
    matched = _metric(metrics, "plait_router_matched_items_total")
    total = _metric(metrics, "plait_router_prompt_items_total")
    assert 0.5 < matched / total < 1.0, (matched, total)


def _metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def test_streams_pass_through_byte_for_byte(cluster):
    router = cluster["router"]
    body = {
        "text": SYSTEMS[0] + " user: tell me more. assistant:",
        "stream": True,
        "sampling_params": {"max_new_tokens": 12, "temperature": 0},
    }
    via = requests.post(router + "/generate", json=body, stream=True, timeout=120)
    replica = via.headers[HEADER]
    chunks = [line for line in via.iter_lines() if line]
    direct = [
        line for line in requests.post(replica + "/generate", json=body, stream=True, timeout=120).iter_lines() if line
    ]
    assert chunks[-1] == b"data: [DONE]" and len(chunks) > 3

    def payload(lines):  # the same bytes but the per-request id and timings
        out = []
        for line in lines[:-1]:
            d = json.loads(line[len(b"data: ") :])
            out.append((d["text"], d["output_ids"] if "output_ids" in d else None, d["meta_info"]["finish_reason"]))
        return out

    assert payload(chunks) == payload(direct)


def test_openai_routes_through_the_real_client(cluster):
    import openai

    client = openai.OpenAI(base_url=cluster["router"] + "/v1", api_key="none")
    model = client.models.list().data[0].id
    messages = [{"role": "system", "content": SYSTEMS[1]}, {"role": "user", "content": "hello there"}]
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0)
    pieces = client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
    assert text == whole.choices[0].message.content and text
    done = client.completions.create(model=model, prompt=SYSTEMS[2] + " user: hi", max_tokens=5, temperature=0)
    assert done.choices[0].text is not None


def test_a_dead_replica_is_skipped_and_its_requests_go_elsewhere(cluster):
    router, replicas = cluster["router"], cluster["replicas"]
    prefix = SYSTEMS[3] + " user: please write a long story. assistant:"
    victim = generate(router, prefix, 2).headers[HEADER]
    survivor = next(u for u in cluster["urls"] if u != victim)
    # A long request in flight on the victim, then the victim killed: it comes back from the survivor.
    box: dict = {}

    def long_one():
        box["r"] = requests.post(
            router + "/generate",
            timeout=300,
            json={"text": prefix, "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}},
        )

    thread = threading.Thread(target=long_one, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while requests.get(victim + "/get_server_info", timeout=30).json()["num_running_reqs"] < 1:
        assert time.time() < deadline
        time.sleep(0.1)
    replicas[victim].send_signal(signal.SIGKILL)
    replicas[victim].wait(timeout=30)
    thread.join(timeout=240)
    assert not thread.is_alive(), "the in-flight request hung when its replica died"
    assert box["r"].status_code == 200, box["r"].text
    assert box["r"].headers[HEADER] == survivor
    # New requests, those whose prefix lived on the victim included, all go to the survivor.
    for system in SYSTEMS:
        assert generate(router, system + " user: again?", 2).headers[HEADER] == survivor
    info = requests.get(router + "/get_server_info", timeout=30).json()
    dead = next(r for r in info["replicas"] if r["url"] == victim)
    assert dead["healthy"] is False and dead["last_error"]
    assert requests.get(router + "/health", timeout=30).status_code == 200
    metrics = requests.get(router + "/metrics", timeout=30).text
    assert f'plait_router_replica_healthy{{replica="{victim}"}} 0.0' in metrics
    assert _metric(metrics, "plait_router_retries_total") >= 1
    # With every replica gone the router says so (503), it does not hang.
    replicas[survivor].send_signal(signal.SIGKILL)
    replicas[survivor].wait(timeout=30)
    r = requests.post(router + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}, timeout=60)
    assert r.status_code == 503 and "no replica could take the request" in r.json()["error"]["message"]
