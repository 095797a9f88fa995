"""The clients people use on top of an OpenAI- or SGLang-compatible server, against `plait serve`.

- SGLang's bench_serving (its exact /generate request, the fields current SGLang clients send, /get_server_info's
  internal_states) and SGLang's frontend RuntimeEndpoint (its requests, reproduced from its source);
- the official openai client: other servers' request fields accepted, unknown ones listed in a header, a forced
  tool call cut by max_tokens returned as a call, tool-call arguments streamed piece by piece;
- instructor, langchain-openai, litellm, DSPy and lm-eval: their requests, recorded from the real clients
  (tests/helpers/data/client_requests), replayed here, each answer checked as that client reads it.

One server (a subprocess on a free port, the embedded model).
"""

from __future__ import annotations

import json
import os

import jiter
import jsonschema
import openai
import pytest
import requests
from conftest import server_process
from helpers.paths import DATA as TEST_DATA

DATA = os.path.join(TEST_DATA, "client_requests")
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Oslo?"}]
# Unconstrained recorded requests may ask for hundreds of tokens; the replay caps that (not the request's shape).
REPLAY_MAX_TOKENS = 40


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    with server_process(tmp_path_factory.mktemp("clients") / "server.log", "--num-threads", "1") as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def sse_payloads(response: requests.Response) -> list[dict]:
    """The JSON payloads of an SSE response ([DONE] and `event:` lines left out)."""
    out = []
    for line in response.iter_lines(decode_unicode=True):
        if line and line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[len("data: ") :]))
    return out


# ---------------------------------------------------------------- SGLang's bench_serving and frontend


def test_bench_serving_sglang_backend_request_and_server_info(url):
    # sglang.benchmark.backends.sglang_client (0.5.x): its warm-up was a 400 "unknown field 'return_routed_experts'".
    payload = {
        "text": "Hello, my name is",
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True},
        "stream": True,
        "lora_path": None,
        "return_logprob": False,
        "logprob_start_len": -1,
        "return_routed_experts": False,
        "routing_key": "user-1",
        "extra_key": "bench",
        "priority": 0,
        "no_logs": True,
        "custom_labels": {"bench": "serving"},
    }
    r = requests.post(url + "/generate", json=payload, stream=True, timeout=120)
    assert r.status_code == 200, r.text
    chunks = sse_payloads(r)
    assert chunks[-1]["meta_info"]["completion_tokens"] == 4 and chunks[-1]["text"]
    assert "x-plait-ignored-fields" not in r.headers  # every field is one SGLang defines
    info = requests.get(url + "/get_server_info", timeout=30).json()
    assert "decode" not in info  # bench_serving would read a PD decode server's list there
    state = info["internal_states"][0]
    assert state.get("avg_spec_accept_length") is None  # what bench_serving reads: no speculation
    assert state["last_gen_throughput"] > 0 and state["memory_usage"]["token_capacity"] == info["max_total_tokens"]


