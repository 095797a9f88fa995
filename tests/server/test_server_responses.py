"""OpenAI's Responses API (/v1/responses) with the official openai client: text and message input, instructions,
max_output_tokens, streaming with the official event types (through the SDK's own stream accumulator),
text.format json_schema, function tools, usage, retrieve/delete, and previous_response_id continuing a
conversation whose tokens the prefix cache still holds. One server (a subprocess, the embedded model).
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import test_server_clients as clients_module
from pydantic import BaseModel

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


# The clients module's server and client fixtures (module-scoped: this module starts its own server).
url, client = clients_module.url, clients_module.client


def test_text_input_with_instructions_and_usage(client):
    r = client.responses.create(
        model="default",
        input="What is the capital of France?",
        instructions="Answer in one short sentence.",
        max_output_tokens=30,
        temperature=0,
    )
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "completed"
    assert "Paris" in r.output_text
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert r.usage.input_tokens > 10 and 0 < r.usage.output_tokens <= 30
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == "Answer in one short sentence." and r.temperature == 0


def test_max_output_tokens_makes_an_incomplete_response(client):
    r = client.responses.create(
        model="default",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Write a long story about a dragon."}]}],
        max_output_tokens=3,
    )
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output_text


def test_streamed_events_are_the_official_ones_and_add_up(client):
    with client.responses.stream(model="default", input="Say hello.", max_output_tokens=60, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()  # the SDK rebuilds the response from the events and checks them
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == final.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.usage.output_tokens > 0


def test_text_format_json_schema(client):
    r = client.responses.create(
        model="default",
        input="Invent a person.",
        max_output_tokens=40,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}},
    )
    jsonschema.validate(json.loads(r.output_text), PERSON)

    class Person(BaseModel):
        name: str
        age: int

    parsed = client.responses.parse(
        model="default", input="Invent a person.", text_format=Person, max_output_tokens=40, temperature=0
    )
    assert isinstance(parsed.output_parsed, Person)


def test_function_tools_whole_and_streamed(client):
    r = client.responses.create(
        model="default",
        input="What is the weather in Oslo?",
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=40,
        temperature=0,
    )
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert isinstance(json.loads(call.arguments)["city"], str)
    events = list(
        client.responses.create(
            model="default",
            input="Weather in Rome?",
            tools=[WEATHER],
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=40,
            temperature=0,
            stream=True,
        )
    )
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(pieces) > 1 and "".join(pieces) == done.arguments and done.name == "get_weather"
    assert json.loads(done.arguments)["city"]


def test_previous_response_id_continues_the_conversation_from_the_cache(client):
    first = client.responses.create(
        model="default",
        input="What is the capital of France?",
        max_output_tokens=20,
        temperature=0,
        instructions="Answer in one short sentence.",
    )
    second = client.responses.create(
        model="default",
        input="And of Italy?",
        previous_response_id=first.id,
        max_output_tokens=20,
        temperature=0,
        instructions="Answer in one short sentence.",
    )
    assert second.previous_response_id == first.id and "Rome" in second.output_text
    # The first turn (its prompt and its output) is in the prompt of the second, and in the prefix cache.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens + first.usage.output_tokens - 1
    # A tool result sent back by call id continues a conversation that ended in a call.
    call_turn = client.responses.create(
        model="default",
        input="What is the weather in Oslo?",
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=40,
        temperature=0,
    )
    call = call_turn.output[0]
    answer = client.responses.create(
        model="default",
        previous_response_id=call_turn.id,
        tools=[WEATHER],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}],
        max_output_tokens=30,
        temperature=0,
    )
    assert answer.status == "completed"
    # All of the forced turn but its last user message (which asked for the call: 129 of 146 tokens here) is reused.
    assert answer.usage.input_tokens_details.cached_tokens >= 0.8 * call_turn.usage.input_tokens


def test_retrieve_delete_and_unknown_ids(client):
    r = client.responses.create(model="default", input="Hi", max_output_tokens=2)
    assert client.responses.retrieve(r.id).output_text == r.output_text
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError, match="no stored response") as info:
        client.responses.create(model="default", input="Hi", previous_response_id="resp_nope")
    assert info.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(model="default", input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize(
    "fields, param, needle",
    [
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
            "input",
            "input_image",
        ),
        ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools", "type 'web_search' are not supported"),
        ({"input": "Hi", "background": True}, "background", "not supported by plait"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "'item_reference' is not supported"),
        ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
    ],
    ids=["image", "hosted-tool", "background", "item-reference", "max-tokens"],
)
def test_what_plait_cannot_do_is_a_400_naming_the_field(client, fields, param, needle):
    with pytest.raises(openai.BadRequestError, match=needle) as info:
        client.responses.create(model="default", **fields)
    assert info.value.body["param"] == param


def test_include_output_text_logprobs_whole_and_streamed(client):
    # They were dropped: "logprobs": [] whatever the request included.
    ask = dict(
        model="default",
        input="Write a long story about a dragon.",
        max_output_tokens=5,
        temperature=0,
        include=["message.output_text.logprobs"],
        top_logprobs=2,
    )
    r = client.responses.create(**ask)
    part = r.output[0].content[0]
    assert len(part.logprobs) == r.usage.output_tokens == 5
    assert "".join(lp.token for lp in part.logprobs) == part.text
    assert all(lp.logprob <= 0 and len(lp.top_logprobs) == 2 for lp in part.logprobs)
    assert all(lp.top_logprobs[0].logprob >= lp.logprob - 1e-4 for lp in part.logprobs)  # greedy: the top one
    streamed, done = [], None
    for event in client.responses.create(**ask, stream=True):
        if event.type == "response.output_text.delta":
            streamed += event.logprobs
        elif event.type == "response.output_text.done":
            done = event.logprobs
    assert [lp.token for lp in streamed] == [lp.token for lp in part.logprobs] == [lp.token for lp in done]
    assert client.responses.create(**{**ask, "include": None, "top_logprobs": None}).output[0].content[0].logprobs == []
