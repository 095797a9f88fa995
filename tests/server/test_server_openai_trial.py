"""Regressions from a new user's trial of `plait serve` with the official openai client.

Each test pins a failure the trial found: a response without an X-Request-Id header, a streamed
echo that dropped the prompt's logprobs, streams cut by the client missing from the metrics, and
requests for OpenAI features plait does not implement (image parts, legacy function calls, a forced
tool_choice without tools, stored completions, stream_options without stream) answered with a
misleading message or silently ignored. One server (a subprocess on a free port, the embedded model) serves the whole
module.
"""

from __future__ import annotations

import asyncio
import time

import openai
import pytest
import requests
from conftest import server_process
from prometheus_client.parser import text_string_to_metric_families

STARTUP_DEADLINE_S = 600
SETTLE_DEADLINE_S = 30
USER_HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    with server_process(log_path, "--num-threads", "1", startup_deadline_s=STARTUP_DEADLINE_S) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _server_info(url: str) -> dict:
    return requests.get(url + "/get_server_info", timeout=30).json()


def _wait_idle(url: str) -> dict:
    """Server info once no request is open or running (a leak keeps them non-zero)."""
    deadline = time.time() + SETTLE_DEADLINE_S
    while True:
        info = _server_info(url)
        if info["num_open_http_requests"] == 0 and info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0:
            return info
        if time.time() > deadline:
            pytest.fail(f"requests still open {SETTLE_DEADLINE_S}s later: {info}")
        time.sleep(0.2)


def _finished_requests(url: str) -> dict[str, float]:
    """plait_requests_total by finish_reason."""
    text = requests.get(url + "/metrics", timeout=30).text
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "plait_requests_total":
                counts[sample.labels["finish_reason"]] = sample.value
    return counts


# ---------------------------------------------------------------- request ids


def test_every_response_carries_a_request_id(url, client):
    raw = client.chat.completions.with_raw_response.create(model="default", messages=USER_HI, max_tokens=1)
    completion = raw.parse()
    assert completion._request_id == completion.id  # the openai client reads the x-request-id header
    r = requests.post(
        url + "/v1/completions",
        json={"prompt": "hi", "max_tokens": 1},
        headers={"X-Request-Id": "trace-42"},
        timeout=60,
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"  # the client's own, echoed
    r = requests.post(url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1}}, timeout=60)
    assert r.headers["x-request-id"] == r.json()["meta_info"]["id"]
    with pytest.raises(openai.BadRequestError) as info:  # errors are traceable too
        client.completions.create(model="default", prompt="hi", max_tokens=-1)
    assert info.value.request_id


# ---------------------------------------------------------------- streamed echo logprobs


def test_streamed_echo_has_the_prompt_logprobs_like_the_full_response(client):
    args = dict(model="default", prompt="Hi there", max_tokens=2, echo=True, logprobs=1, temperature=0)
    full = client.completions.create(**args).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**args, stream=True)]
    assert "".join(c.text for c in chunks) == full.text
    streamed = {
        key: sum((getattr(c.logprobs, key) for c in chunks), [])
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    }
    assert streamed["tokens"] == full.logprobs.tokens == ["Hi", " there"] + full.logprobs.tokens[2:]
    assert streamed["text_offset"] == full.logprobs.text_offset
    assert streamed["token_logprobs"] == pytest.approx(full.logprobs.token_logprobs)
    assert streamed["token_logprobs"][0] is None  # nothing predicts the first prompt token


