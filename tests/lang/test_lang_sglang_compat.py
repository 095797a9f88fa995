"""SGLang's frontend surface beyond the DSL, without a model: its module paths (the same objects as plait's
own), its named chat templates, its script helpers, `build_regex_from_object`, `separate_reasoning`, and the
hosted-API backends (Anthropic, Azure OpenAI) against real HTTP servers on localhost speaking their wire
formats (tests/helpers/provider_fakes.py)."""

import importlib
import importlib.metadata
import json
import re
import sys
from enum import Enum

import plait as sgl
import pytest
from helpers.provider_fakes import COMPLETION_TOKENS, PROMPT_TOKENS, ProviderFake
from plait.backend.base import BaseBackend
from pydantic import BaseModel


def test_sglang_module_paths_name_plaits_own_objects():
    import plait.chat_template
    import plait.ir
    import plait.lang.backend.runtime_endpoint as runtime_endpoint
    import plait.lang.chat_template as chat_template
    import plait.lang.interpreter as interpreter
    import plait.lang.ir as ir
    import plait.srt.utils
    import plait.test.test_utils as test_utils
    import plait.utils

    assert chat_template.get_chat_template is plait.chat_template.get_chat_template
    assert chat_template.get_chat_template_by_model_path is sgl.get_chat_template_by_model_path
    assert ir.SglGen is plait.ir.SglGen and ir.REGEX_INT == plait.ir.REGEX_INT
    assert runtime_endpoint.RuntimeEndpoint is sgl.RuntimeEndpoint and runtime_endpoint.Runtime is sgl.Runtime
    assert interpreter.ProgramState is sgl.ProgramState
    assert callable(test_utils.add_common_sglang_args_and_parse) and callable(test_utils.select_sglang_backend)
    for name in ("http_request", "download_and_cache_file", "read_jsonl", "dump_state_text"):
        assert callable(getattr(plait.utils, name))
    from plait.lang.backend.anthropic import Anthropic
    from plait.lang.backend.openai import OpenAI

    assert Anthropic is sgl.Anthropic and OpenAI is sgl.OpenAI
    assert sgl.__version__ == importlib.metadata.version("plait")


def test_image_and_video_expressions_and_load_image(tmp_path):
    from plait.srt.utils import load_image

    with pytest.raises(ValueError, match="no such file"):
        load_image("cat.png")
    with pytest.raises(ValueError, match="no network"):
        load_image("https://example.com/cat.png")
    assert repr(sgl.image("cat.png")) == "Image('cat.png')"
    assert repr(sgl.video("a.mp4", 4)) == "Video('a.mp4', 4)"  # frames are read when the program runs
    with pytest.raises(ValueError, match="positive num_frames"):
        sgl.video("a.mp4", 0)


def test_sglangs_named_chat_templates():
    names = ["default", "claude", "chatml", "chatml-llava", "qwen", "qwen2-vl", "vicuna_v1.1", "llama-2-chat"]
    names += ["llama-3-instruct", "llama-3-instruct-llava", "llama-4", "minicpmv", "minicpmo", "janus-pro"]
    names += ["yi-1.5", "yi-vl", "gemma-it", "dbrx-instruct", "c4ai-command-r", "granite-3-instruct", "deepseek-v3"]
    for name in names:
        assert sgl.get_chat_template(name).name == name
    with pytest.raises(ValueError, match="unknown chat template 'nope'"):
        sgl.get_chat_template("nope")
    by_path = sgl.get_chat_template_by_model_path
    assert by_path("meta-llama/Meta-Llama-3-8B-Instruct").name == "llama-3-instruct"
    assert by_path("Qwen/Qwen2-7B-Instruct").name == "qwen"
    assert by_path("Qwen/Qwen2-VL-7B-Instruct").name == "qwen2-vl"
    assert by_path("mistralai/Mistral-7B-Instruct-v0.2").name == "llama-2-chat"
    assert by_path("google/gemma-3-1b-it").name == "gemma-it"  # "gemma" and "it"
    assert by_path("some/unknown-model").name == "default"
    # Llama 2 puts the system prompt inside the first user turn.
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    turns.append({"role": "assistant", "content": "Hello"})
    prompt = sgl.get_chat_template("llama-2-chat").get_prompt(turns)
    assert prompt == "[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST]Hello </s><s>"
    qwen = sgl.get_chat_template("qwen")
    assert qwen.get_prompt([{"role": "system", "content": None}, {"role": "user", "content": "Hi"}]) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    )


class Weapon(str, Enum):
    sword = "sword"
    bow = "bow"


class Wizard(BaseModel):
    name: str
    age: int
    weapon: Weapon


