"""Program control flow in the interpreter: run_batch, fork/join and scopes, select, streaming; against the
scripted Engine stand-in (scripted_engine.py), so each test pins exact requests and text."""

import asyncio
import random

import plait as sgl
import pytest
from helpers.scripted_engine import backend_for
from plait.runtime.sampling_params import SamplingParams

# ---------------------------------------------------------------- run_batch


def test_run_batch_keeps_input_order_isolates_failures_and_shows_progress(capsys):
    rng = random.Random(0)
    backend = backend_for(reply=lambda p: p.split(":")[0], delay=lambda p: rng.random() * 0.02)

    @sgl.function
    def tag(s, i):
        if i == 5:
            raise RuntimeError("program 5 fails")
        s += f"{i}: " + sgl.gen("echo", max_tokens=8)

    states = tag.run_batch([{"i": i} for i in range(12)], progress_bar=True, backend=backend, num_threads=4)
    assert [s.error() is None for s in states] == [i != 5 for i in range(12)]
    assert isinstance(states[5].error(), RuntimeError)
    assert [s["echo"] for i, s in enumerate(states) if i != 5] == [str(i) for i in range(12) if i != 5]
    assert "12/12" in capsys.readouterr().err

    gen_states = tag.run_batch([(i,) for i in range(6, 9)], generator_style=True, backend=backend)
    assert [s["echo"] for s in gen_states] == ["6", "7", "8"]
    assert tag.run_batch([], backend=backend) == []
    with pytest.raises(TypeError, match="item 1"):
        tag.run_batch([(1,), (1, 2, 3)], backend=backend)


def test_run_batch_precaches_the_shared_prefix():
    backend = backend_for(reply=lambda p: "fine")
    preamble = "You are a careful assistant. Answer every question in one short sentence. "

    @sgl.function
    def q(s, question):
        s += preamble + "Question: " + question + "\nAnswer:" + sgl.gen("a", max_tokens=4)

    q.run_batch([{"question": "a"}, {"question": "b"}], backend=backend)
    first = backend.engine.requests[0]
    assert first["prompt"] == preamble + "Question: " and first["sampling_params"] == SamplingParams(max_new_tokens=0)


# ---------------------------------------------------------------- fork / join / scopes


def test_fork_runs_branches_and_join_gathers_variables():
    backend = backend_for(reply=lambda p: "tip" + p[-2])

    @sgl.function
    def tips(s):
        s += "Write tips.\n"
        forks = s.fork(3)
        forks += lambda i: f"Tip {i}:" + sgl.gen("tip", max_tokens=8)
        assert forks[1]["tip"] == "tip1"
        forks.join()
        s += "Done: " + ", ".join(s["tip"])

    state = tips.run(backend=backend)
    assert state["tip"] == ["tip0", "tip1", "tip2"]
    assert state.text() == "Write tips.\nDone: tip0, tip1, tip2"
    reqs = backend.engine.requests
    # the shared prefix was prefilled once, before any branch generated
    assert reqs[0]["prompt"] == "Write tips.\n" and reqs[0]["sampling_params"] == SamplingParams(max_new_tokens=0)
    assert sorted(r["prompt"] for r in reqs[1:]) == [f"Write tips.\nTip {i}:" for i in range(3)]
    assert len({r["options"].group for r in reqs}) == 1  # forks stay in the program's scheduling group


def test_fork_pins_the_shared_prefix_until_join_or_program_end():
    backend = backend_for(reply=lambda p: "x")

    @sgl.function
    def joined(s):
        s += "shared context "
        forks = s.fork(2)
        forks += sgl.gen("g", max_tokens=1)
        assert backend.engine.unpinned == []  # still pinned while the branches may run
        forks.join()

    joined.run(backend=backend).sync()
    assert backend.engine.pinned == ["shared context "] and backend.engine.unpinned == [1]

    @sgl.function
    def never_joined(s):
        s += "other context "
        s.fork(2)

    never_joined.run(backend=backend)
    assert backend.engine.pinned[-1] == "other context " and backend.engine.unpinned == [1, 2]


def test_fork_accepts_lists_and_exprs_and_concat_join():
    backend = backend_for(reply=lambda p: "!")

    @sgl.function
    def p(s):
        s += "start "
        forks = s.fork(2)
        forks += ["a", "b"]
        forks += sgl.gen("g", max_tokens=1)
        forks.join("concate_and_append")

    assert p.run(backend=backend).text() == "start a!b!"


