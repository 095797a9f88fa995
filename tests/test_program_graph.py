"""Programs as request graphs (issue 8): the graph a trace and a run produce, its rendering, run_batch's
shared-segment plan, program-aware pins, the group hint, and the hints over HTTP.

The first half needs no model (tracing, rendering, the segment finder). The second half runs the real
default model through one colocated Runtime for the module, and through plait's HTTP server wrapping
that same Engine. Greedy decoding and a few tokens per gen keep it short.
"""

import shutil
import subprocess
import threading
import time

import pytest
import requests

import plait as sgl

from conftest import http_server_in_thread
from plait.backend.base import BaseBackend
from plait.backend.engine_backend import EngineBackend
from plait.batch_plan import find_shared_segments
from plait.graph_render import dot_available, to_dot, to_html

# ---------------------------------------------------------------- programs


@sgl.function
def qa(s, question):
    s += "Answer briefly.\n"
    s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=8, stop="\n")
    s += "\nSure? " + sgl.select("sure", choices=["yes", "no"])


@sgl.function
def skeleton(s, topic):
    s += "Tips about " + topic + ".\n"
    forks = s.fork(2)
    forks += lambda i: "Tip " + str(i + 1) + ":" + sgl.gen("tip", max_tokens=4)
    forks.join()
    s += "Summary:" + sgl.gen("summary", max_tokens=4)


@sgl.function
def concat(s):
    s += "Start. "
    forks = s.fork(2)
    forks += ["A", "B"]
    forks += sgl.gen("g", max_tokens=2)
    forks.join("concate_and_append")
    s += " End:" + sgl.gen("end", max_tokens=2)


@sgl.function
def tree(s):
    s += "Problem.\n"
    forks = s.fork(2)
    forks += sgl.gen("plan", max_tokens=4)
    for branch in forks:
        sub = branch.fork(2)
        sub += sgl.gen("step", max_tokens=4)
        sub.join()
    forks.join()


def nodes_of(graph):
    return [(n.kind, n.branch, n.name, graph.display_text(n)) for n in graph.nodes]


# ---------------------------------------------------------------- graphs by tracing (no model)

def test_trace_graph_of_a_sequential_program_exact():
    g = qa.graph(backend=BaseBackend())
    assert nodes_of(g) == [
        ("text", "main", None, "Answer briefly.\nQ: "),
        ("arg", "main", "question", "{question}"),
        ("text", "main", None, "\nA:"),
        ("gen", "main", "answer", "{answer}"),
        ("text", "main", None, "\nSure? "),
        ("select", "main", "sure", "{sure}"),
    ]
    assert g.edge_tuples() == [(0, 1, "next"), (1, 2, "next"), (2, 3, "next"), (3, 4, "next"), (4, 5, "next")]
    assert g.nodes[3].detail == {"max_new_tokens": 8, "stop": "\n"}
    assert g.nodes[5].detail == {"choices": ["yes", "no"]}
    assert g.prompt_text(5) == "Answer briefly.\nQ: {question}\nA:{answer}\nSure? "
    # both requests read the header, the argument and "\nA:"; only the select reads the answer
    assert g.sharing() == {0: [3, 5], 1: [3, 5], 2: [3, 5], 3: [5], 4: [5]}
    assert g.shared_segments() == {0: [3, 5], 1: [3, 5], 2: [3, 5]}
    # a concrete argument is text
    assert qa.graph("Why?", backend=BaseBackend()).nodes[0].text == "Answer briefly.\nQ: Why?\nA:"


def test_trace_graph_of_fork_and_join_exact():
    g = skeleton.graph(backend=BaseBackend())
    assert nodes_of(g) == [
        ("text", "main", None, "Tips about "),
        ("arg", "main", "topic", "{topic}"),
        ("text", "main", None, ".\n"),
        ("fork", "main", None, ""),
        ("text", "f3.0", None, "Tip 1:"),
        ("gen", "f3.0", "tip", "{tip}"),
        ("text", "f3.1", None, "Tip 2:"),
        ("gen", "f3.1", "tip", "{tip}"),
        ("join", "main", None, ""),
        ("text", "main", None, "Summary:"),
        ("gen", "main", "summary", "{summary}"),
    ]
    assert g.edge_tuples() == [(0, 1, "next"), (1, 2, "next"), (2, 3, "next"), (3, 4, "fork"), (4, 5, "next"),
                               (3, 6, "fork"), (6, 7, "next"), (3, 8, "next"), (5, 8, "join"), (7, 8, "join"),
                               (8, 9, "next"), (9, 10, "next")]
    assert g.nodes[3].detail == {"size": 2} and g.nodes[8].detail == {"mode": "gather_variable", "fork": 3}
    # gather_variable: the branches' text is not in the parent's prompt
    assert g.prompt_text(10) == "Tips about {topic}.\nSummary:"
    assert g.shared_segments() == {0: [5, 7, 10], 1: [5, 7, 10], 2: [5, 7, 10]}


