"""SGLang frontend programs of the kinds users write, that plait's other tests do not: keyword-only and
*args parameters, `name in state` right after run(), parsed JSON from forks and n samples, streaming a
variable a join gathered, empty select choices, a fork whose shared prompt is past the context. Each
test pins a place where such a program failed or gave a wrong answer.

One Runtime (embedded default model, one torch thread) serves the module; outputs are a few tokens.
"""

import functools

import plait as sgl
import pytest
from conftest import default_backend_runtime, http_server_in_thread
from pydantic import BaseModel


@pytest.fixture(scope="module", autouse=True)
def runtime():
    with default_backend_runtime(num_threads=1) as rt:
        yield rt


@pytest.fixture(scope="module")
def openai_url(runtime):
    with http_server_in_thread(runtime.engine) as url:  # the real HTTP app over the module's engine
        yield url + "/v1"


@sgl.function
def few_shot(s, question, *, shots=("2+2=4", "3+5=8"), unit=""):
    for shot in shots:
        s += shot + "\n"
    s += question + "=" + sgl.gen("answer", max_tokens=4, stop=["\n", "="], regex=r"[0-9]+", temperature=0) + unit


@sgl.function
def concat(s, head, *items):
    s += head + ":" + ",".join(items)


@sgl.function
def calls_with_star_args(s):
    s += concat("h", "a", "b") + ";"
    s += few_shot("1+1", shots=["1+2=3"], unit="!")


def test_keyword_only_parameters_and_star_args_reach_the_body():
    # SGLang passes run()'s extra positional and keyword arguments straight to the body; plait refused
    # keyword-only names as "neither a parameter nor a sampling parameter" and extra positionals outright.
    state = few_shot.run("7+1", shots=["1+1=2"], unit=" apples")
    assert state.text() == "1+1=2\n7+1=" + state["answer"] + " apples"
    assert state["answer"].isdigit()
    assert concat.run("h", "x", "y", "z").text() == "h:x,y,z"
    assert calls_with_star_args.run().text().startswith("h:a,b;1+2=3\n1+1=")
    with pytest.raises(TypeError, match=r"\['head'\] by name"):
        concat.run("x", "y", head="h")
    states = few_shot.run_batch([{"question": "1+3", "shots": []}, ("2+3",)], temperature=0)
    assert states[0].text().startswith("1+3=") and states[1].text().startswith("2+2=4\n3+5=8\n2+3=")


