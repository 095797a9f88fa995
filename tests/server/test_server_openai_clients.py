"""Regressions from a new user's trial of `plait serve` driven the way apps and wrappers drive it: the
official openai client (sync and async), `requests` with compressed bodies, explicit nulls.

Each test pins a failure the trial found: `"n": null` (and the other nullable OpenAI fields) refused,
chat logprob `bytes` that could not rebuild a character split over tokens, gzip request bodies
answered with an opaque parse error, and an empty model name refused. One server (a subprocess on a
free port, the embedded model) serves the whole module.
"""

from __future__ import annotations

import gzip
import json
import threading
import time
import zlib

import openai
import pytest
import requests
import test_server_openai_trial as trial
from conftest import wait_server_idle

USER_HI = [{"role": "user", "content": "hi"}]
# The embedded model answers this with an emoji whose 4 UTF-8 bytes come in 3 tokens.
EMOJI = [{"role": "user", "content": "Say 👋"}]


# The same module-scoped server and client as the first OpenAI trial: pytest starts one for this module too.
url, client = trial.url, trial.client


# ---------------------------------------------------------------- explicit nulls


def test_explicit_nulls_mean_the_defaults(url, client):
    # The openai client sends `"n": null` for n=None; OpenAI declares these fields nullable, and vLLM
    # reads null as the default. plait answered 400 "n: Input should be a valid integer".
    chat = client.chat.completions.create(
        model="default", messages=USER_HI, max_tokens=2, temperature=0, n=None, stream=None, logprobs=None
    )
    assert len(chat.choices) == 1 and chat.choices[0].logprobs is None and chat.usage.completion_tokens <= 2
    legacy = client.completions.create(
        model="default", prompt="hi", max_tokens=2, temperature=0, n=None, echo=None, stream=None
    )
    assert len(legacy.choices) == 1 and not legacy.choices[0].text.startswith("hi")  # echo stayed off
    r = requests.post(
        url + "/v1/chat/completions",
        timeout=60,
        json={
            "messages": USER_HI,
            "max_tokens": 1,
            "ignore_eos": None,
            "skip_special_tokens": None,
            "continue_final_message": None,
            "no_stop_trim": None,
        },
    )
    assert r.status_code == 200, r.text
    # A null that is not a default is still refused by name.
    r = requests.post(url + "/v1/chat/completions", json={"messages": None}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


# ---------------------------------------------------------------- logprob bytes


def _joined_bytes(content) -> bytes:
    return b"".join(bytes(t.bytes) for t in content)


def test_chat_logprob_bytes_rebuild_characters_split_over_tokens(client):
    # OpenAI's `bytes` lets a client join tokens that each hold part of a character. plait sent the
    # UTF-8 bytes of U+FFFD (what such a token decodes to alone), so the join was garbage.
    reply = client.chat.completions.create(
        model="default", messages=EMOJI, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2
    )
    choice = reply.choices[0]
    content = choice.logprobs.content
    assert "\ufffd" in "".join(t.token for t in content)  # the case this pins: partial characters
    assert _joined_bytes(content).decode("utf-8") == choice.message.content
    assert all(t.top_logprobs[0].bytes == t.bytes for t in content)  # greedy: the top one is the token
    stream = client.chat.completions.create(
        model="default", messages=EMOJI, max_tokens=3, temperature=0, logprobs=True, stream=True
    )
    streamed = [t for chunk in stream for c in chunk.choices if c.logprobs for t in c.logprobs.content]
    assert _joined_bytes(streamed) == _joined_bytes(content)


# ---------------------------------------------------------------- compressed request bodies


def _post_encoded(url: str, data: bytes, encoding: str) -> requests.Response:
    return requests.post(
        url + "/v1/completions",
        data=data,
        timeout=60,
        headers={"Content-Type": "application/json", "Content-Encoding": encoding},
    )


def test_gzip_and_deflate_request_bodies_are_inflated(url):
    # They were read as JSON as they came: 400 "There was an error parsing the body".
    body = json.dumps({"prompt": "The sky is", "max_tokens": 2, "temperature": 0}).encode()
    plain = requests.post(url + "/v1/completions", data=body, timeout=60).json()["choices"][0]["text"]
    for encoding, data in (("gzip", gzip.compress(body)), ("deflate", zlib.compress(body))):
        r = _post_encoded(url, data, encoding)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == plain


@pytest.mark.parametrize(
    "encoding, data, status, needle",
    [
        ("br", b"{}", 415, "unsupported Content-Encoding 'br'"),
        ("gzip", b"{not gzip}", 400, "not valid gzip data"),
        ("gzip", gzip.compress(b'{"prompt": "hi"}')[:-6], 400, "truncated"),
        # A few hundred KiB that inflate past the 64 MiB body limit: refused as the bytes inflate.
        ("gzip", gzip.compress(b" " * (80 << 20), compresslevel=1), 413, "request body is too large"),
    ],
    ids=["br", "garbage", "truncated", "bomb"],
)
def test_bad_compressed_bodies_get_a_clear_error(url, encoding, data, status, needle):
    r = _post_encoded(url, data, encoding)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]
    assert wait_server_idle(url)["num_open_http_requests"] == 0


