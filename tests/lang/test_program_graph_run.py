"""Programs as request graphs (issue 8) on the real model: cache hits recorded per node, pins between gens
and across forks, run_batch's shared segments prefilled once, the group hint, and the hints over HTTP.

One colocated Runtime for the module (the default model), and plait's HTTP server wrapping that same
Engine. Greedy decoding and a few tokens per gen keep it short. The no-model half (tracing, rendering,
the segment finder, the pin ledger) is tests/lang/test_program_graph.py.
"""

import time

import plait as sgl
import pytest
import requests
from conftest import http_server_in_thread
from plait.backend.engine_backend import EngineBackend
from plait.graph_render import to_dot
from test_program_graph import check_dot, seg_tuples, skeleton

# ---------------------------------------------------------------- the real model


@pytest.fixture(scope="module")
def runtime():
    rt = sgl.Runtime(schedule_policy="dfs-weight")
    yield rt
    rt.shutdown()


@pytest.fixture(scope="module")
def http_url(runtime):
    with http_server_in_thread(runtime.engine) as url:
        yield url


def protected(runtime) -> int:
    return runtime.engine.get_stats()["protected_tokens"]


def wait_for(predicate, what: str, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


class RecordingEngine:
    """The real Engine, with every generate call's keyword arguments written down (the DSL passes one
    SamplingParams and one RequestOptions)."""

    def __init__(self, engine):
        self._engine = engine
        self.calls = []

    def generate(self, **kwargs):
        self.calls.append(kwargs)
        return self._engine.generate(**kwargs)

    def __getattr__(self, name):
        return getattr(self._engine, name)


SYSTEM = "You are a geography tutor. Answer in one short sentence, then stop. " * 4


@sgl.function
def two_turns(s, q1, q2, seen):
    s += sgl.system(SYSTEM)
    s += sgl.user(q1) + sgl.assistant(sgl.gen("a1", max_tokens=6))
    s["a1"]  # the program's Python reads the answer: between its two gens, its state stays pinned
    wait_for(lambda: protected(seen) > 0, "the state pin")
    s += sgl.user(q2) + sgl.assistant(sgl.gen("a2", max_tokens=6))


def test_run_graph_records_cache_hits_per_node_and_pins_the_state_between_gens(runtime, monkeypatch):
    # a pool short of room (less than STATE_PIN_FREE_SHARE of it free), where a state pin pays for its call
    monkeypatch.setattr(runtime.endpoint, "kv_free_tokens", lambda: 0)
    runtime.endpoint.pin_service()._room_read_at = float("-inf")
    state = two_turns.run("Capital of France?", "And of Spain?", runtime, temperature=0, backend=runtime)
    state.sync()
    assert state.error() is None
    assert protected(runtime) == 0  # every pin released at the end
    g = state.graph()
    assert g.source == "run" and g.name == "two_turns"
    assert [n.kind for n in g.nodes] == ["text", "gen", "text", "gen", "text"]
    assert g.edge_tuples() == [(0, 1, "next"), (1, 2, "next"), (2, 3, "next"), (3, 4, "next")]
    a1, a2 = g.nodes[1], g.nodes[3]
    assert (a1.name, a1.text, a2.name, a2.text) == ("a1", state["a1"], "a2", state["a2"])
    assert g.prompt_text(3) + a2.text + g.nodes[4].text == state.text()
    for node in (a1, a2):
        meta = state.get_meta_info(node.name)
        assert node.stats.requests == 1
        assert (node.stats.prompt_tokens, node.stats.cached_tokens, node.stats.completion_tokens) == (
            meta["prompt_tokens"],
            meta["cached_tokens"],
            meta["completion_tokens"],
        )
        assert node.stats.latency_s > 0 and node.stats.start_s >= 0
    # the second turn reused the first turn's prompt and answer
    assert a2.stats.cached_tokens >= a1.stats.prompt_tokens
    assert "cached " + str(a2.stats.cached_tokens) in to_dot(g)


@sgl.function
def two_turns_unpinned(s, q1, q2, rt, seen):
    s += sgl.system(SYSTEM)
    s += sgl.user(q1) + sgl.assistant(sgl.gen("a1", max_tokens=6))
    s["a1"]
    time.sleep(0.3)  # time for a state pin, were one taken
    seen.append(protected(rt))
    s += sgl.user(q2) + sgl.assistant(sgl.gen("a2", max_tokens=6))


def test_no_state_pin_while_the_pool_has_room(runtime):
    """With most of the KV pool free (the module's runtime: a few programs in a 65k-token pool) nothing is
    evicted between a program's requests: the state is not pinned, and the second turn still hits it."""
    runtime.endpoint.pin_service()._room_read_at = float("-inf")
    seen: list[int] = []
    state = two_turns_unpinned.run("Capital of France?", "And of Spain?", runtime, seen, temperature=0, backend=runtime)
    state.sync()
    assert state.error() is None and seen == [0]
    assert state.get_meta_info("a2")["cached_tokens"] >= state.get_meta_info("a1")["prompt_tokens"]


def test_fork_prefix_is_prefilled_once_pinned_until_join_and_every_request_is_grouped(runtime):
    spy = RecordingEngine(runtime.engine)
    backend = EngineBackend(spy)

    @sgl.function
    def fork_then_select(s):
        s += SYSTEM + "Name two rivers.\n"
        forks = s.fork(2)
        wait_for(lambda: protected(runtime) > 0, "the fork pin")
        forks += lambda i: "River " + str(i + 1) + ":" + sgl.gen("river", max_tokens=4, stop="\n")
        forks.join()
        s += "\nLonger one: " + sgl.select("longer", choices=["first", "second"])

    state = fork_then_select.run(temperature=0, backend=backend)
    state.sync()
    assert state.error() is None and protected(runtime) == 0
    g = state.graph()
    assert [(n.kind, n.branch) for n in g.nodes] == [
        ("text", "main"),
        ("fork", "main"),
        ("text", "f1.0"),
        ("gen", "f1.0"),
        ("text", "f1.1"),
        ("gen", "f1.1"),
        ("join", "main"),
        ("text", "main"),
        ("select", "main"),
    ]
    fork, river0, river1, select = g.nodes[1], g.nodes[3], g.nodes[5], g.nodes[8]
    prefix_tokens = fork.stats.prompt_tokens
    assert fork.stats.requests == 1 and fork.stats.completion_tokens == 0  # the shared prefix's prefill
    for river in (river0, river1):  # each branch found the whole shared prefix in the cache
        assert river.stats.cached_tokens >= prefix_tokens - 1
    # prefix prefill + one per choice + the prefix again (its last token id marks where each choice starts)
    assert select.stats.requests == 4 and select.stats.cached_tokens > 0
    assert [n.text for n in (river0, river1)] == state["river"]
    # every request of the program carries its group id, the forks' and the select's included
    groups = {call["options"].group for call in spy.calls}
    assert groups == {state.stream_executor.program_id} and len(spy.calls) == 5


@sgl.function
def few_shot(s, examples, question):
    s += "Answer with a number.\n" * 3
    s += examples
    s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=3, stop="\n")