def test_sglang_runtime_endpoint_requests(url):
    # sglang.lang.backend.runtime_endpoint.RuntimeEndpoint: what gen() and select() send (SGLang 0.5).
    model_info = requests.get(url + "/get_model_info", timeout=30).json()
    assert model_info["model_path"]
    text = "<|im_start|>user\nIs the sky blue? Answer yes or no.<|im_end|>\n<|im_start|>assistant\n"
    gen = requests.post(
        url + "/generate",
        timeout=120,
        json={
            "text": text,
            "sampling_params": {
                "skip_special_tokens": True,
                "spaces_between_special_tokens": True,
                "max_new_tokens": 4,
                "min_new_tokens": 0,
                "n": 1,
                "stop": [],
                "stop_token_ids": [],
                "stop_regex": [],
                "temperature": 0,
                "top_p": 1.0,
                "top_k": -1,
                "min_p": 0.0,
                "frequency_penalty": 0.0,
                "presence_penalty": 0.0,
                "ignore_eos": False,
                "regex": None,
                "json_schema": None,
            },
        },
    )
    assert gen.status_code == 200, gen.text
    assert gen.json()["meta_info"]["completion_tokens"] <= 4
    prefix = requests.post(
        url + "/generate", json={"text": text, "sampling_params": {"max_new_tokens": 0}}, timeout=120
    )
    prompt_len = prefix.json()["meta_info"]["prompt_tokens"]
    scores = requests.post(
        url + "/generate",
        timeout=120,
        json={
            "text": [text + c for c in ("yes", "no")],
            "sampling_params": {"max_new_tokens": 0, "temperature": 0},
            "return_logprob": True,
            "return_text_in_logprobs": True,
            "logprob_start_len": max(prompt_len - 2, 0),
        },
    ).json()
    for out in scores:  # select() reads [logprob, token id, text] entries, the first one's text included
        entries = out["meta_info"]["input_token_logprobs"]
        assert isinstance(entries[0][-1], str) and all(len(e) == 3 for e in entries)
    flushed = requests.post(url + "/flush_cache", json={"empty_cache": True}, timeout=30)
    assert flushed.status_code in (200, 400)  # 400: requests of other tests still running


# ---------------------------------------------------------------- the openai client


def test_fields_other_servers_define_pass_and_unknown_ones_are_listed(url, client):
    reply = client.chat.completions.with_raw_response.create(
        model="default",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        prompt_cache_key="session-1",
        verbosity="low",
        reasoning_effort="low",
        safety_identifier="user-1",
        store=True,
        service_tier="flex",
        extra_body={
            "separate_reasoning": True,
            "stream_reasoning": False,
            "priority": 1,
            "include_reasoning": True,
            "cache_salt": "s",
            "return_token_ids": True,
        },
    )
    assert reply.parse().usage.completion_tokens <= 2 and "x-plait-ignored-fields" not in reply.headers
    typo = client.completions.with_raw_response.create(
        model="default", prompt="hi", max_tokens=1, extra_body={"temprature": 0.2}
    )
    assert typo.headers["x-plait-ignored-fields"] == "temprature"
    with pytest.raises(openai.BadRequestError, match="'lora_path' is not supported by plait"):
        client.completions.create(model="default", prompt="hi", max_tokens=1, extra_body={"lora_path": "adapters/x"})
    r = requests.post(url + "/generate", json={"text": "hi", "temperature": 0}, timeout=30)
    assert r.status_code == 400 and "inside sampling_params" in r.json()["error"]["message"]


def _assembled(stream) -> tuple[str, dict[int, dict], list[str], int]:
    content, calls, reasons, pieces = "", {}, [], 0
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
                pieces += bool(call.function.arguments)
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    return content, calls, reasons, pieces


