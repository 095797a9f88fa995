"""deploy/kubernetes/: every manifest valid against Kubernetes' own schemas (kubernetes-validate, strict: an
unknown field fails) or, for the custom resources, their CRDs' schemas (tests/helpers/data/crds/), with no
cluster; and wired to what plait really does: its flags parse, the probes are the open paths, the pool's
picker reads gauges plait exports, the LeaderWorkerSet's pods become the nodes of one model."""

from __future__ import annotations

import glob
import json
import os

import jsonschema
import kubernetes_validate
import pytest
import yaml
from helpers.paths import DATA, REPO
from plait.runtime.cli.main import parse_server_args
from plait.runtime.server.http_guards import ALWAYS_OPEN_PATHS, PROBE_PATHS
from plait.runtime.server.metrics import ServerMetrics

K8S_VERSION = "1.33.0"
MANIFESTS = sorted(glob.glob(os.path.join(REPO, "deploy", "kubernetes", "*.yaml")))
CRDS = {
    (group_version, kind): os.path.join(DATA, "crds", f"{group_version.replace('/', '_')}_{kind}.json")
    for group_version, kind in (
        ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"),
        ("inference.networking.k8s.io/v1", "InferencePool"),
        ("gateway.networking.k8s.io/v1", "HTTPRoute"),
    )
}
LWS_ENV = {"LWS_LEADER_ADDRESS": "plait-tp-0.plait-tp.default", "LWS_GROUP_SIZE": "2"}


def documents() -> list[dict]:
    docs = []
    for path in MANIFESTS:
        with open(path) as f:
            docs += [d for d in yaml.safe_load_all(f) if d]
    return docs


def by_kind(kind: str) -> list[dict]:
    return [d for d in documents() if d["kind"] == kind]


def pod_specs(doc: dict) -> list[tuple[dict, dict]]:
    """(pod template, its labels) of a Deployment or of each template of a LeaderWorkerSet."""
    if doc["kind"] == "Deployment":
        templates = [doc["spec"]["template"]]
    else:
        lwt = doc["spec"]["leaderWorkerTemplate"]
        templates = [lwt["leaderTemplate"], lwt["workerTemplate"]]
    return [(t, t["metadata"]["labels"]) for t in templates]


def plait_args(container: dict) -> list[str]:
    assert container["command"] == ["plait", "serve"]
    return container["args"]


def test_the_manifests_are_there():
    names = {os.path.basename(p) for p in MANIFESTS}
    assert names == {"plait-deployment.yaml", "plait-leaderworkerset.yaml", "plait-inferencepool.yaml"}


@pytest.mark.parametrize("doc", documents(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_valid_against_the_kubernetes_schemas(doc):
    crd = CRDS.get((doc["apiVersion"], doc["kind"]))
    if crd is None:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        return
    with open(crd) as f:
        schema = json.load(f)
    jsonschema.validate(doc, schema)
    for template, _ in pod_specs(doc) if doc["kind"] == "LeaderWorkerSet" else []:
        pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template}
        kubernetes_validate.validate(pod_template, K8S_VERSION, strict=True)


def test_a_broken_manifest_is_caught():
    deployment = by_kind("Deployment")[0]
    broken = json.loads(json.dumps(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {"path": "/health"}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)
    pool = json.loads(json.dumps(by_kind("InferencePool")[0]))
    del pool["spec"]["endpointPickerRef"]["name"]
    with open(CRDS[("inference.networking.k8s.io/v1", "InferencePool")]) as f:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(pool, json.load(f))


def test_replicas_parse_probe_open_paths_and_sit_behind_their_service():
    deployment = next(d for d in by_kind("Deployment") if d["metadata"]["name"] == "plait")
    ((template, labels),) = pod_specs(deployment)
    container = template["spec"]["containers"][0]
    args = parse_server_args(plait_args(container))
    assert args.host == "0.0.0.0" and args.kv_events_endpoint == "tcp://*:5557"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": args.port, "kv-events": 5557}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] in ALWAYS_OPEN_PATHS
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/path"] in PROBE_PATHS and int(annotations["prometheus.io/port"]) == args.port
    service = next(s for s in by_kind("Service") if s["metadata"]["name"] == "plait")
    assert service["spec"]["selector"].items() <= labels.items()


def test_the_pool_selects_the_replicas_and_its_picker_reads_gauges_plait_exports():
    pool = by_kind("InferencePool")[0]
    deployment = next(d for d in by_kind("Deployment") if d["metadata"]["name"] == "plait")
    ((template, labels),) = pod_specs(deployment)
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    args = parse_server_args(plait_args(template["spec"]["containers"][0]))
    assert pool["spec"]["targetPorts"] == [{"number": args.port}]
    picker = next(
        d for d in by_kind("Deployment") if d["metadata"]["name"] == pool["spec"]["endpointPickerRef"]["name"]
    )
    picker_service = next(
        s for s in by_kind("Service") if s["metadata"]["name"] == pool["spec"]["endpointPickerRef"]["name"]
    )
    assert picker_service["spec"]["ports"][0]["port"] == pool["spec"]["endpointPickerRef"]["port"]["number"]
    flags = dict(a.split("=", 1) for a in picker["spec"]["template"]["spec"]["containers"][0]["args"])
    assert flags["--pool-name"] == pool["metadata"]["name"]
    info = {"num_running_reqs": 1, "num_waiting_reqs": 2, "token_usage": 0.5}
    exported = ServerMetrics("m").render(info).decode()
    for flag in ("--total-queued-requests-metric", "--kv-cache-usage-percentage-metric"):
        assert f"\n{flags[flag]}{{" in exported, flag
    route = by_kind("HTTPRoute")[0]
    assert route["spec"]["rules"][0]["backendRefs"][0]["name"] == pool["metadata"]["name"]


def test_the_leaderworkerset_pods_are_one_models_nodes(monkeypatch):
    lws = by_kind("LeaderWorkerSet")[0]
    size = lws["spec"]["leaderWorkerTemplate"]["size"]
    (leader, leader_labels), (worker, _) = pod_specs(lws)
    nodes = []
    for index, template in enumerate([leader] + [worker] * (size - 1)):
        monkeypatch.setenv("LWS_WORKER_INDEX", str(index))
        for key, value in {**LWS_ENV, "LWS_GROUP_SIZE": str(size)}.items():
            monkeypatch.setenv(key, value)
        args = parse_server_args(plait_args(template["spec"]["containers"][0]))
        nodes.append((args.nnodes, args.node_rank, args.dist_init_addr, args.world_size()))
    assert nodes == [(size, i, "plait-tp-0.plait-tp.default:20000", size) for i in range(size)]
    assert "readinessProbe" in leader["spec"]["containers"][0] and "ports" not in worker["spec"]["containers"][0]
    service = next(s for s in by_kind("Service") if s["metadata"]["name"] == "plait-tp")
    assert service["spec"]["selector"].items() <= leader_labels.items()