# ---------------------------------------------------------------- model names


def test_an_empty_model_name_is_the_served_model(client):
    # vLLM serves "" as its model; wrappers with the model setting left unset send it. plait said 404.
    reply = client.chat.completions.create(model="", messages=USER_HI, max_tokens=1)
    assert reply.model == client.models.list().data[0].id
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=USER_HI, max_tokens=1)


# ---------------------------------------------------------------- legacy completions logprobs


def test_completion_top_logprobs_always_hold_the_chosen_token(client):
    # OpenAI: "the API will always return the logprob of the sampled token, so there may be up to
    # logprobs+1 elements". plait gave None for logprobs=0 (a harness's max(top.values()) crashed) and
    # left a prompt token out of its own position's dict. The shape lm-eval's loglikelihood sends:
    prompts = [[504, 3461, 314, 2389], [504, 3461]]
    for k in (0, 2):
        reply = client.completions.create(
            model="default", prompt=prompts, max_tokens=1, temperature=0, logprobs=k, echo=True, seed=1234
        )
        for choice, prompt in zip(reply.choices, prompts):
            lp = choice.logprobs
            assert len(lp.tokens) == len(prompt) + 1 and lp.top_logprobs[0] is None  # nothing predicts it
            for token, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
                assert top[token] == logprob and len(top) <= k + 1
            # greedy: the generated token is the most likely one
            assert lp.token_logprobs[-1] == max(lp.top_logprobs[-1].values())


# ---------------------------------------------------------------- chat templates


def test_a_chat_template_sent_with_the_request_is_refused_and_cannot_stall_the_server(url, client):
    # chat_template_kwargs={"chat_template": ...} replaced the model's template. Rendering runs on the
    # event loop, and nested loops pass Jinja's sandbox: this one held every client (even /health) for
    # hours. vLLM refuses a request's template unless the operator trusts them.
    stall = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}hi"
    with pytest.raises(openai.BadRequestError, match="chat template sent with the request is not accepted") as info:
        client.chat.completions.create(
            model="default",
            messages=USER_HI,
            max_tokens=1,
            extra_body={"chat_template_kwargs": {"chat_template": stall}},
        )
    assert info.value.body["param"] == "chat_template_kwargs"
    assert requests.get(url + "/health", timeout=10).status_code == 200
    # Values for the model's own template are still passed on.
    reply = client.chat.completions.create(
        model="default",
        messages=USER_HI,
        max_tokens=1,
        extra_body={"chat_template_kwargs": {"add_generation_prompt": True}},
    )
    assert reply.usage.completion_tokens == 1


# ---------------------------------------------------------------- long prompts


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", lambda text: {"prompt": text, "max_tokens": 1}),
        ("/v1/chat/completions", lambda text: {"messages": [{"role": "user", "content": text}], "max_tokens": 1}),
    ],
    ids=["completions", "chat"],
)
def test_tokenizing_a_huge_prompt_does_not_hold_up_other_clients(url, path, body):
    # Tokenizing ran on the event loop: a 48 MB prompt held every client, /health included, for over a
    # minute before its 400. This one takes seconds to tokenize; /health must answer meanwhile.
    text = "hello world " * 400_000  # 800,000 tokens, far past the context
    replies = []
    big = threading.Thread(target=lambda: replies.append(requests.post(url + path, json=body(text), timeout=300)))
    big.start()
    time.sleep(0.3)
    probes = []
    while big.is_alive():
        start = time.perf_counter()
        assert requests.get(url + "/health", timeout=60).status_code == 200
        probes.append((time.perf_counter() - start, big.is_alive()))
        time.sleep(0.1)
    big.join()
    assert any(alive for _, alive in probes), "the big request ended before /health was probed"
    assert max(latency for latency, _ in probes) < 1.0, probes
    assert replies[0].status_code == 400 and "too long" in replies[0].json()["error"]["message"]