def test_trace_graph_concatenating_join_puts_the_branches_in_the_prompt():
    g = concat.graph(backend=BaseBackend())
    assert [(n.kind, n.branch) for n in g.nodes] == [
        ("text", "main"), ("fork", "main"), ("text", "f1.0"), ("gen", "f1.0"), ("text", "f1.1"), ("gen", "f1.1"),
        ("join", "main"), ("text", "main"), ("gen", "main")]
    assert g.nodes[6].detail == {"mode": "concate_and_append", "fork": 1}
    assert g.prompt_text(8) == "Start. A{g}B{g} End:"
    assert g.prompt_path(8) == [0, 2, 3, 4, 5, 7]


def test_trace_graph_of_nested_forks_exact():
    g = tree.graph(backend=BaseBackend())
    assert [(n.id, n.kind, n.branch) for n in g.nodes] == [
        (0, "text", "main"), (1, "fork", "main"),
        (2, "gen", "f1.0"), (3, "fork", "f1.0"), (4, "gen", "f3.0"), (5, "gen", "f3.1"), (6, "join", "f1.0"),
        (7, "gen", "f1.1"), (8, "fork", "f1.1"), (9, "gen", "f8.0"), (10, "gen", "f8.1"), (11, "join", "f1.1"),
        (12, "join", "main")]
    assert g.edge_tuples() == [
        (0, 1, "next"), (1, 2, "fork"), (2, 3, "next"), (3, 4, "fork"), (3, 5, "fork"), (3, 6, "next"),
        (4, 6, "join"), (5, 6, "join"), (1, 7, "fork"), (7, 8, "next"), (8, 9, "fork"), (8, 10, "fork"),
        (8, 11, "next"), (9, 11, "join"), (10, 11, "join"), (1, 12, "next"), (6, 12, "join"), (11, 12, "join")]
    # each plan is shared by its own two steps, the problem by all six requests
    assert g.shared_segments() == {0: [2, 4, 5, 7, 9, 10], 2: [4, 5], 7: [9, 10]}
    assert g.prompt_text(10) == "Problem.\n{plan}"


# ---------------------------------------------------------------- rendering (no model)

def check_dot(text: str, graph) -> None:
    assert text.startswith("digraph ") and text.rstrip().endswith("}")
    assert text.count("{") == text.count("}")
    assert sum(1 for line in text.splitlines() if " -> " in line) == len(graph.edges)
    for node in graph.nodes:
        assert f"n{node.id} [" in text
    if dot_available():  # graphviz itself is the judge of validity when installed
        done = subprocess.run(["dot", "-Tsvg"], input=text.encode(), capture_output=True, timeout=60)
        assert done.returncode == 0, done.stderr.decode()