def test_continuous_usage_stats_put_the_running_usage_on_every_chunk(client):
    # vLLM's stream option; plait accepted it and silently sent usage only at the end.
    chunks = list(
        client.chat.completions.create(
            model="default",
            messages=USER_HI,
            max_tokens=3,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == chunks[-1].usage.completion_tokens >= 1
    assert {c.usage.prompt_tokens for c in chunks} == {chunks[-1].usage.prompt_tokens}


# ---------------------------------------------------------------- disconnects and concurrency


def test_a_stream_the_client_drops_is_aborted_and_counted(url, client):
    before = _finished_requests(url).get("abort", 0.0)
    body = {"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    # (leaving the block closes the connection with the stream unread)
    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=60) as response:
        events = 0
        for line in response.iter_lines(decode_unicode=True):
            events += line.startswith("data:")
            if events == 2:
                break
    info = _wait_idle(url)
    assert info["kv_used_tokens"] == 0 and info["integrity_errors"] == 0
    assert _finished_requests(url).get("abort", 0.0) == before + 1
    assert client.completions.create(model="default", prompt="hi", max_tokens=1).choices[0].finish_reason


def test_twenty_parallel_streams_each_get_their_usage(url):
    aclient = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)

    async def one(i: int) -> tuple[int, int, str]:
        stream = await aclient.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": f"Say {i}"}],
            max_tokens=3,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        usage, reason = None, None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                reason = chunk.choices[0].finish_reason
            usage = chunk.usage or usage
        return usage.completion_tokens, usage.prompt_tokens, reason

    async def all_of_them():
        try:
            return await asyncio.gather(*(one(i) for i in range(20)))
        finally:
            await aclient.close()

    results = asyncio.run(all_of_them())
    assert all(
        completion >= 1 and prompt > 0 and reason in ("stop", "length") for completion, prompt, reason in results
    )
    assert _wait_idle(url)["kv_used_tokens"] == 0


# ---------------------------------------------------------------- unsupported features: clear 400s


def _chat(**fields) -> dict:
    return {"messages": USER_HI, "max_tokens": 1, **fields}


REFUSED = [
    (
        "/v1/chat/completions",
        _chat(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this?"},
                        {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
                    ],
                }
            ]
        ),
        "messages",
        "takes no images",
    ),
    (
        "/v1/chat/completions",
        _chat(messages=[{"role": "user", "content": [{"type": "text"}]}]),
        "messages",
        "missing required field 'messages.0.content.0.text'",
    ),
    (
        "/v1/chat/completions",
        _chat(
            messages=USER_HI
            + [{"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}]
        ),
        "messages",
        "legacy function_call are not supported: send tool_calls",
    ),
    ("/v1/chat/completions", _chat(tool_choice="required"), "tool_choice", "needs tools"),
    (
        "/v1/chat/completions",
        _chat(tool_choice={"type": "function", "function": {"name": "f"}}),
        "tool_choice",
        "not among the tools",
    ),
    (
        "/v1/chat/completions",
        _chat(stream_options={"include_usage": True}),
        "stream_options",
        "only allowed when stream is true",
    ),
    ("/v1/chat/completions", _chat(audio={"voice": "alloy", "format": "wav"}), "audio", "generates text only"),
    (
        "/v1/chat/completions",
        _chat(web_search_options={"search_context_size": "low"}),
        "web_search_options",
        "no web search",
    ),
    ("/v1/completions", {"prompt": {"text": "hi"}}, "prompt", "expected str, list[str], list[int] or list[list[int]]"),
    ("/v1/completions", {"prompt": "hi", "stop": 5}, "stop", "expected str or list[str]"),
    ("/v1/completions", {"prompt": "hi", "suffix": "end"}, "suffix", "suffix"),
    ("/v1/completions", {"prompt": "hi", "best_of": 3}, "best_of", "best_of must equal n"),
    ("/v1/completions", {"prompt": []}, "prompt", "must not be empty"),
]


@pytest.mark.parametrize("path, body, param, needle", REFUSED, ids=[f"{c[2]}-{i}" for i, c in enumerate(REFUSED)])
def test_unsupported_or_malformed_requests_get_a_400_naming_the_field(url, path, body, param, needle):
    r = requests.post(url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert needle in error["message"], error


def test_max_tokens_the_context_cannot_hold_is_a_400(url, client):
    # It used to run until the context was full (minutes for max_tokens=2**40 on this CPU), as no
    # OpenAI-compatible server does.
    with pytest.raises(openai.BadRequestError, match="more than the context length"):
        client.completions.create(model="default", prompt="hi", max_tokens=10**6)
    with pytest.raises(openai.BadRequestError, match="more than the context length"):
        client.chat.completions.create(model="default", messages=USER_HI, max_tokens=2**40)
    r = requests.post(url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 10**6}}, timeout=60)
    assert r.status_code == 400 and "more than the context length" in r.json()["error"]["message"]
    # A limit that fits still works.
    reply = client.chat.completions.create(model="default", messages=USER_HI, max_tokens=2)
    assert reply.usage.completion_tokens <= 2


def test_a_seed_out_of_range_is_refused_and_the_server_survives(url, client):
    # Such a seed used to reach torch.Generator.manual_seed in the scheduler and kill it: every later
    # request got a 500 and /health a 503.
    for seed, n in ((10**23, 1), (2**64 - 1, 2), (-(2**63) - 1, 1)):
        with pytest.raises(openai.BadRequestError, match="seed must be in"):
            client.chat.completions.create(model="default", messages=USER_HI, max_tokens=1, seed=seed, n=n)
    r = requests.post(
        url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1, "seed": 2**64}}, timeout=60
    )
    assert r.status_code == 400 and "seed must be in" in r.json()["error"]["message"]
    assert requests.get(url + "/health", timeout=30).status_code == 200
    reply = client.chat.completions.create(model="default", messages=USER_HI, max_tokens=2, seed=2**64 - 2, n=2)
    assert len(reply.choices) == 2