def test_a_forced_call_cut_by_max_tokens_is_a_call_with_finish_reason_length(client):
    forced = {"type": "function", "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(
        model="default", messages=ASK_WEATHER, tools=[WEATHER], tool_choice=forced, max_tokens=13, temperature=0
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    # Cut inside the arguments ('{"city' or so): the text so far comes back as the call's arguments; a call
    # that did finish in time parses (below).
    args = call.function.arguments
    assert args and (args.startswith('{"city"') or '{"city"'.startswith(args)) and not args.endswith("}")
    content, calls, reasons, _ = _assembled(
        client.chat.completions.create(
            model="default",
            messages=ASK_WEATHER,
            tools=[WEATHER],
            tool_choice=forced,
            max_tokens=13,
            temperature=0,
            stream=True,
        )
    )
    assert content == "" and reasons == ["length"]
    assert calls[0]["name"] == "get_weather" and calls[0]["arguments"] == call.function.arguments
    whole = client.chat.completions.create(
        model="default", messages=ASK_WEATHER, tools=[WEATHER], tool_choice=forced, max_tokens=40, temperature=0
    ).choices[0]
    assert whole.finish_reason == "tool_calls" and json.loads(whole.message.tool_calls[0].function.arguments)["city"]


def test_tool_call_arguments_stream_piece_by_piece(client):
    content, calls, reasons, pieces = _assembled(
        client.chat.completions.create(
            model="default",
            messages=ASK_WEATHER,
            tools=[WEATHER],
            tool_choice="required",
            max_tokens=40,
            temperature=0,
            stream=True,
        )
    )
    assert reasons == ["tool_calls"] and pieces > 2, pieces
    assert json.loads(calls[0]["arguments"])["city"]


# ---------------------------------------------------------------- recorded requests of the other clients


def recorded() -> list[tuple[str, dict]]:
    rows = []
    for name in sorted(os.listdir(DATA)):
        if name.endswith(".jsonl"):
            with open(os.path.join(DATA, name)) as f:
                rows += [(name[: -len(".jsonl")], json.loads(line)) for line in f]
    return rows


RECORDED = recorded()


def _capped(body: dict) -> dict:
    body = dict(body)
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        if isinstance(body.get(name), int):
            body[name] = min(body[name], REPLAY_MAX_TOKENS)
    return body


@pytest.mark.parametrize("client_name, row", RECORDED, ids=[f"{c}:{r['recipe']}" for c, r in RECORDED])
def test_recorded_client_requests_get_what_the_client_reads(url, client_name, row):
    body = _capped(row["body"])
    r = requests.post(url + row["path"], json=body, stream=bool(body.get("stream")), timeout=300)
    assert r.status_code == 200, r.text
    assert "x-plait-ignored-fields" not in r.headers, r.headers["x-plait-ignored-fields"]
    if row["path"] == "/v1/responses":
        events = sse_payloads(r) if body.get("stream") else [{"type": "response.completed", "response": r.json()}]
        (final,) = [e["response"] for e in events if e["type"] in ("response.completed", "response.incomplete")]
        assert final["output"] and final["usage"]["output_tokens"] > 0
        return
    if body.get("stream"):
        chunks = sse_payloads(r)
        assert chunks and not any("error" in c for c in chunks), chunks[-1:]
        if body.get("tools"):  # arguments piece by piece; instructor's create_partial parses each as partial JSON
            pieces = [
                d["function"]["arguments"]
                for c in chunks
                for ch in c["choices"]
                for d in (ch["delta"].get("tool_calls") or [])
                if d["function"].get("arguments")
            ]
            partials, text = [], ""
            for piece in pieces:
                text += piece
                partials.append(jiter.from_json(text.encode(), partial_mode="trailing-strings"))
            # (text a grammar forces, '{"city":"', arrives as one piece: jump-forward appends it in one step)
            assert len({json.dumps(p) for p in partials}) > 1 and json.loads(text) == partials[-1], pieces
        return
    reply = r.json()
    choice = reply["choices"][0]
    if row["path"] == "/v1/completions":
        if body.get("echo"):  # lm-eval's loglikelihood: the prompt's logprobs, position by position
            logprobs = choice["logprobs"]
            assert len(logprobs["tokens"]) == len(body["prompt"][0]) + 1 and logprobs["token_logprobs"][0] is None
            assert all(isinstance(x, float) for x in logprobs["token_logprobs"][1:])
        assert choice["text"] is not None and reply["usage"]["completion_tokens"] <= body["max_tokens"]
        return
    message = choice["message"]
    rf = body.get("response_format") or {}
    if rf.get("type") == "json_schema":  # constrained: it parses and matches, whoever asked
        jsonschema.validate(json.loads(message["content"]), rf["json_schema"]["schema"])
    if isinstance(body.get("tool_choice"), dict):
        (call,) = message["tool_calls"]
        assert call["function"]["name"] == body["tool_choice"]["function"]["name"]
        schema = next(
            t["function"]["parameters"] for t in body["tools"] if t["function"]["name"] == call["function"]["name"]
        )
        jsonschema.validate(json.loads(call["function"]["arguments"]), schema)
    if body.get("stop") and message["content"]:
        assert not any(s in message["content"] for s in body["stop"])
