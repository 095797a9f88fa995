"""The Kubernetes model-server protocol: the gauges endpoint pickers read, under vLLM's and SGLang's names
beside plait's own, and the probes and scrapes a platform sends without the API key."""

from __future__ import annotations

from types import SimpleNamespace

from fastapi.testclient import TestClient
from plait.runtime.server import create_app
from plait.runtime.server.metrics import ServerMetrics
from plait.runtime.server_args import ServerArgs
from prometheus_client.parser import text_string_to_metric_families

INFO = {"num_running_reqs": 3, "num_waiting_reqs": 7, "token_usage": 0.25, "cache_hit_rate": 0.5}


def samples(text: str) -> dict[str, tuple[dict, float]]:
    return {s.name: (s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples}


def test_gauges_under_vllm_and_sglang_names():
    got = samples(ServerMetrics("smol").render(INFO).decode())
    want = {
        "vllm:num_requests_running": 3,
        "vllm:num_requests_waiting": 7,
        "vllm:kv_cache_usage_perc": 0.25,
        "sglang:num_running_reqs": 3,
        "sglang:num_queue_reqs": 7,
        "sglang:token_usage": 0.25,
        "sglang:cache_hit_rate": 0.5,
        "plait_num_queued_reqs": 7,  # plait's own stay
        "plait_kv_cache_usage": 0.25,
    }
    for name, value in want.items():
        assert got[name] == ({"model_name": "smol"}, value), name


def test_gauges_absent_until_the_engine_reports_them():
    got = samples(ServerMetrics("smol").render(None).decode())
    assert not any(name.startswith(("vllm:", "sglang:")) for name in got)


class EngineForProbes:
    """What /metrics and /health_generate reach: server info, and a generation that answers."""

    model_path = "/models/tiny-model"
    model_config = SimpleNamespace(context_len=32, vocab_size=100)
    tokenizer = None
    tokenizer_manager = SimpleNamespace(dead_reason=None)

    def get_server_info(self) -> dict:
        return dict(INFO)

    def __getattr__(self, name):
        raise AssertionError(f"engine.{name} called")


def test_probes_open_under_the_api_key_unless_asked():
    auth = {"Authorization": "Bearer k"}
    with TestClient(create_app(EngineForProbes(), ServerArgs(api_key="k"))) as client:
        r = client.get("/metrics")  # a Prometheus scrape written for SGLang sends no key
        assert r.status_code == 200 and "vllm:num_requests_waiting" in r.text
        assert client.get("/health").status_code == 200
        assert client.get("/v1/models").status_code == 401  # everything else keeps the key
        assert client.get("/get_server_info").status_code == 401
    args = ServerArgs(api_key="k", require_api_key_for_probes=True)
    with TestClient(create_app(EngineForProbes(), args)) as client:
        assert client.get("/metrics").status_code == 401
        assert client.get("/health_generate").status_code == 401
        assert client.get("/metrics", headers=auth).status_code == 200
        assert client.get("/health").status_code == 200
