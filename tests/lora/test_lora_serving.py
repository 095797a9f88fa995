"""LoRA adapters where users reach them (issue 36), on a random small Llama with a tokenizer, the HTTP app
on a real socket (uvicorn on a free port) over the module's Engine.

HTTP: `lora_path` on /generate gives transformers + PEFT's merged outputs; /load_lora_adapter and
/unload_lora_adapter while a request streams; the OpenAI `model` field naming an adapter as
"base:adapter" or by its name, through the official openai client; unknown adapters answered 400 / 404
naming them; /v1/models lists the loaded adapters with their parent (as vLLM does).
DSL: `gen(..., lora=...)`, the program's `run(lora=...)` and a backend's `lora=` default, through the
Engine backend and the HTTP endpoint backend alike."""

from __future__ import annotations

import json
import threading

import pytest
import requests

pytest.importorskip("peft")
openai = pytest.importorskip("openai")

from conftest import http_server_in_thread  # noqa: E402
from helpers.lora_adapters import make_peft_adapter, merged_greedy  # noqa: E402
from helpers.model_folders import TEMPLATE, build_tokenizer, make_folder  # noqa: E402

PROMPT = [40, 41, 42, 43, 44, 45]
NEW = 8
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The base model (with a tokenizer), two adapters, and transformers' merged references of PROMPT."""
    d = tmp_path_factory.mktemp("lora_http")
    tokenizer = build_tokenizer()
    tokenizer.chat_template = TEMPLATE
    base = make_folder(d / "base", "llama", tokenizer=tokenizer)
    adapters = {
        "a": make_peft_adapter(base, str(d / "a"), 8, seed=11),
        "b": make_peft_adapter(base, str(d / "b"), 4, seed=12, targets=["q_proj", "v_proj", "gate_proj"]),
        "c": make_peft_adapter(base, str(d / "c"), 2, seed=13),  # loaded and unloaded while serving
    }
    refs = {name: merged_greedy(base, path, [PROMPT], NEW)[0] for name, path in adapters.items()}
    refs[None] = merged_greedy(base, None, [PROMPT], NEW)[0]
    assert len({tuple(r) for r in refs.values()}) == 4, "each adapter must change the outputs"
    return base, adapters, refs


@pytest.fixture(scope="module")
def engine(models):
    from plait.runtime import Engine

    base, adapters, _ = models
    paths = [f"{name}={adapters[name]}" for name in ("a", "b")]
    with Engine(model_path=base, lora_paths=paths, max_lora_rank=8, max_loras_per_batch=2) as eng:
        yield eng


@pytest.fixture(scope="module")
def url(engine):
    with http_server_in_thread(engine) as url:
        yield url


@pytest.fixture(scope="module")
def base_name(url):
    return requests.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


def generate(url: str, **body) -> requests.Response:
    return requests.post(url + "/generate", json={"sampling_params": GREEDY, **body}, timeout=120)


def test_generate_with_lora_path(url, models):
    _, _, refs = models
    r = generate(url, input_ids=PROMPT, lora_path="a")
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == refs["a"]
    # a batch mixing the adapter and the base model, one lora_path per prompt
    r = generate(url, input_ids=[PROMPT, PROMPT], lora_path=["a", None])
    assert [o["output_ids"] for o in r.json()] == [refs["a"], refs[None]]
    r = generate(url, input_ids=PROMPT, lora_path="nope")
    assert r.status_code == 400 and "'nope'" in r.json()["error"]["message"], r.text


def test_load_and_unload_while_a_request_streams(url, models):
    base, adapters, refs = models
    streamed: list[dict] = []

    def stream_base():
        body = {"input_ids": PROMPT, "stream": True, "sampling_params": {**GREEDY, "max_new_tokens": 100}}
        with requests.post(url + "/generate", json=body, stream=True, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith(b"data:") and line != b"data: [DONE]":
                    streamed.append(json.loads(line[5:]))

    thread = threading.Thread(target=stream_base)
    thread.start()
    r = requests.post(url + "/load_lora_adapter", json={"lora_name": "c", "lora_path": adapters["c"]}, timeout=120)
    assert r.status_code == 200 and r.json()["success"] and r.json()["rank"] == 2, r.text
    cards = {m["id"]: m for m in requests.get(url + "/v1/models", timeout=30).json()["data"]}
    assert cards["c"]["parent"] == cards["a"]["parent"] != "c" and cards["c"]["root"] == adapters["c"]
    assert generate(url, input_ids=PROMPT, lora_path="c").json()["output_ids"] == refs["c"]
    r = requests.post(url + "/unload_lora_adapter", json={"lora_name": "c"}, timeout=120)
    assert r.status_code == 200 and r.json()["success"], r.text
    thread.join()
    assert streamed and streamed[-1]["output_ids"][:NEW] == refs[None]  # the stream ran on, unharmed
    assert "c" not in {m["id"] for m in requests.get(url + "/v1/models", timeout=30).json()["data"]}
    r = generate(url, input_ids=PROMPT, lora_path="c")
    assert r.status_code == 400 and "'c'" in r.json()["error"]["message"], r.text
    # unloading what is not loaded: a 404 naming it; a folder that is no adapter: a 400 naming it
    r = requests.post(url + "/unload_lora_adapter", json={"lora_name": "c"}, timeout=60)
    assert r.status_code == 404 and "'c'" in r.json()["error"]["message"], r.text
    r = requests.post(url + "/load_lora_adapter", json={"lora_name": "d", "lora_path": base + "/nowhere"}, timeout=60)
    assert r.status_code == 400 and "'d'" in r.json()["error"]["message"], r.text
    # a name with ':' could not be told from "base:adapter" in the OpenAI model field
    r = requests.post(url + "/load_lora_adapter", json={"lora_name": "x:y", "lora_path": adapters["c"]}, timeout=60)
    assert r.status_code == 400 and "'x:y'" in r.json()["error"]["message"], r.text


def test_openai_model_field_names_the_adapter(url, models, base_name):
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    native = generate(url, input_ids=PROMPT, lora_path="a").json()["text"]
    plain = generate(url, input_ids=PROMPT).json()["text"]
    assert native != plain
    extra = {"ignore_eos": True}
    for model in (f"{base_name}:a", "a"):  # SGLang's spelling, then vLLM's
        out = client.completions.create(model=model, prompt=PROMPT, max_tokens=NEW, temperature=0, extra_body=extra)
        assert out.choices[0].text == native, model
    out = client.completions.create(model=base_name, prompt=PROMPT, max_tokens=NEW, temperature=0, extra_body=extra)
    assert out.choices[0].text == plain
    chat = client.chat.completions.create(
        model="a", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0, extra_body=extra
    )
    assert chat.choices[0].message.content is not None
    for model in (f"{base_name}:zzz", "zzz"):
        with pytest.raises(openai.NotFoundError, match="zzz"):
            client.completions.create(model=model, prompt=PROMPT, max_tokens=1)
    with pytest.raises(openai.NotFoundError, match="zzz"):
        client.chat.completions.create(model="zzz", messages=[{"role": "user", "content": "hi"}], max_tokens=1)


def test_v1_models_lists_the_adapters(url, models, base_name):
    _, adapters, _ = models
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) >= {base_name, "a"}
    assert cards["a"].parent == base_name and cards["a"].root == adapters["a"]
    assert client.models.retrieve("a").parent == base_name
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("zzz")