def test_a_logit_bias_that_overflows_float32_is_refused(url, client):
    # 1e308 is inf in float32: sampling returned token 0 every step instead of the biased token.
    with pytest.raises(openai.BadRequestError, match=r"logit_bias values must be in \[-100, 100\]"):
        client.completions.create(model="default", prompt="hi", max_tokens=1, logit_bias={"28": 1e308})
    r = requests.post(
        url + "/generate",
        json={"text": "hi", "sampling_params": {"max_new_tokens": 1, "logit_bias": {"28": 1e308}}},
        timeout=60,
    )
    assert r.status_code == 400 and "logit_bias" in r.json()["error"]["message"]
    biased = client.completions.create(
        model="default", prompt="hi", max_tokens=2, temperature=0, logit_bias={"28": 100}, logprobs=0
    )
    assert biased.choices[0].text == ",," and biased.choices[0].logprobs.tokens == [",", ","]


@pytest.mark.parametrize(
    "path, body, param, needle",
    [
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 1}',
            "messages",
            "messages[0].content is not valid Unicode",
        ),
        ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 1}', "prompt", "prompt is not valid Unicode"),
        ("/generate", '{"text": "a\\ud800b", "sampling_params": {"max_new_tokens": 1}}', "text", "not valid Unicode"),
    ],
    ids=["chat", "completions", "generate"],
)
def test_a_lone_surrogate_is_a_400_not_a_500(url, path, body, param, needle):
    # Valid JSON ("\ud800" escape), but no tokenizer can encode it: it was an internal error.
    r = requests.post(url + path, data=body, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and needle in r.json()["error"]["message"]


def test_strict_schema_with_a_keyword_the_backend_cannot_enforce_is_refused(client):
    # strict=true promises a matching output; uniqueItems is not enforced, which was silently ignored.
    schema = {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
        "required": ["tags"],
    }

    def ask(strict: bool):
        return client.chat.completions.create(
            model="default",
            messages=USER_HI,
            max_tokens=2,
            response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": strict}},
        )

    with pytest.raises(openai.BadRequestError, match="strict=true, but keyword 'uniqueItems'") as info:
        ask(strict=True)
    assert info.value.body["param"] == "response_format"
    assert ask(strict=False).choices[0].message.content.startswith("{")  # best effort without strict


def test_off_values_of_unsupported_openai_fields_are_accepted(client):
    # What SDK wrappers send on every request: asks for nothing plait lacks, so it must just work.
    completion = client.chat.completions.create(
        model="default",
        messages=USER_HI,
        max_tokens=1,
        store=False,
        metadata={"team": "a"},
        service_tier="auto",
        tool_choice="none",
        parallel_tool_calls=False,
    )
    assert completion.choices[0].finish_reason in ("stop", "length")


def test_a_reply_dumped_back_into_the_history_is_accepted(client):
    # `message.model_dump()` carries refusal/annotations/audio/function_call/tool_calls as nulls.
    first = client.chat.completions.create(model="default", messages=USER_HI, max_tokens=2, temperature=0)
    history = USER_HI + [first.choices[0].message.model_dump(), {"role": "user", "content": "again"}]
    assert history[1]["tool_calls"] is None and "annotations" in history[1]
    second = client.chat.completions.create(model="default", messages=history, max_tokens=2, temperature=0)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens


def test_wrong_method_and_unknown_route_say_what_is_served(url):
    r = requests.get(url + "/v1/chat/completions", timeout=30)
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert "GET /v1/chat/completions (allowed: POST)" in r.json()["error"]["message"]
    r = requests.post(url + "/v1/embeddings", json={"input": "hi"}, timeout=30)
    assert r.status_code == 404 and "no route POST /v1/embeddings" in r.json()["error"]["message"]


def test_models_retrieve(client):
    served = client.models.list().data[0].id
    assert client.models.retrieve(served).id == served
    assert client.models.retrieve("default").id == served  # the alias SGLang's examples send
    with pytest.raises(openai.NotFoundError, match="'gpt-4' does not exist"):
        client.models.retrieve("gpt-4")
