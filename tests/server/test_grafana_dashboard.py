"""deploy/grafana/plait-dashboard.json against Grafana's own JSON schemas (tests/helpers/data/grafana_schemas/: the
dashboard, the timeseries and stat panels' options, Prometheus queries), and every metric its queries read
against what the server's /metrics exports (a renamed metric would leave a panel empty)."""

from __future__ import annotations

import json
import os
import re

import jsonschema
import pytest
from helpers.paths import DATA, REPO
from plait.runtime.server.metrics import ServerMetrics
from prometheus_client.parser import text_string_to_metric_families

DASHBOARD = os.path.join(REPO, "deploy", "grafana", "plait-dashboard.json")
SCHEMAS = os.path.join(DATA, "grafana_schemas")
# What the dashboard must show (the list), by a word of the panel titles.
TOPICS = (
    "Tokens per second",
    "Time to first token",
    "Inter-token latency",
    "End-to-end latency",
    "Requests",
    "KV cache usage",
    "Prefix cache hit rate",
    "Grammar compile time",
    "Speculative accept length",
)


def schema(name: str, definition: str | None = None) -> dict:
    with open(os.path.join(SCHEMAS, f"{name}.jsonschema.json")) as f:
        loaded = json.load(f)
    return loaded if definition is None else {**loaded, "$ref": f"#/definitions/{definition}"}


@pytest.fixture(scope="module")
def dashboard() -> dict:
    with open(DASHBOARD) as f:
        return json.load(f)


def panels(dashboard: dict) -> list[dict]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def test_the_dashboard_is_valid_for_grafana(dashboard):
    jsonschema.validate(dashboard, schema("dashboard"))
    for panel in panels(dashboard):
        kind = panel["type"]
        assert kind in ("timeseries", "stat"), kind
        jsonschema.validate(panel["options"], schema(kind, "Options"))
        if kind == "timeseries":
            jsonschema.validate(panel["fieldConfig"]["defaults"]["custom"], schema("timeseries", "FieldConfig"))
        for target in panel["targets"]:
            jsonschema.validate(target, schema("prometheus", "Dataquery"))
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    titles = " | ".join(p["title"] for p in panels(dashboard))
    assert all(topic in titles for topic in TOPICS), titles


def test_every_metric_the_dashboard_reads_is_exported():
    with open(DASHBOARD) as f:
        exprs = [t["expr"] for p in json.load(f)["panels"] for t in p.get("targets", [])]
    read = {m for e in exprs for m in re.findall(r"\b(plait_[a-z0-9_]+)", e)}
    metrics = ServerMetrics("m")
    metrics.observe_first_token(0.1)
    metrics.observe_inter_token(0.01, 2)
    metrics.observe_finished(
        {"prompt_tokens": 3, "completion_tokens": 2, "cached_tokens": 1, "finish_reason": {"type": "stop"}}, 0.2
    )
    metrics.observe_rejected()
    metrics.set_in_flight(1)
    # What the scheduler reports, speculation's accept length and the grammar compile time included (the
    # names the scheduler is to report them under).
    text = metrics.render(
        {
            "num_running_reqs": 1,
            "num_waiting_reqs": 0,
            "token_usage": 0.5,
            "cache_hit_rate": 0.3,
            "grammar_cache_hits": 1,
            "grammar_cache_misses": 1,
            "grammar_compile_seconds": 0.4,
            "jump_forward_tokens": 2,
            "avg_spec_accept_length": 2.0,
            "spec_verify_steps": 4,
            "spec_accepted_tokens": 8,
            "spec_draft_tokens": 12,
            "hicache_host_usage": 0.25,
            "hicache_loaded_tokens": 64,
            "hicache_bytes_to_host": 4096,
            "hicache_bytes_to_device": 8192,
        }
    ).decode()
    exported = {s.name for family in text_string_to_metric_families(text) for s in family.samples}
    assert read - exported == set(), sorted(read - exported)


def test_the_json_is_the_build_scripts_output():
    from importlib.util import module_from_spec, spec_from_file_location

    spec = spec_from_file_location("build_dashboard", os.path.join(os.path.dirname(DASHBOARD), "build_dashboard.py"))
    module = module_from_spec(spec)
    spec.loader.exec_module(module)
    with open(DASHBOARD) as committed:
        assert json.load(committed) == module.build()
