"""The inference-gateway component: the InferencePool selects the prefill pods on PORT, the
endpoint picker it names is deployed with epp-config.yaml, and that configuration reads our pods
where and how the service exports its metrics. (The live scrape against the same configuration is
in test_prometheus_scrape.py; schema validation in test_manifests.py.)"""

from __future__ import annotations

import epp_config
import pytest
from deploy_testlib import OVERLAYS, effective_env, named

ENGINE_LABEL = "llm-d.ai/engine-type"  # the extractor's engineLabelKey when the config sets none
PREFILL = "triton-prefill"  # the prefill Deployment (deploy/base/deployment.yaml)


def the(docs: list[dict], kind: str) -> dict:
    (found,) = [d for d in docs if d["kind"] == kind]
    return found


def port_of(container: dict, name: str) -> int:
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == name]
    return port


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def pod_labels(deployment: dict) -> dict:
    return deployment["spec"]["template"]["metadata"]["labels"]


def args_of(container: dict) -> dict[str, str]:
    """--flag=value arguments as {flag: value}."""
    return dict(a.removeprefix("--").partition("=")[::2] for a in container.get("args", []))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pool_selects_the_prefill_pods_on_port(overlay: str, rendered, rendered_with_gateway):
    docs = rendered_with_gateway[overlay]
    pool = the(docs, "InferencePool")["spec"]
    prefill = named(docs, "Deployment", PREFILL)
    assert selects(pool["selector"]["matchLabels"], pod_labels(prefill))
    # the same pods as the Service that clients use
    assert pool["selector"]["matchLabels"] == named(docs, "Service", PREFILL)["spec"]["selector"]
    picker = named(docs, "Deployment", pool["endpointPickerRef"]["name"])
    assert not selects(pool["selector"]["matchLabels"], pod_labels(picker))
    (c,) = prefill["spec"]["template"]["spec"]["containers"]
    listen = int(effective_env(rendered[overlay]).get("PORT") or 8000)
    assert [p["number"] for p in pool["targetPorts"]] == [port_of(c, "http")] == [listen]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_prefill_objects_gain_only_the_engine_label(overlay, rendered, rendered_with_gateway):
    with_gateway = rendered_with_gateway[overlay]
    for doc in rendered[overlay]:
        got = named(with_gateway, doc["kind"], doc["metadata"]["name"])
        if doc["kind"] == "Deployment":
            got = {**got, "spec": {**got["spec"], "template": {**got["spec"]["template"]}}}
            labels = dict(pod_labels(got))
            labels.pop(ENGINE_LABEL)
            got["spec"]["template"]["metadata"] = {"labels": labels}
        assert got == doc, f"the component changes {doc['kind']}/{doc['metadata']['name']}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_picker_reads_our_metrics_on_admin_port(overlay: str, rendered, rendered_with_gateway):
    docs = rendered_with_gateway[overlay]
    config = epp_config.load()
    (c,) = named(docs, "Deployment", PREFILL)["spec"]["template"]["spec"]["containers"]
    admin = int(effective_env(rendered[overlay]).get("ADMIN_PORT") or 8001)
    source = epp_config.plugin(config, "metrics-data-source")["parameters"]
    assert source["port"] == port_of(c, "admin") == admin, "scrape ADMIN_PORT, as Prometheus does"
    (endpoint,) = the(docs, "ServiceMonitor")["spec"]["endpoints"]
    assert source.get("path", "/metrics") == endpoint.get("path", "/metrics")
    # The pods carry the label that picks our engine's metric names, and unlabelled pods get them
    # too (defaultEngine), not vLLM's.
    extractor = epp_config.plugin(config, "core-metrics-extractor")["parameters"]
    assert extractor.get("engineLabelKey", ENGINE_LABEL) == ENGINE_LABEL
    engine = epp_config.engine(config)["name"]
    assert pod_labels(named(docs, "Deployment", PREFILL))[ENGINE_LABEL] == engine
    assert engine not in epp_config.BUILTIN_ENGINES, "a built-in name would keep its metrics"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_picker_deployment_serves_the_pool(overlay: str, rendered_with_gateway) -> None:
    docs = rendered_with_gateway[overlay]
    pool = the(docs, "InferencePool")
    ref = pool["spec"]["endpointPickerRef"]
    svc = named(docs, "Service", ref["name"])
    (svc_port,) = [p for p in svc["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    picker = named(docs, "Deployment", ref["name"])
    pod = picker["spec"]["template"]["spec"]
    assert selects(svc["spec"]["selector"], pod_labels(picker))
    (c,) = pod["containers"]
    assert c["image"].endswith(f":{epp_config.EPP_VERSION}"), "the release the config is for"
    args = args_of(c)
    assert port_of(c, svc_port["targetPort"]) == int(args.get("grpc-port", 9002))
    assert args["pool-name"] == pool["metadata"]["name"]
    assert "pool-namespace" not in args, "the picker's own namespace (NAMESPACE) holds the pool"
    env = {e["name"]: e for e in c["env"]}
    assert env["NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    # --config-file is epp-config.yaml, as the component's ConfigMap carries it
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    directory, _, key = args["config-file"].rpartition("/")
    (volume,) = [v for v in pod["volumes"] if v["name"] == mounts[directory]]
    config_map = named(docs, "ConfigMap", volume["configMap"]["name"])
    assert key == epp_config.EPP_CONFIG.name
    assert config_map["data"][key] == epp_config.EPP_CONFIG.read_text()
    # its ServiceAccount may read the pool and its pods
    account = pod["serviceAccountName"]
    binding = the(docs, "RoleBinding")
    assert {"kind": "ServiceAccount", "name": account} in binding["subjects"]
    role = named(docs, "Role", binding["roleRef"]["name"])
    granted = {
        (group, resource)
        for rule in role["rules"]
        if {"get", "list", "watch"} <= set(rule["verbs"])
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    assert {("", "pods"), ("inference.networking.k8s.io", "inferencepools")} <= granted


def test_every_route_has_a_parser() -> None:
    """Routes the OpenAI parser does not claim (/v1/prefill, /v1/score) need a fallback parser:
    without one the picker answers them 400. The first parser without claimed paths takes every
    route, and parsers after it are never used."""
    config = epp_config.load()
    types = {p.get("name") or p["type"]: p["type"] for p in config["plugins"]}
    parsers = [types[p["pluginRef"]] for p in config["requestHandler"]["parsers"]]
    assert parsers == ["openai-parser", "passthrough-parser"], parsers