def test_copy_and_var_scope():
    backend = backend_for(reply=lambda p: "42")

    @sgl.function
    def p(s):
        with s.copy() as c:
            c += "scratch " + sgl.gen("draft", max_tokens=2)
        s += "{"
        with s.var_scope("body"):
            s += '"x": ' + sgl.gen("x", max_tokens=2)
        s += "}"

    state = p.run(backend=backend)
    assert state["draft"] == ["42"]
    assert state["body"] == '"x": 42'
    assert state.text() == '{"x": 42}'


# ---------------------------------------------------------------- select


def test_select_prefills_prefix_then_scores_all_choices_in_one_request():
    backend = backend_for(favored="ue")

    @sgl.function
    def p(s):
        s += "The sky is " + sgl.select("colour", ["red", "blue", "green"])

    state = p.run(backend=backend)
    assert state["colour"] == "blue"
    prefill, scoring = backend.engine.requests
    assert prefill["prompt"] == "The sky is " and prefill["sampling_params"] == SamplingParams(max_new_tokens=0)
    # the prefix alone goes last: its last token's id marks where each choice starts
    assert scoring["prompt"] == ["The sky is red", "The sky is blue", "The sky is green", "The sky is "]
    assert scoring["options"].return_logprob and scoring["options"].logprob_start_len == len("The sky is ") - 2
    meta = state.get_meta_info("colour")
    assert [len(x) for x in meta["input_token_logprobs"]] == [3, 4, 5]  # the choices' own tokens
    assert meta["normalized_prompt_logprobs"][1] == pytest.approx((-2.0 - 0.1 - 0.1 - 2.0 + 0.0) / 4)
    assert state.text() == "The sky is blue"


def test_select_methods_reach_the_runtime():
    backend = backend_for(favored="a")

    @sgl.function
    def p(s, method):
        s += "x " + sgl.select("c", ["ab", "bbbb"], choices_method=method)

    assert p.run(sgl.greedy_token_selection, backend=backend)["c"] == "ab"
    backend.engine.requests.clear()
    state = p.run(sgl.unconditional_likelihood_normalized, backend=backend)
    state.sync()
    uncond = backend.engine.requests[-1]
    assert uncond["input_ids"] == [[ord("a"), ord("b")], [ord("b")] * 4]
    assert "normalized_unconditional_prompt_logprobs" in state.get_meta_info("c")

    @sgl.function
    def sampled(s):
        s += sgl.select("c", ["a", "b"], temperature=0.5)

    assert "temperature" in str(sampled.run(backend=backend).error())


# ---------------------------------------------------------------- streaming


def test_stream_text_iter_and_async_iter():
    backend = backend_for(reply=lambda p: "streamed words")

    @sgl.function
    def p(s):
        s += "Say: " + sgl.gen("out", max_tokens=20)

    state = p.run(stream=True, backend=backend)
    pieces = list(state.text_iter("out"))
    assert len(pieces) > 1 and "".join(pieces) == "streamed words"
    assert state["out"] == "streamed words"
    assert backend.engine.requests[0]["stream"] is True

    state = p.run(stream=True, backend=backend)
    assert "".join(state.text_iter()) == "Say: streamed words"

    async def collect():
        st = p.run(stream=True, backend=backend)
        return [x async for x in st.text_async_iter("out", return_meta_data=True)]

    items = asyncio.run(collect())
    assert "".join(piece for piece, _ in items) == "streamed words"
    assert items[-1][1]["completion_tokens"] == len("streamed words")
    # without stream=True the iterator yields the finished value once
    assert list(p.run(backend=backend).text_iter("out")) == ["streamed words"]


def test_appending_to_a_joined_branch_is_an_error_not_a_hang():
    # A fork made before a loop and joined in its first round: its branches have ended. Appending to one used
    # to queue text for a worker that had exited, and the next join waited forever.
    backend = backend_for(reply=lambda p: "ok")
    seen = {}

    @sgl.function
    def rounds(s):
        forks = s.fork(2)
        forks += lambda i: f"Branch {i}:" + sgl.gen("x", max_tokens=4)
        forks.join()
        try:
            forks[0] += "again" + sgl.gen("y", max_tokens=4)
        except RuntimeError as e:
            seen["error"] = str(e)

    state = rounds.run(backend=backend)
    assert state.error() is None
    assert "has ended" in seen["error"] and "call s.fork() again" in seen["error"]
