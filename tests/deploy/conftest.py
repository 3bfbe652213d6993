"""Fixtures for the deployment tests: kustomize rendering, rules, dashboard, the live service."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from deploy_testlib import (
    DEPLOY,
    OVERLAYS,
    READY_TIMEOUT_S,
    REPO,
    SERVICE_DRAIN_TIMEOUT_S,
    find_tool,
    free_port,
    http_status,
    load_yaml_docs,
    stop_process,
)


@pytest.fixture(scope="session")
def kustomize() -> Callable[[Path], list[dict]]:
    """Render a kustomization with `kubectl kustomize` (or a standalone `kustomize build`)."""
    kubectl, standalone = find_tool("kubectl"), find_tool("kustomize")
    if kubectl:
        base_cmd = [kubectl, "kustomize"]
    elif standalone:
        base_cmd = [standalone, "build"]
    else:
        pytest.skip("neither `kubectl` nor `kustomize` found on PATH; install kubectl >= 1.27")
    cache: dict[Path, list[dict]] = {}

    def render(path: Path) -> list[dict]:
        path = Path(path)
        if path not in cache:
            res = subprocess.run(
                [*base_cmd, str(path)], capture_output=True, text=True, timeout=60, check=False
            )
            assert res.returncode == 0, f"kustomize failed on {path}:\n{res.stderr}"
            cache[path] = load_yaml_docs(res.stdout)
        return [dict(d) for d in cache[path]]

    return render


@pytest.fixture(scope="session")
def rendered(kustomize) -> dict[str, list[dict]]:
    """Rendered docs of each overlay, by overlay name."""
    return {name: kustomize(DEPLOY / "overlays" / name) for name in OVERLAYS}


def render_with_component(kustomize, tmp_path_factory, component: str) -> dict[str, list[dict]]:
    """Rendered docs of each overlay with deploy/components/<component> added, by overlay name."""
    out = {}
    for name in OVERLAYS:
        root = tmp_path_factory.mktemp(f"{component}-{name}")
        # kustomize refuses absolute paths to other kustomizations, so point at them relatively.
        (root / "kustomization.yaml").write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "kustomize.config.k8s.io/v1beta1",
                    "kind": "Kustomization",
                    "resources": [os.path.relpath(DEPLOY / "overlays" / name, root)],
                    "components": [os.path.relpath(DEPLOY / "components" / component, root)],
                }
            )
        )
        out[name] = kustomize(root)
    return out


@pytest.fixture(scope="session")
def rendered_with_keda(kustomize, tmp_path_factory) -> dict[str, list[dict]]:
    """Rendered docs of each overlay with the KEDA component added, by overlay name."""
    return render_with_component(kustomize, tmp_path_factory, "keda")


@pytest.fixture(scope="session")
def rendered_with_gateway(kustomize, tmp_path_factory) -> dict[str, list[dict]]:
    """Rendered docs of each overlay with the inference-gateway component added, by overlay."""
    return render_with_component(kustomize, tmp_path_factory, "inference-gateway")


@pytest.fixture(scope="session")
def rule_groups() -> list[dict]:
    """The rule groups of deploy/base/prometheusrule.yaml (`groups` of a plain rules file)."""
    doc = load_yaml_docs((DEPLOY / "base" / "prometheusrule.yaml").read_text())[0]
    assert doc["kind"] == "PrometheusRule"
    return doc["spec"]["groups"]


@pytest.fixture(scope="session")
def dashboard() -> dict:
    return json.loads((DEPLOY / "grafana" / "prefill-dashboard.json").read_text())


@dataclass
class LiveService:
    proc: subprocess.Popen
    url: str
    port: int
    log_path: Path
    drain_timeout_s: int
    admin_port: int  # /health, /ready and /metrics, as the probes and the ServiceMonitor use

    def log_tail(self, n: int = 60) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "<no log>"
        return "\n".join(lines[-n:])


@pytest.fixture(scope="module")
def prefill_service(tmp_path_factory) -> Iterator[LiveService]:
    """The real service (`python -m service`) on CPU on free loopback ports (PORT and
    ADMIN_PORT), once /ready is 200."""
    from service.config import Settings

    port, admin_port = free_port(), free_port()
    # Clear every setting the service reads from the inherited environment (names are
    # case-insensitive), so it runs with exactly what this fixture sets.
    env = {k: v for k, v in os.environ.items() if k.lower() not in Settings.model_fields}
    env.update(
        DEVICE="cpu",
        HOST="127.0.0.1",
        PORT=str(port),
        ADMIN_PORT=str(admin_port),
        DRAIN_TIMEOUT_S=str(SERVICE_DRAIN_TIMEOUT_S),
        LOG_LEVEL="info",
        CUDA_VISIBLE_DEVICES="",
    )
    log_path = tmp_path_factory.mktemp("service") / "service.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "service"],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    svc = LiveService(
        proc, f"http://127.0.0.1:{port}", port, log_path, SERVICE_DRAIN_TIMEOUT_S, admin_port
    )
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(
                    f"service exited with {proc.returncode} before /ready:\n{svc.log_tail()}"
                )
            if http_status(svc.url + "/ready") == 200:
                break
            if time.monotonic() > deadline:
                pytest.fail(f"/ready not 200 after {READY_TIMEOUT_S:.0f} s:\n{svc.log_tail()}")
            time.sleep(0.5)
        yield svc
    finally:
        stop_process(proc, grace_s=SERVICE_DRAIN_TIMEOUT_S + 20)