def test_build_regex_from_object():
    from plait.srt.constrained.outlines_backend import build_regex_from_object

    regex = build_regex_from_object(Wizard)
    assert re.fullmatch(regex, '{"name": "Merlin", "age": 900, "weapon": "bow"}')
    assert re.fullmatch(regex, '{\n  "name": "Merlin",\n  "age": 900,\n  "weapon": "bow"\n}')
    assert not re.fullmatch(regex, '{"name": "Merlin", "age": 900, "weapon": "axe"}')
    assert build_regex_from_object(Wizard.model_json_schema()) == regex
    assert build_regex_from_object(json.dumps(Wizard.model_json_schema())) == regex
    with pytest.raises(TypeError, match="Pydantic model class, a dict or a JSON string"):
        build_regex_from_object(5)


def test_script_helpers(monkeypatch):
    import argparse

    from plait.test.test_utils import add_common_sglang_args_and_parse, select_sglang_backend

    monkeypatch.setattr(sys, "argv", ["bench.py", "--num-questions", "3", "--port", "31000"])
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-questions", type=int, default=10)
    args = add_common_sglang_args_and_parse(parser)
    assert (args.num_questions, args.port, args.host, args.backend, args.parallel) == (
        3,
        31000,
        "http://127.0.0.1",
        "srt",
        64,
    )
    args.backend = "vllm"
    with pytest.raises(ValueError, match="unknown --backend 'vllm'"):
        select_sglang_backend(args)


def test_utils(tmp_path):
    from plait.utils import dump_state_text, find_printable_text, read_jsonl

    data = tmp_path / "q.jsonl"
    data.write_text('# a comment\n{"q": 1}\n\n{"q": 2}\n')
    assert list(read_jsonl(str(data))) == [{"q": 1}, {"q": 2}]
    out = tmp_path / "states.txt"
    dump_state_text(str(out), ["first", 2])
    text = out.read_text()
    assert "=" * 40 + " 0 " + "=" * 40 + "\nfirst\n" in text and "\n2\n" in text
    assert find_printable_text("Hello wor") == "Hello " and find_printable_text("line\n") == "line\n"


def test_http_request_and_downloads(tmp_path):
    from plait.utils import download_and_cache_file, http_request

    with ProviderFake("hi") as fake:
        response = http_request(fake.url + "/v1/chat/completions", json={"model": "m"}, api_key="k")
        assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"] == "hi"
        assert fake.requests[0]["headers"]["authorization"] == "Bearer k"
        assert http_request(fake.url + "/nowhere", json={}).status_code == 404  # returned, not raised
    cached = tmp_path / "data.json"
    cached.write_text("{}")
    assert download_and_cache_file("http://example.invalid/data.json", str(cached)) == str(cached)
    target = tmp_path / "missing.json"
    with pytest.raises(RuntimeError, match=f"could not download .*put the file at {re.escape(str(target))}"):
        download_and_cache_file("http://127.0.0.1:9/missing.json", str(target))
    assert not target.exists()


class ScriptedBackend(BaseBackend):
    """Answers every gen with the next scripted text."""

    def __init__(self, *answers: str) -> None:
        super().__init__()
        self.answers = list(answers)

    def generate(self, s, params):
        return self.answers.pop(0), {}

    def generate_stream(self, s, params):
        text = self.answers.pop(0)
        for i in range(0, len(text), 4):
            yield text[i : i + 4], {}


@sgl.function
def reasoned(s, question):
    s += sgl.user(question)
    s += sgl.assistant(sgl.separate_reasoning(sgl.gen("answer", max_tokens=64), model_type="deepseek-r1"))


@pytest.mark.parametrize("stream", [False, True])
def test_separate_reasoning(stream):
    backend = ScriptedBackend("Let me think.\nIt is Paris.</think>\n\nParis")
    state = reasoned.run(question="Capital of France?", backend=backend, stream=stream)
    if stream:
        "".join(state.text_iter())
    assert state["answer"] == "Paris"
    assert state["answer_reasoning_content"] == "Let me think.\nIt is Paris."
    assert "</think>" in state.text()  # the text keeps what the model wrote

    @sgl.function
    def qwen(s):
        s += sgl.separate_reasoning(sgl.gen("a"), model_type="qwen3")

    state = qwen.run(backend=ScriptedBackend("no thinking here"))
    assert (state["a"], state["a_reasoning_content"]) == ("no thinking here", "")
    state = qwen.run(backend=ScriptedBackend("<think>cut off while thin"))
    assert (state["a"], state["a_reasoning_content"]) == ("", "cut off while thin")
    with pytest.raises(ValueError, match="unknown model_type 'gpt-9'"):
        sgl.separate_reasoning(sgl.gen("a"), model_type="gpt-9")
    with pytest.raises(ValueError, match="wraps a named gen"):
        sgl.separate_reasoning(sgl.gen(), model_type="qwen3")


