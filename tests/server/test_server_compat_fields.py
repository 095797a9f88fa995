"""Fields of other servers' APIs (current SGLang, OpenAI, vLLM) on plait's routes, without a model: the ones plait
implements under their names, the ones it accepts as no-ops (logged once), the ones refused unless off, and
top-level fields no API defines (ignored, listed in a response header). End to end: test_server_clients.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from plait.runtime.server.errors import APIError, describe_validation_errors
from plait.runtime.server.native_api import MISPLACED_SAMPLING_FIELDS
from plait.runtime.server.protocol.compat import CHAT, COMPLETIONS, NATIVE, review
from plait.runtime.server.protocol.native import GenerateRequest
from plait.runtime.server.protocol.openai import ChatCompletionRequest, CompletionRequest
from pydantic import ValidationError


def validation_message(model, data) -> tuple[str, str]:
    with pytest.raises(ValidationError) as info:
        model.model_validate(data)
    return describe_validation_errors(info.value.errors())


def reviewed(model, data, api, **kw) -> SimpleNamespace:
    """Validate and review a body as its route does: the request's state afterwards (ignored_fields)."""
    request = SimpleNamespace(state=SimpleNamespace(ignored_fields=None))
    review(model.model_validate(data), api, request, set(), **kw)
    return request.state


def review_error(model, data, api, **kw) -> APIError:
    with pytest.raises(APIError) as info:
        reviewed(model, data, api, **kw)
    assert info.value.status_code == 400
    return info.value


def test_unknown_top_level_fields_are_ignored_and_listed():
    state = reviewed(CompletionRequest, {"prompt": "hi", "tempreature": 0.5, "zz": 1}, COMPLETIONS)
    assert state.ignored_fields == ["tempreature", "zz"]
    assert reviewed(CompletionRequest, {"prompt": "hi"}, COMPLETIONS).ignored_fields is None
    # Nested objects stay strict: a typo there is a 400.
    msg, param = validation_message(
        CompletionRequest, {"prompt": "hi", "stream": True, "stream_options": {"include_usaje": True}}
    )
    assert "unknown field 'stream_options.include_usaje'" in msg
    # On /generate a sampling parameter at the top level would be ignored while the client meant it.
    error = review_error(
        GenerateRequest, {"text": "hi", "temperature": 0.5}, NATIVE, misplaced=MISPLACED_SAMPLING_FIELDS
    )
    assert "'temperature' is a sampling parameter: send it inside sampling_params" in error.message
    assert error.param == "temperature"


# What current SGLang, OpenAI and vLLM clients send (the list, from SGLang's bench_serving, the openai
# client and vLLM's models): accepted with real values, a no-op where plait lacks the feature.
KNOWN_FIELDS = [
    (
        GenerateRequest,
        NATIVE,
        {
            "return_routed_experts": True,
            "priority": 3,
            "routing_key": "k",
            "extra_key": "e",
            "no_logs": True,
            "lora_path": None,
            "return_logprob": False,
            "logprob_start_len": -1,
            "custom_labels": {"team": "a"},
            "session_id": "s",
            "cache_salt": "salt",
        },
    ),
    (
        ChatCompletionRequest,
        CHAT,
        {
            "separate_reasoning": True,
            "stream_reasoning": False,
            "prompt_cache_key": "p",
            "verbosity": "low",
            "reasoning_effort": "low",
            "store": True,
            "safety_identifier": "u1",
            "service_tier": "flex",
            "priority": 1,
            "return_routed_experts": True,
            "prediction": {"type": "content", "content": "x"},
            "metadata": {"a": "b"},
        },
    ),
    (
        CompletionRequest,
        COMPLETIONS,
        {
            "prompt_cache_key": "p",
            "request_id": "r",
            "cache_salt": "s",
            "priority": 2,
            "return_token_ids": True,
            "vllm_xargs": {"a": 1},
        },
    ),
]


@pytest.mark.parametrize("model, api, fields", KNOWN_FIELDS, ids=[api for _, api, _ in KNOWN_FIELDS])
def test_fields_other_servers_define_are_accepted_and_logged_once(model, api, fields, caplog):
    base = (
        {"text": "hi"}
        if api == NATIVE
        else {"prompt": "hi"}
        if api == COMPLETIONS
        else {"messages": [{"role": "user", "content": "hi"}]}
    )
    once: set = set()
    request = SimpleNamespace(state=SimpleNamespace(ignored_fields=None))
    with caplog.at_level("INFO", logger="plait.server"):
        for _ in range(3):
            review(model.model_validate({**base, **fields}), api, request, once)
    assert request.state.ignored_fields is None  # all of them are known fields
    logged = [r.getMessage() for r in caplog.records if "accepted and ignored" in r.getMessage()]
    assert len(logged) == len(set(logged)) and logged, logged  # once each, however many requests
    assert not any("'priority'" in m for m in logged)  # used: the scheduler admits lower values first


