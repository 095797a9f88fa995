"""SGLang frontend programs, written as SGLang's docs and examples write them (only the import changed),
on the real default model: each test pins a place where such a program failed or surprised.

One Runtime serves the module, built the way SGLang's quick-start builds it (`tp_size=1`). Outputs
are a few tokens long; the assertions are about the program's shape and errors, not the model's words.
"""

import socket

import plait as sgl
import pytest
import requests
from conftest import default_backend_runtime


@pytest.fixture(scope="module")
def runtime():
    # SGLang's local_example_chat.py passes tp_size; plait used to refuse it as an unknown argument.
    with default_backend_runtime(tp_size=1) as rt:
        yield rt


def test_parallelism_the_model_cannot_split_by_is_refused_naming_the_numbers():
    # (checked before any process starts: the default model has 9 heads and 30 layers)
    with pytest.raises(ValueError, match=r"tp_size 2 does not divide the model's num_attention_heads 9"):
        sgl.Runtime(tp_size=2)
    with pytest.raises(ValueError, match=r"pp_size 31 is above the model's num_hidden_layers 30"):
        sgl.Runtime(pp_size=31)


@sgl.function
def image_qa(s, image_file, question):
    s += sgl.user(sgl.image(image_file) + question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=4))


def test_image_program_on_a_text_model_says_why(runtime):
    # (image programs on a vision model: tests/lang/test_lang_images.py)
    state = image_qa.run(image_file="example_image.png", question="What is in the image?")
    with pytest.raises(RuntimeError) as info:
        state["answer"]
    assert "this model takes no images" in str(info.value.__cause__ or info.value)


@sgl.function
def answer_then_fail(s, question):
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=3, temperature=0))
    if s["answer"] is not None:  # the body reads the answer, then a tool it calls breaks
        raise ValueError("the tool crashed")
    s += sgl.user("never sent")


def test_stream_ends_in_the_programs_failure(runtime):
    # A streamed program's body runs on its own thread; its exception used to end text_iter()
    # silently, as if the program had finished.
    state = answer_then_fail.run(question="What is the capital of France?", stream=True)
    pieces = []
    with pytest.raises(RuntimeError, match="the program failed") as info:
        for piece in state.text_iter():
            pieces.append(piece)
    assert isinstance(info.value.__cause__, ValueError)
    assert "".join(pieces) == state.text()  # everything produced was yielded before the error
    assert state.text().endswith(
        state["answer"] + runtime.endpoint.chat_template.role_prefix_and_suffix["assistant"][1]
    )
    # The variable itself was complete before the failure: streaming it ends normally.
    state = answer_then_fail.run(question="What is the capital of France?", stream=True)
    assert "".join(state.text_iter("answer")) == state["answer"]


