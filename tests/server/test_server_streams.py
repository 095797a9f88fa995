"""Many streams at once through a real `plait serve` (the embedded model): every stream gets all its tokens,
in order, one chunk per token; clients that leave mid-stream are aborted in the scheduler at once, with
their KV back. The server's own encoding of stream events (sse.py) writes what json.dumps writes."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
import requests
from conftest import server_process
from plait.runtime.engine.streams import CumulativeOutput
from plait.runtime.server.sse import CumulativeEvents, EventTemplate, Slot, sse_event

STREAMS = 64
TOKENS = 12
LEAVERS = 16  # streams whose client goes away after two chunks
LONG = 4000  # what a leaver asks for: far more than it can get before the others end
# A leaver's tokens after its client left: the abort reaches the scheduler within a step or two of the
# disconnect, not when max_new_tokens runs out.
LEAVER_TOKENS_MAX = 32
IDLE_DEADLINE_S = 60


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("streams") / "server.log"
    with server_process(log_path, "--num-threads", "2") as url:
        yield url


def server_info(url: str) -> dict:
    return requests.get(url + "/get_server_info", timeout=60).json()


def wait_idle(url: str) -> dict:
    deadline = time.time() + IDLE_DEADLINE_S
    while True:
        info = server_info(url)
        if not (info["num_running_reqs"] or info["num_waiting_reqs"] or info["kv_used_tokens"]):
            if not info["num_open_http_requests"]:
                return info
        assert time.time() < deadline, f"the server did not go idle: {info}"
        time.sleep(0.1)


async def read_stream(session: aiohttp.ClientSession, url: str, i: int, max_new_tokens: int, leave_after=None):
    """One /generate stream: its chunks (SGLang's cumulative shape), or the first `leave_after` of them
    before the client closes the connection."""
    body = {
        "text": f"Question {i}: name a river and say why it matters.",
        "stream": True,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True},
    }
    chunks = []
    resp = await session.post(url + "/generate", json=body)
    assert resp.status == 200
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line:
            continue
        assert line.startswith("data: "), line
        if line == "data: [DONE]":
            break
        chunks.append(json.loads(line[len("data: ") :]))
        if leave_after is not None and len(chunks) == leave_after:
            resp.close()  # the client goes away mid-stream
            break
    resp.release()
    return chunks


async def many_streams(url: str):
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        return await asyncio.gather(
            *[read_stream(session, url, i, TOKENS) for i in range(STREAMS)],
            *[read_stream(session, url, STREAMS + i, LONG, leave_after=2) for i in range(LEAVERS)],
        )


def test_many_streams_get_every_token_in_order_one_chunk_each_and_leavers_are_aborted(url):
    before = wait_idle(url)
    outputs = asyncio.run(many_streams(url))
    for chunks in outputs[:STREAMS]:
        ids: list[int] = []
        for k, chunk in enumerate(chunks, start=1):
            # cumulative chunks: each adds exactly one token to what came before, which it keeps as it was
            assert chunk["output_ids"][: len(ids)] == ids and len(chunk["output_ids"]) == k
            assert chunk["meta_info"]["completion_tokens"] == k
            ids = chunk["output_ids"]
        assert len(chunks) == TOKENS
        assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": TOKENS}
    assert all(len(chunks) == 2 for chunks in outputs[STREAMS:])
    after = wait_idle(url)  # nothing running or waiting, no KV held, no HTTP request open
    leaver_tokens = after["generation_tokens"] - before["generation_tokens"] - STREAMS * TOKENS
    assert 2 * LEAVERS <= leaver_tokens <= LEAVERS * LEAVER_TOKENS_MAX
    assert after["last_integrity_error"] is None


def test_a_request_read_whole_gets_what_its_stream_gets(url):
    """A request without stream is asked of the scheduler as its first token and its end alone (engine_client
    FINAL_ONLY_INTERVAL): the same text and ids as the streamed request, its n samples (which wait on the first
    sample's first token) too, a stop string still cut, and a stream_interval the request sets kept."""
    prompt = "Question 5: name a river and say why it matters."
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    streamed = asyncio.run(_stream_whole(url, prompt, params))
    whole = requests.post(url + "/generate", json={"text": prompt, "sampling_params": params}, timeout=120).json()
    assert whole["output_ids"] == streamed["output_ids"] and whole["text"] == streamed["text"]
    samples = requests.post(
        url + "/generate", json={"text": prompt, "sampling_params": {**params, "n": 2}}, timeout=120
    ).json()
    assert [s["output_ids"] for s in samples] == [streamed["output_ids"]] * 2
    stop = streamed["text"][len(streamed["text"]) // 2 :][:3]
    cut = requests.post(
        url + "/v1/completions",
        json={
            "model": "default",
            "prompt": prompt,
            "max_tokens": 24,
            "temperature": 0,
            "stop": [stop],
            "ignore_eos": True,
        },
        timeout=120,
    ).json()
    assert cut["choices"][0]["text"] == streamed["text"][: streamed["text"].index(stop)]
    own = requests.post(
        url + "/generate", json={"text": prompt, "sampling_params": {**params, "stream_interval": 5}}, timeout=120
    ).json()
    assert own["output_ids"] == streamed["output_ids"]
    from plait.runtime.sampling_params import SamplingParams
    from plait.runtime.server.engine_client import FINAL_ONLY_INTERVAL, _final_only

    assert _final_only({"sampling_params": {"n": 1}})["sampling_params"]["stream_interval"] == FINAL_ONLY_INTERVAL
    assert _final_only({"sampling_params": SamplingParams()})["sampling_params"].stream_interval == FINAL_ONLY_INTERVAL
    assert _final_only({"sampling_params": SamplingParams(stream_interval=3)})["sampling_params"].stream_interval == 3
    assert wait_idle(url)["last_integrity_error"] is None


async def _stream_whole(url: str, prompt: str, params: dict) -> dict:
    chunks = []
    async with aiohttp.ClientSession() as session:
        resp = await session.post(url + "/generate", json={"text": prompt, "stream": True, "sampling_params": params})
        async for line in resp.content:
            line = line.strip()
            if line.startswith(b"data:") and line != b"data: [DONE]":
                chunks.append(json.loads(line[5:]))
    assert len(chunks) == params["max_new_tokens"]  # one chunk a token: streams keep theirs
    return chunks[-1]


@pytest.mark.parametrize(
    "text",
    ["plain", "", 'quotes " and \\ backslashes', "new\nline\ttab", "unicode: é ü 中文 🙂", "\x00\x1f control"],
)
def test_event_template_writes_what_json_dumps_writes(text):
    head = {"id": "cmpl-1", "object": "text_completion", "created": 17, "model": "m/é"}
    template = EventTemplate(
        {**head, "choices": [{"index": Slot("index"), "text": Slot("text"), "logprobs": None, "finish_reason": None}]}
    )
    assert template.slots == ("index", "text")
    for index in (0, 7):
        body = {**head, "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": None}]}
        assert template.render(index, text) == sse_event(body)
    nested = EventTemplate({"a": [Slot("x"), {"b": Slot("y")}], "c": 1.5})
    for x, y in ((None, True), (2.25, [1, "é"]), ({"k": None}, "s")):
        assert nested.render(x, y) == sse_event({"a": [x, {"b": y}], "c": 1.5})
    with pytest.raises(TypeError, match="takes 2 values"):
        nested.render(1)


def test_cumulative_events_write_what_json_dumps_writes_of_each_chunk():
    deltas = [
        {"text": "Hello", "text_offset": 0, "output_ids": [5, 6], "meta_info": {"id": "r", "completion_tokens": 2}},
        {"text": "", "text_offset": 5, "output_ids": [7], "meta_info": {"id": "r", "finish_reason": None}},
        {"text": ' "wörld" \\ \n\t 🙂 \x01', "text_offset": 5, "output_ids": [8], "meta_info": {"e2e": 0.125}},
        # a stop regex matched inside the text sent: the end is cut, then more comes
        {"text": "!", "text_offset": 3, "output_ids": [], "meta_info": {"finish_reason": {"type": "stop"}}},
    ]
    logprobs = [
        {**d, "meta_info": {**d["meta_info"], "output_token_logprobs": [(-0.5, i, "t")]}} for i, d in enumerate(deltas)
    ]
    for stream, index in ((deltas, None), (logprobs, 3)):
        events, reference = CumulativeEvents(index), CumulativeOutput()
        for delta in stream:
            reference.add(delta)
            chunk = reference.chunk()
            if index is not None:
                chunk["index"] = index
            assert events.add(delta) == sse_event(chunk).encode()
    assert reference.text == "Hel!" and reference.output_ids == [5, 6, 7, 8]