# ---------------------------------------------------------------- the DSL
START = "the quick brown fox"
DSL_GREEDY = {"max_tokens": NEW, "temperature": 0, "ignore_eos": True}


def _two_gens():
    import plait as sgl

    @sgl.function
    def two_gens(s):
        s += START
        s += sgl.gen("x", **DSL_GREEDY)
        s += sgl.gen("y", lora="b", **DSL_GREEDY)

    return two_gens


def _expected(engine, lora_x, lora_y) -> tuple[str, str]:
    """What the Engine answers the program's two requests with (x under `lora_x`, then y under `lora_y`)."""
    sampling = {**GREEDY}
    x = engine.generate(prompt=START, sampling_params=sampling, lora_path=lora_x)["text"]
    y = engine.generate(prompt=START + x, sampling_params=sampling, lora_path=lora_y)["text"]
    return x, y


@pytest.mark.parametrize("kind", ["engine", "http"])
def test_dsl_gen_lora_and_the_program_and_backend_defaults(engine, url, kind):
    from plait.backend.engine_backend import EngineBackend
    from plait.backend.runtime_endpoint import RuntimeEndpoint

    def backend(lora=None):
        return EngineBackend(engine, lora=lora) if kind == "engine" else RuntimeEndpoint(url, lora=lora)

    program = _two_gens()
    plain, with_a = _expected(engine, None, "b"), _expected(engine, "a", "b")
    assert plain != with_a and plain != _expected(engine, None, None)  # each adapter changes the text
    state = program.run(backend=backend())  # gen y's own adapter; x the base model's
    assert (state["x"], state["y"]) == plain
    state = program.run(backend=backend(), lora="a")  # the program's default, under y's own
    assert (state["x"], state["y"]) == with_a
    state = program.run(backend=backend(lora="a"))  # the backend's default
    assert (state["x"], state["y"]) == with_a
    states = program.run_batch([{}, {}], backend=backend(), lora="a")  # no prefill ahead in another namespace
    assert [(st["x"], st["y"]) for st in states] == [with_a, with_a]


def test_dsl_lora_refused_where_it_would_be_dropped():
    import plait as sgl
    from plait.backend.chat_api import refuse_unsupported
    from plait.gen_params import GenOverrides, RunDefaults, resolve_gen

    params = resolve_gen(RunDefaults(), GenOverrides.from_gen_kwargs({"lora": "a"}))
    assert params.options.lora_path == "a"
    with pytest.raises(NotImplementedError, match="serves no LoRA adapters"):
        refuse_unsupported("Anthropic", params)  # the hosted APIs' backends

    with pytest.raises(ValueError, match="program's LoRA adapter"):
        sgl.gen("pick", choices=["x", "y"], lora="a")
    with pytest.raises(ValueError, match="lora_path"):

        @sgl.function
        def p(s):
            s += "x"

        p.run(lora=5)


def test_dsl_lora_through_the_openai_backend(engine, url, base_name):
    """The OpenAI backend names a gen's adapter as the request's model (vLLM's spelling, plait's too)."""
    import plait as sgl

    backend = sgl.OpenAI(base_name, is_chat_model=False, base_url=url + "/v1", api_key="none")
    x_plain = engine.generate(prompt=START, sampling_params=GREEDY)["text"]
    x_a = engine.generate(prompt=START, sampling_params=GREEDY, lora_path="a")["text"]
    assert x_plain != x_a

    @sgl.function
    def one_gen(s):
        s += START
        s += sgl.gen("x", max_tokens=NEW, temperature=0, ignore_eos=True)

    assert one_gen.run(backend=backend)["x"] == x_plain
    assert one_gen.run(backend=backend, lora="a")["x"] == x_a
