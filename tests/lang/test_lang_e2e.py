"""The language end to end on the real default model (SmolLM2-135M-Instruct), through both backends:
the colocated Runtime (in-process Engine) and RuntimeEndpoint over HTTP to plait's server.

One Engine serves the whole module: the HTTP backend talks to the real FastAPI app of
runtime/server wrapping that same Engine, on a real socket, so the model loads once. Greedy decoding
and a few tokens per gen keep it short.
"""

import dataclasses
import json
import math
import os

import plait as sgl
import pytest
from conftest import http_server_in_thread
from plait.gen_params import RunDefaults, resolve_gen
from plait.runtime.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine_runtime():
    rt = sgl.Runtime()
    yield rt
    rt.shutdown()


@pytest.fixture(scope="module")
def http_url(engine_runtime):
    with http_server_in_thread(engine_runtime.engine) as url:
        yield url


@pytest.fixture(scope="module", params=["colocated", "http"])
def runtime(request, engine_runtime):
    """The Runtime (for direct engine checks), with the default backend set to the backend under test."""
    if request.param == "colocated":
        backend = engine_runtime
    else:
        backend = sgl.RuntimeEndpoint(request.getfixturevalue("http_url"))
    sgl.set_default_backend(backend)
    yield engine_runtime
    sgl.set_default_backend(None)


# ---------------------------------------------------------------- programs


@sgl.function
def few_shot_qa(s, question):
    s += "Q: What is the capital of Italy?\nA: Rome\n"
    s += "Q: What is the capital of Germany?\nA: Berlin\n"
    s += "Q: " + question + "\nA:" + sgl.gen("answer", stop="\n", max_tokens=8)


@sgl.function
def multi_turn(s, q1, q2):
    s += sgl.system("You are a helpful assistant. Answer briefly.")
    s += sgl.user(q1)
    s += sgl.assistant(sgl.gen("a1", max_tokens=8))
    s += sgl.user(q2)
    s += sgl.assistant(sgl.gen("a2", max_tokens=8))


@sgl.function
def pick_capital(s):
    s += sgl.user("What is the capital of France?")
    s += sgl.assistant("The capital of France is " + sgl.select("city", ["Paris", "London", "Berlin"]))


@sgl.function
def tool_agent(s, question, max_steps=2):
    """Choose a tool, run it in Python, loop until the model says it is done."""
    s += sgl.user("Question: " + question + "\nUse the calculator tool to compute, then answer.")
    for _ in range(max_steps):
        s += sgl.assistant("Next action: " + sgl.select("action", ["calculator", "answer"]))
        if s["action"] == "answer":
            break
        s += sgl.user("Calculator result: " + str(17 * 23))
    s += sgl.assistant("Final answer: " + sgl.gen("final", max_tokens=6))


@sgl.function
def skeleton_of_thought(s, topic):
    s += "Two tips about " + topic + ":\n"
    forks = s.fork(2)
    forks += lambda i: f"Tip {i + 1}:" + sgl.gen("tip", max_tokens=8, stop="\n")
    forks.join()
    s += "Summary: " + " / ".join(t.strip() for t in s["tip"])


@sgl.function
def city_json(s, country):
    s += "The capital city of " + country + " as JSON:\n"
    with s.var_scope("json"):
        s += '{"country": "' + country + '", "capital": "' + sgl.gen("capital", stop=['"', "\n"], max_tokens=8)
        s += '"}'


def test_backend_identity_and_management(runtime):
    backend = sgl.global_config.default_backend
    backend = getattr(backend, "endpoint", backend)
    # The colocated backend reports the served name (the folder's name), SGLang's RuntimeEndpoint the server's
    # model_path: the same model either way.
    assert runtime.endpoint.get_model_name() == "SmolLM2-135M-Instruct"
    assert os.path.basename(backend.get_model_name()) == runtime.endpoint.get_model_name()
    assert backend.get_model_name().endswith("SmolLM2-135M-Instruct")
    # Both from the tokenizer (each named after its backend's model name).
    unnamed = [dataclasses.replace(b.get_chat_template(), name="") for b in (backend, runtime.endpoint)]
    assert unnamed[0] == unnamed[1] and unnamed[0].source == "tokenizer"
    assert os.path.basename(sgl.get_server_info()["model_path"]) == os.path.basename(backend.get_model_name())
    assert sgl.flush_cache()


def test_few_shot_qa(runtime):
    state = few_shot_qa.run(question="What is the capital of France?", temperature=0)
    assert state.error() is None
    assert "Paris" in state["answer"]
    meta = state.get_meta_info("answer")
    assert meta["prompt_tokens"] > 20 and 1 <= meta["completion_tokens"] <= 8


