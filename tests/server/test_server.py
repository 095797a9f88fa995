"""The real HTTP server end to end: `python -m plait.runtime.server` as a subprocess on a free port with
the embedded default model, exercised with `requests` and the official `openai` client.

One server for the whole module (starting one loads the model). It runs with an API key and with
`--max-running-requests 2 --max-queued-requests 2`, so auth and the 503 overload path are tested on
the same instance; every other test keeps at most four requests open and max_tokens small.
"""

from __future__ import annotations

import importlib.util
import json
import socket
import time

import openai
import pytest
import requests
from conftest import server_process
from prometheus_client.parser import text_string_to_metric_families

API_KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
STARTUP_DEADLINE_S = 600
# Far more tokens than the model can produce on a CPU before the polling deadline: if a request
# reached max_new_tokens, the abort did not happen.
LONG = 4000
IDLE_DEADLINE_S = 30


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    with server_process(
        log_path,
        "--api-key",
        API_KEY,
        "--max-running-requests",
        "2",
        "--max-queued-requests",
        "2",
        "--num-threads",
        "1",
        startup_deadline_s=STARTUP_DEADLINE_S,
    ) as url:
        yield {"url": url, "log": log_path}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


def post(server, path, body=None, **kw):
    return requests.post(server["url"] + path, json=body, headers={**AUTH, **kw.pop("headers", {})}, timeout=300, **kw)


def server_info(server) -> dict:
    r = requests.get(server["url"] + "/get_server_info", headers=AUTH, timeout=60)
    assert r.status_code == 200
    return r.json()


def wait_idle(server) -> dict:
    """Poll until no request runs, waits or holds KV; return the final server info."""
    deadline = time.time() + IDLE_DEADLINE_S
    while True:
        info = server_info(server)
        if (
            info["num_running_reqs"] == 0
            and info["num_waiting_reqs"] == 0
            and info["kv_used_tokens"] == 0
            and info["num_open_http_requests"] == 0
        ):
            return info
        assert time.time() < deadline, f"server did not go idle: {info}"
        time.sleep(0.1)


def sse_events(resp):
    """Yield decoded `data:` payloads of an SSE response until [DONE]."""
    for raw in resp.iter_lines():
        if not raw:
            continue
        line = raw.decode()
        assert line.startswith("data: "), line
        if line == "data: [DONE]":
            return
        yield json.loads(line[len("data: ") :])


def flush(server):
    wait_idle(server)
    r = post(server, "/flush_cache")
    assert r.status_code == 200 and r.json()["success"] is True


# ---------------------------------------------------------------- startup, auth, info


def test_ready_log_health_and_model_info(server):
    assert server["log"].read_text().count("plait server ready on http://127.0.0.1:") == 1
    assert requests.get(server["url"] + "/health", timeout=10).status_code == 200  # no key needed
    assert requests.get(server["url"] + "/health_generate", headers=AUTH, timeout=300).status_code == 200
    info = requests.get(server["url"] + "/get_model_info", headers=AUTH, timeout=10).json()
    assert info["is_generation"] is True and info["served_model_name"] == "SmolLM2-135M-Instruct"
    assert info["context_length"] > 0 and info["vocab_size"] == 49152


