"""plait on Ray Serve (runtime/integrations/ray_serve.py), on a small local Ray cluster: two replicas of the
default model behind the OpenAI ingress, reached with the OpenAI client. Both replicas serve; requests that
share a prefix stick to one replica (the cached tokens prove it); a replica killed mid-request is replaced
and the client's retried request succeeds."""

from __future__ import annotations

import threading
import time

import openai
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'ray[serve]')")
pytestmark = pytest.mark.ray

from conftest import free_port  # noqa: E402

APP = "plait"
REPLICA_HEADER = "x-plait-replica"
SHARED = (
    "You are the support assistant of a bakery. Answer in one short sentence, politely, and never invent "
    "prices. The bakery opens at seven and closes at six, bakes sourdough daily and croissants on weekends. "
)


@pytest.fixture(scope="module")
def cluster():
    try:
        ray.init(num_cpus=2, object_store_memory=80 << 20, include_dashboard=False, log_to_driver=False)
    except Exception as e:  # noqa: BLE001 - no Ray here (no shared memory, a sandbox): skip, say why
        pytest.skip(f"a local Ray cluster cannot start here: {type(e).__name__}: {e}")
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def app(cluster):
    from plait.runtime.integrations.ray_serve import build_app
    from ray import serve

    engine_kwargs = {"num_threads": 1, "max_total_tokens": 4096, "max_running_requests": 8}
    serve.run(
        build_app(engine_kwargs, num_replicas=2, replica_cpus=0.5, health_check_period_s=2.0),
        name=APP,
        route_prefix="/",
        blocking=False,
    )
    wait_running(2, deadline_s=600)
    yield openai.OpenAI(base_url=cluster + "/v1", api_key="none", max_retries=0, timeout=300)


def wait_running(n: int, deadline_s: float) -> None:
    from ray import serve

    deadline = time.time() + deadline_s
    while True:
        status = serve.status().applications.get(APP)
        states = status.deployments["PlaitServer"].replica_states if status else {}
        if status is not None and status.status == "RUNNING" and states.get("RUNNING", 0) == n and len(states) == 1:
            return
        assert time.time() < deadline, f"{n} replicas not running: {status}"
        time.sleep(1.0)


def complete(client: openai.OpenAI, prompt: str, max_tokens: int = 4) -> tuple[str, int]:
    """(the replica that served it, its cached prompt tokens)."""
    raw = client.completions.with_raw_response.create(
        model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=max_tokens, temperature=0
    )
    body = raw.parse()
    assert body.choices[0].text is not None and body.usage.completion_tokens >= 1
    return raw.headers[REPLICA_HEADER], body.usage.prompt_tokens_details.cached_tokens


def test_both_replicas_serve_and_a_prefix_sticks_to_one(app):
    first, cached = complete(app, SHARED + "When do you open?")
    assert cached == 0
    for question in ("Do you sell rye?", "Are croissants baked daily?", "Is there parking?"):
        replica, cached = complete(app, SHARED + question)
        assert replica == first, question  # where the prefix is cached
        assert cached >= 40, (question, cached)  # the shared system text came from that replica's cache
    others = {complete(app, f"Tenant {i}: a new system prompt, unrelated to baking, number {i}.")[0] for i in range(3)}
    assert others - {first}, "a new prefix went to the replica with the most cache room: the other one"
    # a chat conversation's second turn goes where its first was (it starts with the first)
    messages = [{"role": "user", "content": "Name a colour of the sea in one word."}]
    raw = app.chat.completions.with_raw_response.create(
        model="SmolLM2-135M-Instruct", messages=messages, max_tokens=4, temperature=0
    )
    messages += [{"role": "assistant", "content": raw.parse().choices[0].message.content or "blue"}]
    messages += [{"role": "user", "content": "And of the sky?"}]
    again = app.chat.completions.with_raw_response.create(
        model="SmolLM2-135M-Instruct", messages=messages, max_tokens=4, temperature=0
    )
    assert again.headers[REPLICA_HEADER] == raw.headers[REPLICA_HEADER]
    assert again.parse().usage.prompt_tokens_details.cached_tokens > 0