@pytest.mark.parametrize(
    "model, api, fields, param, needle",
    [
        (GenerateRequest, NATIVE, {"priority": "high"}, "priority", "valid integer"),
        (GenerateRequest, NATIVE, {"return_routed_experts": "yes"}, "return_routed_experts", "valid boolean"),
        (ChatCompletionRequest, CHAT, {"verbosity": "loud"}, "verbosity", "verbosity"),
        (ChatCompletionRequest, CHAT, {"reasoning_effort": "extreme"}, "reasoning_effort", "reasoning_effort"),
        (CompletionRequest, COMPLETIONS, {"prompt_cache_key": 5}, "prompt_cache_key", "valid string"),
    ],
)
def test_known_fields_of_the_wrong_type_are_a_400_naming_them(model, api, fields, param, needle):
    base = (
        {"text": "hi"}
        if api == NATIVE
        else {"prompt": "hi"}
        if api == COMPLETIONS
        else {"messages": [{"role": "user", "content": "hi"}]}
    )
    msg, got = validation_message(model, {**base, **fields})
    assert got == param and needle in msg, msg


def test_native_text_xor_input_ids_and_features_that_would_change_the_answer():
    msg, _ = validation_message(GenerateRequest, {"text": "a", "input_ids": [1]})
    assert "exactly one of 'text' or 'input_ids'" in msg
    msg, _ = validation_message(GenerateRequest, {})
    assert "exactly one of" in msg
    # SGLang's bench sends lora_path=None: accepted; a real value is refused by name.
    assert reviewed(GenerateRequest, {"text": "a", "lora_path": None, "image_data": []}, NATIVE).ignored_fields is None
    assert reviewed(GenerateRequest, {"text": "a", "image_data": "x.png"}, NATIVE).ignored_fields is None  # (a VLM's)
    error = review_error(GenerateRequest, {"text": "a", "video_data": "x.mp4"}, NATIVE)
    assert "'video_data' is not supported by plait: plait's vision models take images only" in error.message
    assert error.param == "video_data"
    error = review_error(
        ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "use_beam_search": True}, CHAT
    )
    assert error.param == "use_beam_search" and "beam search" in error.message
    assert (
        reviewed(
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": "x"}], "length_penalty": 1.0, "modalities": ["text"]},
            CHAT,
        ).ignored_fields
        is None
    )


# ---------------------------------------------------------------- other servers' names plait implements


def test_vllm_and_sglang_sampling_names_map_onto_plaits():
    from plait.runtime.server.openai.api import sampling_dict

    chat = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "x"}],
            "stop_regex": "\\d+",
            "include_stop_str_in_output": True,
            "spaces_between_special_tokens": False,
            "stream_interval": 4,
            "structured_outputs": {"choice": ["yes", "no (maybe)"]},
        }
    )
    params = sampling_dict(chat, 8)
    assert params["stop_regex"] == "\\d+" and params["no_stop_trim"] is True
    assert params["spaces_between_special_tokens"] is False and params["stream_interval"] == 4
    assert params["regex"] == "(yes|no\\ \\(maybe\\))"
    so = sampling_dict(
        CompletionRequest.model_validate({"prompt": "x", "structured_outputs": {"json": {"type": "object"}}}), 8
    )
    assert so["json_schema"] == '{"type": "object"}'
    grammar = sampling_dict(
        CompletionRequest.model_validate({"prompt": "x", "structured_outputs": {"grammar": 'root ::= "a"'}}), 8
    )
    assert grammar["ebnf"] == 'root ::= "a"'
    with pytest.raises(APIError, match="asks for json and regex: give one constraint"):
        sampling_dict(
            CompletionRequest.model_validate({"prompt": "x", "structured_outputs": {"json": "{}", "regex": "a"}}), 8
        )


def test_sglang_sampling_seed_is_the_seed():
    from plait.runtime.server.native_api import verified_sampling_params
    from test_server_protocol import make_ctx

    assert verified_sampling_params({"sampling_seed": 7, "max_new_tokens": 2}, make_ctx()).seed == 7
    with pytest.raises(APIError, match="seed \\(1\\) and sampling_seed \\(2\\) differ"):
        verified_sampling_params({"sampling_seed": 2, "seed": 1}, make_ctx())


def test_template_fields_reach_the_chat_template():
    from plait.runtime.server.openai.chat import request_template_kwargs

    req = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "x"}],
            "reasoning_effort": "none",
            "add_generation_prompt": False,
            "documents": [{"title": "t", "text": "d"}],
        }
    )
    assert request_template_kwargs(req) == {
        "add_generation_prompt": False,
        "documents": [{"title": "t", "text": "d"}],
        "reasoning_effort": "none",
        "enable_thinking": False,
    }