def test_api_key_required_everywhere_but_health_and_probes(server, client):
    # /metrics and /health_generate stay open, as SGLang's do (require_api_key_for_probes closes them).
    for path in ("/metrics", "/health_generate"):
        assert requests.get(server["url"] + path, timeout=300).status_code == 200, path
    routes = [
        ("GET", "/v1/models"),
        ("GET", "/get_model_info"),
        ("GET", "/get_server_info"),
        ("POST", "/generate"),
        ("POST", "/flush_cache"),
        ("POST", "/abort_request"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/responses"),
        ("GET", "/openapi.json"),
    ]
    for method, path in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            r = requests.request(method, server["url"] + path, headers=headers, json={}, timeout=30)
            assert r.status_code == 401, (method, path, headers)
            assert "API key" in r.json()["error"]["message"]
    bad_client = openai.OpenAI(base_url=server["url"] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_client.models.list()
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]
    info = server_info(server)
    assert info["api_key"] == "<redacted>" and info["internal_states"][0]["api_key"] == "<redacted>"


# ---------------------------------------------------------------- SGLang native API


def test_native_generate_single_batch_and_logprobs(server):
    r = post(
        server,
        "/generate",
        {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 6, "temperature": 0}},
    )
    assert r.status_code == 200
    out = r.json()
    assert set(out) >= {"text", "output_ids", "meta_info"} and len(out["output_ids"]) == 6
    meta = out["meta_info"]
    assert meta["completion_tokens"] == 6 and meta["prompt_tokens"] > 0
    assert meta["finish_reason"] == {"type": "length", "length": 6}

    r = post(
        server,
        "/generate",
        {
            "input_ids": [[504, 3575, 282], [1, 2, 3, 4]],
            "rid": ["b-0", "b-1"],
            "sampling_params": [{"max_new_tokens": 3, "temperature": 0}, {"max_new_tokens": 2, "temperature": 0}],
            "return_logprob": True,
            "top_logprobs_num": 2,
            "return_text_in_logprobs": True,
        },
    )
    assert r.status_code == 200
    batch = r.json()
    assert [o["meta_info"]["id"] for o in batch] == ["b-0", "b-1"]
    assert [o["meta_info"]["completion_tokens"] for o in batch] == [3, 2]
    for o in batch:
        lps = o["meta_info"]["output_token_logprobs"]
        assert len(lps) == len(o["output_ids"])
        assert [entry[1] for entry in lps] == o["output_ids"]
        assert all(isinstance(entry[2], str) and entry[0] <= 0 for entry in lps)
        assert all(len(top) == 2 for top in o["meta_info"]["output_top_logprobs"])

    r = post(server, "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2, "n": 2, "seed": 3}})
    assert r.status_code == 200 and len(r.json()) == 2


def test_native_stream_is_cumulative_and_matches_non_stream(server):
    body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    flush(server)  # both runs start from an empty cache: identical numerics, identical greedy tokens
    expected = post(server, "/generate", body).json()
    flush(server)
    with post(server, "/generate", {**body, "stream": True}, stream=True) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        chunks = list(sse_events(r))
    assert len(chunks) >= 2
    for prev, cur in zip(chunks, chunks[1:]):
        assert cur["text"].startswith(prev["text"])
        assert cur["meta_info"]["completion_tokens"] >= prev["meta_info"]["completion_tokens"]
    assert chunks[-1]["text"] == expected["text"]
    assert chunks[-1]["output_ids"] == expected["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_abort_request_by_rid_ends_the_stream(server):
    with post(
        server,
        "/generate",
        {
            "text": "Count to a million:",
            "rid": "abort-me",
            "stream": True,
            "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True},
        },
        stream=True,
    ) as r:
        events = sse_events(r)
        next(events)
        assert post(server, "/abort_request", {"rid": "abort-me"}).json()["aborted"] == ["abort-me"]
        last = list(events)[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert last["meta_info"]["completion_tokens"] < LONG
    wait_idle(server)


# ---------------------------------------------------------------- OpenAI API


def test_openai_completions(server, client):
    r = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt="1, 2, 3,", max_tokens=12, temperature=0, stop=[" 6"]
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and "6" not in choice.text and choice.text.startswith(" 4")
    assert r.usage.prompt_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    r = client.completions.create(
        model="default", prompt=["Hello", "Goodbye"], max_tokens=3, n=2, temperature=0.8, seed=1, logprobs=2
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in r.choices)
    # up to logprobs + 1: the chosen token is always there too (OpenAI)
    assert all(len(top) <= 3 for c in r.choices for top in c.logprobs.top_logprobs)

    pieces, finish = [], None
    for chunk in client.completions.create(
        model="default", prompt="Once upon a time", max_tokens=5, temperature=0, stream=True
    ):
        pieces.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "length" and "".join(pieces)
    full = client.completions.create(model="default", prompt="Once upon a time", max_tokens=5, temperature=0)
    assert full.choices[0].text.startswith("".join(pieces)[:1])


def test_openai_chat_stream_and_non_stream_agree(server, client):
    messages = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name a color."}]
    flush(server)
    full = client.chat.completions.create(
        model="default", messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2
    )
    msg = full.choices[0]
    assert msg.message.role == "assistant" and msg.message.content
    assert len(msg.logprobs.content) == full.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in msg.logprobs.content)
    flush(server)
    stream = client.chat.completions.create(
        model="default",
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == msg.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_chat_usage_reports_cached_prompt_tokens_and_n(server, client):
    messages = [{"role": "user", "content": "Write one word about the sea."}]
    first = client.chat.completions.create(
        model="default", messages=messages, max_completion_tokens=3, n=2, temperature=0.7, seed=5
    )
    assert len(first.choices) == 2 and first.usage.completion_tokens <= 6
    again = client.chat.completions.create(model="default", messages=messages, max_tokens=3)
    # The whole prompt but its last token was computed before: it comes from the radix cache.
    assert again.usage.prompt_tokens_details.cached_tokens >= again.usage.prompt_tokens - 1 > 0


PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.mark.xfail(
    importlib.util.find_spec("plait.runtime.constrained.integration") is None,
    strict=True,
    reason="the scheduler's constrained-decoding integration has not landed yet",
)
def test_response_format_json_schema(server, client):
    import jsonschema

    r = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Describe a person."}],
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}},
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON_SCHEMA)
    r = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Any JSON."}],
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_object"},
    )
    content = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    else:  # the small model may nest until max_tokens: then the text is a cut-off JSON object
        assert r.choices[0].finish_reason == "length" and content.startswith("{")