def test_streams_pass_through(app):
    chunks = list(
        app.completions.create(
            model="SmolLM2-135M-Instruct",
            prompt="Count: 1, 2, 3, 4,",
            max_tokens=6,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) >= 3 and "".join(texts).strip(), texts  # piece by piece, as the replica wrote them


def test_a_killed_replica_is_replaced_and_the_retried_request_succeeds(app, cluster):
    from ray import serve

    victim, _ = complete(app, SHARED + "Who bakes the bread?")
    actors = ray.util.list_named_actors(all_namespaces=True)
    names = [a["name"] for a in actors if a["name"].startswith(f"SERVE_REPLICA::{APP}#PlaitServer#")]
    assert len(names) == 2 and any(n.endswith(victim) for n in names), (names, victim)
    victim_actor = ray.get_actor(next(n for n in names if n.endswith(victim)), namespace="serve")
    retrying = openai.OpenAI(base_url=cluster + "/v1", api_key="none", max_retries=3, timeout=300)
    result: dict = {}

    def long_request():  # the same prefix: routed to the victim, which dies while it decodes
        try:
            raw = retrying.completions.with_raw_response.create(
                model="SmolLM2-135M-Instruct",
                prompt=SHARED + "Tell me about the bread.",
                max_tokens=160,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            result["replica"] = raw.headers[REPLICA_HEADER]
            result["tokens"] = raw.parse().usage.completion_tokens
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            result["error"] = e

    thread = threading.Thread(target=long_request)
    thread.start()
    time.sleep(2.0)  # (its 160 tokens take several seconds on the CPU)
    ray.kill(victim_actor, no_restart=True)
    thread.join(timeout=300)
    assert "error" not in result, result
    assert result["replica"] != victim and result["tokens"] == 160, result
    wait_running(2, deadline_s=600)  # Serve started a replacement
    replicas = serve.status().applications[APP].deployments["PlaitServer"].replica_states
    assert replicas == {"RUNNING": 2}, replicas
    assert complete(app, "A question after the replacement.")[1] == 0


def test_the_serve_config_builds_and_validates():
    import os

    import yaml
    from helpers.paths import REPO
    from plait.runtime.integrations.ray_serve import app_builder
    from ray.serve.schema import ServeDeploySchema

    with open(os.path.join(REPO, "deploy", "ray", "plait.yaml")) as f:
        config = yaml.safe_load(f)
    ServeDeploySchema.model_validate(config)  # what `serve run` / `serve deploy` check first
    (app_config,) = config["applications"]
    module, _, name = app_config["import_path"].partition(":")
    assert (module, name) == ("plait.runtime.integrations.ray_serve", "app_builder")
    app_builder(app_config["args"])  # the settings are checked and the application built, with no cluster


def test_a_programs_group_and_forks_land_where_their_prefix_is(app, cluster):
    import plait as pl
    import requests

    # /generate naming a group (what the DSL sends): one replica for the whole group, whatever the texts
    served = set()
    for text in ("Group text one.", "An unrelated second text.", "A third, unrelated again."):
        r = requests.post(
            cluster + "/generate", json={"text": text, "group": "program-7", "sampling_params": {"max_new_tokens": 2}}
        )
        assert r.status_code == 200, r.text
        served.add(r.headers[REPLICA_HEADER])
    assert len(served) == 1, served

    # a DSL program through RuntimeEndpoint: its prefix prefilled once, then its forks, all on that replica
    metas: list = []

    @pl.function
    def facts(s, topic):
        s += SHARED + f"Three facts about {topic}."
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f" Fact {i + 1}:" + pl.gen("fact", max_tokens=3, temperature=0)
        metas.extend(f.get_meta_info("fact") for f in forks)  # (waits for each fork's answer)

    states = facts.run_batch([{"topic": "bread"}, {"topic": "cakes"}], backend=pl.RuntimeEndpoint(cluster))
    assert [state.error() for state in states] == [None, None]
    assert len(metas) == 6
    for meta in metas:  # every fork found the program's prefix cached where it was sent
        assert meta["cached_tokens"] >= 40, meta