@pytest.mark.parametrize("program", [qa, skeleton, concat, tree])
def test_rendering_gives_valid_dot_and_a_self_contained_page(program, tmp_path):
    g = program.graph(backend=BaseBackend())
    check_dot(to_dot(g), g)
    page = to_html(g)
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page and page.count("<tr>") == len(g.nodes) + 1
    assert g.save(str(tmp_path / "g.dot")).endswith("g.dot")
    assert (tmp_path / "g.dot").read_text() == to_dot(g)
    g.save(str(tmp_path / "g.svg"))
    assert (tmp_path / "g.svg").read_text().startswith("<svg")
    if shutil.which("dot"):
        g.save(str(tmp_path / "g.png"))
        assert (tmp_path / "g.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        with pytest.raises(RuntimeError, match="graphviz"):
            g.save(str(tmp_path / "g.png"))
    with pytest.raises(ValueError, match=".txt"):
        g.save(str(tmp_path / "g.txt"))


def test_dot_escapes_quotes_backslashes_and_newlines():
    @sgl.function
    def tricky(s):
        s += 'say "hi" \\ then\nnewline {braces} <b>'
        s += sgl.gen("x")

    g = tricky.graph(backend=BaseBackend())
    text = to_dot(g)
    assert '\\"hi\\"' in text and "\\\\ then" in text
    check_dot(text, g)
    assert "&lt;b&gt;" in to_html(g)


# ---------------------------------------------------------------- shared segments (no model)

def seg_tuples(segments):
    return [(s.id, s.parent, s.start, s.end, s.members) for s in segments]


def test_shared_segments_on_text_exact():
    header = "Answer each question.\n"
    ex_a, ex_b = "Q: 1+1?\nA: 2\n", "E: 2*3?\nA: 6\n"
    texts = [header + ex_a + "Q: x?", header + ex_a + "Q: y?", header + ex_b + "Q: z?", header + ex_b + "Q: w?",
             "Unrelated prompt"]
    h, a = len(header), len(header + ex_a + "Q: ")
    assert seg_tuples(find_shared_segments(texts)) == [
        (0, None, 0, h, (0, 1, 2, 3)),  # the common header
        (1, 0, h, a, (0, 1)),  # examples A, up to where the questions differ
        (2, 0, h, a, (2, 3)),  # examples B
    ]
    # segments shorter than min_len are dropped and their children attach to the nearest kept one
    short = seg_tuples(find_shared_segments(texts, min_len=len(header) + 1))
    assert short == [(0, None, 0, a, (0, 1)), (1, None, 0, a, (2, 3))]
    assert find_shared_segments(["abc", "xyz"]) == [] and find_shared_segments(["same"]) == []
    with pytest.raises(ValueError, match="min_len"):
        find_shared_segments(texts, min_len=0)


def test_shared_segments_on_tokens_exact():
    seqs = [[1, 2, 3, 4, 5, 9], [1, 2, 3, 4, 5, 8], [1, 2, 3, 7, 7], [1, 2, 3, 7, 7, 6], [1, 2], [5, 5, 5]]
    assert seg_tuples(find_shared_segments(seqs)) == [
        (0, None, 0, 2, (0, 1, 2, 3, 4)),
        (1, 0, 2, 3, (0, 1, 2, 3)),
        (2, 1, 3, 5, (0, 1)),
        (3, 1, 3, 5, (2, 3)),  # [1,2,3,7,7] is a prefix of [1,2,3,7,7,6]: the whole of it is shared
    ]
    assert seg_tuples(find_shared_segments(seqs, min_len=2)) == [
        (0, None, 0, 2, (0, 1, 2, 3, 4)), (1, 0, 2, 5, (0, 1)), (2, 0, 2, 5, (2, 3))]


# ---------------------------------------------------------------- pins (no model)

class PinLedgerEngine:
    """The Engine's pin API over a ledger (one token per character): what a program pins, in order."""

    def __init__(self, pool_tokens):
        self.info = type("Info", (), {"max_total_tokens": pool_tokens})()
        self.events = []
        self.lock = threading.Lock()

    def pin_prefix(self, prefix):
        with self.lock:
            self.events.append(("pin", prefix))
            return {"pin_id": len(self.events), "pinned_tokens": len(prefix)}

    def unpin_prefix(self, pin_id):
        with self.lock:
            self.events.append(("unpin", pin_id))
        return True


def test_pins_keep_order_give_back_over_budget_and_release_everything():
    from plait.pins import ProgramPins

    engine = PinLedgerEngine(pool_tokens=40)  # budget: a quarter, 10 tokens
    service = EngineBackend(engine).pin_service()
    pins = ProgramPins(service)
    pins.move_state_pin("main", "abcdef")  # 6 tokens: kept
    pins.wait_idle()
    # 8: pinned before the old one is released, and the 6 it supersedes do not count twice
    pins.move_state_pin("main", "abcdefgh")
    fork = pins.pin("abcdefghijk")  # 11 > budget: given back at once
    pins.wait_idle()
    assert engine.events == [("pin", "abcdef"), ("pin", "abcdefgh"), ("unpin", 1), ("pin", "abcdefghijk"),
                             ("unpin", 4)]
    assert fork.pin is None and service.pinned_tokens == 8
    pins.release_all(wait=True)
    assert engine.events[-1] == ("unpin", 2) and service.pinned_tokens == 0
    assert pins.pin("more") is None  # the program is over


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
    """The real Engine, with every generate call's keyword arguments written down."""

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


def test_run_graph_records_cache_hits_per_node_and_pins_the_state_between_gens(runtime):
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
            meta["prompt_tokens"], meta["cached_tokens"], meta["completion_tokens"])
        assert node.stats.latency_s > 0 and node.stats.start_s >= 0
    # the second turn reused the first turn's prompt and answer
    assert a2.stats.cached_tokens >= a1.stats.prompt_tokens
    assert "cached " + str(a2.stats.cached_tokens) in to_dot(g)


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
        ("text", "main"), ("fork", "main"), ("text", "f1.0"), ("gen", "f1.0"), ("text", "f1.1"), ("gen", "f1.1"),
        ("join", "main"), ("text", "main"), ("select", "main")]
    fork, river0, river1, select = g.nodes[1], g.nodes[3], g.nodes[5], g.nodes[8]
    prefix_tokens = fork.stats.prompt_tokens
    assert fork.stats.requests == 1 and fork.stats.completion_tokens == 0  # the shared prefix's prefill
    for river in (river0, river1):  # each branch found the whole shared prefix in the cache
        assert river.stats.cached_tokens >= prefix_tokens - 1
    assert select.stats.requests == 3 and select.stats.cached_tokens > 0  # prefix prefill + one per choice
    assert [n.text for n in (river0, river1)] == state["river"]
    # every request of the program carries its group id, the forks' and the select's included
    groups = {call.get("group") for call in spy.calls}
    assert groups == {state.stream_executor.program_id} and len(spy.calls) == 5