# ---------------------------------------------------------------- bad input: 4xx, server keeps serving

TOO_LONG_IDS = [504] * 9000
BAD_REQUESTS = [
    # (path, body or raw bytes, status, param or None, words the message must contain)
    ("/generate", b'{"text": "hi",', 400, None, "malformed JSON"),
    ("/v1/chat/completions", b"{not json", 400, None, "malformed JSON"),
    ("/generate", b"[1, 2]", 400, None, "JSON object"),
    ("/generate", {"text": 5}, 400, "text", "text"),
    ("/generate", {"text": "hi", "stream": "yes"}, 400, "stream", "stream"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": "8"}}, 400, "sampling_params", "max_new_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"temprature": 0.5}}, 400, "sampling_params", "temprature"),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": -1}}, 400, "sampling_params", "temperature"),
    ("/generate", {"text": "hi", "sampling_params": {"top_p": 0}}, 400, "sampling_params", "top_p"),
    ("/generate", {"text": "hi", "sampling_params": {"top_k": 0}}, 400, "sampling_params", "top_k"),
    (
        "/generate",
        {"text": "hi", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}},
        400,
        "sampling_params",
        "mutually exclusive",
    ),
    ("/generate", {"text": "hi", "temperature": 0}, 400, "temperature", "send it inside sampling_params"),
    ("/generate", {"text": "hi", "image_data": "x.png"}, 400, "image_data", "takes no images"),
    ("/generate", {"input_ids": [1, 49152]}, 400, "input_ids", "49152"),
    ("/generate", {"input_ids": TOO_LONG_IDS}, 400, "input_ids", "too long"),
    ("/generate", {"text": "word " * 9000}, 400, None, "too long"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model", "gpt-4"),
    (
        "/v1/chat/completions",
        {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]},
        404,
        "model",
        "gpt-4",
    ),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens", "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": 3}, 400, "temperature", "temperature"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, 400, "logprobs", "logprobs"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n", "n"),
    ("/v1/completions", {"prompt": "hi", "best_of": 3}, 400, None, "best_of"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt", "prompt"),
    ("/v1/completions", {"prompt": TOO_LONG_IDS}, 400, "prompt", "too long"),
    ("/v1/completions", {"prompt": "hi", "top_k": 0}, 400, None, "top_k"),
    ("/v1/completions", {"prompt": "hi", "lora_path": "adapter"}, 400, "lora_path", "name a LoRA adapter by `model`"),
    ("/v1/completions", {"prompt": "hi", "priority": "high"}, 400, "priority", "valid integer"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages", "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "messages"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 30, "logprobs": True},
        400,
        "top_logprobs",
        "top_logprobs",
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 9000}]}, 400, "messages", "too long"),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x"}},
        },
        400,
        None,
        "json_schema",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
        },
        400,
        None,
        "not a valid JSON schema",
    ),
    ("/v1/completions", {"prompt": "hi", "regex": "("}, 400, None, "regex"),
]


@pytest.mark.parametrize(
    "path, body, status, param, needle",
    BAD_REQUESTS,
    ids=[f"{i}-{c[0]}-{c[4][:20]}" for i, c in enumerate(BAD_REQUESTS)],
)
def test_bad_input_gets_4xx_naming_the_field(server, path, body, status, param, needle):
    if isinstance(body, bytes):
        r = requests.post(
            server["url"] + path, data=body, timeout=60, headers={**AUTH, "Content-Type": "application/json"}
        )
    else:
        r = post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"], err
    if param is not None:
        assert err["param"] == param, err


