"""HTTP server: request parsing, validation and response shaping that need no model.

End-to-end behaviour against the real Engine lives in tests/server/test_server.py; these tests pin the
pieces that turn JSON into Engine calls and Engine outputs into OpenAI/SGLang bodies.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from plait.runtime.cli.main import parse_server_args
from plait.runtime.server import create_app
from plait.runtime.server.errors import APIError, describe_validation_errors
from plait.runtime.server.metrics import ServerMetrics, find_stat
from plait.runtime.server.native_api import native_calls
from plait.runtime.server.openai.api import check_model, sampling_dict
from plait.runtime.server.openai.outputs import ChoiceCursor, chat_logprobs, completion_logprobs, finish_reason, usage
from plait.runtime.server.openai.response_format import response_format_to_sampling
from plait.runtime.server.protocol.native import GenerateRequest
from plait.runtime.server.protocol.openai import ChatCompletionRequest, CompletionRequest
from plait.runtime.server.server_context import ServerContext
from plait.runtime.server_args import ServerArgs
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError


class EngineThatMustNotBeCalled:
    """Stands where the Engine would be for requests that must be rejected before reaching it."""

    model_path = "/models/tiny-model"
    model_config = SimpleNamespace(context_len=32, vocab_size=100)
    tokenizer = None
    tokenizer_manager = SimpleNamespace(dead_reason=None)  # what /health consults

    def __getattr__(self, name):
        raise AssertionError(f"engine.{name} called for a request that should have been rejected")


def make_ctx(**server_args) -> ServerContext:
    return ServerContext.build(EngineThatMustNotBeCalled(), ServerArgs(**server_args))


def validation_message(model, data) -> tuple[str, str]:
    with pytest.raises(ValidationError) as info:
        model.model_validate(data)
    return describe_validation_errors(info.value.errors())


# ---------------------------------------------------------------- validation messages


def test_wrong_type_names_the_field():
    msg, param = validation_message(GenerateRequest, {"text": 5})
    assert param == "text" and "'text'" in msg
    msg, param = validation_message(CompletionRequest, {"prompt": "hi", "max_tokens": "10"})
    assert param == "max_tokens"


def test_missing_fields_are_named():
    msg, param = validation_message(CompletionRequest, {"max_tokens": 3})
    assert "missing required field 'prompt'" in msg and param == "prompt"


def test_openai_ranges_and_unsupported_features():
    assert (
        validation_message(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "temperature": 2.5})[
            1
        ]
        == "temperature"
    )
    assert validation_message(CompletionRequest, {"prompt": "x", "top_p": 0})[1] == "top_p"
    assert validation_message(CompletionRequest, {"prompt": "x", "n": 0})[1] == "n"
    assert validation_message(CompletionRequest, {"prompt": "x", "logprobs": 21})[1] == "logprobs"
    assert validation_message(ChatCompletionRequest, {"messages": []})[1] == "messages"
    assert (
        validation_message(ChatCompletionRequest, {"messages": [{"role": "wizard", "content": "x"}]})[1] == "messages"
    )
    msg, _ = validation_message(
        ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}
    )
    assert "top_logprobs requires logprobs" in msg
    msg, _ = validation_message(
        ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}
    )
    assert "missing required field 'tools.0.function'" in msg
    msg, _ = validation_message(CompletionRequest, {"prompt": "x", "response_format": {"type": "json_schema"}})
    assert "json_schema.schema" in msg


# ---------------------------------------------------------------- native /generate → Engine calls


def test_native_batch_expands_n_with_distinct_rids_and_seeds():
    ctx = make_ctx()
    body = GenerateRequest.model_validate(
        {
            "text": ["a", "b"],
            "rid": ["r1", "r2"],
            "return_logprob": [True, False],
            "sampling_params": {"max_new_tokens": 4, "n": 2, "seed": 7},
        }
    )
    runs = native_calls(body, ctx)
    assert [len(run) for run in runs] == [2, 2]
    calls = [c for run in runs for c in run]
    assert [c["options"].rid for c in calls] == ["r1-0", "r1-1", "r2-0", "r2-1"]
    assert [c["prompt"] for c in calls] == ["a", "a", "b", "b"]
    assert [c["sampling_params"].seed for c in calls] == [7, 8, 7, 8]
    assert all(c["sampling_params"].n == 1 for c in calls)
    assert [c["options"].return_logprob for c in calls] == [True, True, False, False]
    assert all(c["options"].stream for c in calls)  # (the server reads every Engine request as a stream)


@pytest.mark.parametrize(
    "body, needle, param",
    [
        ({"text": "a", "sampling_params": {"max_new_tokens": 4, "temprature": 1}}, "temprature", "sampling_params"),
        ({"text": "a", "sampling_params": {"top_p": 1.5}}, "top_p", "sampling_params"),
        ({"text": "a", "sampling_params": {"max_new_tokens": "8"}}, "max_new_tokens", "sampling_params"),
        ({"text": ["a", "b"], "sampling_params": [{}]}, "1 entries but the batch has 2", "sampling_params"),
        ({"text": "a", "rid": ["x"]}, "not a batch", "rid"),
        ({"input_ids": [1, 2, 100]}, "token id 100", "input_ids"),
        ({"input_ids": list(range(32))}, "too long", "input_ids"),
        ({"input_ids": []}, "empty", "input_ids"),
        ({"text": ""}, "empty", "text"),
        ({"text": "a", "top_logprobs_num": -1}, "top_logprobs_num", "top_logprobs_num"),
    ],
)
def test_native_bad_input_names_the_field(body, needle, param):
    with pytest.raises(APIError) as info:
        native_calls(GenerateRequest.model_validate(body), make_ctx())
    assert info.value.status_code == 400 and needle in info.value.message and info.value.param == param


# ---------------------------------------------------------------- OpenAI requests → sampling params


def test_openai_sampling_mapping():
    req = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 9,
            "temperature": 0,
            "top_p": 0.9,
            "stop": ["\n"],
            "seed": 3,
            "min_tokens": 2,
            "top_k": 5,
            "logit_bias": {"12": -100},
            "response_format": {"type": "json_object"},
        }
    )
    params = sampling_dict(req, req.max_new_tokens)
    assert params["max_new_tokens"] == 9 and params["temperature"] == 0 and params["top_p"] == 0.9
    assert params["stop"] == ["\n"] and params["seed"] == 3 and params["min_new_tokens"] == 2
    assert params["top_k"] == 5 and params["logit_bias"] == {12: -100.0}
    assert json.loads(params["json_schema"]) == {"type": "object"}
    bad = CompletionRequest.model_validate({"prompt": "x", "logit_bias": {"the": 1.0}})
    with pytest.raises(APIError, match="logit_bias"):
        sampling_dict(bad, 4)


def test_response_format_json_schema_maps_to_sampling_params():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    req = CompletionRequest.model_validate(
        {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}}
    )
    assert json.loads(response_format_to_sampling(req.response_format)["json_schema"]) == schema
    text = CompletionRequest.model_validate({"prompt": "x", "response_format": {"type": "text"}})
    assert response_format_to_sampling(text.response_format) == {}


def test_unknown_model_is_404_and_aliases_are_accepted():
    ctx = make_ctx()
    for name in (None, "tiny-model", "default", "/models/tiny-model"):
        check_model(CompletionRequest(prompt="x", model=name), ctx)
    with pytest.raises(APIError) as info:
        check_model(CompletionRequest(prompt="x", model="gpt-4"), ctx)
    assert info.value.status_code == 404 and info.value.param == "model"


# ---------------------------------------------------------------- Engine outputs → OpenAI bodies


def test_logprob_and_usage_shapes():
    tokens = [(-0.1, 5, "Hel"), (-0.2, 6, "lo")]
    tops = [[(-0.1, 5, "Hel"), (-2.0, 7, "Hi")], [(-0.2, 6, "lo")]]
    c = completion_logprobs(tokens, tops, None, 10)
    assert c == {
        "tokens": ["Hel", "lo"],
        "token_logprobs": [-0.1, -0.2],
        "top_logprobs": [{"Hel": -0.1, "Hi": -2.0}, {"lo": -0.2}],
        "text_offset": [10, 13],
    }
    chat = chat_logprobs(tokens, tops, None)["content"]
    assert chat[0]["token"] == "Hel" and chat[0]["bytes"] == list(b"Hel")
    assert [t["token"] for t in chat[0]["top_logprobs"]] == ["Hel", "Hi"]
    metas = [
        {"prompt_tokens": 10, "cached_tokens": 4, "completion_tokens": 3},
        {"prompt_tokens": 10, "cached_tokens": 10, "completion_tokens": 5},
    ]
    assert usage(metas[:1], metas) == {
        "prompt_tokens": 10,
        "completion_tokens": 8,
        "total_tokens": 18,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    assert finish_reason({"finish_reason": {"type": "length", "length": 3}}) == "length"
    assert finish_reason({"finish_reason": None}) is None


def test_choice_cursor_takes_the_engines_delta_chunks_and_keeps_the_text_so_far():
    cur = ChoiceCursor()
    assert cur.text_delta({"text": "Hel", "text_offset": 0}) == "Hel"
    assert cur.text_delta({"text": "lo", "text_offset": 3}) == "lo"
    assert cur.text_delta({"text": "", "text_offset": 5}) == "" and cur.text == "Hello"
    # a stop regex matched inside what was sent: nothing to send, but the tool-call parser reads the cut text
    assert cur.text_delta({"text": "", "text_offset": 4}) == "" and cur.text == "Hell"
    assert cur.logprob_delta({"output_token_logprobs": [1, 2], "output_top_logprobs": [None, None]}) == (
        [1, 2],
        [None, None],
    )
    assert cur.logprob_delta({"output_token_logprobs": [3], "output_top_logprobs": [None]}) == ([3], [None])


# ---------------------------------------------------------------- metrics


def test_metrics_render_parses_and_reads_engine_stats():
    m = ServerMetrics("tiny")
    m.observe_first_token(0.05)
    m.observe_inter_token(0.01, 3)
    m.observe_finished(
        {"prompt_tokens": 8, "completion_tokens": 4, "cached_tokens": 2, "finish_reason": {"type": "length"}}, 0.2
    )
    text = m.render({"internal_states": [{"num_running_reqs": 3, "num_waiting_reqs": 1}], "token_usage": 0.25}).decode()
    samples = {
        (s.name, s.labels.get("finish_reason")): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    assert samples[("plait_prompt_tokens_total", None)] == 8
    assert samples[("plait_generation_tokens_total", None)] == 4
    assert samples[("plait_num_running_reqs", None)] == 3
    assert samples[("plait_num_queued_reqs", None)] == 1
    assert samples[("plait_kv_cache_usage", None)] == 0.25
    assert samples[("plait_cache_hit_rate", None)] == 0.25
    assert samples[("plait_inter_token_latency_seconds_count", None)] == 3
    assert samples[("plait_requests_total", "length")] == 1
    assert find_stat({"a": {"num_queue_reqs": 2}}, ("num_waiting_reqs", "num_queue_reqs")) == 2.0
    # A second app in the same process has its own registry: no duplicate-name error, separate counts.
    assert ServerMetrics("tiny").render(None)


# ---------------------------------------------------------------- CLI


def test_cli_every_server_arg_is_a_flag():
    args = parse_server_args(
        [
            "--model",
            "/m",
            "--port",
            "1234",
            "--disable-radix-cache",
            "--max-queued-requests",
            "3",
            "--api-key",
            "k",
            "--mem-fraction-static",
            "0.5",
        ]
    )
    assert (
        args.model_path,
        args.port,
        args.disable_radix_cache,
        args.max_queued_requests,
        args.api_key,
        args.mem_fraction_static,
    ) == ("/m", 1234, True, 3, "k", 0.5)
    assert parse_server_args([]) == ServerArgs()
    with pytest.raises(SystemExit):
        parse_server_args(["--schedule-policy", "random"])
    with pytest.raises(SystemExit):
        parse_server_args(["--port", "eighty"])
    # Graphs for every batch the scheduler can run unless capped; a cap must be a positive int.
    assert ServerArgs().cuda_graph_max_bs is None
    assert parse_server_args(["--cuda-graph-max-bs", "64"]).cuda_graph_max_bs == 64
    with pytest.raises(SystemExit):
        parse_server_args(["--cuda-graph-max-bs", "0"])
    # vLLM's per-prompt prefill cap: 0 (the default) is no cap, a negative one is refused.
    assert parse_server_args(["--long-prefill-token-threshold", "2048"]).long_prefill_token_threshold == 2048
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be an int >= 0"):
        ServerArgs(long_prefill_token_threshold=-1)
    # SGLang's parallelism flags; settings that cannot work together are usage errors naming them.
    assert parse_server_args(["--tp-size", "1", "--dp-size", "1"]) == ServerArgs()
    assert parse_server_args(["--tp-size", "2", "--pp-size", "2"]).world_size() == 4
    with pytest.raises(SystemExit):
        parse_server_args(["--tp-size", "0"])
    with pytest.raises(ValueError, match="nnodes 2 needs dist_init_addr"):
        ServerArgs.from_kwargs(tp_size=2, nnodes=2)
    with pytest.raises(ValueError, match="node_rank 2 must be below nnodes 2"):
        ServerArgs.from_kwargs(tp_size=2, nnodes=2, node_rank=2, dist_init_addr="10.0.0.1:5000")
    with pytest.raises(ValueError, match="do not split evenly over nnodes 2"):
        ServerArgs.from_kwargs(tp_size=3, nnodes=2, dist_init_addr="10.0.0.1:5000")


def test_every_server_flag_explains_itself_in_help(capsys):
    import dataclasses

    from plait.runtime.cli.flags import CLI_HELP
    from plait.runtime.cli.main import build_parser

    assert set(CLI_HELP) == {f.name for f in dataclasses.fields(ServerArgs)}  # a new setting needs its line
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "waiting-queue order: lpm" in text and "{lpm,dfs-weight,fcfs}" in text
    assert "(default: 8192)" in text  # chunked_prefill_size


def test_model_path_that_is_not_a_folder_says_what_works():
    from plait.runtime.executor.loader import load_model_config

    with pytest.raises(
        ValueError,
        match=r"'HuggingFaceTB/SmolLM2-135M-Instruct' is not a folder.*no hub"
        r".*model_path=None runs the embedded default model.*llama-3.1-8b",
    ):
        load_model_config("HuggingFaceTB/SmolLM2-135M-Instruct", "auto")


def test_max_running_requests_default_depends_on_the_device_and_pool():
    from plait.runtime.executor.model_runner import default_max_running_requests

    assert ServerArgs().max_running_requests is None
    assert parse_server_args(["--max-running-requests", "8"]).max_running_requests == 8
    with pytest.raises(SystemExit):
        parse_server_args(["--max-running-requests", "0"])
    assert default_max_running_requests("cpu", 10**6) == 256
    assert default_max_running_requests("cuda", 841_265) == 1024  # the 8B shape on an H200
    assert default_max_running_requests("cuda", 12_800) == 100  # a small pool: 128 tokens a request
    assert default_max_running_requests("cuda", 10) == 1


# ---------------------------------------------------------------- HTTP layer, before the Engine


@pytest.fixture(scope="module")
def client():
    app = create_app(EngineThatMustNotBeCalled(), ServerArgs(api_key="sekrit"))
    with TestClient(app) as c:
        yield c


def test_http_auth_and_errors_before_the_engine(client):
    assert client.get("/health").status_code == 200  # public
    r = client.post("/generate", json={"text": "hi"})
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    assert client.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    auth = {"Authorization": "Bearer sekrit"}
    r = client.post("/generate", content=b'{"text": "hi",', headers={**auth, "Content-Type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"prompt": "hi", "temperature": "hot"}, headers=auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = client.post("/v1/completions", json={"prompt": "hi", "model": "nope"}, headers=auth)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = client.post("/generate", json={"text": "hi", "sampling_params": {"min_p": 2}}, headers=auth)
    assert r.status_code == 400 and "min_p" in r.json()["error"]["message"]
    r = client.get("/v1/models", headers=auth).json()
    assert r["data"][0]["id"] == "tiny-model" and r["data"][0]["max_model_len"] == 32