@sgl.function
def few_shot(s, examples, question):
    s += "Answer with a number.\n" * 3
    s += examples
    s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=3, stop="\n")


ADD = "".join(f"Q: What is {i} plus {i}?\nA: {2 * i}\n" for i in range(1, 7))
MUL = "".join(f"Q: What is {i} times {i}?\nA: {i * i}\n" for i in range(1, 7))
BATCH = [{"examples": ADD, "question": "What is 2 plus 5?"}, {"examples": MUL, "question": "What is 3 times 4?"},
         {"examples": ADD, "question": "What is 7 plus 1?"}, {"examples": MUL, "question": "What is 5 times 2?"}]


def test_run_batch_prefills_each_shared_segment_once_and_releases_it(runtime):
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
    assert seg_tuples(plan.segments) == [(0, None, 0, header, (0, 1, 2, 3)), (1, 0, header, add, (0, 2)),
                                         (2, 0, header, mul, (1, 3))]
    # each segment computed once: the header fresh, each example group on top of the cached header
    assert [(s.prefill.prompt_tokens, s.prefill.cached_tokens) for s in plan.segments] == [
        (header, 0), (add, header), (mul, header)]
    assert plan.dispatch_order() == [0, 2, 1, 3]  # one example group, then the other
    # and every program then found its whole group segment in the cache
    ends = {0: add, 2: add, 1: mul, 3: mul}
    assert [s.get_meta_info("answer")["cached_tokens"] for s in states] == [ends[i] for i in range(4)]
    g = plan.to_graph()
    assert [(n.kind, n.name) for n in g.nodes] == [("text", None), ("text", None), ("program", "#0"),
                                                   ("program", "#2"), ("text", None), ("program", "#1"),
                                                   ("program", "#3")]
    assert g.edge_tuples() == [(0, 1, "next"), (1, 2, "next"), (1, 3, "next"), (0, 4, "next"), (4, 5, "next"),
                               (4, 6, "next")]
    assert g.nodes[0].text + g.nodes[1].text == "Answer with a number.\n" * 3 + ADD + "Q: What is "
    assert g.nodes[2].text == "2 plus 5?\nA:"
    assert all(g.nodes[i].stats.cached_tokens == ends[int(g.nodes[i].name[1:])] for i in (2, 3, 5, 6))
    check_dot(to_dot(g), g)


def test_program_hints_off_sends_what_sglang_sends(runtime):
    spy = RecordingEngine(runtime.engine)
    backend = EngineBackend(spy, program_hints=False)
    states = few_shot.run_batch(BATCH[:2], temperature=0, backend=backend)
    assert all(s.error() is None for s in states)
    assert not hasattr(states[0], "batch_plan") and states[0].stream_executor.pins is None
    assert all("group" not in call for call in spy.calls)
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
    res = requests.post(http_url + "/generate", json={"text": prefix, "group": "program-1",
                                                      "sampling_params": {"max_new_tokens": 0}})
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