def test_server_still_serves_after_bad_input(server, client):
    post(server, "/generate", {"text": 5})
    r = client.completions.create(model="default", prompt="Hi", max_tokens=2)
    assert r.choices[0].text is not None and r.usage.completion_tokens <= 2


# ---------------------------------------------------------------- disconnects, overload


def test_disconnect_mid_stream_aborts_and_frees_kv(server):
    before = wait_idle(server)
    r = post(
        server,
        "/generate",
        {
            "text": "Tell me everything about rivers.",
            "stream": True,
            "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True},
        },
        stream=True,
    )
    events = sse_events(r)
    next(events), next(events)
    r.close()  # the client goes away mid-stream
    after = wait_idle(server)  # running 0, KV used 0, no open HTTP requests
    assert after["generation_tokens"] - before["generation_tokens"] < LONG
    assert after["last_integrity_error"] is None
    assert "client disconnected; aborting" in server["log"].read_text()


def test_disconnect_mid_request_aborts_non_streaming(server):
    before = wait_idle(server)
    body = json.dumps(
        {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": LONG, "ignore_eos": True}
    ).encode()
    host, port = server["url"].rsplit("/", 1)[1].split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        deadline = time.time() + IDLE_DEADLINE_S
        while server_info(server)["num_running_reqs"] == 0:  # wait until it is decoding
            assert time.time() < deadline
            time.sleep(0.1)
    after = wait_idle(server)
    assert after["generation_tokens"] - before["generation_tokens"] < LONG


def test_overload_gets_503_and_recovers(server):
    wait_idle(server)
    body = {"text": "Keep talking.", "stream": True, "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}}
    held = []
    try:
        for _ in range(4):  # max_running_requests 2 + max_queued_requests 2: two run, two wait
            r = post(server, "/generate", body, stream=True)  # returns once the headers arrive
            assert r.status_code == 200
            held.append(r)
        r = post(server, "/generate", {"text": "one more", "sampling_params": {"max_new_tokens": 1}})
        assert r.status_code == 503 and "capacity" in r.json()["error"]["message"]
        assert 1 <= int(r.headers["Retry-After"]) <= 60  # when to come back, in whole seconds
        r = post(server, "/v1/completions", {"prompt": "one more", "max_tokens": 1})
        assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
        info = server_info(server)
        assert info["num_running_reqs"] + info["num_waiting_reqs"] == 4
    finally:
        for r in held:
            r.close()
    wait_idle(server)
    assert post(server, "/generate", {"text": "ok", "sampling_params": {"max_new_tokens": 1}}).status_code == 200


# ---------------------------------------------------------------- metrics


def scrape(server) -> dict:
    r = requests.get(server["url"] + "/metrics", headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            key = s.name + ("{" + s.labels["finish_reason"] + "}" if "finish_reason" in s.labels else "")
            samples[key] = s.value
    return samples


def test_metrics_parse_and_count(server):
    before = scrape(server)
    with post(
        server,
        "/generate",
        {"text": "Hello there", "stream": True, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}},
        stream=True,
    ) as r:
        list(sse_events(r))
    after = scrape(server)
    assert after["plait_generation_tokens_total"] - before.get("plait_generation_tokens_total", 0) == 4
    assert after["plait_prompt_tokens_total"] > before.get("plait_prompt_tokens_total", 0)
    assert after["plait_requests_total{length}"] == before.get("plait_requests_total{length}", 0) + 1
    assert (
        after["plait_time_to_first_token_seconds_count"] == before.get("plait_time_to_first_token_seconds_count", 0) + 1
    )
    assert (
        after["plait_inter_token_latency_seconds_count"] == before.get("plait_inter_token_latency_seconds_count", 0) + 3
    )
    assert (
        after["plait_e2e_request_latency_seconds_count"] == before.get("plait_e2e_request_latency_seconds_count", 0) + 1
    )
    for gauge in ("plait_num_running_reqs", "plait_num_queued_reqs", "plait_kv_cache_usage", "plait_cache_hit_rate"):
        assert gauge in after
    assert 0.0 <= after["plait_cache_hit_rate"] <= 1.0 and 0.0 <= after["plait_kv_cache_usage"] <= 1.0
    assert after["plait_rejected_requests_total"] >= 0