ADD = "".join(f"Q: What is {i} plus {i}?\nA: {2 * i}\n" for i in range(1, 7))
MUL = "".join(f"Q: What is {i} times {i}?\nA: {i * i}\n" for i in range(1, 7))
BATCH = [
    {"examples": ADD, "question": "What is 2 plus 5?"},
    {"examples": MUL, "question": "What is 3 times 4?"},
    {"examples": ADD, "question": "What is 7 plus 1?"},
    {"examples": MUL, "question": "What is 5 times 2?"},
]


def test_run_batch_prefills_each_shared_segment_once_and_releases_it(runtime, monkeypatch):
    monkeypatch.setattr(sgl.global_config, "batch_prefill", "always")  # "auto" leaves a batch this small alone
    runtime.engine.flush_cache()
    states = few_shot.run_batch(BATCH, temperature=0, backend=runtime)
    assert all(s.error() is None for s in states) and protected(runtime) == 0
    plan = states[0].batch_plan
    tokenize = runtime.endpoint.tokenize
    prompts = [tokenize("Answer with a number.\n" * 3 + b["examples"] + "Q: " + b["question"] + "\nA:") for b in BATCH]
    assert plan.unit == "tokens" and plan.prefixes == prompts

    def lcp(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    header, add, mul = lcp(prompts[0], prompts[1]), lcp(prompts[0], prompts[2]), lcp(prompts[1], prompts[3])
    assert seg_tuples(plan.segments) == [
        (0, None, 0, header, (0, 1, 2, 3)),
        (1, 0, header, add, (0, 2)),
        (2, 0, header, mul, (1, 3)),
    ]
    # each segment computed once: the header fresh, each example group on top of the cached header
    assert [(s.prefill.prompt_tokens, s.prefill.cached_tokens) for s in plan.segments] == [
        (header, 0),
        (add, header),
        (mul, header),
    ]
    assert plan.dispatch_order() == [0, 2, 1, 3]  # one example group, then the other
    # and every program then found its whole group segment in the cache
    ends = {0: add, 2: add, 1: mul, 3: mul}
    assert [s.get_meta_info("answer")["cached_tokens"] for s in states] == [ends[i] for i in range(4)]
    g = plan.to_graph()
    assert [(n.kind, n.name) for n in g.nodes] == [
        ("text", None),
        ("text", None),
        ("program", "#0"),
        ("program", "#2"),
        ("text", None),
        ("program", "#1"),
        ("program", "#3"),
    ]
    assert g.edge_tuples() == [
        (0, 1, "next"),
        (1, 2, "next"),
        (1, 3, "next"),
        (0, 4, "next"),
        (4, 5, "next"),
        (4, 6, "next"),
    ]
    assert g.nodes[0].text + g.nodes[1].text == "Answer with a number.\n" * 3 + ADD + "Q: What is "
    assert g.nodes[2].text == "2 plus 5?\nA:"
    assert all(g.nodes[i].stats.cached_tokens == ends[int(g.nodes[i].name[1:])] for i in (2, 3, 5, 6))
    check_dot(to_dot(g), g)


def test_run_batch_prefills_up_front_only_where_the_batch_fills_the_cache(runtime, monkeypatch):
    """batch_prefill "auto": a batch whose distinct tokens fit in half the KV pool runs as SGLang's would (its
    constant text precached, no plan), with the same answers; one that fills more of it (a pool shrunk to
    the batch's size, here) gets the plan. Any other setting is refused by name."""
    runtime.engine.flush_cache()
    planned = few_shot.run_batch(BATCH, temperature=0, backend=runtime)
    assert not hasattr(planned[0], "batch_plan") and protected(runtime) == 0
    monkeypatch.setattr(sgl.global_config, "batch_prefill", "always")
    runtime.engine.flush_cache()
    always = few_shot.run_batch(BATCH, temperature=0, backend=runtime)
    assert [s["answer"] for s in always] == [s["answer"] for s in planned]
    monkeypatch.setattr(sgl.global_config, "batch_prefill", "auto")
    monkeypatch.setattr(runtime.endpoint, "kv_pool_tokens", lambda: always[0].batch_plan.distinct_length())
    assert hasattr(few_shot.run_batch(BATCH, temperature=0, backend=runtime)[0], "batch_plan")
    # more programs than the sample (8): "auto" decides from a sample's plan before tracing them all
    monkeypatch.setattr(runtime.endpoint, "kv_pool_tokens", lambda: 65536)
    assert not hasattr(few_shot.run_batch(BATCH * 3, temperature=0, backend=runtime)[0], "batch_plan")
    monkeypatch.setattr(runtime.endpoint, "kv_pool_tokens", lambda: 16)
    assert len(few_shot.run_batch(BATCH * 3, temperature=0, backend=runtime)[0].batch_plan.prefixes) == 12
    monkeypatch.setattr(sgl.global_config, "batch_prefill", "sometimes")
    with pytest.raises(ValueError, match="batch_prefill must be 'auto', 'always' or 'never', got 'sometimes'"):
        few_shot.run_batch(BATCH, temperature=0, backend=runtime)


def test_program_hints_off_sends_what_sglang_sends(runtime):
    spy = RecordingEngine(runtime.engine)
    backend = EngineBackend(spy, program_hints=False)
    states = few_shot.run_batch(BATCH[:2], temperature=0, backend=backend)
    assert all(s.error() is None for s in states)
    assert not hasattr(states[0], "batch_plan") and states[0].stream_executor.pins is None
    assert all(call["options"].group is None for call in spy.calls)
    # SGLang's precache: the constant text every run starts with, traced with placeholder arguments
    assert spy.calls[0]["prompt"] == "Answer with a number.\n" * 3
    assert protected(runtime) == 0


def test_unpin_takes_the_pin_id_and_is_a_no_op_after_shutdown(runtime):
    pin = runtime.engine.pin_prefix(SYSTEM + "Pinned, then released.")
    with pytest.raises(TypeError, match=r"pass pin_prefix\(...\)\['pin_id'\]"):
        runtime.engine.unpin_prefix(pin)
    assert runtime.engine.unpin_prefix(pin["pin_id"]) is True and protected(runtime) == 0
    from plait.runtime import Engine

    engine = Engine(num_threads=1)
    late = engine.pin_prefix("Released after the shutdown.")["pin_id"]
    engine.shutdown()
    # a program's worker thread releasing its state pin just after shutdown used to log a failure
    assert engine.unpin_prefix(late) is False


def test_hints_over_http(runtime, http_url):
    prefix = SYSTEM + "Hints over HTTP."
    res = requests.post(
        http_url + "/generate", json={"text": prefix, "group": "program-1", "sampling_params": {"max_new_tokens": 0}}
    )
    assert res.status_code == 200, res.text
    prompt_tokens = res.json()["meta_info"]["prompt_tokens"]
    pin = requests.post(http_url + "/pin_prefix", json={"text": prefix}).json()
    assert pin["pinned_tokens"] == prompt_tokens and protected(runtime) >= prompt_tokens
    assert requests.post(http_url + "/unpin_prefix", json={"pin_id": pin["pin_id"]}).json() == {"success": True}
    assert protected(runtime) == 0
    assert requests.post(http_url + "/unpin_prefix", json={"pin_id": pin["pin_id"]}).json()["success"] is False
    bad = requests.post(http_url + "/pin_prefix", json={"text": ""})
    assert bad.status_code == 400 and "empty" in bad.text
    assert requests.post(http_url + "/generate", json={"text": "x", "group": 5}).status_code == 400

    # a whole program over HTTP: group tags, fork pins and the run graph work as in-process
    state = skeleton.run("rivers", temperature=0, backend=sgl.RuntimeEndpoint(http_url))
    state.sync()
    assert state.error() is None and protected(runtime) == 0
    g = state.graph()
    assert [n.kind for n in g.nodes] == ["text", "fork", "text", "gen", "text", "gen", "join", "text", "gen"]
    assert g.nodes[1].stats.requests == 1 and all(g.nodes[i].stats.cached_tokens > 0 for i in (3, 5, 8))