def test_choices_method_may_be_any_callable_with_sglangs_signature():
    def shortest(*, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs, **_):
        return sgl.ChoicesDecision(min(choices, key=len), {"by": "length"})

    expr = sgl.select("c", ["long one", "short"], choices_method=shortest)
    decision = expr.choices_method(
        choices=["long one", "short"],
        normalized_prompt_logprobs=[0.0, -1.0],
        input_token_logprobs=[[], []],
        output_token_logprobs=[[], []],
    )
    assert (decision.decision, decision.meta_info) == ("short", {"by": "length"})
    assert not expr.choices_method.requires_unconditional_logprobs
    with pytest.raises(TypeError, match="choices_method must be a choice method"):
        sgl.select("c", ["a", "b"], choices_method="greedy")


@sgl.function
def capital(s):
    s += sgl.system("Answer in one word.")
    s += sgl.user("What is the capital of France?")
    s += sgl.assistant(sgl.gen("answer", max_tokens=8, temperature=0, stop=["."]))


def test_anthropic_backend_over_the_official_sdk():
    pytest.importorskip("anthropic")
    with ProviderFake("Paris") as fake:
        backend = sgl.Anthropic("claude-3-5-haiku", api_key="sk-test", base_url=fake.url)
        state = capital.run(backend=backend)
        assert state["answer"] == "Paris"
        body = fake.requests[-1]["body"]
        assert body["model"] == "claude-3-5-haiku" and body["system"] == "Answer in one word."
        assert body["messages"] == [{"role": "user", "content": "What is the capital of France?"}]
        assert (body["max_tokens"], body["temperature"], body["stop_sequences"]) == (8, 0.0, ["."])
        headers = fake.requests[-1]["headers"]  # (the key's header depends on the SDK's version)
        assert headers.get("x-api-key") == "sk-test" or headers.get("authorization") == "Bearer sk-test"
        assert state.get_meta_info("answer")["completion_tokens"] == COMPLETION_TOKENS
        assert state.text().startswith("Answer in one word.\n\nHuman: What is")  # SGLang's "claude" markup

        state = capital.run(backend=backend, stream=True)
        assert "".join(state.text_iter("answer")) == "Paris"
        assert fake.requests[-1]["body"]["stream"] is True

        @sgl.function
        def constrained(s):
            s += sgl.user("Age?") + sgl.assistant(sgl.gen("n", regex=r"[0-9]+"))

        error = constrained.run(backend=backend).error()  # (a gen's failure is the state's, as on any backend)
        assert isinstance(error, NotImplementedError)
        assert "Anthropic cannot constrain a gen's output (regex)" in str(error)


def test_azure_openai_and_token_usage():
    pytest.importorskip("openai")
    with ProviderFake("Paris") as fake:
        backend = sgl.OpenAI(
            "gpt-4o", is_azure=True, api_version="2024-06-01", azure_endpoint=fake.url, api_key="azure-key"
        )
        assert capital.run(backend=backend)["answer"] == "Paris"
        assert capital.run(backend=backend)["answer"] == "Paris"
        request = fake.requests[-1]
        assert request["path"] == "/openai/deployments/gpt-4o/chat/completions?api-version=2024-06-01"
        assert request["headers"]["api-key"] == "azure-key"
        assert (backend.token_usage.prompt_tokens, backend.token_usage.completion_tokens) == (
            2 * PROMPT_TOKENS,
            2 * COMPLETION_TOKENS,
        )
        backend.token_usage.reset()
        assert backend.token_usage.prompt_tokens == backend.token_usage.completion_tokens == 0

        @sgl.function(num_api_spec_tokens=64)
        def speculated(s):
            s += sgl.assistant("Name: " + sgl.gen("name", stop="\n") + "\nAge: " + sgl.gen("age", stop="\n"))

        with pytest.raises(NotImplementedError, match=r"num_api_spec_tokens=64\): API speculative execution"):
            speculated.run(backend=backend)


@pytest.mark.parametrize(("backend", "package"), [("LiteLLM", "litellm"), ("VertexAI", "google-cloud-aiplatform")])
def test_backends_without_their_sdk_say_what_to_install(backend, package):
    module = {"LiteLLM": "litellm", "VertexAI": "vertexai"}[backend]
    try:
        importlib.import_module(module)
        pytest.skip(f"{module} is installed")
    except ImportError:
        pass
    with pytest.raises(ImportError, match=f"plait.{backend} needs the '{package}' package: pip install {package}"):
        getattr(sgl, backend)("some-model")
