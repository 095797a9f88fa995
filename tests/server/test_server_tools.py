"""OpenAI tool calling on /v1/chat/completions (runtime/server/tools/calls.py).

End to end: a real `plait serve` subprocess (the embedded SmolLM2, whose chat template knows no tools,
so the generic tools prompt is used) driven by the real openai client. tool_choice "required" and named
are enforced by constrained decoding, so their calls must parse and match the tools' schemas. The tiny
model does not write tool calls on its own in "auto" mode, so those tests force the *text* of a call
with extra_body regex / response_format and check that the parser turns it into `tool_calls`; the
formats it never writes (Llama-3.1, Mistral, fences) are covered by parser tests on strings.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema
import openai
import pytest
import requests
from conftest import server_process
from plait.runtime.constrained import validate_constraint
from plait.runtime.server.openai.chat import chat_prompt_ids
from plait.runtime.server.protocol.openai import ChatCompletionRequest
from plait.runtime.server.tools.calls import GENERIC_TOOLS_HOWTO, call_schema, render_messages
from plait.runtime.server.tools.parser import ToolPlan, parse_tool_calls
from transformers import AutoTokenizer

WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER_PARAMS},
}
# A schema with its own $defs and a local $ref: it must survive being nested in the call schema.
TIME_PARAMS = {
    "type": "object",
    "properties": {"place": {"$ref": "#/$defs/Place"}},
    "required": ["place"],
    "$defs": {"Place": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}},
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "description": "Current time somewhere", "parameters": TIME_PARAMS},
}
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_CALL = (
    r'Let me check\. <tool_call>\{"name": "get_weather", '
    r'"arguments": \{"city": "[A-Z][a-z]{2,8}", "unit": "celsius"\}\}</tool_call>'
)


def _request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": ASK, **fields})


# ---------------------------------------------------------------- parsing (no server)

NAMES = {"get_weather", "get_time"}
PARSED = [
    ('{"name": "get_weather", "arguments": {"city": "Oslo"}}', None, [("get_weather", {"city": "Oslo"})]),
    (
        '[{"name": "get_weather", "arguments": {"city": "A"}}, {"name": "get_time", "arguments": {}}]',
        None,
        [("get_weather", {"city": "A"}), ("get_time", {})],
    ),
    (
        '<|python_tag|>{"name": "get_time", "parameters": {"place": {"tz": "UTC"}}}',
        None,
        [("get_time", {"place": {"tz": "UTC"}})],
    ),  # Llama-3.1 JSON
    (
        '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "B"}}',
        None,
        [("get_time", {}), ("get_weather", {"city": "B"})],
    ),  # Llama-3.2: calls one after another
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "C"}}]', None, [("get_weather", {"city": "C"})]),
    (
        '```json\n{"name": "get_weather", "arguments": "{\\"city\\": \\"D\\"}"}\n```',
        None,
        [("get_weather", {"city": "D"})],
    ),  # fenced, arguments as JSON text
    (
        'I will look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "E"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"place": {"tz": "CET"}}}\n</tool_call>',
        "I will look.",
        [("get_weather", {"city": "E"}), ("get_time", {"place": {"tz": "CET"}})],
    ),  # Hermes / Qwen
]
TEXT = [
    "The weather is sunny.",
    '{"name": "send_email", "arguments": {}}',  # not an offered tool
    '{"name": "get_weather", "arguments": {"city": "Oslo"}',  # cut short
    '{"city": "Oslo"}',  # JSON, but not a call
    "[1, 2]",
    'Sure <tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',
    '{"name": "get_weather", "arguments": [1]} and more',
]


@pytest.mark.parametrize("text, content, calls", PARSED)
def test_parser_reads_the_common_call_formats(text, content, calls):
    parsed = parse_tool_calls(text, NAMES)
    assert (text[: parsed.content_end].strip() or None) == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.calls] == calls
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in parsed.calls)
    assert len({c["id"] for c in parsed.calls}) == len(calls)


@pytest.mark.parametrize("text", TEXT)
def test_parser_leaves_anything_that_is_not_a_whole_call_as_text(text):
    parsed = parse_tool_calls(text, NAMES)
    assert parsed.calls == [] and parsed.content_end == len(text)


def test_stream_sends_text_at_once_and_holds_what_may_be_a_call():
    auto = ToolPlan(frozenset(NAMES), forced=False, parallel=True)
    stream, text, sent = auto.new_stream(), "", []
    for piece in ["Let me", " check. <tool", "_call>", '{"name": "get_time", "arguments": {}}</tool_call>']:
        text += piece
        sent.append(stream.update(text))
    assert [content for content, _ in sent] == ["Let me", " check. ", "", ""]
    ((_, calls),) = [s for s in sent if s[1]]
    assert [(c["index"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [(0, "get_time", "{}")]
    assert stream.finish(text) == ("", []) and stream.sent_calls

    stream = auto.new_stream()
    assert stream.update(" {") == ("", []) and stream.update(' {"a": 1}') == ("", [])
    assert stream.finish(' {"a": 1}') == (' {"a": 1}', [])  # JSON, but not a call: sent as content at the end
    stream = auto.new_stream()
    assert stream.update("The <tool")[0] == "The " and stream.update("The <toolbox>")[0] == "<toolbox>"


def test_call_schema_nests_each_tools_schema_with_its_refs():
    schema = call_schema(_request(tools=[WEATHER, TIME], tool_choice="required"))
    assert validate_constraint("json", json.dumps(schema)) == []
    good = [
        {"name": "get_time", "arguments": {"place": {"tz": "UTC"}}},
        {"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}},
    ]
    jsonschema.validate(good, schema)
    for bad in (
        [],
        [{"name": "get_time", "arguments": {"place": {}}}],
        [{"name": "get_weather", "arguments": {}}],
        [{"name": "nope", "arguments": {}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = call_schema(_request(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False))
    jsonschema.validate(good[1], single)
    named = call_schema(
        _request(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    )
    jsonschema.validate(good[0], named)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good[1], named)
    assert call_schema(_request(tools=[WEATHER])) is None  # auto: nothing forced


NO_ARGS = [None, {}, {"type": "object"}, {"type": "object", "properties": {}, "required": []}]


@pytest.mark.parametrize("parameters", NO_ARGS, ids=["none", "empty", "object", "no-properties"])
def test_forced_call_of_a_function_without_parameters_takes_an_empty_object(parameters):
    tool = {
        "type": "function",
        "function": {"name": "get_time", **({} if parameters is None else {"parameters": parameters})},
    }
    schema = call_schema(_request(tools=[tool], tool_choice="required", parallel_tool_calls=False))
    jsonschema.validate({"name": "get_time", "arguments": {}}, schema)
    with pytest.raises(jsonschema.ValidationError):  # the backend kept it open: invented keys until max_tokens
        jsonschema.validate({"name": "get_time", "arguments": {"tz": "UTC"}}, schema)
    open_ = {"type": "object", "additionalProperties": {"type": "string"}}  # declared open: stays open
    tool["function"]["parameters"] = open_
    schema = call_schema(_request(tools=[tool], tool_choice="required", parallel_tool_calls=False))
    jsonschema.validate({"name": "get_time", "arguments": {"tz": "UTC"}}, schema)


HISTORY = ASK + [
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 22 C"},
]


def test_generic_rendering_for_a_template_without_tools(default_tokenizer):
    messages, kwargs = render_messages(_request(messages=HISTORY, tools=[WEATHER]), default_tokenizer)
    assert kwargs == {}
    text = default_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert GENERIC_TOOLS_HOWTO in text and '"name": "get_weather", "description": "Current weather in a city"' in text
    assert '<|im_start|>assistant\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in text
    assert "<|im_start|>user\nResult of get_weather (call call_1):\nsunny, 22 C<|im_end|>" in text
    messages, _ = render_messages(_request(messages=HISTORY, tools=[WEATHER], tool_choice="none"), default_tokenizer)
    assert GENERIC_TOOLS_HOWTO not in json.dumps(messages)  # "none": tools are not offered


TOOL_TEMPLATE = (  # a Hermes-style template that reads `tools` and renders calls and results itself
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }}:{{ t.function.parameters | tojson }};"
    "{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} {{ c.function.arguments.city }}</tool_call>"
    "{% endfor %}{% if m.tool_call_id %} [{{ m.tool_call_id }}]{% endif %}\n{% endfor %}"
)


def test_a_template_that_reads_tools_gets_them_and_the_calls_in_openai_shape(default_model_path):
    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    tokenizer.chat_template = TOOL_TEMPLATE
    # The route's own prompt builder (it only reads the tokenizer and the context length of the server).
    ids = chat_prompt_ids(
        _request(messages=HISTORY, tools=[WEATHER]), SimpleNamespace(tokenizer=tokenizer, context_len=8192)
    )
    text = tokenizer.decode(ids)
    assert text.startswith("<tools>get_weather:" + json.dumps(WEATHER_PARAMS))
    assert "<|assistant|><tool_call>get_weather Paris</tool_call>" in text  # arguments handed over as an object
    assert "<|tool|>sunny, 22 C [call_1]" in text


# ---------------------------------------------------------------- end to end: plait serve + openai client


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    with server_process(log_path, "--num-threads", "1") as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def _check_against_schemas(calls: list[tuple[str, dict]]) -> None:
    for name, arguments in calls:
        jsonschema.validate(arguments, SCHEMAS[name])


def test_required_calls_a_tool_with_arguments_that_match_its_schema(client):
    reply = client.chat.completions.create(
        model="default", messages=ASK, tools=[WEATHER, TIME], tool_choice="required", max_tokens=80, temperature=0
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = _calls(choice.message)
    assert len(calls) >= 1 and {c.id[:5] for c in choice.message.tool_calls} == {"call_"}
    _check_against_schemas(calls)


def test_named_tool_choice_calls_that_function_once(client):
    reply = client.chat.completions.create(
        model="default",
        messages=ASK,
        tools=[WEATHER, TIME],
        max_tokens=60,
        temperature=0.8,
        seed=3,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        n=2,
    )
    for choice in reply.choices:
        calls = _calls(choice.message)
        assert choice.finish_reason == "tool_calls" and [name for name, _ in calls] == ["get_time"]
        _check_against_schemas(calls)


def test_auto_turns_a_hermes_call_into_tool_calls_and_keeps_the_text_before(client):
    reply = client.chat.completions.create(
        model="default", messages=ASK, tools=[WEATHER], max_tokens=60, temperature=0, extra_body={"regex": HERMES_CALL}
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    assert [(n, a["unit"]) for n, a in _calls(choice.message)] == [("get_weather", "celsius")]


def test_auto_turns_generic_json_into_a_call_and_plain_text_stays_text(client):
    shaped = {
        "type": "object",
        "properties": {"name": {"const": "get_weather"}, "arguments": WEATHER_PARAMS},
        "required": ["name", "arguments"],
    }
    reply = client.chat.completions.create(
        model="default",
        messages=ASK,
        tools=[WEATHER],
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "call", "schema": shaped}},
    )
    assert reply.choices[0].finish_reason == "tool_calls"
    _check_against_schemas(_calls(reply.choices[0].message))

    reply = client.chat.completions.create(
        model="default",
        messages=ASK,
        tools=[WEATHER],
        max_tokens=8,
        temperature=0,
        extra_body={"regex": "It is sunny in Paris."},
    )
    assert reply.choices[0].message.content == "It is sunny in Paris." and reply.choices[0].message.tool_calls is None
    assert reply.choices[0].finish_reason == "stop"


def test_tool_choice_none_offers_no_tools_and_parses_nothing(client):
    call_text = r'\{"name": "get_weather", "arguments": \{"city": "Oslo", "unit": "celsius"\}\}'
    plain = client.chat.completions.create(
        model="default", messages=ASK, max_tokens=40, temperature=0, extra_body={"regex": call_text}
    )
    none = client.chat.completions.create(
        model="default",
        messages=ASK,
        tools=[WEATHER],
        tool_choice="none",
        max_tokens=40,
        temperature=0,
        extra_body={"regex": call_text},
    )
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens  # no tools prompt
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason == "stop"
    assert json.loads(none.choices[0].message.content)["name"] == "get_weather"


def test_required_call_of_a_function_without_parameters_ends_with_empty_arguments(client):
    clock = {"type": "function", "function": {"name": "get_time", "description": "The current UTC time"}}
    listing = {
        "type": "function",
        "function": {"name": "list_files", "parameters": {"type": "object", "properties": {}}},
    }
    for tool in (clock, listing):
        reply = client.chat.completions.create(
            model="default", messages=ASK, tools=[tool], tool_choice="required", max_tokens=30, temperature=0
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message.content
        assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
            (tool["function"]["name"], "{}")
        ]


def test_forced_tool_choice_with_response_format_makes_the_calls(client):
    # Agent frameworks send the final answer's response_format on every turn, forced ones included.
    answer = {
        "type": "json_schema",
        "json_schema": {
            "name": "answer",
            "schema": {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]},
        },
    }
    reply = client.chat.completions.create(
        model="default",
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        response_format=answer,
        max_tokens=60,
        temperature=0,
    )
    assert reply.choices[0].finish_reason == "tool_calls"
    _check_against_schemas(_calls(reply.choices[0].message))


def _collect(stream) -> tuple[str, dict[int, dict], list]:
    content, calls, reasons = "", {}, []
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": call.id, "name": "", "arguments": ""})
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    return content, calls, reasons


def test_streamed_tool_calls_arrive_as_deltas_the_sdk_assembles(client):
    stream = client.chat.completions.create(
        model="default",
        messages=ASK,
        tools=[WEATHER, TIME],
        stream=True,
        tool_choice="required",
        max_tokens=80,
        temperature=0,
    )
    content, calls, reasons = _collect(stream)
    assert content == "" and reasons == ["tool_calls"] and calls
    _check_against_schemas([(c["name"], json.loads(c["arguments"])) for c in calls.values()])

    stream = client.chat.completions.create(
        model="default",
        messages=ASK,
        tools=[WEATHER],
        stream=True,
        max_tokens=60,
        temperature=0,
        extra_body={"regex": HERMES_CALL},
    )
    content, calls, reasons = _collect(stream)
    assert content.strip() == "Let me check." and reasons == ["tool_calls"]
    assert [c["name"] for c in calls.values()] == ["get_weather"] and calls[0]["id"].startswith("call_")


def test_follow_up_turn_with_the_tool_result(client):
    first = client.chat.completions.create(
        model="default", messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=60, temperature=0
    )
    message = first.choices[0].message
    history = ASK + [
        message.model_dump(),
        *({"role": "tool", "tool_call_id": c.id, "content": "sunny, 22 C"} for c in message.tool_calls),
    ]
    second = client.chat.completions.create(
        model="default", messages=history, tools=[WEATHER], tool_choice="none", max_tokens=4, temperature=0
    )
    assert second.choices[0].finish_reason in ("stop", "length") and second.choices[0].message.content
    # The call and its result are in the prompt (the tools list is not: tool_choice is "none").
    question_only = client.chat.completions.create(model="default", messages=ASK, max_tokens=1)
    assert second.usage.prompt_tokens > question_only.usage.prompt_tokens + first.usage.completion_tokens + 10


BAD = [
    (
        {"tools": [{"type": "function", "function": {"parameters": {}}}]},
        "tools",
        "missing required field 'tools.0.function.name'",
    ),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools", "must be 1-64 characters"),
    (
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"a": {"type": "integr"}}},
                    },
                }
            ]
        },
        "tools",
        "parameters ('f'): the schema is not a valid JSON schema at properties/a/type",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
        "tools",
        "must describe a JSON object",
    ),
    (
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
        "tool_choice",
        "names the function 'get_time', which is not among the tools ('get_weather')",
    ),
    ({"tool_choice": "required"}, "tool_choice", "tool_choice 'required' needs tools"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice", 'must be "none", "auto", "required" or'),
    ({"tools": [WEATHER, WEATHER]}, "tools", "two tools are named 'get_weather'"),
    (
        {"tools": [WEATHER], "tool_choice": "required", "regex": "[a-z]+"},
        "tool_choice",
        "cannot be combined with regex or ebnf",
    ),
    ({"functions": [{"name": "f"}]}, "functions", "legacy 'functions' field is not supported"),
    ({"function_call": {"name": "f"}}, "function_call", "send tools and tool_choice="),
]


@pytest.mark.parametrize("fields, param, needle", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_bad_tool_requests_get_a_400_naming_the_field(url, fields, param, needle):
    r = requests.post(url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 1, **fields}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and needle in error["message"], error
