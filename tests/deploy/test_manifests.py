"""Kubernetes manifests under deploy/: schema validation, kustomize rendering, the pod contract."""

from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from crd_checks import CRD_CHECKS
from deploy_testlib import (
    CLIENT_SERVICE,
    DEPLOY,
    METRICS_SERVICE,
    OVERLAYS,
    container,
    effective_env,
    load_yaml_docs,
    named,
    one,
    scrape_job,
)

# The oldest Kubernetes we support (native sidecars, HPA v2 and PDB v1 are older) and the newest
# schema kubernetes-validate ships.
K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
RUN_AS_USER = 10001
# What deploy/components/inference-gateway adds
GATEWAY_KINDS = ("InferencePool", "ConfigMap", "Deployment", "Service", "ServiceAccount", "Role",
                 "RoleBinding")


def validate_doc(doc: dict) -> list[str]:
    """Problems with one object: strict Kubernetes schema for core kinds, crd_checks for CRDs."""
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key in CRD_CHECKS:
        return CRD_CHECKS[key](doc)
    problems = []
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            problems.append(f"k8s {version}: {path}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError:
            return [f"no schema for {key}: add a structural check to crd_checks.py"]
    return problems


def name_of(doc: dict) -> str:
    return f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"


def kustomizations() -> list[Path]:
    return sorted(DEPLOY.rglob("kustomization.yaml"))


def manifest_files() -> list[Path]:
    """Complete objects under deploy/; patches are partial and are validated after rendering."""
    return sorted(
        p
        for p in DEPLOY.rglob("*.yaml")
        if p.name != "kustomization.yaml" and "patches" not in p.relative_to(DEPLOY).parts
    )


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_manifest_file_validates(path: Path) -> None:
    docs = load_yaml_docs(path.read_text())
    assert docs, f"{path} holds no objects"
    problems = [f"{name_of(d)}: {msg}" for d in docs for msg in validate_doc(d)]
    assert not problems, "\n".join(problems)


def test_every_manifest_is_used_by_a_kustomization() -> None:
    """A manifest no kustomization lists is never deployed, however valid it is."""
    referenced = set()
    for k in kustomizations():
        spec = yaml.safe_load(k.read_text())
        for entry in spec.get("resources", []) + spec.get("components", []):
            referenced.add((k.parent / entry).resolve())
        for patch in spec.get("patches", []):
            if "path" in patch:
                referenced.add((k.parent / patch["path"]).resolve())
        for gen in spec.get("configMapGenerator", []):
            for entry in gen.get("files", []):  # "path" or "key=path"
                referenced.add((k.parent / entry.rpartition("=")[2]).resolve())
    unused = [
        str(p.relative_to(DEPLOY))
        for p in DEPLOY.rglob("*.yaml")
        if p.name != "kustomization.yaml" and p.resolve() not in referenced
    ]
    assert not unused, f"not referenced by any kustomization.yaml: {unused}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates(overlay: str, rendered) -> None:
    docs = rendered[overlay]
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(
        [
            "ConfigMap",
            "Deployment",
            "Service",
            "Service",
            "ServiceMonitor",
            "PrometheusRule",
            "PodDisruptionBudget",
            "HorizontalPodAutoscaler",
        ]
    ), kinds
    problems = [f"{name_of(d)}: {msg}" for d in docs for msg in validate_doc(d)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_keda_component_replaces_the_hpa(overlay: str, rendered_with_keda) -> None:
    docs = rendered_with_keda[overlay]
    kinds = [d["kind"] for d in docs]
    assert "HorizontalPodAutoscaler" not in kinds and kinds.count("ScaledObject") == 1, kinds
    scaled = one(docs, "ScaledObject")
    deployment = one(docs, "Deployment")
    assert scaled["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    problems = [f"{name_of(d)}: {msg}" for d in docs for msg in validate_doc(d)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_inference_gateway_component_adds_the_pool(overlay: str, rendered, rendered_with_gateway):
    """The component adds the InferencePool and its endpoint picker, all valid
    (test_inference_gateway.py checks how they fit together)."""
    docs = rendered_with_gateway[overlay]
    added = sorted(d["kind"] for d in docs)
    for d in rendered[overlay]:
        added.remove(d["kind"])
    assert added == sorted(GATEWAY_KINDS), added
    problems = [f"{name_of(d)}: {msg}" for d in docs for msg in validate_doc(d)]
    assert not problems, "\n".join(problems)


# --- the pod contract, asserted on the rendered overlays -------------------------------------


def overlay_literals(overlay: str) -> dict[str, str]:
    """KEY=VALUE literals an overlay merges into the ConfigMap."""
    spec = yaml.safe_load((DEPLOY / "overlays" / overlay / "kustomization.yaml").read_text())
    out = {}
    for gen in spec.get("configMapGenerator", []):
        for lit in gen.get("literals", []):
            key, _, value = lit.partition("=")
            out[key] = value
    return out


def base_config() -> dict[str, str]:
    return load_yaml_docs((DEPLOY / "base" / "configmap.yaml").read_text())[0]["data"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_mem_fraction_static_reaches_the_container(overlay: str, rendered) -> None:
    want = overlay_literals(overlay).get("MEM_FRACTION_STATIC")
    assert want is not None, f"overlay {overlay} does not set MEM_FRACTION_STATIC"
    assert 0.0 < float(want) < 1.0
    assert want != base_config()["MEM_FRACTION_STATIC"], "the overlay should change the base value"
    docs = rendered[overlay]
    assert not any(v["name"] == "MEM_FRACTION_STATIC" for v in container(docs).get("env", [])), (
        "set MEM_FRACTION_STATIC through the ConfigMap only"
    )
    assert effective_env(docs)["MEM_FRACTION_STATIC"] == want


def test_overlays_differ_in_mem_fraction(rendered) -> None:
    values = {o: effective_env(rendered[o])["MEM_FRACTION_STATIC"] for o in OVERLAYS}
    assert len(set(values.values())) == len(OVERLAYS), values


def resolve_port(c: dict, port: int | str) -> int:
    if isinstance(port, int):
        return port
    named = {p["name"]: p["containerPort"] for p in c.get("ports", []) if "name" in p}
    assert port in named, f"probe port {port!r} is not a named container port"
    return named[port]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes(overlay: str, rendered) -> None:
    """The probes and the scrape go to ADMIN_PORT, which a client connection flood on PORT
    cannot exhaust; clients reach PORT."""
    docs = rendered[overlay]
    c = container(docs)
    env = effective_env(docs)
    listen = int(env.get("PORT") or 8000)
    admin = int(env.get("ADMIN_PORT") or 8001)
    assert admin not in (0, listen), "the probes need an admin listener apart from PORT"
    expect = {"startupProbe": "/ready", "readinessProbe": "/ready", "livenessProbe": "/health"}
    for probe, path in expect.items():
        get = c[probe]["httpGet"]
        assert get["path"] == path, f"{probe} should GET {path}"
        assert resolve_port(c, get["port"]) == admin, (
            f"{probe} port != ADMIN_PORT the service answers probes on"
        )
    startup = c["startupProbe"]
    budget = startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3)
    assert budget >= 300, f"startupProbe allows only {budget}s for weights + graph capture"
    # clients reach PORT only: the admin port is on no Service a client is routed to
    client = named(docs, "Service", CLIENT_SERVICE)
    assert [resolve_port(c, p["targetPort"]) for p in client["spec"]["ports"]] == [listen]
    assert client["spec"]["ports"][0]["port"] == 8000
    ports = {p["name"]: p for p in named(docs, "Service", METRICS_SERVICE)["spec"]["ports"]}
    scraped = [ports[ep["port"]] for ep in one(docs, "ServiceMonitor")["spec"]["endpoints"]]
    assert scraped and all(resolve_port(c, p["targetPort"]) == admin for p in scraped), (
        "the ServiceMonitor should scrape the metrics Service's port that targets ADMIN_PORT"
    )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gpu_and_host_resources(overlay: str, rendered) -> None:
    res = container(rendered[overlay])["resources"]
    assert str(res["requests"]["nvidia.com/gpu"]) == "1"
    assert str(res["limits"]["nvidia.com/gpu"]) == "1"
    for kind in ("cpu", "memory"):
        req, lim = quantity(res["requests"][kind]), quantity(res["limits"][kind])
        assert 0 < req <= lim, f"{kind}: request {req} must be positive and <= limit {lim}"


def quantity(q: str | int) -> float:
    m = re.fullmatch(r"([0-9.]+)(m|Ki|Mi|Gi|Ti|k|M|G|T)?", str(q))
    assert m, f"cannot parse quantity {q!r}"
    scale = {
        None: 1,
        "m": 1e-3,
        "k": 1e3,
        "M": 1e6,
        "G": 1e9,
        "T": 1e12,
        "Ki": 2**10,
        "Mi": 2**20,
        "Gi": 2**30,
        "Ti": 2**40,
    }[m.group(2)]
    return float(m.group(1)) * scale


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_security_context(overlay: str, rendered) -> None:
    pod = one(rendered[overlay], "Deployment")["spec"]["template"]["spec"]
    pod_sc, c_sc = (
        pod.get("securityContext", {}),
        container(rendered[overlay]).get("securityContext", {}),
    )
    eff = {**pod_sc, **c_sc}  # container-level fields override pod-level ones
    assert eff.get("runAsNonRoot") is True
    assert eff.get("runAsUser") == RUN_AS_USER
    assert c_sc.get("allowPrivilegeEscalation") is False
    assert c_sc.get("readOnlyRootFilesystem") is True
    assert "ALL" in c_sc.get("capabilities", {}).get("drop", [])
    assert eff.get("seccompProfile", {}).get("type") == "RuntimeDefault"
    assert pod.get("automountServiceAccountToken") is False
    assert pod.get("enableServiceLinks") is False, "Service links inject *_PORT variables"


def writable_mounts(docs: list[dict]) -> dict[str, dict]:
    """mountPath -> emptyDir spec, for the container's emptyDir mounts."""
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    empty = {v["name"]: v["emptyDir"] for v in pod.get("volumes", []) if "emptyDir" in v}
    c = container(docs)
    return {
        m["mountPath"]: empty[m["name"]] for m in c.get("volumeMounts", []) if m["name"] in empty
    }


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_writable_scratch_for_read_only_root(overlay: str, rendered) -> None:
    mounts = writable_mounts(rendered[overlay])
    assert "/tmp" in mounts and "/cache" in mounts, sorted(mounts)
    assert mounts.get("/dev/shm", {}).get("medium") == "Memory", (
        "/dev/shm must be a memory emptyDir"
    )


def prestop_sleep_s(c: dict) -> int:
    pre = c.get("lifecycle", {}).get("preStop", {})
    if "sleep" in pre:
        return int(pre["sleep"]["seconds"])
    cmd = pre.get("exec", {}).get("command", [])
    m = re.fullmatch(r"(?:.*\s)?sleep\s+(\d+)", " ".join(cmd))
    assert m, f"preStop should sleep so endpoints deregister before SIGTERM, got {pre}"
    return int(m.group(1))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grace_period_covers_prestop_and_drain(overlay: str, rendered) -> None:
    docs = rendered[overlay]
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    grace = pod["terminationGracePeriodSeconds"]
    drain = int(effective_env(docs)["DRAIN_TIMEOUT_S"])
    sleep = prestop_sleep_s(container(docs))
    assert sleep > 0
    # The grace period starts with preStop; SIGTERM (and the drain) only after it returns. The
    # process exits at most SHUTDOWN_MARGIN_S after the drain (service.api.worker enforces it).
    from service.api.worker import SHUTDOWN_MARGIN_S

    need = drain + sleep + SHUTDOWN_MARGIN_S
    assert grace > need, (f"grace {grace}s <= drain {drain}s + preStop sleep {sleep}s + exit "
                          f"margin {SHUTDOWN_MARGIN_S}s")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_selectors_line_up(overlay: str, rendered) -> None:
    docs = rendered[overlay]
    dep = one(docs, "Deployment")
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    subset = lambda sel, labels: all(labels.get(k) == v for k, v in sel.items())  # noqa: E731
    assert subset(dep["spec"]["selector"]["matchLabels"], pod_labels)
    client, svc = (named(docs, "Service", n) for n in (CLIENT_SERVICE, METRICS_SERVICE))
    for s in (client, svc):
        assert subset(s["spec"]["selector"], pod_labels), f"{s['metadata']['name']} selects no pod"
    assert subset(one(docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"], pod_labels)
    mon = one(docs, "ServiceMonitor")
    assert subset(mon["spec"]["selector"]["matchLabels"], svc["metadata"]["labels"])
    assert not subset(mon["spec"]["selector"]["matchLabels"], client["metadata"]["labels"])
    svc_ports = {p["name"] for p in svc["spec"]["ports"]}
    assert all(ep["port"] in svc_ports for ep in mon["spec"]["endpoints"])
    assert all(ep.get("path", "/metrics") == "/metrics" for ep in mon["spec"]["endpoints"])
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"]
    assert "replicas" not in dep["spec"], "the HPA owns the replica count"
    # The not-ready alert selects up{job="..."}, the job the ServiceMonitor gives the targets.
    rules = one(docs, "PrometheusRule")
    exprs = " ".join(r["expr"] for g in rules["spec"]["groups"] for r in g["rules"])
    assert f'up{{job="{scrape_job(docs)}"}}' in exprs
    # kube-state-metrics names the Deployment in its `deployment` label.
    deployments = set(re.findall(r'kube_deployment_\w+\{[^}]*deployment="([^"]*)"', exprs))
    assert deployments == {dep["metadata"]["name"]}, deployments


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_config_is_accepted_by_the_service(overlay: str, rendered) -> None:
    """The rendered settings load through service/config.py, and none of them is ignored."""
    from service.config import Settings, load_settings, resolve

    env = {k: v for k, v in effective_env(rendered[overlay]).items() if v is not None}
    # Settings ignores unknown variables, so a misspelt key would silently keep the default.
    unknown = sorted(k for k in env if k.lower() not in Settings.model_fields)
    assert not unknown, f"not service settings (typo?): {unknown}"
    settings = load_settings(env)  # raises ConfigError naming the bad variable
    engine, server = resolve(settings, cuda_available=True)
    assert engine.device == "cuda", "pods must fail loudly without a GPU, not fall back to CPU"
    assert engine.mem_fraction_static == float(env["MEM_FRACTION_STATIC"])
    assert server.drain_timeout_s == float(env["DRAIN_TIMEOUT_S"])
