"""Programs as request graphs (issue 8), without a model: the graph a trace produces, its rendering,
run_batch's shared-segment plan and the pin ledger. The same on the real model (cache hits per node, pins,
the group hint, HTTP) is tests/lang/test_program_graph_run.py.
"""

import shutil
import subprocess
import threading

import plait as sgl
import pytest
from plait.backend.base import BaseBackend
from plait.backend.engine_backend import EngineBackend
from plait.batch_plan import find_shared_segments
from plait.graph_render import dot_available, save, to_dot, to_html

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
    assert g.edge_tuples() == [
        (0, 1, "next"),
        (1, 2, "next"),
        (2, 3, "next"),
        (3, 4, "fork"),
        (4, 5, "next"),
        (3, 6, "fork"),
        (6, 7, "next"),
        (3, 8, "next"),
        (5, 8, "join"),
        (7, 8, "join"),
        (8, 9, "next"),
        (9, 10, "next"),
    ]
    assert g.nodes[3].detail == {"size": 2} and g.nodes[8].detail == {"mode": "gather_variable", "fork": 3}
    # gather_variable: the branches' text is not in the parent's prompt
    assert g.prompt_text(10) == "Tips about {topic}.\nSummary:"
    assert g.shared_segments() == {0: [5, 7, 10], 1: [5, 7, 10], 2: [5, 7, 10]}


def test_trace_graph_concatenating_join_puts_the_branches_in_the_prompt():
    g = concat.graph(backend=BaseBackend())
    assert [(n.kind, n.branch) for n in g.nodes] == [
        ("text", "main"),
        ("fork", "main"),
        ("text", "f1.0"),
        ("gen", "f1.0"),
        ("text", "f1.1"),
        ("gen", "f1.1"),
        ("join", "main"),
        ("text", "main"),
        ("gen", "main"),
    ]
    assert g.nodes[6].detail == {"mode": "concate_and_append", "fork": 1}
    assert g.prompt_text(8) == "Start. A{g}B{g} End:"
    assert g.prompt_path(8) == [0, 2, 3, 4, 5, 7]


def test_trace_graph_of_nested_forks_exact():
    g = tree.graph(backend=BaseBackend())
    assert [(n.id, n.kind, n.branch) for n in g.nodes] == [
        (0, "text", "main"),
        (1, "fork", "main"),
        (2, "gen", "f1.0"),
        (3, "fork", "f1.0"),
        (4, "gen", "f3.0"),
        (5, "gen", "f3.1"),
        (6, "join", "f1.0"),
        (7, "gen", "f1.1"),
        (8, "fork", "f1.1"),
        (9, "gen", "f8.0"),
        (10, "gen", "f8.1"),
        (11, "join", "f1.1"),
        (12, "join", "main"),
    ]
    assert g.edge_tuples() == [
        (0, 1, "next"),
        (1, 2, "fork"),
        (2, 3, "next"),
        (3, 4, "fork"),
        (3, 5, "fork"),
        (3, 6, "next"),
        (4, 6, "join"),
        (5, 6, "join"),
        (1, 7, "fork"),
        (7, 8, "next"),
        (8, 9, "fork"),
        (8, 10, "fork"),
        (8, 11, "next"),
        (9, 11, "join"),
        (10, 11, "join"),
        (1, 12, "next"),
        (6, 12, "join"),
        (11, 12, "join"),
    ]
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
    assert save(g, str(tmp_path / "g.dot")).endswith("g.dot")
    assert (tmp_path / "g.dot").read_text() == to_dot(g)
    save(g, str(tmp_path / "g.svg"))
    assert (tmp_path / "g.svg").read_text().startswith("<svg")
    if shutil.which("dot"):
        save(g, str(tmp_path / "g.png"))
        assert (tmp_path / "g.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        with pytest.raises(RuntimeError, match="graphviz"):
            save(g, str(tmp_path / "g.png"))
    with pytest.raises(ValueError, match=".txt"):
        save(g, str(tmp_path / "g.txt"))


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
    texts = [
        header + ex_a + "Q: x?",
        header + ex_a + "Q: y?",
        header + ex_b + "Q: z?",
        header + ex_b + "Q: w?",
        "Unrelated prompt",
    ]
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
        (0, None, 0, 2, (0, 1, 2, 3, 4)),
        (1, 0, 2, 5, (0, 1)),
        (2, 0, 2, 5, (2, 3)),
    ]


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
    assert engine.events == [("pin", "abcdef"), ("pin", "abcdefgh"), ("unpin", 1), ("pin", "abcdefghijk"), ("unpin", 4)]
    assert fork.pin is None and service.pinned_tokens == 8
    pins.release_all(wait=True)
    assert engine.events[-1] == ("unpin", 2) and service.pinned_tokens == 0
    assert pins.pin("more") is None  # the program is over


def test_a_state_stays_pinned_only_when_long_enough_and_another_request_follows():
    from plait.pins import MIN_STATE_PIN_CHARS, ProgramPins

    engine = PinLedgerEngine(pool_tokens=10_000)
    service = EngineBackend(engine).pin_service()
    pins = ProgramPins(service)
    short, long = "x" * (MIN_STATE_PIN_CHARS - 1), "y" * MIN_STATE_PIN_CHARS
    pins.after_request("main", short, will_extend=True)  # cheaper to prefill again than to keep
    pins.after_request("main", long, will_extend=True)
    pins.after_request("f0.0", long + "z", will_extend=True)  # another branch: a pin of its own
    pins.after_request("main", long + "more", will_extend=False)  # nothing follows on main: its pin goes
    pins.wait_idle()
    assert engine.events == [("pin", long), ("pin", long + "z"), ("unpin", 1)]
    assert service.pinned_tokens == MIN_STATE_PIN_CHARS + 1
    pins.release_all(wait=True)
    assert engine.events[-1] == ("unpin", 2) and service.pinned_tokens == 0


def test_state_pins_follow_the_runtimes_free_room_and_survive_a_failing_reading():
    from plait.pins import MIN_STATE_PIN_CHARS, ProgramPins

    class RoomEngine(PinLedgerEngine):
        free = 9_000

        def get_stats(self):
            if self.free is None:
                raise RuntimeError("the engine is shutting down")
            return {"free_tokens": self.free}

    engine = RoomEngine(pool_tokens=10_000)
    service = EngineBackend(engine).pin_service()
    pins = ProgramPins(service)
    state = "y" * MIN_STATE_PIN_CHARS
    pins.after_request("main", state, will_extend=True)  # 90% free: nothing to protect, no call
    pins.wait_idle()
    assert engine.events == []
    for free in (1_000, None):  # 10% free: pinned; a reading that fails: pinned too (the old behaviour)
        engine.free, service._room_read_at = free, float("-inf")
        pins.after_request("main", state + str(free), will_extend=True)
        pins.wait_idle()
        assert engine.events[-1][0] in ("pin", "unpin") and ("pin", state + str(free)) in engine.events
    pins.release_all(wait=True)
    assert service.pinned_tokens == 0