def test_multi_turn_chat_roles_and_messages(runtime):
    state = multi_turn.run(q1="What is 2 + 2?", q2="And 3 + 3?", temperature=0)
    msgs = state.messages()
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    assert msgs[2]["content"] == state["a1"].strip() and state["a1"].strip()
    assert msgs[4]["content"] == state["a2"].strip() and state["a2"].strip()
    # the text is exactly what the model's own chat template makes of these messages
    assert state.text() == runtime.get_tokenizer().apply_chat_template(msgs, tokenize=False)


def test_select_scores_match_the_models_logprobs(runtime):
    state = pick_capital.run()
    assert state["city"] == "Paris"
    meta = state.get_meta_info("city")
    assert len(meta["normalized_prompt_logprobs"]) == 3
    # Cross-check the healing bookkeeping: score "…is Paris" directly and compare the choice tokens.
    prefix = state.text()[: state.text().rindex("Paris")]
    tok = runtime.get_tokenizer()
    full = json.loads(  # (SGLang's Runtime.generate returns the output's JSON text)
        runtime.generate(
            prefix + "Paris",
            {"max_new_tokens": 0},
            return_logprob=True,
            logprob_start_len=0,
            return_text_in_logprobs=True,
        )
    )
    n = len(meta["input_token_logprobs"][0])
    direct = full["meta_info"]["input_token_logprobs"][-n:]
    assert "".join(t[2] for t in direct).strip() == "Paris"
    assert [t[1] for t in direct] == [t[1] for t in meta["input_token_logprobs"][0]]
    assert meta["normalized_prompt_logprobs"][0] == pytest.approx(sum(t[0] for t in direct) / n, abs=1e-3)
    assert tok.decode([t[1] for t in direct]).strip() == "Paris"


def test_select_methods(runtime):
    @sgl.function
    def p(s, method):
        s += "The color of the clear daytime sky is " + sgl.select(
            "c", ["blue", "green", "purple"], choices_method=method
        )

    for method in (sgl.greedy_token_selection, sgl.unconditional_likelihood_normalized):
        state = p.run(method)
        assert state.error() is None
        assert state["c"] in ("blue", "green", "purple")
        assert all(math.isfinite(x) for x in state.get_meta_info("c")["normalized_prompt_logprobs"])
    uncond = state.get_meta_info("c")["unconditional_token_logprobs"]
    assert [len(u) for u in uncond] == [len(c) for c in state.get_meta_info("c")["input_token_logprobs"]]


def test_gen_int_and_dtype(runtime):
    @sgl.function
    def arithmetic(s):
        s += "Q: What is 12 + 30?\nA: 42\nQ: What is 5 + 4?\nA: " + sgl.gen_int("n", max_tokens=4)
        s += "\nQ: Is 7 greater than 3? Answer True or False.\nA: " + sgl.gen("b", dtype=bool, max_tokens=3)

    state = arithmetic.run(temperature=0)
    assert state.error() is None
    assert state["n"].strip().lstrip("+-").isdigit()
    assert state["b"] in ("True", "False")


def test_tool_use_loop_branches_on_generated_values(runtime):
    state = tool_agent.run(question="What is 17 * 23?", temperature=0)
    assert state.error() is None
    actions = [m["content"] for m in state.messages() if m["content"].startswith("Next action:")]
    assert 1 <= len(actions) <= 2
    if actions[0].endswith("calculator"):
        assert "Calculator result: 391" in state.text()
    else:
        assert "Calculator result" not in state.text()
    assert state["final"].strip()


def test_fork_join_skeleton_of_thought(runtime):
    state = skeleton_of_thought.run(topic="staying healthy", temperature=0)
    assert state.error() is None
    tips = state["tip"]
    assert isinstance(tips, list) and len(tips) == 2
    assert state.text().startswith("Two tips about staying healthy:\nSummary: ")
    # the shared prefix was prefilled before the branches: both found it in the prefix cache
    metas = state.get_meta_info("tip")
    assert all(m["cached_tokens"] > 0 for m in metas)


def test_streaming_text_iter(runtime):
    @sgl.function
    def count(s):
        s += "Count to ten: one, two, three," + sgl.gen("rest", max_tokens=8, ignore_eos=True)

    state = count.run(temperature=0, stream=True)
    pieces = list(state.text_iter("rest"))
    assert "".join(pieces) == state["rest"]
    assert len(pieces) >= 2
    assert state.get_meta_info("rest")["completion_tokens"] == 8


@sgl.function
def three_stories(s):
    s += "Once upon a time" + sgl.gen("story", n=3, max_tokens=8, ignore_eos=True)