def counted(func):
    """A decorator of the user's own, as programs get for retries or timing."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        wrapper.calls += 1
        return func(*args, **kwargs)

    wrapper.calls = 0
    return wrapper


@sgl.function
@counted
def decorated(s, topic, style="plain"):
    s += topic + " (" + style + "): " + sgl.gen("line", max_tokens=2)


def test_a_program_under_a_functools_wraps_decorator_keeps_its_parameters():
    # Parameters were read with getfullargspec, which sees the wrapper's (*args, **kwargs): the program
    # was refused as not taking the state, or later as taking no parameters.
    assert decorated.arg_names == ["topic", "style"]
    state = decorated.run("tea", style="haiku", temperature=0)
    assert state.text().startswith("tea (haiku): ") and decorated.func.calls == 1
    assert [st.text()[:9] for st in decorated.run_batch([("cats",), {"topic": "dogs"}])] == ["cats (pla", "dogs (pla"]


@sgl.function
def story(s):
    s += sgl.user("Tell me a story about a dragon.")
    s += sgl.assistant(sgl.gen("answer", max_tokens=12, ignore_eos=True))


def test_contains_waits_for_the_gen_still_running():
    # run() returns while the gen runs: `"answer" in state` said False, then state["answer"] existed.
    state = story.run()
    assert "answer" in state
    assert "nothing" not in state
    assert state.get_meta_info("answer")["completion_tokens"] == 12


class Person(BaseModel):
    name: str
    age: int


@sgl.function
def people(s):
    s += "A person as JSON: "
    forks = s.fork(2)
    forks += sgl.gen("person", json_schema=Person, max_tokens=40, temperature=0)
    forks.join()
    s += "Two more: " + sgl.gen("pair", json_schema=Person, max_tokens=40, n=2, temperature=0)


def test_parsed_reads_every_branch_and_every_sample():
    # A join gathers a list, gen(n=2) gives one: parsed() passed the list to json.loads (TypeError), and
    # the parent did not know the branches' Pydantic model.
    state = people.run()
    gathered = state.parsed("person")
    samples = state.parsed("pair")
    assert len(gathered) == 2 and all(isinstance(p, Person) for p in gathered)
    assert len(samples) == 2 and all(isinstance(p, Person) for p in samples)


@sgl.function
def fork_then_summary(s):
    s += "Topic: tea."
    forks = s.fork(2)
    forks += sgl.gen("idea", max_tokens=3)
    forks.join()
    s["note"] = "set by the body"
    s += " Summary:" + sgl.gen("summary", max_tokens=3)


def test_streaming_a_variable_that_no_gen_of_the_state_streamed():
    # A variable the join gathered (or the body set) has no stream; text_iter said the program "finished
    # without producing variable 'idea'; it produced ['idea', ...]".
    state = fork_then_summary.run(stream=True)
    assert "".join(state.text_iter("summary")) == state["summary"]
    assert list(state.text_iter("note")) == ["set by the body"]
    with pytest.raises(TypeError, match=r"'idea' is a list.*state\['idea'\]"):
        list(state.text_iter("idea"))


def test_an_empty_select_choice_is_refused_where_written():
    # It was scored by the prompt's last position: -inf after a one-token prompt, the prompt's own last
    # token otherwise (so "Pick one: " + select(["", "a"]) picked "").
    with pytest.raises(ValueError, match=r"choice 1 is the empty string"):
        sgl.select("x", choices=["a", "", "b"])
    with pytest.raises(ValueError, match="empty string"):
        sgl.gen("x", choices=["", "a"])
    # A str of choices was taken character by character; json_schema=5 failed later, on the worker.
    with pytest.raises(TypeError, match=r"choices must be a list of str, got the str 'yes'"):
        sgl.select("x", choices="yes")
    with pytest.raises(TypeError, match=r"json_schema must be a dict.*got 5"):
        sgl.gen("x", json_schema=5)


@sgl.function
def long_fork(s, words):
    s += "word " * words
    forks = s.fork(2)
    forks += sgl.gen("x", max_tokens=2)
    forks.join()


def test_a_fork_past_the_context_names_the_cause_and_the_runtime_keeps_serving():
    # The error said only "prefilling the shared prefix failed"; the cause was in the chained traceback.
    with pytest.raises(
        RuntimeError,
        match=r"cannot fork: prefilling the shared prefix failed: "
        r"ValueError: prompt is too long: 9001 tokens",
    ):
        long_fork.run(words=9000)
    assert len(long_fork.run(words=3)["x"]) == 2


@sgl.function
def color_chat(s):
    s += sgl.user("Name a color.")
    s += sgl.assistant(sgl.gen("color", max_tokens=3, temperature=0, return_logprob=True, top_logprobs_num=2))


@sgl.function
def sky(s):
    s += "The sky is" + sgl.gen("rest", max_tokens=3, temperature=0, return_logprob=True, top_logprobs_num=2)


@pytest.mark.parametrize("program,is_chat", [(color_chat, True), (sky, False)], ids=["chat", "completion"])
def test_openai_backend_returns_the_logprobs_a_gen_asks_for(openai_url, program, is_chat):
    # They were dropped silently: get_meta_info(name) had no output_token_logprobs on the OpenAI backend.
    backend = sgl.OpenAI("SmolLM2-135M-Instruct", base_url=openai_url, is_chat_model=is_chat)
    name = "color" if is_chat else "rest"
    meta = program.run(backend=backend).get_meta_info(name)
    native = program.run().get_meta_info(name)  # the same greedy request, in process
    assert [lp for lp, _, _ in meta["output_token_logprobs"]] == pytest.approx(
        [lp for lp, _, _ in native["output_token_logprobs"]], abs=1e-3
    )
    assert all(isinstance(text, str) for _, _, text in meta["output_token_logprobs"])
    assert [len(top) for top in meta["output_top_logprobs"]] == [2, 2, 2]
    assert meta["output_top_logprobs"][0][0][0] == pytest.approx(native["output_top_logprobs"][0][0][0], abs=1e-3)


@sgl.function
def japanese_day(s):
    s += "今日は日"
    s += sgl.select("day", ["本", "曜日"])


def test_select_after_a_character_split_across_tokens_scores_only_the_choices_tokens(runtime):
    # "日" is two byte tokens; the last one decodes to "\ufffd", so the text check took it for a token
    # merged with the choice and counted the prompt's own last token in every choice's score.
    tokenizer = runtime.get_tokenizer()
    prompt_ids = tokenizer("今日は日").input_ids
    meta = japanese_day.run().get_meta_info("day")
    for choice, entries in zip(["本", "曜日"], meta["input_token_logprobs"]):
        ids = tokenizer("今日は日" + choice).input_ids
        assert ids[: len(prompt_ids)] == prompt_ids  # the choice does not merge with the prompt here
        assert [token_id for _, token_id, _ in entries] == ids[len(prompt_ids) :]


def test_reading_a_streamed_programs_later_variable_waits_for_its_body():
    # The body of a streamed run goes on after run() returns: reading a variable it had not got to yet
    # (a join's, a later gen's) raised KeyError "the program has no variable" at once.
    state = fork_then_summary.run(stream=True)
    assert len(state["idea"]) == 2
    state = fork_then_summary.run(stream=True)
    assert "summary" in state and state.get_meta_info("summary")["completion_tokens"] == 3
    with pytest.raises(KeyError, match="no variable 'nope'"):
        state["nope"]


@sgl.function
def select_first(s):
    s += sgl.select("word", ["Hello", "Zebra"])


def test_a_select_with_no_text_before_it_says_it_cannot_score():
    # The first token of a prompt has no logprob: "Hello" (one token) scored -inf and "Zebra" (two
    # tokens, scored on its second) won, whatever the model thought.
    with pytest.raises(RuntimeError, match=r"cannot score choice 'Hello': with no text before select"):
        select_first.run()["word"]
