"""Tool calls read back from outputs as they grow (no model): streamed the way OpenAI streams them (id and name
first, then the arguments piece by piece), and a forced call cut by max_tokens returned as a call.

End to end with the server and the real clients: test_server_clients.py.
"""

from __future__ import annotations

import json

import jiter
import pytest
from plait.runtime.server.tools.json_scan import scan_call, value_end
from plait.runtime.server.tools.parser import ToolPlan

NAMES = frozenset({"get_weather", "get_time"})
FORCED = ToolPlan(NAMES, forced=True, parallel=False, forced_name="get_weather")
REQUIRED = ToolPlan(NAMES, forced=True, parallel=True)
AUTO = ToolPlan(NAMES, forced=False, parallel=True)
CALL = '{"name": "get_weather", "arguments": {"city": "Oslo", "days": [1, 2], "unit": "celsius"}}'


def stream_pieces(plan: ToolPlan, text: str, step: int = 3, cut: bool = False):
    """Feed `text` to a stream `step` characters at a time: (content, assembled calls, every tool_calls delta)."""
    stream, content, deltas = plan.new_stream(), "", []
    for end in range(step, len(text) + step, step):
        piece, calls = stream.update(text[:end])
        content += piece
        deltas.append(calls)
    rest, calls = stream.finish(text, cut=cut)
    content += rest
    deltas.append(calls)
    assembled: dict[int, dict] = {}
    for delta in (d for ds in deltas for d in ds):
        entry = assembled.setdefault(delta["index"], {"id": None, "name": "", "arguments": ""})
        entry["id"] = entry["id"] or delta.get("id")
        entry["name"] += delta.get("function", {}).get("name") or ""
        entry["arguments"] += delta["function"].get("arguments") or ""
    return content, assembled, deltas


def test_scanner_reads_a_call_as_far_as_it_is_written():
    span = scan_call(CALL, 0)
    assert span.name == "get_weather" and span.end == len(CALL)
    assert json.loads(span.arguments_text(CALL)) == {"city": "Oslo", "days": [1, 2], "unit": "celsius"}
    cut = CALL[:49]  # inside "Oslo"
    span = scan_call(cut, 0)
    assert span.name == "get_weather" and span.end is None and span.args_end is None
    assert span.arguments_text(cut) == '{"city": "Os'
    assert scan_call('{"name": "get_wea', 0).name is None  # a name is known once its string is closed
    assert value_end('"a\\"b" ', 0) == 6 and value_end("12", 0) is None and value_end("12,", 0) == 2


def test_a_forced_call_streams_its_name_first_then_its_arguments_piece_by_piece():
    content, calls, deltas = stream_pieces(FORCED, CALL)
    assert content == ""
    assert [c["name"] for c in calls.values()] == ["get_weather"] and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["arguments"]) == {"city": "Oslo", "days": [1, 2], "unit": "celsius"}
    argument_pieces = [d for ds in deltas for d in ds if d["function"].get("arguments")]
    assert len(argument_pieces) > 10  # not one delta at the end
    heads = [d for ds in deltas for d in ds if "id" in d]
    assert len(heads) == 1 and heads[0]["type"] == "function"
    # What instructor's create_partial does with the pieces: parse the arguments so far as partial JSON.
    seen, so_far = [], ""
    for piece in argument_pieces:
        so_far += piece["function"]["arguments"]
        seen.append(jiter.from_json(so_far.encode(), partial_mode="trailing-strings"))
    assert any("Oslo".startswith(s.get("city", "-")) and s["city"] != "Oslo" for s in seen)  # a string filling in
    assert seen[-1] == {"city": "Oslo", "days": [1, 2], "unit": "celsius"}


def test_parallel_calls_stream_with_their_own_index():
    text = '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]'
    _, calls, _ = stream_pieces(REQUIRED, text, step=5)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_time", {}),
        ("get_weather", {"city": "Rome"}),
    ]
    assert calls[0]["id"] != calls[1]["id"]


def test_auto_streams_a_hermes_call_after_its_text_and_text_stays_text():
    text = 'Checking. <tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
    content, calls, _ = stream_pieces(AUTO, text, step=4)
    assert content == "Checking. " and [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_time", {"tz": "CET"})
    ]
    content, calls, _ = stream_pieces(AUTO, '{"city": "Oslo"} is JSON, not a call')
    assert calls == {} and content == '{"city": "Oslo"} is JSON, not a call'


def test_arguments_given_as_json_text_are_sent_whole_once_complete():
    text = '{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}'
    _, calls, _ = stream_pieces(AUTO, text)
    assert json.loads(calls[0]["arguments"]) == {"city": "Oslo"}


@pytest.mark.parametrize(
    "cut_at, arguments", [(49, '{"city": "Os'), (len('{"name": "get_weather", "argu'), ""), (12, "")]
)
def test_a_forced_call_cut_by_max_tokens_is_still_a_call(cut_at, arguments):
    text = CALL[:cut_at]
    message, called = FORCED.message(text, cut=True)
    assert called and message["content"] is None
    (call,) = message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": arguments}
    content, calls, _ = stream_pieces(FORCED, text, cut=True)
    assert content == "" and [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", arguments)]
    # What parses today: a call that was complete when max_tokens came is whole.
    message, _ = FORCED.message(CALL, cut=True)
    assert json.loads(message["tool_calls"][0]["function"]["arguments"])["city"] == "Oslo"


def test_a_whole_output_keeps_the_models_own_argument_text():
    message, called = AUTO.message('{"name": "get_time", "arguments": {"tz":"UTC"}}')
    assert called and message["tool_calls"][0]["function"]["arguments"] == '{"tz":"UTC"}'
    message, called = AUTO.message('{"name": "get_weather", "arguments": {"city": "Oslo"}')  # cut, not forced
    assert not called and message["content"].startswith('{"name"')