def test_n_samples_with_a_seed_get_seed_plus_k_as_from_the_engine(runtime):
    state = three_stories.run(temperature=1.0, seed=7)
    samples = state["story"]
    # The Engine's own n = 3 (request_options.expand_samples: sample k has seed 7 + k), and its sample k
    # alone: the DSL's samples are those, not three copies of seed 7's.
    params = resolve_gen(
        RunDefaults.from_kwargs({"temperature": 1.0, "seed": 7}),
        sgl.gen("story", n=3, max_tokens=8, ignore_eos=True).overrides,
        runtime.endpoint.get_chat_template().stop_str,
    ).sampling
    engine = runtime.engine
    assert [o["text"] for o in engine.generate("Once upon a time", params)] == samples
    alone = [engine.generate("Once upon a time", params.for_sample(k))["text"] for k in range(3)]
    assert alone == samples and len(set(samples)) == 3


def test_one_sampling_params_per_gen_built_and_verified_once(engine_runtime, monkeypatch):
    """The DSL's hot path: a gen's SamplingParams is built once and verified once, from gen() to the
    scheduler (the Engine takes the object as it is)."""
    built, verified = [], []
    init, check = SamplingParams.__init__, SamplingParams._check
    monkeypatch.setattr(SamplingParams, "__init__", lambda self, *a, **k: built.append(1) or init(self, *a, **k))
    monkeypatch.setattr(SamplingParams, "_check", lambda self, vocab: verified.append(vocab) or check(self, vocab))

    def counts(n_gens: int) -> tuple[int, int]:
        @sgl.function
        def gens(s):
            for i in range(n_gens):
                s += f"Q{i}:" + sgl.gen(f"a{i}", max_tokens=1)

        built.clear(), verified.clear()
        state = gens.run(temperature=0, backend=engine_runtime)
        state.sync()
        assert state.error() is None
        return len(built), len(verified)

    one, four = counts(1), counts(4)
    assert (four[0] - one[0], four[1] - one[1]) == (3, 3)  # three more gens: three SamplingParams, three checks


def test_run_batch_of_32_with_progress_bar(runtime, capsys):
    questions = [f"What is {i} + {i}?" for i in range(32)]
    states = few_shot_qa.run_batch(
        [{"question": q} for q in questions], progress_bar=True, temperature=0, max_new_tokens=4
    )
    assert len(states) == 32
    for q, state in zip(questions, states):
        assert state.error() is None
        assert ("Q: " + q + "\nA:") in state.text()
    assert "32/32" in capsys.readouterr().err


def test_var_scope_builds_json(runtime):
    state = city_json.run(country="France", temperature=0)
    data = json.loads(state["json"])
    assert data["country"] == "France" and data["capital"] == state["capital"]
    assert "Paris" in data["capital"]


def test_errors_inside_programs(runtime):
    @sgl.function
    def fails_after_gen(s, i):
        s += "Count: " + sgl.gen("x", max_tokens=2)
        if i == 1:
            raise ValueError("bad item")

    with pytest.raises(ValueError, match="bad item"):
        fails_after_gen.run(1)
    states = fails_after_gen.run_batch([(0,), (1,), (2,)])
    assert [type(s.error()).__name__ for s in states] == ["NoneType", "ValueError", "NoneType"]
    assert states[0]["x"] is not None and states[2]["x"] is not None

    @sgl.function
    def bad_param(s):
        s += "x" + sgl.gen("y", max_tokens=2, top_p=5.0)

    with pytest.raises(ValueError, match=r"gen\('y'\): top_p"):  # raised where the program writes it
        bad_param.run()


def test_openai_backend_against_the_servers_v1_api(http_url, engine_runtime):
    import openai

    model = openai.OpenAI(base_url=http_url + "/v1", api_key="EMPTY").models.list().data[0].id
    chat = sgl.OpenAI(model, base_url=http_url + "/v1")
    state = multi_turn.run(q1="What is 2 + 2?", q2="And 3 + 3?", temperature=0, backend=chat)
    assert state.error() is None
    msgs = state.messages()
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    assert state["a1"].strip() and state["a2"].strip()
    assert state.get_meta_info("a1")["completion_tokens"] <= 8

    @sgl.function
    def not_at_turn_start(s):
        s += sgl.user("Hi")
        s += sgl.assistant("Sure: " + sgl.gen("x", max_tokens=4))

    assert "assistant turn" in str(not_at_turn_start.run(backend=chat).error())

    # A completion model: raw text in, and select scored from echoed prompt logprobs.
    completion = sgl.OpenAI(model, base_url=http_url + "/v1", is_chat_model=False)

    @sgl.function
    def capital(s):
        s += "Q: What is the capital of France?\nA: The capital of France is"
        s += sgl.select("city", [" Paris", " London", " Berlin"])
        s += "." + sgl.gen("rest", max_tokens=4, stop="\n")

    state = capital.run(backend=completion, temperature=0)
    assert state.error() is None
    assert state["city"] == " Paris"
    assert len(state.get_meta_info("city")["input_token_logprobs"][0]) >= 1