@sgl.function
def qa(s, question):
    s += sgl.system("You are a helpful assistant.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=3))


def test_streaming_a_variable_the_program_never_makes_names_it(runtime):
    # A misspelt var_name used to yield nothing and end, like an empty answer.
    state = qa.run(question="Hi", stream=True)
    with pytest.raises(KeyError, match=r"'anwser'.*\['answer'\]"):
        list(state.text_iter(var_name="anwser"))


def test_state_prints_as_sglang_does(runtime):
    # SGLang's cot_decoding example slices the text out of str(state).
    state = qa.run(question="Hi", temperature=0)
    text = str(state)[len("ProgramState(") : -1]
    assert text == state.text() and "\n" in text


def test_endpoint_without_a_server_says_how_to_start_one():
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(
        requests.exceptions.ConnectionError,
        match=r"127\.0\.0\.1:\d+/get_model_info.*"
        r"python -m plait\.runtime\.server",
    ):
        sgl.RuntimeEndpoint(f"http://127.0.0.1:{port}")


@sgl.function
def top_k_first_tokens(s, question, k):
    # The first step of SGLang's cot_decoding example: no token, only the next token's top-k.
    s += sgl.user("Question: " + question + "\nAnswer:")
    s += sgl.assistant_begin()
    step_0 = s.fork(1)[0]
    step_0 += sgl.gen("get_top_k", max_tokens=0, return_logprob=True, top_logprobs_num=k, return_text_in_logprobs=True)
    s["top_k"] = step_0.get_meta_info("get_top_k")["output_top_logprobs"][0]


@sgl.function
def first_token(s, question):
    s += sgl.user("Question: " + question + "\nAnswer:")
    s += sgl.assistant_begin()
    s += sgl.gen("first", max_tokens=1, temperature=0, return_logprob=True, top_logprobs_num=1)


def test_max_tokens_zero_gives_the_next_tokens_distribution(runtime):
    # It used to come back empty (the IndexError cot_decoding hit): a prefill-only request skipped the
    # last position's logits.
    state = top_k_first_tokens.run(question="What is 2 + 3?", k=4)
    top = state["top_k"]
    assert len(top) == 4 and all(isinstance(text, str) for _, _, text in top)
    logprobs = [lp for lp, _, _ in top]
    assert logprobs == sorted(logprobs, reverse=True) and logprobs[0] <= 0.0
    greedy = first_token.run(question="What is 2 + 3?").get_meta_info("first")
    assert greedy["output_token_logprobs"][0][1] == top[0][1]  # the greedy token is the top-1


def test_runtime_as_sglang_has_it(runtime):
    import asyncio
    import json

    # generate returns the output's JSON text (SGLang programs json.loads it).
    out = json.loads(runtime.generate("The capital of France is", {"max_new_tokens": 2, "temperature": 0}))
    assert out["meta_info"]["completion_tokens"] == 2 and isinstance(out["text"], str)
    # The served name, never the embedded model's cache folder.
    assert "/" not in runtime.endpoint.get_model_name()
    assert runtime.server_args.tp_size == 1

    async def pieces():
        return [p async for p in runtime.async_generate("Hello", {"max_new_tokens": 3, "temperature": 0})]

    streamed = asyncio.run(pieces())
    assert (
        streamed
        and "".join(streamed) == json.loads(runtime.generate("Hello", {"max_new_tokens": 3, "temperature": 0}))["text"]
    )
    assert runtime.add_request.__func__ is type(runtime).async_generate
    with pytest.raises(NotImplementedError, match="embeddings"):
        runtime.encode("Hello")
    # url: plait's HTTP API over the same engine, for programs that post to it or open a RuntimeEndpoint.
    reply = requests.post(
        runtime.url + "/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    )
    assert reply.status_code == 200 and reply.json()["text"] == "".join(streamed)
    endpoint = sgl.RuntimeEndpoint(runtime.url)
    state = qa.run(question="Hi", backend=endpoint, temperature=0)
    assert state["answer"] == qa.run(question="Hi", temperature=0)["answer"]


def test_custom_choices_method_on_the_runtime(runtime):
    calls = []

    def last_choice(*, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs, **kw):
        calls.append(normalized_prompt_logprobs)
        return sgl.ChoicesDecision(choices[-1], {"scores": list(normalized_prompt_logprobs)})

    @sgl.function
    def pick(s):
        s += "Pick a colour: " + sgl.select("c", ["red", "green", "blue"], choices_method=last_choice)

    state = pick.run()
    assert state["c"] == "blue" and len(calls[0]) == 3
    assert state.get_meta_info("c") == {"scores": calls[0]}


EXIT_WHILE_FORKS_RUN = """
import plait as sgl

@sgl.function
def branches(s):
    s += "Write a long story about a dragon."
    forks = s.fork(4)
    for f in forks:
        f += sgl.gen("story", max_tokens=400, ignore_eos=True)
    raise SystemExit("the program gives up while its forks generate")

sgl.set_default_backend(sgl.Runtime())
branches.run()
"""


def test_exit_while_forks_run_is_quiet(tmp_path):
    # A program that stopped (an exception in its body) and exited without shutdown(): its forks were cut off
    # by the engine's shutdown at exit and each logged a traceback; pin calls printed "cannot schedule new
    # futures after shutdown".
    import subprocess
    import sys

    script = tmp_path / "exits.py"
    script.write_text(EXIT_WHILE_FORKS_RUN)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "the program gives up while its forks generate" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert "cannot schedule new futures" not in done.stderr, done.stderr
